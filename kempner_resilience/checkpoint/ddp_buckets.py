"""DDP's gradient-bucket layout: recorded in checkpoints, restored at resume.

Why: ``DistributedDataParallel`` reduces gradients in buckets (flat buffers, one all-reduce
each). A new process starts with one bucket in parameter order; after its first backward pass
DDP rebuilds the buckets once, in the order gradients became ready (``Reducer::rebuild_buckets``,
unless ``find_unused_parameters=True``). An uninterrupted run therefore reduces step N (N >= 2)
in the rebuilt layout, while a resumed process reduces its first step in the initial one. With 3
or more ranks the ring all-reduce then adds the ranks' values in another order at some positions,
and the resumed run drifts by ~1e-8 from the uninterrupted one (with 2 ranks a+b == b+a hides it).

The fix: the layout DDP rebuilt (``rebuilt_per_bucket_param_indices`` in its logging data, as
parameter names) is saved with each checkpoint, and at resume, before the first step, the
``Reducer`` is rebuilt with that layout through DDP's own ``_ddp_init_helper`` (the path DDP
takes to rebuild its reducer when unpickled). The first resumed step then reduces exactly as step
N of the uninterrupted run. The new reducer rebuilds once more after its first backward; that
rebuild follows the same gradient-ready order and so yields the same layout.

The record is advisory: it is applied only when it names exactly the DDP's parameters, every rank
holds the same one, and the DDP is in a configuration this module knows how to rebuild; otherwise
a warning says why and training continues with DDP's own layout. ``checkpoint.ddp_buckets: false``
turns it off. These are PyTorch internals (tested with torch 2.13): any failure while rebuilding
puts the original reducer back.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kempner_resilience.core.log import get_logger

log = get_logger(__name__)

__all__ = ["BucketLayouts", "find_ddp"]

RECORD_KEY = "ddp_buckets"
_VERSION = 1
# _compute_bucket_assignment_by_size is swapped for the duration of one _ddp_init_helper call.
_PATCH_LOCK = threading.Lock()


def find_ddp(modules: Mapping[str, nn.Module]) -> dict[str, DDP]:
    """Every DDP inside the state's modules, keyed ``<state name>[.<submodule path>]``."""
    out: dict[str, DDP] = {}
    for name, module in modules.items():
        for path, sub in module.named_modules():
            if isinstance(sub, DDP):
                out[f"{name}.{path}" if path else name] = sub
    return out


def _param_names(ddp: DDP) -> tuple[list[Any], dict[int, str]]:
    params, _ = ddp._build_params_for_reducer()
    return params, ddp._build_debug_param_to_name_mapping(params)


def _logged_layout(ddp: DDP) -> list[list[int]] | None:
    """The layout DDP rebuilt, from its logging data; None before the rebuild was logged (it is
    logged at the forward after the rebuild). Takes the reducer's lock: never call this while
    another thread may be inside a backward pass."""
    data = ddp._get_ddp_logging_data()
    text = data.get("rebuilt_per_bucket_param_indices")
    if not data.get("has_rebuilt_buckets") or not isinstance(text, str) or not text.strip():
        return None
    return [[int(i) for i in bucket.split()] for bucket in text.split(",")]


class BucketLayouts:
    """The bucket layouts of the DDPs in a TrainState: what to save, and restoring them."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        self.ddps = find_ddp(modules)
        # key -> (id of the reducer it describes, layout as parameter names per bucket, whether
        # DDP itself built it). DDP rebuilds once: its layout is then final. A restored layout
        # holds until the new reducer's own rebuild, which observe() checks against it.
        self._known: dict[str, tuple[int, list[list[str]], bool]] = {}

    # ------------------------------------------------------------------------------ saving

    def observe(self) -> None:
        """Read layouts DDP has rebuilt since the last call. Call between steps, in the thread
        that trains (cheap: a flag check once a layout is known)."""
        for key, ddp in self.ddps.items():
            reducer = getattr(ddp, "reducer", None)
            known = self._known.get(key)
            if reducer is None or (known is not None and known[0] == id(reducer) and known[2]):
                continue
            if not getattr(ddp, "_has_rebuilt_buckets", False):
                continue
            try:
                indices = _logged_layout(ddp)
                if indices is None:
                    continue
                _, names = _param_names(ddp)
                layout = [[names[i] for i in b] for b in indices]
            except Exception as e:  # noqa: BLE001 - internals of another torch version
                log.debug("cannot read DDP %s's bucket layout: %s", key, e)
                continue
            if known is not None and known[0] == id(reducer) and known[1] != layout:
                log.warning("DDP %s rebuilt its gradient buckets differently from the layout "
                            "restored from the checkpoint (gradients became ready in another "
                            "order): this run may differ from an uninterrupted one in the last "
                            "bits", key)
            self._known[key] = (id(reducer), layout, True)

    def _current(self, key: str, ddp: DDP) -> list[list[str]] | None:
        known = self._known.get(key)
        if known is not None and known[0] == id(getattr(ddp, "reducer", None)):
            return known[1]
        return None

    def record(self, observe: bool = True) -> dict[str, Any]:
        """What goes into the checkpoint. Reads DDP's logging data only from the main thread
        (it takes the reducer's lock, which a training thread stuck in backward may hold), and
        not at all with ``observe=False`` (a rescue after a failed backward: the layout read
        at the last step boundary is the one)."""
        if observe and threading.current_thread() is threading.main_thread():
            self.observe()
        out: dict[str, Any] = {}
        for key, ddp in self.ddps.items():
            layout = self._current(key, ddp)
            if layout is not None:
                out[key] = {"version": _VERSION, "buckets": layout}
            elif getattr(ddp, "_lazy_init_ran", False) and _rebuilds(ddp):
                # Trained, but the rebuilt layout is not known yet (DDP logs it at the forward
                # after its rebuild, i.e. from step 3 of a fresh process, 4 with static_graph):
                # resume says what this costs.
                out[key] = {"version": _VERSION, "buckets": None}
        return out

    # ----------------------------------------------------------------------------- resuming

    def plan(self, records: Mapping[str, Any] | None) -> dict[str, tuple[Any, str | None]]:
        """Per DDP: (bucket indices to restore or None, why not or None). Local, no changes;
        every rank must agree on the plan before ``apply``."""
        records = records or {}
        out: dict[str, tuple[Any, str | None]] = {}
        for key, ddp in self.ddps.items():
            rec = records.get(key)
            if rec is None:
                # An older checkpoint, or one written before any step: nothing to restore.
                out[key] = (None, None)
                continue
            try:
                out[key] = self._plan_one(ddp, rec)
            except Exception as e:  # noqa: BLE001 - internals of another torch version
                out[key] = (None, f"cannot inspect it ({type(e).__name__}: {e})")
        return out

    def _plan_one(self, ddp: DDP, rec: Mapping[str, Any]) -> tuple[Any, str | None]:
        if rec.get("version") != _VERSION:
            return None, f"unknown bucket record version {rec.get('version')!r}"
        if not _rebuilds(ddp):
            return None, None      # this DDP never rebuilds: its layout is fixed at construction
        buckets = rec.get("buckets")
        if buckets is None:
            return None, ("the checkpoint was written before DDP's rebuilt layout was known "
                          "(within the first steps of a fresh process)")
        why = _unsupported(ddp)
        if why:
            return None, why
        params, names = _param_names(ddp)
        index = {n: i for i, n in names.items()}
        flat = [n for b in buckets for n in b]
        if len(flat) != len(set(flat)) or set(flat) != set(index):
            missing, extra = sorted(set(index) - set(flat)), sorted(set(flat) - set(index))
            detail = "; ".join(f"{what}: {', '.join(names_[:3])}" for what, names_ in (
                ("not in the record", missing), ("not trained by this DDP", extra)) if names_)
            return None, ("the recorded layout does not match the parameters this DDP reduces "
                          f"({detail or 'a parameter is listed twice'})")
        indices = [[index[n] for n in b] for b in buckets]
        for b in indices:
            kinds = {(params[i].dtype, params[i].device) for i in b}
            if len(kinds) != 1:
                return None, "a recorded bucket mixes dtypes or devices in this model"
        return indices, None

    def apply(self, key: str, indices: list[list[int]]) -> tuple[Any, Any] | None:
        """Rebuild DDP ``key``'s reducer with ``indices``. Returns the old (reducer, logger) for
        ``revert``, or None when it failed (the old ones are back; a warning says why). Local:
        every rank must apply the same layout, or revert, before the next step."""
        ddp = self.ddps[key]
        old = (ddp.reducer, ddp.logger)
        try:
            params, expect_sparse = ddp._build_params_for_reducer()
            names = ddp._build_debug_param_to_name_mapping(params)
            # DDP reverses the assignment it is given (that function lists buckets
            # first-parameter-first); the recorded one is in reduction order. Size limits only
            # feed DDP's logging here.
            assigned = [list(b) for b in reversed(indices)]
            limits = [int(ddp.bucket_bytes_cap)] * len(indices)

            def assignment(*_args: Any, **_kwargs: Any) -> tuple[list[list[int]], list[int]]:
                return assigned, limits

            with _PATCH_LOCK:
                real = dist._compute_bucket_assignment_by_size
                dist._compute_bucket_assignment_by_size = assignment  # type: ignore[assignment]
                try:
                    ddp._ddp_init_helper(params, expect_sparse, names, ddp.static_graph)
                finally:
                    dist._compute_bucket_assignment_by_size = real  # type: ignore[assignment]
            if ddp.static_graph:      # as DDP.__setstate__ does after _ddp_init_helper
                ddp.reducer._set_static_graph()
                ddp.logger._set_static_graph()
            for hook, state in getattr(ddp, "_comm_hooks", []):
                ddp.logger._set_comm_hook_name(hook.__qualname__)
                dist._register_comm_hook(ddp.reducer, state, hook)
        except Exception as e:  # noqa: BLE001 - internals of another torch version
            ddp.reducer, ddp.logger = old
            log.warning("could not restore DDP %s's gradient bucket layout (%s: %s); continuing "
                        "with DDP's own", key, type(e).__name__, e)
            return None
        self._known[key] = (id(ddp.reducer), [[names[i] for i in b] for b in indices], False)
        return old

    def revert(self, key: str, old: tuple[Any, Any]) -> None:
        """Put back the reducer ``apply`` replaced (another rank could not apply its layout)."""
        ddp = self.ddps[key]
        ddp.reducer, ddp.logger = old
        self._known.pop(key, None)


def _rebuilds(ddp: DDP) -> bool:
    """Whether DDP rebuilds its buckets after the first iteration (the Reducer's rule) through
    its C++ Reducer (not with the compiled-autograd python reducer, nor without a reducer)."""
    if getattr(ddp, "_use_python_reducer", False) or getattr(
            ddp, "_delay_all_reduce_all_params", False):
        return False
    return bool(ddp.static_graph or not ddp.find_unused_parameters)


def _unsupported(ddp: DDP) -> str | None:
    """Why this DDP's reducer is not rebuilt here, or None."""
    if getattr(ddp, "_has_rebuilt_buckets", False):
        return "it already trained in this process before the checkpoint was loaded"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "it uses DDP's mixed_precision option"
    if ddp._get_ddp_logging_data().get("comm_hook") and not getattr(ddp, "_comm_hooks", None):
        return "it has a built-in comm hook"
    if any(hasattr(p, "_in_backward_optimizers") for p in ddp.module.parameters()):
        return "it runs the optimizer in backward"
    return None
