"""Every private torch surface this package relies on, named in one place and checked at import.

torch keeps no promise about names with a leading underscore. Reaching them through this module
means a torch that renamed one fails here, at import, with the name and the module that needs
it, instead of deep inside an emergency save after a signal. The torch versions this package is
tested on are checked here too (``MIN_TORCH``): below it, the import fails with the fix.

Required (the import fails without them):

- ``torch.distributed.checkpoint.filesystem._StorageInfo`` / ``_StoragePrefix``: the storage
  records our DCP writer (``checkpoint/writer.py``) returns, as ``FileSystemWriter`` does;
- ``torch.distributed._shard._utils.narrow_tensor_by_index``: the reader's slicing of a stored
  tensor to the requested chunk (``checkpoint/reader.py``), as ``FileSystemReader`` does;
- ``torch._utils._rebuild_tensor_v2``, ``torch._utils._element_size``,
  ``torch.storage._dtype_to_storage_type_map``: the ``torch.save``-compatible record headers
  written without ``torch.save`` (``checkpoint/recordfmt.py``);
- ``torch._foreach_copy_``: the rescue's copy of the live state at a step boundary
  (``rescue/boundary.py``);
- ``torch.distributed.distributed_c10d._get_default_store``: the stop agreement's store
  (``stop/agreement.py`` calls it directly: the stop layer must not import DCP, which this
  module does; the name is checked here all the same, as every run with state imports this).

Optional (looked up where used; without them a feature is off and says so in the log):

- a gloo backend's ``_set_default_timeout`` (``checkpoint/comm.py``: bounding a save's wait for
  its peers; without it the group's own timeout applies);
- torch elastic's agent and rendezvous internals (``integrations/torchrun_spares.py``,
  ``slurm/standby.py``: relaunch in place under torchrun; without them a failure requeues).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.storage
from torch.distributed import distributed_c10d as _c10d
from torch.distributed._shard import _utils as _shard_utils
from torch.distributed.checkpoint import filesystem as _dcp_fs

__all__ = ["MIN_TORCH", "TESTED_ON", "check_version", "StorageInfo", "StoragePrefix",
           "narrow_tensor_by_index", "rebuild_tensor_v2", "element_size",
           "dtype_to_storage_type_map", "foreach_copy_"]

# The oldest torch this package is run on: 2.11 (CUDA 13) by bench/gpu_check.py on the GPU
# machines, 2.13 (CPU) by the test suite. An older torch is refused rather than trusted: the
# registry serves no CPU build of older versions here to run the suite on.
MIN_TORCH = (2, 11)
TESTED_ON = "torch 2.11 (CUDA 13, bench/gpu_check.py on an H100) and 2.13 (CPU, the test suite)"


def _release(version: str) -> tuple[int, int]:
    m = re.match(r"^(\d+)\.(\d+)", version)
    if m is None:
        raise ImportError(f"kempner_resilience cannot read torch's version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_version(version: str) -> None:
    """ImportError naming the fix when ``version`` is older than ``MIN_TORCH``."""
    if _release(version) < MIN_TORCH:
        want = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"kempner_resilience needs torch >= {want} (tested on {TESTED_ON}); this is torch "
            f"{version}. Install a newer torch for your CUDA, e.g. pip install 'torch>={want}' "
            "(see docs/quickstart.md#1-install)")


check_version(torch.__version__)

_missing: list[str] = []


def _need(owner: Any, name: str, user: str) -> Any:
    value = getattr(owner, name, None)
    if value is None:
        _missing.append(f"{getattr(owner, '__name__', owner)}.{name} (used by {user})")
    return value


StorageInfo = _need(_dcp_fs, "_StorageInfo", "checkpoint/writer.py")
StoragePrefix = _need(_dcp_fs, "_StoragePrefix", "checkpoint/writer.py")
narrow_tensor_by_index = _need(_shard_utils, "narrow_tensor_by_index", "checkpoint/reader.py")
rebuild_tensor_v2 = _need(torch._utils, "_rebuild_tensor_v2", "checkpoint/recordfmt.py")
element_size = _need(torch._utils, "_element_size", "checkpoint/recordfmt.py")
dtype_to_storage_type_map = _need(torch.storage, "_dtype_to_storage_type_map",
                                  "checkpoint/recordfmt.py")
foreach_copy_ = _need(torch, "_foreach_copy_", "rescue/boundary.py")
_need(_c10d, "_get_default_store", "stop/agreement.py")

if _missing:
    raise ImportError(
        f"this torch ({torch.__version__}) lacks private names kempner_resilience relies on: "
        f"{'; '.join(_missing)}. It is tested on {TESTED_ON}: install one of those")
