"""The torch this package runs on: the versions it is tested on, and the private names it uses,
checked at import with a message that names the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kempner_resilience.core import torch_private


def test_a_torch_older_than_the_tested_ones_is_refused_with_the_version_and_the_fix():
    with pytest.raises(ImportError) as e:
        torch_private.check_version("2.10.1+cu128")
    msg = str(e.value)
    assert "torch >= 2.11" in msg and "2.10.1+cu128" in msg and "pip install" in msg


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu", "2.14.0.dev20260101", "3.0.0"])
def test_the_tested_torch_versions_and_newer_ones_are_accepted(version):
    torch_private.check_version(version)


def test_every_private_name_resolves_on_this_torch():
    for name in torch_private.__all__:
        assert getattr(torch_private, name) is not None, name


@pytest.mark.parametrize("group", sorted(torch_private.ELASTIC))
def test_every_torch_elastic_name_the_torchrun_glue_relies_on_resolves_on_this_torch(group):
    names = torch_private.elastic(group)
    assert names is not None and len(names) == len(torch_private.ELASTIC[group][1]), group


def test_the_torchrun_glue_extends_torch_elastic_without_changing_torchs_classes():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from kempner_resilience.supervise.torchrun.elastic import ElasticAgent, SpareHandler

    before = {cls: dict(vars(cls)) for cls in (LocalElasticAgent, dr.DynamicRendezvousHandler)}
    assert issubclass(ElasticAgent, LocalElasticAgent)
    assert issubclass(SpareHandler, dr.DynamicRendezvousHandler)
    assert {cls: dict(vars(cls)) for cls in before} == before


def test_a_missing_dcp_name_fails_the_checkpoint_layers_import_with_the_name_and_the_fix():
    code = ("import torch.distributed.checkpoint.filesystem as fs; del fs._StorageInfo\n"
            "import kempner_resilience.checkpoint.writer")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert "ImportError" in proc.stderr and "_StorageInfo (used by checkpoint/writer.py)" in \
        proc.stderr and "install one of those" in proc.stderr, proc.stderr[-2000:]


def test_the_torchrun_agent_starts_without_importing_dcp():
    """DCP's import is half a second of CPU at every agent's start; only ranks save."""
    code = ("import sys, kempner_resilience.cli.torchrun, kempner_resilience.supervise.torchrun."
            "wrapper, kempner_resilience.supervise.torchrun.spares\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
