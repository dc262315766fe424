"""Our DCP storage plugins as torch's own: ``ChecksummingWriter`` and ``VerifyingReader`` are
drop-in ``storage_writer``/``storage_reader`` arguments of ``dcp.save``/``dcp.load``, taking
torch's ``FileSystemWriter``/``FileSystemReader`` arguments, writing and reading torch's format."""

from __future__ import annotations

import dataclasses
import io
import pickle
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint_helpers import toy
from checkpoint_helpers.launch import run_ranks
from helpers import assert_bitwise_equal
from kempner_resilience.checkpoint import CheckpointCorrupt, CheckpointManager, commit, layout
from kempner_resilience.checkpoint.info import CheckpointCommitted
from kempner_resilience.checkpoint.reader import VerifyingReader
from kempner_resilience.checkpoint.writer import ChecksummingWriter
from kempner_resilience.config import CheckpointConfig
from kempner_resilience.core.runpaths import RunPaths

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict:
    """Nested dicts and lists, a view, bf16 and bool, a 0-dim and an empty tensor, raw bytes
    and plain Python values: what a training state holds."""
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g),
            "nested": {"ids": torch.arange(10), "t": torch.randn(4, 4, generator=g).t()},
            "scalar": torch.tensor(3.5), "empty": torch.empty(0),
            "half": torch.randn(5, dtype=torch.bfloat16, generator=g),
            "mask": torch.tensor([True, False, True]),
            "strided": torch.randn(50, 300, generator=g)[:, ::3],
            "listed": [torch.ones(2), {"deep": torch.full((2, 2), 7.0)}],
            "blob": io.BytesIO(b"loader state"), "step": 7, "name": "run"}


def _blank(x):
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    if isinstance(x, dict):
        return {k: _blank(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_blank(v) for v in x]
    return io.BytesIO() if isinstance(x, io.BytesIO) else x


def _comparable(x):
    """``x`` for ``assert_bitwise_equal``: each tensor with its dtype (torch.equal ignores
    it), a byte stream as its bytes."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, x)
    if isinstance(x, dict):
        return {k: _comparable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_comparable(v) for v in x]
    return x.getvalue() if isinstance(x, io.BytesIO) else x


def _assert_same(want, got) -> None:
    assert_bitwise_equal(_comparable(want), _comparable(got))


@pytest.mark.parametrize("writer,reader", [
    (ChecksummingWriter, FileSystemReader), (FileSystemWriter, VerifyingReader),
    (ChecksummingWriter, VerifyingReader)], ids=["ours-to-torch", "torch-to-ours", "ours"])
def test_a_state_saved_with_one_side_s_plugin_loads_bitwise_with_the_other_s(
        tmp_path: Path, writer, reader) -> None:
    dcp.save(_state(), storage_writer=writer(tmp_path))
    got = _blank(_state())
    dcp.load(got, storage_reader=reader(tmp_path))
    _assert_same(_state(), got)


def test_torch_s_writer_arguments_are_taken_and_a_file_per_item_layout_is_torch_s_own(
        tmp_path: Path) -> None:
    writer = ChecksummingWriter(tmp_path, single_file_per_rank=False, sync_files=False,
                                thread_count=3, per_thread_copy_ahead=1 << 20)
    dcp.save(_state(), storage_writer=writer)
    assert writer.threads == 3 and len(list(tmp_path.glob("*.distcp"))) > 1
    got = _blank(_state())
    dcp.load(got, storage_reader=FileSystemReader(tmp_path))
    _assert_same(_state(), got)


def test_one_writer_reused_for_two_checkpoint_ids_lists_only_each_save_s_own_files(
        tmp_path: Path) -> None:
    writer = ChecksummingWriter(tmp_path / "a")
    dcp.save(_state(), storage_writer=writer)
    first, first_bytes = dict(writer.files), writer.bytes_written
    dcp.save({"w": torch.ones(8)}, storage_writer=writer, checkpoint_id=tmp_path / "b")
    assert 0 < writer.bytes_written < first_bytes
    assert writer.files.keys() == first.keys() and writer.files != first
    got = {"w": torch.zeros(8)}
    dcp.load(got, storage_reader=VerifyingReader(tmp_path / "b"))
    assert torch.equal(got["w"], torch.ones(8))


def test_with_overwrite_false_a_second_save_into_a_directory_is_refused_as_our_saves_ask(
        tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=ChecksummingWriter(tmp_path, overwrite=False))
    with pytest.raises(CheckpointException) as refused:
        dcp.save({"w": torch.zeros(3, 4)},
                 storage_writer=ChecksummingWriter(tmp_path, overwrite=False))
    assert "already exists" in str(refused.value.failures[0])
    got = _blank(_state())
    dcp.load(got, storage_reader=VerifyingReader(tmp_path))
    _assert_same(_state(), got)                            # the first save is intact
    changed = dict(_state(), w=torch.full((3, 4), 2.0))
    dcp.save(changed, storage_writer=ChecksummingWriter(tmp_path))   # torch's default: True
    got = _blank(changed)
    dcp.load(got, storage_reader=FileSystemReader(tmp_path))
    _assert_same(changed, got)


def test_given_only_a_committed_checkpoint_s_path_our_reader_finds_a_flipped_byte(
        tmp_path: Path) -> None:
    state = toy.build(0)
    toy.train_step(state)
    info = CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt")), state).save(1)
    meta = FileSystemReader(info.path).read_metadata()
    blank = {k: torch.zeros(m.size, dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    assert blank
    dcp.load(blank, storage_reader=VerifyingReader(info.path))     # intact: loads
    # One byte inside the largest tensor's record, where the manifest's CRC covers it.
    where = max((s for i, s in meta.storage_data.items() if i.fqn in blank),
                key=lambda s: s.length)
    shard = info.path / where.relative_path
    raw = bytearray(shard.read_bytes())
    raw[where.offset + where.length - 1] ^= 0x40
    shard.write_bytes(bytes(raw))
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as damaged:
        warnings.simplefilter("ignore")
        dcp.load(blank, storage_reader=VerifyingReader(info.path))
    assert "checksum mismatch" in str(damaged.value.failures[0])


def test_torch_s_resharding_scenarios_pass_with_our_writer_and_reader_on_two_gloo_ranks():
    """ShardedTensors saved under one sharding and loaded under another (and swapped with a
    replicated tensor), bytes items, repeated saves into one directory, 1 and 2 threads (the
    scenarios of torch's test_file_system_checkpoint_cpu.py); DTensors across Shard(0),
    Shard(1) and Replicate (test_dtensor_resharding.py's)."""
    outs = run_ranks("dcp_scenarios.py", [], world=2, timeout=180)
    assert all("OK 27" in out for out in outs), outs


def test_a_checkpoint_written_through_torch_s_stream_extensions_loads_with_our_reader(
        tmp_path: Path) -> None:
    from torch.testing._internal.distributed.checkpoint_utils import (
        Rot13Example, get_test_extension_registry)

    dcp.save(_state(), storage_writer=ChecksummingWriter(tmp_path, thread_count=2,
                                                         _extensions=[Rot13Example()]))
    got = _blank(_state())
    dcp.load(got, storage_reader=VerifyingReader(
        tmp_path, _extension_registry=get_test_extension_registry()))
    _assert_same(_state(), got)


def _cause(err: CheckpointException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException``."""
    f = next(iter(err.failures.values()))
    return f[0] if isinstance(f, tuple) else getattr(f, "exc", f)


def _committed(tmp_path: Path, state: dict, step: int = 10) -> Path:
    return CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt")), state).save(step).path


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_a_plain_dcp_save_into_a_committed_step_is_refused_and_the_checkpoint_kept(
        tmp_path: Path) -> None:
    step = _committed(tmp_path, toy.build(0))
    before = _files(step)
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as refused:
        warnings.simplefilter("ignore")
        # overwrite=True is the default, as torch's: it must not matter here.
        dcp.save({"w": torch.zeros(3, 4)}, storage_writer=ChecksummingWriter(step))
    cause = _cause(refused.value)
    assert isinstance(cause, CheckpointCommitted), cause
    assert str(step) in str(cause) and "fresh directory" in str(cause)
    assert _files(step) == before                      # not one byte touched, nothing added
    layout.verify_entry(layout.scan_one(step))         # `kempner-resilience verify` passes


def _step_with_two_twin_layers(tmp_path: Path) -> tuple[Path, dict, Any]:
    """A committed checkpoint of two same-shaped layers, a blank state to load it into, and
    its parsed ``.metadata``."""
    torch.manual_seed(0)
    step = _committed(tmp_path, {"model": torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                               torch.nn.Linear(4, 4))})
    meta = FileSystemReader(step).read_metadata()
    blank = {k: torch.zeros(m.size, dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    return step, blank, meta


def _index(meta: Any, suffix: str) -> Any:
    return next(i for i in meta.storage_data if i.fqn.endswith(suffix))


def _load_fails_naming(step: Path, blank: dict, *words: str) -> None:
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as failed:
        warnings.simplefilter("ignore")
        dcp.load(blank, storage_reader=VerifyingReader(step))
    cause = _cause(failed.value)
    assert isinstance(cause, CheckpointCorrupt), cause
    assert str(step / ".metadata") in str(cause)
    for word in words:
        assert word in str(cause), cause


def test_a_metadata_re_pickled_to_point_layer_0_at_layer_1_s_record_fails_the_load(
        tmp_path: Path) -> None:
    step, blank, meta = _step_with_two_twin_layers(tmp_path)
    layer0, layer1 = _index(meta, "0.weight"), _index(meta, "1.weight")
    meta.storage_data[layer0] = meta.storage_data[layer1]     # same length: its CRC matches
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    _load_fails_naming(step, blank, layer0.fqn, layer1.fqn)
    assert not blank[layer0.fqn].any()                 # layer 1's weights not in layer 0


def test_a_metadata_entry_shifted_off_its_record_fails_as_corrupt_not_in_torch_s_unpickler(
        tmp_path: Path) -> None:
    step, blank, meta = _step_with_two_twin_layers(tmp_path)
    layer0 = _index(meta, "0.weight")
    info = meta.storage_data[layer0]
    meta.storage_data[layer0] = dataclasses.replace(info, offset=info.offset + 1)
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    _load_fails_naming(step, blank, layer0.fqn, f"{info.relative_path}@{info.offset + 1}")


def test_a_save_without_collectives_commits_its_rank_local_metadata_and_verifies(
        tmp_path: Path) -> None:
    step = layout.create_step_dir(RunPaths(tmp_path / "ckpt"), 5)
    writer = ChecksummingWriter(step, overwrite=False)
    dcp.save(_state(), storage_writer=writer, no_dist=True, use_collectives=False)
    assert "__0.metadata" in writer.files and not (step / ".metadata").exists()
    assert commit.commit(step, 5, "test", [(writer.files, None)], time.monotonic(), 0.0, 1,
                         {}) is None
    layout.verify_entry(layout.scan_one(step))
    got = _blank(_state())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # DCP warns that it falls back to rank-local metadata
        dcp.load(got, storage_reader=VerifyingReader(step), no_dist=True)
    _assert_same(_state(), got)


@pytest.fixture
def gloo_alone(tmp_path: Path):
    """A one-rank gloo group in this process (process staging needs one), and torch's staging
    process ended afterwards."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import _async_process_executor as staging

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        proc = staging._CHECKPOINT_PROCESS
        staging._CHECKPOINT_PROCESS = None
        if proc is not None:
            proc._send(staging._CheckpointSaveProcessControlOpts.TERMINATE)
            proc._save_process.join(timeout=10)
        dist.destroy_process_group()


def test_an_async_save_in_a_staging_process_writes_what_a_plain_save_writes_and_verifies(
        tmp_path: Path, gloo_alone) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    paths = RunPaths(tmp_path / "ckpt")
    plain, staged = layout.create_step_dir(paths, 1), layout.create_step_dir(paths, 2)
    writer = ChecksummingWriter(plain, overwrite=False)
    dcp.save(_state(), storage_writer=writer)
    dcp.async_save(_state(), storage_writer=ChecksummingWriter(staged, overwrite=False),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(timeout=120)
    shards = sorted(p.name for p in plain.glob("*.distcp"))
    assert shards and shards == sorted(p.name for p in staged.glob("*.distcp"))
    for name in shards:                     # same bytes: the same record checksums
        assert (staged / name).read_bytes() == (plain / name).read_bytes(), name
    files = dict(writer.files, **{".metadata": {
        "size": (staged / ".metadata").stat().st_size,
        "crc32": layout.file_crc(staged / ".metadata"), "rank": 0}})
    assert commit.commit(staged, 2, "test", [(files, None)], time.monotonic(), 0.0, 1,
                         {}) is None
    layout.verify_entry(layout.scan_one(staged))
    got = _blank(_state())
    dcp.load(got, storage_reader=VerifyingReader(staged))
    _assert_same(_state(), got)
