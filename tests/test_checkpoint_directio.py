"""Checkpoint files written past the page cache (``checkpoint/directio.py``).

Each writer thread copies its records into two buffers touched at set-up and writes them with
``O_DIRECT``; the last partial block goes through the ordinary descriptor. What a user relies
on: the files are the same bytes as a buffered save's, and they load; ``checkpoint.direct_io``
picks auto, on or off, a filesystem that refuses ``O_DIRECT`` is written buffered under auto and
stops the start under on (78); the buffers stay within ``checkpoint.staging_cap_gib``. Real
files on disk, real DCP saves, a real ramfs mount (it refuses ``O_DIRECT``; tmpfs takes it from
Linux 6.6 on), real processes for the exit codes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from helpers import assert_bitwise_equal, env, run_script, write_script
from kempner_resilience.checkpoint import CheckpointManager
from kempner_resilience.checkpoint.directio import ENV_DIRECT_IO, DirectPool, DirectSink
from kempner_resilience.checkpoint.hostbuf import ENV_STAGE_CPU
from kempner_resilience.config import CheckpointConfig, ConfigError, DirectIOMode, load_config
from kempner_resilience.exitcodes import ExitCode
from slurm_fixtures import in_ci


def _supports_o_direct(d: Path) -> bool:
    try:
        fd = os.open(d / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(d / ".probe")
    return True


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    """A directory on a filesystem that takes O_DIRECT (CI must have one: fail, not skip)."""
    if not _supports_o_direct(tmp_path):
        if os.environ.get("CI"):
            pytest.fail(f"{tmp_path} does not take O_DIRECT: the direct path is not tested")
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    return tmp_path


@pytest.fixture
def refusing_dir(tmp_path: Path):
    """A directory on a filesystem that refuses O_DIRECT at open: /dev/shm where its tmpfs
    does (Linux before 6.6), else a ramfs mounted for the test (needs root; CI runs as root and
    fails, not skips, without one)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and not _supports_o_direct(shm):
        d = shm / f"kr-directio-{os.getpid()}-{tmp_path.name}"
        d.mkdir()
        yield d
        subprocess.run(["rm", "-rf", str(d)])
        return
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0 or _supports_o_direct(mnt):
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        why = f"no filesystem refusing O_DIRECT here (ramfs mount: {r.stderr.strip() or 'took it'})"
        if in_ci():
            pytest.fail(f"{why} [CI is set: the buffered fallback is not tested]", pytrace=False)
        pytest.skip(why)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 4099), torch.nn.Linear(4099, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1000, generator=g)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


def _parts(seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    sizes = [0, 1, 4095, 4096, 4097, 8191, 8192, 8193, 20000, 3, 123457, 77]
    return [rnd.randbytes(n) for n in sizes]


def test_a_save_written_past_the_page_cache_is_the_same_files_as_a_buffered_save(
        direct_dir, monkeypatch):
    state = _state()
    cfg = dict(io_threads=2, keep_last=5)
    direct = CheckpointManager(CheckpointConfig(dir=str(direct_dir / "direct"), **cfg), state)
    monkeypatch.setenv(ENV_DIRECT_IO, "0")
    buffered = CheckpointManager(CheckpointConfig(dir=str(direct_dir / "buffered"), **cfg),
                                 state)
    assert direct._saver.direct is not None and buffered._saver.direct is None
    a, b = direct.save(1), buffered.save(1)
    shards = sorted(p.name for p in a.path.glob("*.distcp"))
    assert shards and shards == sorted(p.name for p in b.path.glob("*.distcp"))
    for name in shards:
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name
    ma = json.loads((a.path / "MANIFEST.json").read_text())["files"]
    mb = json.loads((b.path / "MANIFEST.json").read_text())["files"]
    assert all(ma[n] == mb[n] for n in shards)


def test_stock_dcp_load_restores_every_tensor_of_a_save_written_past_the_page_cache(
        direct_dir):
    state = _state()
    info = CheckpointManager(CheckpointConfig(dir=str(direct_dir), io_threads=2), state).save(1)
    fresh = _state()
    with torch.no_grad():
        for p in fresh["model"].parameters():
            p.zero_()
    msd, osd = get_state_dict(fresh["model"], fresh["optim"])
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(info.path))
    want_m, want_o = get_state_dict(state["model"], state["optim"])
    assert_bitwise_equal({"model": want_m, "optim": want_o["state"]},
                         {"model": msd, "optim": osd["state"]})


def test_parts_of_odd_sizes_across_many_buffers_land_in_the_file_in_order(direct_dir):
    pool = DirectPool.reserve(1, buf_bytes=8192)
    assert pool is not None
    parts = _parts(1)
    path = direct_dir / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with pool.lease() as pair:
        sink = DirectSink(path, fd, pair)
        assert sink.direct
        assert sink.write(parts[:6]) + sink.write(parts[6:]) == sum(map(len, parts))
        sink.close()
    os.fsync(fd)
    os.close(fd)
    assert path.read_bytes() == b"".join(parts)


def test_the_direct_buffers_are_two_per_writer_thread_and_reused_by_every_file(direct_dir):
    pool = DirectPool.reserve(3, buf_bytes=8192)
    seen = []
    for _ in range(2):
        with pool.lease() as a, pool.lease() as b, pool.lease() as c, pool.lease() as none:
            assert none is None                      # a fourth thread writes buffered
            seen.append({id(x) for pair in (a, b, c) for x in pair})
    assert len(seen[0]) == 6 and seen[0] == seen[1]


def test_a_leased_buffer_is_already_touched_so_a_save_takes_no_first_touch_faults():
    import resource

    pool = DirectPool.reserve(1, buf_bytes=4 << 20)     # touched by a thread of its own
    src = b"\1" * (4 << 20)
    with pool.lease() as pair:                        # waits until the touching is done
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for buf in pair:
            buf[:] = src
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < 64          # untouched, 2 x 1024 pages would fault here
    pool.release()


def _shard_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.distcp"))}


def _loads_bitwise(path: Path, state: dict) -> None:
    fresh = _state()
    with torch.no_grad():
        for p in fresh["model"].parameters():
            p.zero_()
    msd, osd = get_state_dict(fresh["model"], fresh["optim"])
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))
    want_m, want_o = get_state_dict(state["model"], state["optim"])
    assert_bitwise_equal({"model": want_m, "optim": want_o["state"]},
                         {"model": msd, "optim": osd["state"]})


def test_a_file_whose_length_is_not_whole_blocks_round_trips_with_its_tail_written_buffered(
        direct_dir):
    state = _state()
    mgr = CheckpointManager(CheckpointConfig(dir=str(direct_dir), io_threads=2), state)
    mgr.check_dir()
    assert mgr._saver.direct is not None            # the directory takes O_DIRECT
    info = mgr.save(1)
    sizes = {p.name: p.stat().st_size for p in info.path.glob("*.distcp")}
    assert sizes and all(n % 4096 for n in sizes.values()), sizes
    _loads_bitwise(info.path, state)


def test_under_auto_a_filesystem_refusing_o_direct_gets_the_same_files_buffered_said_once(
        direct_dir, refusing_dir, caplog):
    caplog.set_level(logging.INFO, logger="kempner_resilience")
    state = _state()
    disk = CheckpointManager(CheckpointConfig(dir=str(direct_dir / "disk"), io_threads=2), state)
    disk.check_dir()
    ram = CheckpointManager(CheckpointConfig(dir=str(refusing_dir / "ckpt"), io_threads=2),
                            state)
    ram.check_dir()
    assert disk._saver.direct is not None and ram._saver.direct is None
    a, b = disk.save(1), ram.save(1)
    ram.save(2)
    assert _shard_bytes(a.path) == _shard_bytes(b.path)
    _loads_bitwise(b.path, state)
    said = [r.getMessage() for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(said) == 1 and "written through the page cache" in said[0], said


def test_a_save_on_a_filesystem_refusing_o_direct_is_kept_and_said_once_without_the_start_check(
        direct_dir, refusing_dir, caplog):
    # No check_dir (a manager used on its own): each file falls back as it is opened.
    caplog.set_level(logging.INFO, logger="kempner_resilience")
    state = _state()
    ram = CheckpointManager(CheckpointConfig(dir=str(refusing_dir), io_threads=2), state)
    assert ram._saver.direct is not None
    a = CheckpointManager(CheckpointConfig(dir=str(direct_dir), io_threads=2), state).save(1)
    b, _ = ram.save(1), ram.save(2)
    assert _shard_bytes(a.path) == _shard_bytes(b.path)
    said = [r for r in caplog.records if "refused O_DIRECT at a save" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


TRAIN = """
import sys
import kempner_resilience as kr
import torch

cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", sys.argv[2]])
with kr.ResilientRun(cfg, state={"model": torch.nn.Linear(2, 2)}) as run:
    for step in run.steps(1):
        pass
print("the run started", flush=True)
"""


def test_direct_io_on_where_the_filesystem_refuses_it_exits_78_naming_the_key_and_the_fix(
        tmp_path, refusing_dir):
    script = write_script(tmp_path, TRAIN)
    proc = run_script([sys.executable, str(script), str(refusing_dir / "ckpt"),
                           "checkpoint.direct_io=on"], capture_output=True, text=True,
                          timeout=120, env=env(), cwd=tmp_path)
    assert proc.returncode == ExitCode.CONFIG, proc.stderr
    assert "the run started" not in proc.stdout and "Traceback" not in proc.stderr
    for words in ("checkpoint.direct_io is on", "refuses O_DIRECT",
                  "set checkpoint.direct_io: auto"):
        assert words in proc.stderr, proc.stderr


def test_direct_io_auto_where_the_filesystem_refuses_it_runs(tmp_path, refusing_dir):
    script = write_script(tmp_path, TRAIN)
    proc = run_script([sys.executable, str(script), str(refusing_dir / "ckpt"),
                           "checkpoint.direct_io=auto"], capture_output=True, text=True,
                          timeout=120, env=env(), cwd=tmp_path)
    assert proc.returncode == 0 and "the run started" in proc.stdout, proc.stderr


def test_direct_io_off_holds_no_buffers_and_writes_the_same_files(direct_dir):
    state = _state()
    on = CheckpointManager(CheckpointConfig(dir=str(direct_dir / "on"), io_threads=2,
                                            direct_io=DirectIOMode.ON), state)
    off = CheckpointManager(CheckpointConfig(dir=str(direct_dir / "off"), io_threads=2,
                                             direct_io="off"), state)
    on.check_dir()
    off.check_dir()
    assert on._saver.direct is not None and off._saver.direct is None
    assert _shard_bytes(on.save(1).path) == _shard_bytes(off.save(1).path)


def test_the_environment_variable_overrides_the_key_and_a_bad_value_names_it(direct_dir,
                                                                             monkeypatch):
    cfg = CheckpointConfig(dir=str(direct_dir), io_threads=1, direct_io="on")
    monkeypatch.setenv(ENV_DIRECT_IO, "off")
    assert CheckpointManager(cfg, _state())._saver.direct is None
    monkeypatch.setenv(ENV_DIRECT_IO, "sometimes")
    with pytest.raises(ConfigError, match=f"{ENV_DIRECT_IO}: 'sometimes' is not one of 0, off, "
                                          "1, on, auto"):
        CheckpointManager(cfg, _state())


def test_the_key_takes_auto_on_or_off_and_names_them_otherwise(tmp_path):
    assert load_config().checkpoint.direct_io is DirectIOMode.AUTO
    cfg = tmp_path / "c.yaml"
    cfg.write_text("checkpoint:\n  direct_io: on\n")      # YAML's bare on is true: still on
    assert load_config(cfg).checkpoint.direct_io is DirectIOMode.ON
    assert load_config(overrides=["checkpoint.direct_io=off"]).checkpoint.direct_io \
        is DirectIOMode.OFF
    with pytest.raises(ConfigError, match="checkpoint.direct_io: 'always' has the wrong type; "
                                          "expected one of auto, on, off"):
        load_config(overrides=["checkpoint.direct_io=always"])


def test_the_direct_buffers_and_the_staging_buffers_stay_within_the_cap_and_the_log_says_both(
        direct_dir, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="kempner_resilience")
    monkeypatch.setenv(ENV_STAGE_CPU, "1")
    cap = 64 << 10
    mgr = CheckpointManager(CheckpointConfig(dir=str(direct_dir), io_threads=2,
                                             staging_cap_gib=cap / 2**30), _state())
    direct, staging = mgr._saver.direct, mgr.staging
    assert direct is not None and staging is not None
    assert direct.nbytes + staging.nbytes <= cap
    assert "plus 0.00 GiB O_DIRECT write buffers (2 x 2 x 8 KiB)" in caplog.text
    mgr.save(1)                                            # and they write a checkpoint


def test_the_default_cap_holds_two_8_mib_direct_buffers_per_writer_thread(direct_dir):
    mgr = CheckpointManager(CheckpointConfig(dir=str(direct_dir), io_threads=4), _state())
    assert mgr._saver.direct.nbytes == 4 * 2 * (8 << 20)
