"""Checkpoint files written past the page cache (``checkpoint/directio.py``).

Each writer thread copies its records into two buffers touched at set-up and writes them with
``O_DIRECT``; the last partial block goes through the ordinary descriptor. What a user relies on: the files are the same
bytes as a buffered save's, and they load. Real files on disk, real DCP saves.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from helpers import assert_bitwise_equal
from kempner_resilience.checkpoint import CheckpointManager
from kempner_resilience.checkpoint.directio import ENV_DIRECT_IO, DirectPool, DirectSink
from kempner_resilience.config import CheckpointConfig


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
