"""Every private torch surface this package relies on, named in one place and checked at import.

torch keeps no promise about names with a leading underscore. Reaching them through this module
means a torch that renamed one fails here, at import, with the name and the module that needs
it, instead of deep inside an emergency save after a signal. The torch versions this package is
tested on are checked here too (``MIN_TORCH``): below it, the import fails with the fix.

Required (the import fails without them; DCP's three fail the import of the checkpoint layer,
which reaches them first, so that a process that only supervises ranks never imports DCP):

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
  (``stop/agreement.py`` calls it directly; the name is checked here all the same, as every
  run with state imports this).

- ``Tensor._version``: a tensor's in-place write counter; a gradient accumulated into since
  the optimizer's last step has a higher one (``tensor_version``, ``checkpoint/carried.py``);
- an optimizer's ``step`` wrapped by ``LRScheduler`` (its ``_wrapped_by_lr_sched`` mark): a
  scheduler drives it (``lr_scheduler_attached``, ``checkpoint/carried.py``; without the mark
  the check finds no scheduler and says nothing).

Optional (looked up where used; without them a feature is off and says so in the log):

- ``SavePlanner``'s plan caches (``_cached_save_plan`` and four more, ``forget_save_plans``):
  a run's DCP plans dropped when it closes (``checkpoint/saver.py``'s ``RunSavePlanner``
  scopes them to one run already; without the names they stay in memory until the process
  ends);

- a gloo backend's ``_set_default_timeout`` (``checkpoint/comm.py``: bounding a save's wait for
  its peers; without it the group's own timeout applies);
- torch elastic's internals, in three named groups (``ELASTIC``), resolved on first use by the
  torchrun glue (``elastic(group)``: the agent process only, so a training rank never imports
  the elastic agent), each with what a torch without it loses, logged once:

  * ``shutdown`` (``supervise/torchrun/elastic.py``): ``LocalElasticAgent._start_workers``,
    which our agent subclass extends (worker tracking), its ``_pcontext`` and ``PContext.close``
    (the started context becomes a subclass of its class whose close first waits until the
    deadline: torch closes every worker at the first failure from inside its poll), and two module-level names torch looks up while it starts the workers, replaced
    for the time of that start only (no class to subclass there): the subprocess handler's
    ``Popen`` (the parent-death signal) and ``multiprocessing.api._terminate_process_handler``
    (signals once to every worker). Without them: stock torchrun;
  * ``restarts``: ``LocalElasticAgent._monitor_workers``, ``SimpleElasticAgent.
    _initialize_workers`` and the agent's ``_remaining_restarts`` (``remaining_restarts``):
    the policy's restart decision. Without them torch restarts after any failure;
  * ``spares`` (``supervise/torchrun/elastic.py``, ``supervise/torchrun/spares.py``,
    ``supervise/torchrun/standby.py``): ``_DistributedRendezvousOpExecutor`` (subclassed: a standby is
    noticed), ``DynamicRendezvousHandler``'s ``_op_executor``, ``_this_node``, ``_state_holder``,
    ``_settings`` and ``_stop_heartbeats``, ``_RendezvousExitOp`` (a node that leaves without
    closing the rendezvous) and ``_RendezvousState``'s fields (``rendezvous_state``: the round,
    the participants, the standbys and their heartbeats). Without them: no relaunch in place
    (a failure requeues);
  * ``notice`` (``supervise/torchrun/elastic.py``): the state holder's ``_sanitize``,
    ``_state`` and ``_settings``: the holder becomes a subclass of its class whose sanitize,
    once this node's workers lost a peer, also drops a finished round's participant all of
    whose ranks the workers saw die, or (none named) whose heartbeat is two keep-alive
    intervals old. Without them the dead node leaves when torch's keep-alive window expires.
  * ``warm`` (``supervise/torchrun/agent.py``): ``SubprocessHandler._popen`` and
    ``_stdout``/``_stderr`` (a subclass of torch's handler forks the worker from the agent's
    zygote instead), and ``multiprocessing.api.get_subprocess_handler``, the module-level
    name the process context builds its handlers with, replaced for the time of a worker
    group's start only (``starting``'s way). Without them: the workers start cold.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any

import torch
import torch.storage
from torch.distributed import distributed_c10d as _c10d

from kempner_resilience.core.log import get_logger

__all__ = ["MIN_TORCH", "TESTED_ON", "check_version", "StorageInfo", "StoragePrefix",
           "forget_save_plans",
           "narrow_tensor_by_index", "rebuild_tensor_v2", "element_size",
           "dtype_to_storage_type_map", "foreach_copy_", "ELASTIC", "elastic",
           "remaining_restarts", "set_remaining_restarts", "rendezvous_state", "this_node",
           "instance_missing", "SUBPROCESS_HANDLER_MODULE", "MP_API_MODULE", "tensor_version",
           "lr_scheduler_attached"]

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

_log = get_logger(__name__)

_missing: list[str] = []


def _need(owner: Any, name: str, user: str, missing: list[str] = _missing) -> Any:
    value = getattr(owner, name, None)
    if value is None:
        missing.append(f"{owner.__name__}.{name} (used by {user})")
    return value


rebuild_tensor_v2 = _need(torch._utils, "_rebuild_tensor_v2", "checkpoint/recordfmt.py")
element_size = _need(torch._utils, "_element_size", "checkpoint/recordfmt.py")
dtype_to_storage_type_map = _need(torch.storage, "_dtype_to_storage_type_map",
                                  "checkpoint/recordfmt.py")
foreach_copy_ = _need(torch, "_foreach_copy_", "rescue/boundary.py")
_need(_c10d, "_get_default_store", "stop/agreement.py")

if not hasattr(torch.empty(0), "_version"):
    _missing.append("Tensor._version (used by checkpoint/carried.py)")


def _refuse(missing: list[str]) -> None:
    if missing:
        raise ImportError(
            f"this torch ({torch.__version__}) lacks private names kempner_resilience relies "
            f"on: {'; '.join(missing)}. It is tested on {TESTED_ON}: install one of those")


_refuse(_missing)

# DCP's required names are checked when the checkpoint layer imports the first of them (at its
# own import, long before a save), not here: importing DCP costs half a second of CPU, which a
# process that only supervises (the torchrun agent) never needs.
_DCP_NAMES = {
    "StorageInfo": ("torch.distributed.checkpoint.filesystem", "_StorageInfo",
                    "checkpoint/writer.py"),
    "StoragePrefix": ("torch.distributed.checkpoint.filesystem", "_StoragePrefix",
                      "checkpoint/writer.py"),
    "narrow_tensor_by_index": ("torch.distributed._shard._utils", "narrow_tensor_by_index",
                               "checkpoint/reader.py"),
}


@functools.lru_cache(maxsize=None)
def _dcp() -> dict[str, Any]:
    missing: list[str] = []
    found = {alias: _need(importlib.import_module(module), name, user, missing)
             for alias, (module, name, user) in _DCP_NAMES.items()}
    _refuse(missing)
    return found


def __getattr__(name: str) -> Any:
    if name in _DCP_NAMES:
        return _dcp()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------- torch elastic

_EL = "torch.distributed.elastic."
#: The modules whose module-level names the torchrun glue swaps while a worker group starts.
SUBPROCESS_HANDLER_MODULE = _EL + "multiprocessing.subprocess_handler.subprocess_handler"
MP_API_MODULE = _EL + "multiprocessing.api"
_LEA = "agent.server.local_elastic_agent:LocalElasticAgent."
_DR = "rendezvous.dynamic_rendezvous:"

#: torch elastic's private names by feature: (what a torch without them loses, the names as
#: ``module:attribute.path`` under ``torch.distributed.elastic``). Instance attributes set in
#: ``__init__`` (``_remaining_restarts``, the handler's ``_this_node``, ...) cannot be looked up
#: on the class: ``instance_missing`` checks them on the first instance.
ELASTIC: dict[str, tuple[str, tuple[str, ...]]] = {
    "shutdown": ("stock torchrun: a signal is torch's (SIGTERM, then SIGKILL 30 s later), no "
                 "parent-death signal", (
                     _LEA + "_start_workers", "multiprocessing.api:PContext.close",
                     SUBPROCESS_HANDLER_MODULE[len(_EL):] + ":Popen",
                     MP_API_MODULE[len(_EL):] + ":_terminate_process_handler")),
    "restarts": ("torch restarts the workers after any failure, whatever the policy says", (
        _LEA + "_monitor_workers", "agent.server.api:SimpleElasticAgent._initialize_workers")),
    "spares": ("no relaunch in place: a failure requeues the job", (
        _DR + "_DistributedRendezvousOpExecutor",
        _DR + "_DistributedRendezvousOpExecutor._add_to_redundancy_list",
        _DR + "DynamicRendezvousHandler._stop_heartbeats", _DR + "_RendezvousExitOp",
        _DR + "_RendezvousState")),
    "notice": ("a dead node leaves the rendezvous only when torch's keep-alive window expires", (
        _DR + "_BackendRendezvousStateHolder._sanitize",)),
    "warm": ("the workers start cold (Python and import torch again at each relaunch)", (
        SUBPROCESS_HANDLER_MODULE[len(_EL):] + ":SubprocessHandler._popen",
        SUBPROCESS_HANDLER_MODULE[len(_EL):] + ":SubprocessHandler.close",
        MP_API_MODULE[len(_EL):] + ":get_subprocess_handler")),
}
# The instance attributes of each group, checked on the first instance (``instance_missing``).
ELASTIC_INSTANCE = {
    "shutdown": ("_pcontext",),
    "restarts": ("_remaining_restarts",),
    "spares": ("_op_executor", "_this_node", "_state_holder", "_settings"),
    "notice": ("_state", "_settings"),       # on the state holder
    "warm": ("_stdout", "_stderr"),          # on a subprocess handler
}
# _RendezvousState's fields the glue reads (torch pickles that object into its store).
_STATE_FIELDS = ("round", "participants", "wait_list", "redundancy_list", "last_heartbeats")


def _resolve(path: str) -> Any:
    module, _, attrs = path.partition(":")
    value: Any = importlib.import_module(_EL + module)
    for name in attrs.split("."):
        value = getattr(value, name, None)
        if value is None:
            return None
    return value


@functools.lru_cache(maxsize=None)
def elastic(group: str) -> dict[str, Any] | None:
    """The private names of ``ELASTIC[group]``, resolved (by their attribute path, e.g.
    ``"_RendezvousExitOp"``, ``"LocalElasticAgent._shutdown"``); None when this torch lacks any,
    after one warning that names them and what is lost."""
    lost, paths = ELASTIC[group]
    found: dict[str, Any] = {}
    missing = []
    for path in paths:
        try:
            value = _resolve(path)
        except ImportError:
            value = None
        if value is None:
            missing.append(_EL + path.replace(":", "."))
        else:
            found[path.partition(":")[2]] = value
    if "_RendezvousState" in found:
        state = found["_RendezvousState"]()
        missing += [f"_RendezvousState.{f}" for f in _STATE_FIELDS if not hasattr(state, f)]
    if missing:
        _log.warning("torch %s lacks %s: %s", torch.__version__, ", ".join(missing), lost)
        return None
    return found


def instance_missing(group: str, obj: Any) -> bool:
    """Whether ``obj`` (the first instance of a torch elastic class) lacks an instance attribute
    of ``group``; logs which and what is lost."""
    missing = [n for n in ELASTIC_INSTANCE.get(group, ()) if not hasattr(obj, n)]
    if missing:
        _log.warning("torch %s: %s has no %s: %s", torch.__version__, type(obj).__name__,
                       ", ".join(missing), ELASTIC[group][0])
    return bool(missing)


def remaining_restarts(agent: Any) -> int:
    """torch's count of the in-place restarts an elastic agent has left."""
    return int(getattr(agent, "_remaining_restarts", 0))


def set_remaining_restarts(agent: Any, value: int) -> None:
    """Set it: 0 makes torch stop the failed group and return FAILED instead of restarting."""
    agent._remaining_restarts = value


def rendezvous_state(handler: Any) -> Any:
    """A dynamic rendezvous handler's last synced state (``_RendezvousState``), or None."""
    return getattr(getattr(handler, "_state_holder", None), "state", None)


def this_node(handler: Any) -> Any:
    """A dynamic rendezvous handler's own node descriptor (``addr``), or None."""
    return getattr(handler, "_this_node", None)




#: DCP's plan caches: class-level dicts of ``SavePlanner``, keyed by the planner's class name.
_PLAN_CACHES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans",
                "_cached_global_plan", "_cached_metadata")


def forget_save_plans(key: str) -> None:
    """Drop the DCP plans cached under ``key`` (a planner class's name) in this process."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in _PLAN_CACHES:
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            cache.pop(key, None)
        elif name not in _missing_caches:
            _missing_caches.add(name)
            _log.info("torch's SavePlanner.%s is gone: a run's DCP plans stay in memory until "
                      "the process ends", name)


_missing_caches: set[str] = set()


def tensor_version(t: torch.Tensor) -> int:
    """How many in-place writes ``t`` has seen (autograd's version counter)."""
    return int(t._version)


def lr_scheduler_attached(optim: torch.optim.Optimizer) -> bool:
    """Whether a torch ``LRScheduler`` was made on ``optim`` (it wraps ``optim.step`` and
    marks the wrapper)."""
    return bool(getattr(optim.step, "_wrapped_by_lr_sched", False))
