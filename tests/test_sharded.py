"""Sharded training (FSDP2 ``fully_shard``, HSDP on a 2-D ``("replicate", "shard")`` mesh) gets
what DDP gets: saves through our checksumming writer (sync, async, emergency), exact resume on
the same mesh, and resume at another mesh. Real processes, gloo on CPU, real ``fully_shard``
(``checkpoint_helpers/fsdp_job.py``: dropout, AdamW, a step LR schedule, per-rank data).

One uninterrupted reference run per mesh (15 steps, async periodic saves every 3 steps, so its
last checkpoint, step 15, holds exactly its final state) is computed once per module; the other
runs resume from its checkpoints or are compared with its final state.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, assert_bitwise_equal, run_script
from kempner_resilience.demo.launcher import LocalLauncher
from kempner_resilience.exitcodes import ExitCode

JOB = REPO / "tests" / "checkpoint_helpers" / "fsdp_job.py"
STEPS, EVERY = 15, 3
SAVES = ["checkpoint.async=true", f"checkpoint.every_steps={EVERY}", "signals.grace_s=60",
         "watchdog.hang_timeout_s=120"]
HSDP_MESH = {"dims": ["replicate", "shard"], "shape": [2, 2]}


def run_job(work: Path, ranks: int, mesh: str, steps: int, *, interrupts=None,
            sets=(), extra=()):
    """(launches, final full state or None) of fsdp_job.py on ``ranks`` ranks in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(JOB), "--steps", str(steps), "--mesh", mesh,
           "--out", str(work / "final.pt"), "--set", f"checkpoint.dir={work / 'ckpt'}", *extra]
    for s in [*SAVES, *sets]:
        cmd += ["--set", s]
    launches = LocalLauncher(cmd, ranks=ranks, workdir=work, interrupts=interrupts,
                             max_launches=3).run()
    out = work / "final.pt"
    return launches, torch.load(out, weights_only=False) if out.exists() else None


def copied_checkpoint(src: Path, step: int, work: Path) -> None:
    """``src``'s checkpoint of ``step`` alone in ``work/ckpt`` (a fresh run resumes from it)."""
    name = f"step_{step:09d}"
    shutil.copytree(src / "ckpt" / name, work / "ckpt" / name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Mesh kind -> (work directory, final state) of an uninterrupted run, computed once."""
    cache: dict[str, tuple[Path, dict]] = {}

    def get(mesh: str) -> tuple[Path, dict]:
        if mesh not in cache:
            work = tmp_path_factory.mktemp(f"ref-{mesh}")
            launches, final = run_job(work, 4 if mesh == "hsdp" else 2, mesh, STEPS)
            assert [l.exit_code for l in launches] == [0], launches[0].stderr_tail
            cache[mesh] = work, final
        return cache[mesh]
    return get


@pytest.mark.parametrize("mesh, ranks", [("fsdp", 2), ("hsdp", 4)])
def test_usr1_interrupted_sharded_run_resumes_bitwise_equal_to_an_uninterrupted_one(
        tmp_path, reference, mesh, ranks):
    _, ref = reference(mesh)
    launches, got = run_job(tmp_path, ranks, mesh, STEPS, interrupts={5: "SIGUSR1"})
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, 0], launches[0].stderr_tail
    stop = launches[0].report["stop_step"]
    assert launches[1].report["resumed_from"] == stop > 5
    assert launches[0].report["saved_path"].endswith(f"step_{stop:09d}")
    assert_bitwise_equal(ref, got)


def test_async_save_of_fsdp2_state_resumes_bitwise_equal(tmp_path, reference):
    # The reference's checkpoints were written in the background while training went on.
    src, ref = reference("fsdp")
    copied_checkpoint(src, 12, tmp_path)
    launches, got = run_job(tmp_path, 2, "fsdp", STEPS, sets=["checkpoint.allow_other_run=true"])
    assert [l.exit_code for l in launches] == [0], launches[0].stderr_tail
    assert launches[0].report["resumed_from"] == 12
    assert_bitwise_equal(ref, got)


def test_a_stateful_app_state_of_an_fsdp2_model_is_saved_sharded_and_resumes_bitwise(
        tmp_path, reference):
    # DCP's tutorial pattern: model and optimizer inside one Stateful (get_state_dict /
    # set_state_dict). Its DTensors go through DCP, not pickled into a rank's private blob.
    _, ref = reference("fsdp")
    launches, got = run_job(tmp_path, 2, "fsdp", STEPS, interrupts={5: "SIGUSR1"},
                            extra=["--app"])
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, 0], launches[0].stderr_tail
    assert_bitwise_equal(ref, got)
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(str(tmp_path / "ckpt" / f"step_{STEPS:09d}")).read_metadata()
    assert "app.model.0.weight" in saved.state_dict_metadata
    # The rescue, which needs every rank's full state, knows it is sharded too.
    assert "rescue off: rank 0: state['app'] holds sharded state" in \
        (tmp_path / "rank0.0.log").read_text()


def test_each_shard_of_an_hsdp_checkpoint_is_written_once_and_checksummed(reference):
    src, _ = reference("hsdp")
    path = src / "ckpt" / f"step_{STEPS:09d}"
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert manifest["mesh"] == HSDP_MESH and manifest["world_size"] == 4
    from torch.distributed.checkpoint import FileSystemReader
    storage = FileSystemReader(str(path)).read_metadata().storage_data
    # Every record on disk is one entry of the checkpoint (a chunk replicated over the two
    # replica groups was written by one of them, not twice), and each has its CRC.
    places = sorted((info.relative_path, info.offset) for info in storage.values())
    records = sorted((name, rec[0]) for name, f in manifest["files"].items()
                     for rec in f.get("records", []))
    assert places == records
    assert all(isinstance(rec[2], int) for f in manifest["files"].values()
               for rec in f.get("records", []))
    # Both shards of each tensor were written (2 chunks of model.0.weight, 16 rows each).
    assert sorted(k.offset[0] for k in storage if k.fqn == "model.0.weight") == [0, 16]


@pytest.mark.parametrize("mesh, ranks, other, other_ranks",
                         [("hsdp", 4, "fsdp", 2), ("fsdp", 2, "hsdp", 4)],
                         ids=["4-hsdp-to-2-fsdp", "2-fsdp-to-4-hsdp"])
def test_a_sharded_checkpoint_resumes_at_another_mesh_with_every_value_equal(
        tmp_path, reference, mesh, ranks, other, other_ranks):
    src, ref = reference(mesh)
    copied_checkpoint(src, STEPS, tmp_path)
    loaded = tmp_path / "loaded.pt"
    launches, got = run_job(tmp_path, other_ranks, other, STEPS + 3,
                            sets=["checkpoint.allow_other_run=true"],
                            extra=["--dump-resumed", str(loaded)])
    assert [l.exit_code for l in launches] == [0], launches[0].stderr_tail
    assert launches[0].report["resumed_from"] == STEPS
    dumped = torch.load(loaded, weights_only=False)
    assert dumped.pop("step") == STEPS
    assert_bitwise_equal(ref, dumped, "loaded at the other mesh")     # every param, Adam moment
    assert got is not None and not torch.equal(got["model"]["0.weight"],
                                               ref["model"]["0.weight"])   # and it trained on
    log0 = (tmp_path / "rank0.0.log").read_text()
    assert f"checkpoint written by {ranks} ranks, resuming on {other_ranks}" in log0


def _cli(*args: str) -> str:
    proc = run_script([sys.executable, "-m", "kempner_resilience.cli", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_ls_and_verify_show_the_mesh_a_checkpoint_was_written_with(reference):
    src, _ = reference("hsdp")
    step = src / "ckpt" / f"step_{STEPS:09d}"
    row = next(ln for ln in _cli("ls", str(src / "ckpt")).splitlines()
               if ln.split()[0] == str(STEPS))
    assert "replicate=2,shard=2" in row.split()
    assert "mesh replicate=2,shard=2" in _cli("verify", str(step))


def test_a_state_dict_passed_instead_of_the_model_is_refused_naming_the_fix():
    from kempner_resilience.checkpoint.info import CheckpointError
    from kempner_resilience.checkpoint.state import TrainState

    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="pass the model and optimizer themselves"):
        TrainState({"model": model.state_dict()})
