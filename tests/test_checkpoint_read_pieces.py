"""Resume of large tensors with the checksum through libdeflate where the system has it (the
same CRC-32 as zlib's, ``crc.crc32``): tensors of tens of MB come back bit-identical, and
damage deep inside one still fails the checksum and falls back."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from kempner_resilience.checkpoint import CheckpointManager
from kempner_resilience.checkpoint.crc import crc32
from kempner_resilience.config import CheckpointConfig


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    # 3001 x 1999 float32: about 24 MB, an odd size.
    model = torch.nn.Linear(1999, 3001)
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=1e-3)}


def _train(state: dict) -> None:
    state["model"](torch.randn(4, 1999)).sum().backward()
    state["optim"].step()
    state["optim"].zero_grad()


def _cfg(root: Path) -> CheckpointConfig:
    return CheckpointConfig(dir=str(root), keep_last=5, io_threads=2)


def _weights(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def test_a_tensor_of_tens_of_megabytes_resumes_bit_identical(tmp_path):
    state = _state(0)
    _train(state)
    mgr = CheckpointManager(_cfg(tmp_path), state)
    mgr.save(1)
    mgr.close()
    saved = _weights(state)
    moments = {k: v.clone() for k, v in state["optim"].state_dict()["state"][0].items()}
    fresh = _state(1)
    info = CheckpointManager(_cfg(tmp_path), fresh).resume()
    assert info is not None and info.step == 1
    assert all(torch.equal(fresh["model"].state_dict()[k], saved[k]) for k in saved)
    loaded = fresh["optim"].state_dict()["state"][0]
    assert all(torch.equal(loaded[k], moments[k]) for k in moments)


def test_a_byte_flipped_deep_in_a_large_tensor_fails_the_checksum_and_falls_back(tmp_path,
                                                                                 caplog):
    state = _state(0)
    mgr = CheckpointManager(_cfg(tmp_path), state)
    _train(state)
    mgr.save(1)
    first = _weights(state)
    _train(state)
    mgr.save(2)
    mgr.close()
    shard = max((tmp_path / "step_000000002").glob("*.distcp"), key=lambda p: p.stat().st_size)
    assert shard.stat().st_size > 16 << 20
    with open(shard, "r+b") as f:        # deep inside the big weight's data
        at = shard.stat().st_size * 3 // 4
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    fresh = _state(1)
    info = CheckpointManager(_cfg(tmp_path), fresh).resume()
    assert info is not None and info.step == 1
    assert all(torch.equal(fresh["model"].state_dict()[k], first[k]) for k in first)
    assert "checksum mismatch (file damaged)" in caplog.text and "falling back" in caplog.text


def test_the_fast_crc_is_zlibs_crc_on_tensors_bytearrays_bytes_and_continuations():
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    view = memoryview(data.numpy()).cast("B")
    raw = bytes(view[:1 << 20])
    assert crc32(view) == zlib.crc32(view)
    assert crc32(view[12345:], 0xDEADBEEF) == zlib.crc32(view[12345:], 0xDEADBEEF)
    assert crc32(bytearray(raw), 7) == zlib.crc32(raw, 7)
    assert crc32(raw, 7) == zlib.crc32(raw, 7)
    assert crc32(view[:100], 3) == zlib.crc32(view[:100], 3)
    assert crc32(view[1 << 20:], crc32(view[:1 << 20])) == zlib.crc32(view)
