"""Staging: device state saved and loaded through reused host buffers (``checkpoint.staging``).

There is no GPU here, so ``KEMPNER_RESILIENCE_STAGE_CPU=1`` (for tests and benchmarks) sends CPU
tensors through the same pipeline GPU tensors take: chunks much smaller than the tensors, a ring
of two chunks per I/O thread, CRCs over the staged bytes, resume through the chunks. Only the
CUDA specifics (pinned memory, streams, events) are left out; ``bench/gpu_check.py`` covers those
on a GPU machine. Real DCP files on disk throughout.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from helpers import assert_bitwise_equal, run_script
from kempner_resilience.checkpoint import CheckpointManager
from kempner_resilience.checkpoint.hostbuf import ENV_STAGE_CPU, ENV_STAGE_CPU_GIBPS
from kempner_resilience.config import CheckpointConfig, StagingMode
from kempner_resilience.demo.launcher import LocalLauncher, train_command
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.runpaths import RunPaths

KIB = 1 << 10
CAP_GIB = 128 * KIB / 2**30       # half O_DIRECT buffers, half staging: 2 threads x 2 x 16 KiB each
BIG = 33 << 20                    # above 32 MiB the writer splits the state over 2 files


class OddState(torch.nn.Module):
    """Tensors of odd sizes and many dtypes, a 0-dim one, an empty one, and one large tensor."""

    def __init__(self, big: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(1000, 37, generator=g))      # 148000 bytes
        self.b = torch.nn.Parameter(torch.randn(7, generator=g))
        self.h = torch.nn.Parameter(torch.randn(333, generator=g).half())
        self.register_buffer("ints", torch.arange(11))
        self.register_buffer("empty", torch.zeros(0, 5))
        self.register_buffer("scalar", torch.tensor(3.25))
        self.register_buffer("mask", torch.rand(13, generator=g) > 0.5)
        self.register_buffer("bf", torch.randn(9, 3, generator=g).bfloat16())
        if big:
            self.register_buffer("big", torch.randn(BIG // 4 + 3, generator=g))


def _state(big: bool = True) -> dict:
    model = OddState(big)
    optim = torch.optim.Adam([model.w, model.b], lr=1e-3)
    (model.w.sum() + model.b.sum()).backward()
    optim.step()
    return {"model": model, "optim": optim}


def _zeroed(big: bool = True) -> dict:
    state = _state(big)
    with torch.no_grad():
        for t in [*state["model"].state_dict().values(),
                  *[v for s in state["optim"].state.values() for v in s.values()]]:
            t.zero_()
    return state


def _cfg(root: Path, **kw) -> CheckpointConfig:
    return CheckpointConfig(dir=str(root), io_threads=2, staging_cap_gib=CAP_GIB, keep_last=5,
                            **kw)


def _tensors(state: dict) -> dict:
    msd, osd = get_state_dict(state["model"], state["optim"])
    return {"model": msd, "optim": osd["state"]}


def _staged_manager(root: Path, state: dict, monkeypatch, **kw) -> CheckpointManager:
    monkeypatch.setenv(ENV_STAGE_CPU, "1")
    mgr = CheckpointManager(_cfg(root, **kw), state)
    monkeypatch.delenv(ENV_STAGE_CPU)
    return mgr


def _tensor_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].state_dict().values()) + \
        sum(t.numel() * t.element_size() for s in state["optim"].state.values()
            for t in s.values())


def test_a_save_through_small_staging_chunks_writes_the_same_files_as_without(tmp_path,
                                                                            monkeypatch):
    state = _state()
    staged = _staged_manager(tmp_path / "staged", state, monkeypatch)
    plain = CheckpointManager(_cfg(tmp_path / "plain"), state)
    assert staged.staging is not None and plain.staging is None
    assert staged.staging.chunk_bytes == 16 * KIB
    a, b = staged.save(1), plain.save(1)
    # every tensor byte went through the chunks, and the files are the same bytes
    assert staged.staging.staged_bytes == _tensor_bytes(state)
    shards = sorted(p.name for p in a.path.glob("*.distcp"))
    assert len(shards) == 2 and shards == sorted(p.name for p in b.path.glob("*.distcp"))
    for name in shards:
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name
    ma = json.loads((a.path / "MANIFEST.json").read_text())["files"]
    mb = json.loads((b.path / "MANIFEST.json").read_text())["files"]
    assert all(ma[n] == mb[n] for n in shards)


def test_stock_dcp_load_reads_a_checkpoint_saved_through_staging(tmp_path, monkeypatch):
    state = _state()
    info = _staged_manager(tmp_path, state, monkeypatch).save(1)
    fresh = _zeroed()
    msd, osd = get_state_dict(fresh["model"], fresh["optim"])
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(info.path))   # FileSystemReader
    assert_bitwise_equal(_tensors(state), {"model": msd, "optim": osd["state"]})


def test_resume_through_staging_restores_every_tensor_bitwise(tmp_path, monkeypatch):
    state = _state()
    CheckpointManager(_cfg(tmp_path), state).save(1)
    fresh = _zeroed()
    mgr = _staged_manager(tmp_path, fresh, monkeypatch)
    info = mgr.resume()
    assert info is not None and info.step == 1
    assert mgr.staging.staged_bytes == _tensor_bytes(state)      # read through the chunks
    assert_bitwise_equal(_tensors(state), _tensors(fresh))


def test_a_flipped_byte_in_staged_data_is_detected_and_the_previous_checkpoint_loaded(
        tmp_path, monkeypatch, caplog):
    state = _state(big=False)
    mgr = CheckpointManager(_cfg(tmp_path), state)
    mgr.save(1)
    w1 = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with torch.no_grad():
        state["model"].w.add_(1.0)
    info = mgr.save(2)
    # a byte in the middle of the largest tensor's data: inside a chunk well past the first
    manifest = json.loads((info.path / "MANIFEST.json").read_text())
    # (a tensor record has a data offset; the rank's blob, 3 fields, is larger when it holds
    # the gradients the test's optimizer step left behind)
    name, rec = max(((n, r) for n, f in manifest["files"].items() for r in f.get("records", ())
                     if len(r) > 3), key=lambda p: p[1][1])
    shard = info.path / name
    data = bytearray(shard.read_bytes())
    data[rec[0] + rec[3] + 5 * 16 * KIB + 123] ^= 0x01
    shard.write_bytes(data)
    fresh = _zeroed(big=False)
    got = _staged_manager(tmp_path, fresh, monkeypatch, verify=True).resume()
    assert got.step == 1
    assert_bitwise_equal(w1, fresh["model"].state_dict())
    assert "checksum mismatch" in caplog.text and "falling back" in caplog.text


def test_the_staging_buffers_are_allocated_once_and_reused_by_every_save_and_load(tmp_path,
                                                                                  monkeypatch):
    state = _state(big=False)
    mgr = _staged_manager(tmp_path, state, monkeypatch)
    ptrs, per_save = mgr.staging.data_ptrs(), _tensor_bytes(state)
    mgr.save(1)
    mgr.emergency_save(2)
    mgr.resume()
    assert mgr.staging.data_ptrs() == ptrs
    assert mgr.staging.staged_bytes == 3 * per_save


def test_the_cap_bounds_the_host_memory_staging_takes(tmp_path, monkeypatch):
    state = _state()
    mgr = _staged_manager(tmp_path, state, monkeypatch)
    held = mgr.staging.nbytes + mgr._saver.direct.nbytes     # the O_DIRECT buffers count too
    assert held <= CAP_GIB * 2**30 < _tensor_bytes(state) / 250
    mgr.save(1)
    assert mgr.staging.nbytes + mgr._saver.direct.nbytes == held   # the save added none


def test_the_start_log_names_the_staging_mode_and_the_host_memory_reserved(tmp_path,
                                                                          monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="kempner_resilience")
    _staged_manager(tmp_path, _state(big=False), monkeypatch)
    # pinned is the default; without CUDA it falls back to pageable and says so once
    assert caplog.text.count("pinned needs CUDA") == 1
    assert "staging: pageable, 0.00 GiB host buffers (2 x 2 x 16 KiB) for 0.00 GiB of CPU " \
           "state" in caplog.text


def test_cpu_state_takes_no_staging_buffers_by_default(tmp_path):
    assert CheckpointManager(_cfg(tmp_path), _state(big=False)).staging is None


def test_staging_off_saves_and_resumes_without_staging_buffers(tmp_path, monkeypatch):
    state = _state(big=False)
    mgr = _staged_manager(tmp_path, state, monkeypatch, staging=StagingMode.OFF)
    assert mgr.staging is None
    mgr.save(1)
    fresh = _zeroed(big=False)
    assert _staged_manager(tmp_path, fresh, monkeypatch, staging="off").resume().step == 1
    assert_bitwise_equal(_tensors(state), _tensors(fresh))


def _job(work: Path, steps: int, interrupts: dict | None, stage: bool) -> tuple[list, dict]:
    work.mkdir()
    out = work / "weights.pt"
    cmd = train_command(steps, step_time=0.02, out=out,
                        overrides=[f"checkpoint.dir={work / 'ckpt'}", "signals.grace_s=60",
                                   f"checkpoint.staging_cap_gib={CAP_GIB}",
                                   "watchdog.hang_timeout_s=120"])
    cmd.remove("--quiet")       # the start-up log says whether staging is on
    launches = LocalLauncher(cmd, ranks=1, workdir=work, interrupts=interrupts, max_launches=3,
                             env={ENV_STAGE_CPU: "1" if stage else "0"}).run()
    return launches, torch.load(out, weights_only=True)


@pytest.mark.slow
def test_a_run_saved_and_resumed_through_staging_after_sigusr1_ends_bitwise_equal(tmp_path):
    steps = 16
    straight, ref = _job(tmp_path / "straight", steps, None, stage=False)
    launches, got = _job(tmp_path / "staged", steps, {5: "SIGUSR1"}, stage=True)
    assert [x.exit_code for x in straight] == [0]
    assert [x.exit_code for x in launches] == [ExitCode.REQUEUE, 0]
    assert launches[1].report["resumed_from"] == launches[0].report["stop_step"] > 5
    for i in (0, 1):        # the emergency save, then the resume, went through staging
        assert "staging: pageable" in (tmp_path / "staged" / f"rank0.{i}.log").read_text()
    assert "staging:" not in (tmp_path / "straight" / "rank0.0.log").read_text()
    assert_bitwise_equal(ref, got)


@pytest.mark.slow
def test_a_faulty_staged_copy_is_caught_before_any_commit_and_the_run_ends_with_good_checkpoints(
        tmp_path):
    """The first staged save of a run is checked against a plain copy of every tensor before its
    commit; an emergency save before that proof goes unstaged. With every staged copy corrupted
    (``KEMPNER_RESILIENCE_STAGE_FAULT``): the interrupted launch's emergency checkpoint is good,
    the resumed launch's first periodic save is caught, written again unstaged, and the run ends
    bitwise equal to an uninterrupted one with every committed checkpoint intact."""
    from kempner_resilience.checkpoint import layout
    from kempner_resilience.checkpoint.writer import ENV_STAGE_FAULT

    def job(name: str, interrupts: dict | None, env: dict) -> tuple[list, dict, Path]:
        work = tmp_path / name
        work.mkdir()
        out = work / "weights.pt"
        cmd = train_command(16, step_time=0.02, out=out,
                            overrides=[f"checkpoint.dir={work / 'ckpt'}", "signals.grace_s=60",
                                       f"checkpoint.staging_cap_gib={CAP_GIB}",
                                       "checkpoint.every_steps=6", "checkpoint.keep_last=10",
                                       "watchdog.hang_timeout_s=120"])
        launches = LocalLauncher(cmd, ranks=1, workdir=work, interrupts=interrupts,
                                 max_launches=3, env=env).run()
        return launches, torch.load(out, weights_only=True), work

    _, ref, _ = job("straight", None, {ENV_STAGE_CPU: "0"})
    launches, got, work = job("faulty", {3: "SIGUSR1"},
                              {ENV_STAGE_CPU: "1", ENV_STAGE_FAULT: "1"})
    assert [x.exit_code for x in launches] == [ExitCode.REQUEUE, 0]
    stop = launches[0].report["stop_step"]
    assert launches[1].report["resumed_from"] == stop < 6     # the unstaged emergency save
    log = (work / "rank0.1.log").read_text()
    assert "staging is OFF" in log and "staged bytes differ from a plain copy" in log
    assert "tensor 'model." in log                              # names the tensor
    assert_bitwise_equal(ref, got)
    committed = [e for e in layout.scan(RunPaths(work / "ckpt")) if e.committed]
    assert {stop, 6, 12} <= {e.step for e in committed}
    for e in committed:
        verify = run_script([sys.executable, "-m", "kempner_resilience.cli", "verify",
                                 str(e.path)], capture_output=True, text=True, timeout=120)
        assert verify.returncode == 0, verify.stdout + verify.stderr


def test_the_first_staged_save_is_proven_against_a_plain_copy_and_later_saves_are_not(
        tmp_path, monkeypatch, caplog):
    state = _state(big=False)
    mgr = _staged_manager(tmp_path, state, monkeypatch)
    with caplog.at_level(logging.INFO, logger="kempner_resilience"):
        mgr.save(1)
        mgr.save(2)
    proven = [r for r in caplog.records if "staging proven" in r.getMessage()]
    assert len(proven) == 1


def test_a_save_through_an_asynchronous_paced_stand_in_copy_writes_the_same_files(
        tmp_path, monkeypatch):
    # ENV_STAGE_CPU_GIBPS: each chunk's copy runs in a copy thread, paced like a device link,
    # and is awaited before its chunk is written or refilled (as a CUDA event would be).
    state = _state()
    monkeypatch.setenv(ENV_STAGE_CPU_GIBPS, "2.0")
    staged = _staged_manager(tmp_path / "staged", state, monkeypatch)
    monkeypatch.delenv(ENV_STAGE_CPU_GIBPS)
    plain = CheckpointManager(_cfg(tmp_path / "plain"), state)
    a, b = staged.save(1), plain.save(1)
    assert staged.staging.staged_bytes == _tensor_bytes(state)
    shards = sorted(p.name for p in a.path.glob("*.distcp"))
    assert len(shards) == 2 and shards == sorted(p.name for p in b.path.glob("*.distcp"))
    for name in shards:
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name
    assert staged.staging.nbytes <= CAP_GIB * 2**30       # within checkpoint.staging_cap_gib
