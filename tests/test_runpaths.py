"""RunPaths names every entry of a run's directory, byte for byte as runs before it wrote them:
a directory written by an earlier version keeps resuming, its lease, ledger, pins and bad nodes
keep being read."""

from __future__ import annotations

from pathlib import Path

import pytest

from kempner_resilience.config import load_config
from kempner_resilience.core.runpaths import RunPaths


def test_every_entry_keeps_the_name_earlier_versions_wrote():
    p = RunPaths(Path("/r"))
    assert p.step_dir(10) == Path("/r/step_000000010")
    assert p.step_dir(10, 1) == Path("/r/step_000000010.1")
    assert p.run_file == Path("/r/run.json")
    assert p.lease == Path("/r/.lease")
    assert p.lease_probe("h", 7) == Path("/r/.lease.probe.h.7")
    assert p.lease_aside("tok") == Path("/r/.lease.stale.tok")
    assert p.ledger == Path("/r/ledger.jsonl")
    assert p.pinned == Path("/r/pinned.json")
    assert p.restarts == Path("/r/.kempner_restarts.json")
    assert p.bad_nodes == Path("/r/bad-nodes.json")
    assert p.bad_nodes_lock == Path("/r/.bad-nodes.lock")
    assert p.forced_marker("abc") == Path("/r/.forced-exit.abc")
    assert p.probe("h", 3, 99) == Path("/r/.kempner_probe-h-3-99")
    assert p.rescue == Path("/r/.rescue")
    assert p.rescue_attempt("a1") == Path("/r/.rescue/a1")
    assert RunPaths.trash_name("step_000000003", "1-2") == ".trash-step_000000003-1-2"
    assert RunPaths.damaged_name("step_000000030", "checksum") == \
        ".damaged-step_000000030-checksum"
    assert RunPaths.damaged_name("step_000000030", "checksum", 2) == \
        ".damaged-step_000000030-checksum.2"


def test_step_names_parse_back_and_nothing_else_does():
    assert RunPaths.parse_step_name(RunPaths.step_name(12, 3)) == (12, 3)
    assert RunPaths.parse_step_name("step_000000012") == (12, 0)
    for other in (".trash-step_000000003-1-1", ".damaged-step_000000030-checksum", "step_12",
                  "run.json"):
        assert RunPaths.parse_step_name(other) is None
    assert RunPaths.is_step_trash(RunPaths.trash_name("step_000000003", "x"))
    assert not RunPaths.is_step_trash(".trash-other")


def test_built_from_the_config_it_is_the_resolved_checkpoint_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=["checkpoint.dir=ck"])
    assert RunPaths.from_config(cfg).root == tmp_path / "ck"
    assert RunPaths.from_checkpoint_config(cfg.checkpoint) == RunPaths.from_config(cfg)


def test_it_is_a_frozen_value_that_prints_as_its_directory():
    p = RunPaths("/r")                       # a str is taken as the path it names
    assert p == RunPaths(Path("/r")) and str(p) == "/r"
    assert RunPaths.of(p) is p and RunPaths.of("/r") == p
    with pytest.raises(AttributeError):
        p.root = Path("/elsewhere")          # type: ignore[misc]
