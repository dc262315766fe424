"""Damaged, foreign and unwritable storage: detected, reported with the fix, never fatal to the
previous committed checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint_helpers import toy
from helpers import fill_disk, free_port, spawn_script, start, write_script
from kempner_resilience.checkpoint import MANIFEST_NAME, CheckpointError, CheckpointManager, layout
from kempner_resilience.config import CheckpointConfig
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.runpaths import RunPaths


def _cfg(root: Path, **kw) -> CheckpointConfig:
    return CheckpointConfig(dir=str(root), keep_last=5, **kw)


def _two_checkpoints(root: Path) -> tuple[dict, dict]:
    """Saves step 1 and step 2; returns the model weights at each."""
    state = toy.build(0)
    mgr = CheckpointManager(_cfg(root), state)
    toy.train_step(state)
    mgr.save(1)
    w1 = {k: v.clone() for k, v in state["model"].state_dict().items()}
    toy.train_step(state)
    mgr.save(2)
    w2 = {k: v.clone() for k, v in state["model"].state_dict().items()}
    mgr.close()
    return w1, w2


def _resume(root: Path, **kw) -> tuple[object, dict]:
    fresh = toy.build(0)
    info = CheckpointManager(_cfg(root, **kw), fresh).resume()
    return info, fresh["model"].state_dict()


def _flip_byte_in_largest_shard(ckpt: Path) -> None:
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)




def test_a_corrupted_shard_is_detected_and_the_previous_checkpoint_loaded(tmp_path, caplog):
    w1, _ = _two_checkpoints(tmp_path)
    _flip_byte_in_largest_shard(tmp_path / "step_000000002")
    info, weights = _resume(tmp_path)
    assert info.step == 1
    assert all(torch.equal(weights[k], w1[k]) for k in w1)
    assert "checksum mismatch" in caplog.text and "falling back" in caplog.text


def test_a_truncated_shard_is_skipped_without_reading_data(tmp_path, caplog):
    _two_checkpoints(tmp_path)
    shard = next((tmp_path / "step_000000002").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size - 1)
    mgr = CheckpointManager(_cfg(tmp_path), toy.build(0))
    assert mgr.latest().step == 1
    assert "bytes, manifest says" in caplog.text


def test_a_damaged_manifest_hides_the_checkpoint(tmp_path):
    _two_checkpoints(tmp_path)
    (tmp_path / "step_000000002" / MANIFEST_NAME).write_text("{not json")
    info, _ = _resume(tmp_path)
    assert info.step == 1


def test_all_checkpoints_damaged_is_an_error_not_a_fresh_start(tmp_path):
    _two_checkpoints(tmp_path)
    for d in ("step_000000001", "step_000000002"):
        _flip_byte_in_largest_shard(tmp_path / d)
    with pytest.raises(CheckpointError, match="could be loaded.*checkpoint.resume: false"):
        _resume(tmp_path)


def test_files_owned_by_another_user_are_refused_unless_allowed(tmp_path, caplog):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    w1, w2 = _two_checkpoints(tmp_path)
    os.chown(next((tmp_path / "step_000000002").glob("*.distcp")), 4242, 4242)
    info, weights = _resume(tmp_path)
    assert info.step == 1 and "owned by uid 4242" in caplog.text
    assert "allow_foreign_owner" in caplog.text
    info, weights = _resume(tmp_path, allow_foreign_owner=True)
    assert info.step == 2 and all(torch.equal(weights[k], w2[k]) for k in w2)


def test_a_full_disk_fails_the_save_cleanly_and_keeps_the_previous_checkpoint(mount_tmpfs):
    root = mount_tmpfs("small", "size=2m")
    state = toy.build(0)
    mgr = CheckpointManager(_cfg(root / "ckpt"), state)
    mgr.check_dir()
    first = mgr.save(1)
    w1 = {k: v.clone() for k, v in state["model"].state_dict().items()}
    fill_disk(root)                                  # leave less than one save
    toy.train_step(state)
    with pytest.raises(CheckpointError) as exc:
        mgr.save(2)
    msg = str(exc.value)
    assert "is full" in msg and str(root / "ckpt") in msg and "Free space" in msg
    assert str(first.path) in msg and "intact" in msg
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["step_000000001"]
    with pytest.raises(CheckpointError, match="full"):
        mgr.check_dir()
    fresh = toy.build(0)
    assert CheckpointManager(_cfg(root / "ckpt"), fresh).resume().step == 1
    assert all(torch.equal(fresh["model"].state_dict()[k], w1[k]) for k in w1)


def test_check_dir_names_a_missing_parent_and_the_fix(tmp_path):
    mgr = CheckpointManager(_cfg(tmp_path / "nope" / "ckpt"), toy.build(0))
    with pytest.raises(CheckpointError, match=r"parent directory .*nope does not exist.*mkdir"):
        mgr.check_dir()


def test_check_dir_names_an_unwritable_directory_and_the_fix(mount_tmpfs):
    root = mount_tmpfs("ro", "size=1m,ro")
    mgr = CheckpointManager(_cfg(root), toy.build(0))
    with pytest.raises(CheckpointError, match=r"not writable.*choose another checkpoint.dir"):
        mgr.check_dir()


def test_check_dir_creates_a_missing_directory(tmp_path):
    CheckpointManager(_cfg(tmp_path / "ckpt"), toy.build(0)).check_dir()
    assert (tmp_path / "ckpt").is_dir()


def test_manifest_records_checksums_sizes_step_world_and_reason(tmp_path):
    _two_checkpoints(tmp_path)
    man = json.loads((tmp_path / "step_000000002" / MANIFEST_NAME).read_text())
    assert man["step"] == 2 and man["world_size"] == 1 and man["reason"] == "periodic"
    assert ".metadata" in man["files"]
    for name, meta in man["files"].items():
        assert (tmp_path / "step_000000002" / name).stat().st_size == meta["size"]
        assert isinstance(meta["crc32"], int)


# --- a newest checkpoint this process cannot read -------------------------------------------

HELPERS = Path(__file__).resolve().parent / "checkpoint_helpers"
# Root reads any file regardless of its mode through these two capabilities: without them a
# chmod 000 file is as unreadable to root as to any job user.
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
          "--inh-caps=-dac_override,-dac_read_search"]


def _needs_setpriv() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process that file modes apply to")


def _resume_ranks(root: Path, probe: Path, restricted: set[int], world: int) -> list[tuple]:
    """Run tests/checkpoint_helpers/resume_only.py on ``world`` gloo ranks, the ranks in
    ``restricted`` without the power to bypass file modes; (exit code, stdout, stderr) each."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        cmd = [sys.executable, str(HELPERS / "resume_only.py"), "--dir", str(root),
               "--probe", str(probe)]
        procs.append(spawn_script((NO_DAC if rank in restricted else []) + cmd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_an_unreadable_newest_manifest_is_skipped_with_a_warning(tmp_path):
    _needs_setpriv()
    _two_checkpoints(tmp_path)
    manifest = tmp_path / "step_000000002" / MANIFEST_NAME
    manifest.chmod(0)
    [(code, stdout, stderr)] = _resume_ranks(tmp_path, manifest, restricted={0}, world=1)
    assert "probe readable: no" in stdout            # the permissions really apply
    assert code == 0, stderr
    assert "resumed 1" in stdout
    assert "Traceback" not in stderr
    warning = next(ln for ln in stderr.splitlines() if "WARNING" in ln and "step_000000002" in ln)
    assert "Permission denied" in warning and "falling back" in warning


def test_every_rank_falls_back_together_when_only_rank_0_cannot_read_the_newest(tmp_path):
    _needs_setpriv()
    _two_checkpoints(tmp_path)
    manifest = tmp_path / "step_000000002" / MANIFEST_NAME
    manifest.chmod(0)
    results = _resume_ranks(tmp_path, manifest, restricted={0}, world=2)
    assert "probe readable: no" in results[0][1] and "probe readable: yes" in results[1][1]
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stderr}"
        assert "resumed 1" in stdout, f"rank {rank}: {stdout}{stderr}"


def test_a_manifest_that_is_a_directory_is_skipped_with_a_warning(tmp_path, caplog):
    w1, _ = _two_checkpoints(tmp_path)
    manifest = tmp_path / "step_000000002" / MANIFEST_NAME
    manifest.unlink()
    manifest.mkdir()
    info, weights = _resume(tmp_path)
    assert info.step == 1
    assert all(torch.equal(weights[k], w1[k]) for k in w1)
    assert "step_000000002" in caplog.text and "Is a directory" in caplog.text
    assert "falling back" in caplog.text


def test_a_manifest_present_but_unparsable_is_an_error_not_a_fresh_start(tmp_path):
    _two_checkpoints(tmp_path)
    shutil.rmtree(tmp_path / "step_000000001")
    (tmp_path / "step_000000002" / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"step_000000002.*unreadable manifest"):
        _resume(tmp_path)


# A training job under ResilientRun whose checkpoint disk fills up and frees at chosen steps.
# The script itself creates and removes the filler inside its loop; with async saves it first
# waits (bounded) for the outcome it needs in its own log, so nothing depends on timing.
FULL_DISK_JOB = """
import kempner_resilience as kr
import json, logging, os, signal, sys, threading
import torch, torch.distributed as dist
from kempner_resilience.core.log import configure

a = json.loads(sys.argv[1])
rank = int(sys.argv[2]) if len(sys.argv) > 2 else 0
world = a.get("world", 1)
if world > 1:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]), RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
configure()
seen, cond = [], threading.Condition()

class Seen(logging.Handler):
    def emit(self, record):
        with cond:
            seen.append(record.getMessage())
            cond.notify_all()

logging.getLogger("kempner_resilience").addHandler(Seen())

def wait_logged(text):
    with cond:
        if not cond.wait_for(lambda: any(text in m for m in seen), timeout=60):
            sys.exit(f"never logged: {text}")

disk = os.path.dirname(a["dir"])
filler = os.path.join(disk, "filler")
model = torch.nn.Linear(64, 64)          # 16 KiB of weights: more than the 8 KiB left free
cfg = kr.load_config(overrides=[
    f"checkpoint.dir={a['dir']}", f"checkpoint.every_steps={a['every']}",
    f"checkpoint.async={a.get('async', False)}", "checkpoint.keep_last=10",
    "watchdog.hang_timeout_s=120", "signals.grace_s=60"]
    + ([f"checkpoint.max_failed_saves={a['max_failed']}"] if "max_failed" in a else []))
with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(a["steps"]):
        print(f"step {step}", flush=True)
        with torch.no_grad():
            model.weight.add_(1.0)
        if rank == 0 and step == a.get("fill_at"):
            if "fill_after" in a:
                wait_logged(a["fill_after"])
            st = os.statvfs(disk)
            with open(filler, "wb") as f:
                f.write(b"\\0" * (st.f_bavail * st.f_frsize - 8192))
        if rank == 0 and step == a.get("free_at"):
            wait_logged(a["free_after"])
            with open(a["dir"] + ".listing", "w") as f:
                json.dump(sorted(os.listdir(a["dir"])), f)
            os.unlink(filler)
        if step == a.get("usr1_at"):
            os.kill(os.getpid(), signal.SIGUSR1)
        if world > 1:
            dist.all_reduce(torch.ones(1))      # the step's collective
print("finished", flush=True)
"""


def _run_job(tmp_path: Path, args: dict, ranks: int = 1) -> list[subprocess.CompletedProcess]:
    script = write_script(tmp_path, FULL_DISK_JOB)
    args = {**args, "world": ranks, "port": free_port()}
    procs = [start(script, json.dumps(args), str(r)) for r in range(ranks)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e)
            for p, (o, e) in zip(procs, outs)]


def _steps_run(out: str) -> list[int]:
    return [int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("step ")]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_at_a_periodic_save_warns_training_goes_on_and_the_next_save_commits(
        mount_tmpfs, mode):
    disk = mount_tmpfs("small", "size=2m")
    ckpt = disk / "ckpt"
    # Saves after steps 2, 4, 6, 8: the disk is full for the one at 4, freed before 6.
    [proc] = _run_job(disk.parent, {
        "dir": str(ckpt), "every": 2, "steps": 8, "async": mode == "async",
        "fill_at": 3, "fill_after": "checkpoint step 2 committed",
        "free_at": 5, "free_after": "checkpoint of step 4 failed"})
    assert proc.returncode == 0, proc.stderr
    assert _steps_run(proc.stdout) == list(range(8)) and "finished" in proc.stdout
    warnings = [ln for ln in proc.stderr.splitlines() if "checkpoint of step 4 failed" in ln]
    assert len(warnings) == 1 and "WARNING" in warnings[0], proc.stderr
    assert "is full (No space left on device)" in warnings[0] and str(ckpt) in warnings[0]
    assert "Training goes on" in warnings[0] and "Traceback" not in proc.stderr
    # While the disk was full only the previous checkpoint was there, the partial one removed.
    assert json.loads(Path(str(ckpt) + ".listing").read_text()) == [
        ".lease", "ledger.jsonl", "run.json", "step_000000002"]   # .lease: the live run's
    entries = layout.scan(RunPaths(ckpt))
    assert [(e.step, e.committed) for e in entries] == [(2, True), (6, True), (8, True)]
    for e in entries:
        layout.verify_files(e.path, e.manifest)


@pytest.mark.parametrize("mode,ranks", [("sync", 2), ("async", 1)])
def test_consecutive_failed_periodic_saves_stop_every_rank_with_80_and_no_traceback(
        mount_tmpfs, mode, ranks):
    disk = mount_tmpfs("small", "size=2m")
    ckpt = disk / "ckpt"
    procs = _run_job(disk.parent, {"dir": str(ckpt), "every": 2, "steps": 40, "fill_at": 0,
                                   "async": mode == "async", "max_failed": 2}, ranks)
    for p in procs:
        assert p.returncode == ExitCode.CHECKPOINT_FAILED, p.stderr
        assert "Traceback" not in p.stderr
        assert "2 periodic checkpoints in a row failed (checkpoint.max_failed_saves=2)" in \
            p.stderr and "No space left on device" in p.stderr
        assert "finished" not in p.stdout
    # Sync: the saves at 2 and 4 fail, the run stops there. Async: the failure of the save
    # started at 4 is known when the next one is due, at 6. Every rank stops at the same step.
    last = 3 if mode == "sync" else 5
    assert all(_steps_run(p.stdout)[-1] == last for p in procs)
    assert layout.scan(RunPaths(ckpt)) == []


def test_a_failed_emergency_save_exits_80_with_one_error_line_and_no_traceback(mount_tmpfs):
    disk = mount_tmpfs("small", "size=2m")
    ckpt = disk / "ckpt"
    [proc] = _run_job(disk.parent, {"dir": str(ckpt), "every": 2, "steps": 40, "fill_at": 2,
                                    "usr1_at": 2})
    assert proc.returncode == ExitCode.CHECKPOINT_FAILED, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "emergency checkpoint at step 3" in ln]
    assert len(errors) == 1 and "ERROR" in errors[0] and "is full" in errors[0], proc.stderr
    assert "step_000000002 (step 2) is intact" in errors[0]
    [entry] = layout.scan(RunPaths(ckpt))
    assert entry.step == 2 and entry.committed
    layout.verify_files(entry.path, entry.manifest)


def test_a_failed_periodic_save_is_in_the_ledger_and_the_report_with_its_reason(mount_tmpfs,
                                                                                capsys):
    from kempner_resilience.cli import main as cli_main
    from kempner_resilience.core.ledger import read_ledger

    disk = mount_tmpfs("small", "size=2m")
    ckpt = disk / "ckpt"
    [proc] = _run_job(disk.parent, {
        "dir": str(ckpt), "every": 2, "steps": 8, "fill_at": 3,
        "fill_after": "checkpoint step 2 committed",
        "free_at": 5, "free_after": "checkpoint of step 4 failed"})
    assert proc.returncode == 0, proc.stderr
    failed = [e for e in read_ledger(ckpt / "ledger.jsonl") if e["ev"] == "save_failed"]
    assert [(e["step"], e["failed"]) for e in failed] == [(4, 1)]
    assert "No space left on device" in failed[0]["reason"]
    assert cli_main(["report", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "3 (1 failed)" in out and "step 4: " in out and "No space left on device" in out
