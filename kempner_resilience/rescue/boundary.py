"""Step boundaries: when the state is a consistent checkpoint, and the tiny snapshot that
rebuilds what else a step changes.

At a boundary of ``run.steps()`` (after one step's code, before the next one's) the state is
exactly what a checkpoint of that step would hold. Inside the next step, parameters and
optimizer state stay so until an optimizer step begins: a pre/post hook on every optimizer of
the state records that (``stepped``: an optimizer step began since the boundary, so the live
parameters no longer belong to it). Everything else a step changes is captured at the boundary,
cheaply, so the boundary's state can be rebuilt after a failure in the middle of the next step:

* every RNG stream (python ``random``, numpy, torch CPU, CUDA) and the ``state_dict()`` of the
  other objects of the state (data position, scheduler, scaler), pickled into one small byte
  string (``encode``; about 12 KB, tens of microseconds; ``decode`` gives the per-rank blob a
  checkpoint holds, see ``checkpoint.state``). A small CPU tensor in a ``state_dict()`` (a
  generator's state) goes in as its raw bytes: torch's own pickling of one costs ~60 us. An
  object with a ``snapshot_state()`` gives that instead: its state in a form that pickles
  faster and unpickles to its ``state_dict()`` (Lightning's loop counters);
* each optimizer's param-group settings (lr, momentum, ...: all but the parameters): a script
  may set the next step's values before its optimizer step (nanoGPT's ``get_lr``, ``lr *=
  0.99``), and a checkpoint of the boundary holds the values the last step used;
* the model's persistent buffers (BatchNorm statistics change in the forward pass), copied
  into one flat buffer per dtype and device, allocated once, with one ``torch.cat`` each
  (half the time of a ``torch._foreach_copy_`` into per-buffer copies for 300 small buffers).

Parameters changed outside ``optimizer.step()`` (a manual update, an in-place clamp) are not
seen; see docs/design.md.

A rescue that runs beside a live training thread (the hang watchdog's) ``freeze()``s the
boundary first: from then on that thread stops at its next optimizer step or boundary (the
pre-hook and ``mark`` wait there until the process exits), so the live parameters and optimizer
state stay those of the boundary while they are written. ``generation`` changes with every
optimizer step begun and every mark: the writer compares it before its commit.
"""

from __future__ import annotations

import array
import copy
import ctypes
import io
import pickle
import random
import threading
from typing import Any, Mapping, NamedTuple

import torch

from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.rescue import chunks
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.torch_private import foreach_copy_
from kempner_resilience.stop.watchdog import hold_until_exit

try:  # numpy is optional
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is installed here
    _np = None

__all__ = ["Boundary", "Snapshot", "FrozenTensor", "FrozenStates", "encode", "encode_parts",
           "decode"]

log = get_logger(__name__)

_VERSION = 1
_WORD = "I" if array.array("I").itemsize == 4 else "L"   # MT19937 words are 32 bits


class Snapshot(NamedTuple):
    step: int
    payload: bytes
    chunks: Mapping[int, bytes]      # the sealed chunks the payload refers to by id

    def whole(self) -> bytes:
        """The snapshot with its chunks, as ``encode`` gives it (for a file)."""
        return chunks.pack(self.payload, self.chunks)


class _NumpyState:
    """numpy's global (legacy) RNG state as ``encode`` stores it, read cheaply.

    ``np.random.get_state()`` costs 40-100 us (most of a mark), while most training loops never
    draw from numpy. Its MT19937 words and position are read straight from the bit generator's
    C struct (2.5 KB, about 1 us); only when they changed since the last full read, or when
    that read held a cached Gaussian (which can be used up without touching the words), is
    ``get_state()`` called again. A cached Gaussian can only appear by drawing, which moves the
    words, so the reuse is exact (short of a ``set_state`` to the very same words with a
    different cached Gaussian).
    """

    _RAW = 624 * 4 + ctypes.sizeof(ctypes.c_int)     # mt19937_state: uint32 key[624]; int pos

    def __init__(self) -> None:
        self._addr: int | None = None
        try:
            bitgen = _np.random.mtrand._rand._bit_generator
            if type(bitgen).__name__ == "MT19937":
                self._addr = int(bitgen.ctypes.state_address)
        except Exception:  # noqa: BLE001 - another numpy layout: always read it in full
            self._addr = None
        # The struct as a ctypes array made once: bytes() of it is one copy, a third of a
        # ctypes.string_at call's cost at a boundary whose caches went cold during the step.
        self._view = None if self._addr is None else \
            (ctypes.c_char * self._RAW).from_address(self._addr)
        self._raw = b""
        self._last: tuple = ()

    def get(self) -> tuple:
        raw = bytes(self._view) if self._view is not None else b""
        if raw and raw == self._raw and not self._last[3]:   # equal raw: _last was read
            return self._last
        # The key array as bytes: pickling the ndarray itself costs ~40 us.
        name, key, pos, has_gauss, cached = _np.random.get_state()
        self._raw, self._last = raw, (name, key.tobytes(), pos, has_gauss, cached)
        return self._last


_numpy_state = _NumpyState() if _np is not None else None


class _PythonState:
    """Python's global RNG state as ``encode`` stores it (version, words as bytes, cached
    Gaussian), read cheaply.

    ``random.getstate()`` builds a tuple of 625 ints (about 10 us) and turning it into bytes
    costs as much again, at every step. The generator's C struct (CPython's ``RandomObject``:
    an ``int index`` after the object header, then ``uint32_t state[624]``) is read straight
    instead (2.5 KB, about 1 us), its words and index put in ``getstate()``'s order. The first
    read is checked against ``getstate()``; a Python whose layout differs (or a
    ``random.getstate`` that is not the global generator's) is read the slow way from then on.
    """

    _RAW = 4 + 624 * 4

    def __init__(self) -> None:
        self._inst = getattr(random.getstate, "__self__", None)
        self._addr: int | None = None
        base = type(self._inst).__mro__[-2] if isinstance(self._inst, random.Random) else None
        # The struct must be as large as what is read: never read past the object.
        if base is not None and base.__basicsize__ >= object.__basicsize__ + self._RAW:
            self._addr = id(self._inst) + object.__basicsize__
        # Read through a ctypes array made once (as _NumpyState's); the instance is held.
        self._view = None if self._addr is None else \
            (ctypes.c_char * self._RAW).from_address(self._addr)
        self._checked = False

    def get(self) -> tuple[int, bytes, float | None]:
        if self._addr is not None:
            raw = bytes(self._view)
            fast = (self._inst.VERSION, raw[4:] + raw[:4], self._inst.gauss_next)
            if self._checked:
                return fast
            self._checked = True
            if fast == self._slow():
                return fast
            self._addr = None
            log.debug("python's RNG state read from its struct differs from getstate(): "
                      "getstate() is used")
        return self._slow()

    @staticmethod
    def _slow() -> tuple[int, bytes, float | None]:
        version, words, gauss = random.getstate()
        return version, array.array(_WORD, words).tobytes(), gauss


_python_state = _PythonState()
# torch's CPU RNG state, read from the generator itself: ``torch.get_rng_state()`` is a Python
# function around this call, and its frame costs as much again at a boundary whose caches went
# cold during the step.
_torch_state = torch.default_generator.get_state


def encode(step: int, others: Mapping[str, Any]) -> bytes:
    """This process's RNG streams and the other objects' ``state_dict()`` at ``step``: pickled
    at once, so later changes to the objects cannot reach the snapshot. Whole: with the chunks
    it refers to (``encode_parts`` gives them apart, for the buddy link)."""
    return chunks.pack(*encode_parts(step, others))


def encode_parts(step: int, others: Mapping[str, Any]) -> tuple[bytes, dict[int, bytes]]:
    """``encode``'s snapshot, and the sealed chunks (``rescue.chunks``) it refers to by id."""
    rng: dict[str, Any] = {"python": _python_state.get(),
                           "torch": _torch_state().numpy().tobytes()}
    if _numpy_state is not None:
        rng["numpy"] = _numpy_state.get()
    if torch.cuda.is_initialized():     # (is_available() asks the driver: ~10 us a step)
        rng["cuda"] = [t.numpy().tobytes() for t in torch.cuda.get_rng_state_all()]
    objects = {name: _snapshot_state(obj) for name, obj in others.items()}
    out = io.BytesIO()
    pickler = _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dump((_VERSION, step, rng, objects))
    return out.getvalue(), pickler.refs


def _snapshot_state(obj: Any) -> Any:
    """``obj.state_dict()``, or what its ``snapshot_state()`` gives where it has one: the same
    state in a form that pickles faster and unpickles to what ``state_dict()`` gives (a
    trainer adapter's loop counters: ``trainers/lightning.py``)."""
    fast = getattr(obj, "snapshot_state", None)
    return obj.state_dict() if fast is None else fast()


class _Pickler(pickle.Pickler):
    """A plain dense CPU tensor as its dtype, shape and bytes (copied now, so a later change to
    the tensor cannot reach the snapshot); anything else as ``pickle`` does. Pickle asks this
    only for objects that are not plain numbers, strings or containers, and memoizes the
    result (a tensor found twice is one tensor again when loaded). A sealed chunk goes in by
    its id, noted in ``refs``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refs: dict[int, bytes] = {}

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is chunks.Chunk:
            return chunks.reduce_chunk(obj, self.refs)
        if type(obj) is not torch.Tensor or obj.device.type != "cpu" \
                or obj.layout is not torch.strided or obj.requires_grad or obj.is_conj() \
                or obj.is_neg() or obj.is_quantized or not obj.is_contiguous():
            return NotImplemented
        try:
            return _tensor_from, _tensor_args(obj)
        except (RuntimeError, TypeError):     # a kind of tensor without plain bytes
            return NotImplemented


class FrozenTensor:
    """A plain CPU tensor's bytes, taken once: it pickles (for ``encode``) as that tensor, and
    unpickles to an equal one. For a ``snapshot_state()`` holding a tensor that stays the same
    for many steps (a loader's generator states as its epoch began): the bytes are read once
    per epoch, not at every boundary, where a cold cache makes each torch call cost ~20 us."""

    __slots__ = ("_args",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._args = _tensor_args(tensor.detach().cpu().contiguous())

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _tensor_from, self._args


class FrozenStates:
    """``FrozenTensor``s of a list of tensors that is replaced, never changed in place (a
    loader's generator states as its epoch began): made again only for another list."""

    __slots__ = ("_of", "_frozen")

    def __init__(self) -> None:
        self._of: list[torch.Tensor] | None = None
        self._frozen: list[FrozenTensor] = []

    def __call__(self, tensors: list[torch.Tensor]) -> list[FrozenTensor]:
        if tensors is not self._of:
            self._of, self._frozen = tensors, [FrozenTensor(t) for t in tensors]
        return self._frozen


def _tensor_args(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    """A contiguous CPU tensor as ``_tensor_from`` rebuilds it: dtype, shape, bytes (a copy)."""
    return t.dtype, tuple(t.shape), \
        t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _tensor_from(dtype: torch.dtype, shape: tuple[int, ...], raw: bytes) -> torch.Tensor:
    """The tensor ``_Pickler`` wrote."""
    return _tensor(raw).view(dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)


def _tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class _Unpickler(pickle.Unpickler):
    """``pickle.loads``, with the snapshot's chunk ids resolved to the chunks it came with."""

    def __init__(self, file: io.BytesIO, refs: Mapping[int, bytes]) -> None:
        super().__init__(file)
        self._chunk = chunks.resolver(refs)

    def find_class(self, module: str, name: str) -> Any:
        if module == chunks.__name__ and name == "_chunk_ref":
            return self._chunk
        return super().find_class(module, name)


def decode(payload: bytes) -> dict[str, Any]:
    """The per-rank blob of a checkpoint (``{"step", "rng", "objects"}``, the shape
    ``TrainState.capture`` saves) from an ``encode``d snapshot. Unpickles: only for snapshots
    this package wrote."""
    inner, refs = chunks.unpack(payload)
    version, step, rng, objects = _Unpickler(io.BytesIO(inner), refs).load()
    if version != _VERSION:
        raise ValueError(f"rescue snapshot version {version!r}, expected {_VERSION}")
    py_version, words, gauss = rng["python"]
    out: dict[str, Any] = {"python": (py_version, tuple(array.array(_WORD, words)), gauss),
                           "torch": _tensor(rng["torch"])}
    if "numpy" in rng:
        name, key, pos, has_gauss, cached = rng["numpy"]
        out["numpy"] = (name, _np.frombuffer(key, dtype=_np.uint32).copy(), pos, has_gauss,
                        cached)
    if "cuda" in rng:
        out["cuda"] = [_tensor(raw) for raw in rng["cuda"]]
    return {"step": step, "rng": out, "objects": objects}


class Boundary:
    """The last step boundary of this process and what rebuilds it.

    ``mark(step)`` at every boundary (the main thread); ``why_inconsistent()``, ``snapshot()``
    and ``boundary_buffers()`` from any thread after a failure. Snapshots are immutable byte
    strings swapped in with one assignment, so a reader never sees half of one.
    """

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self.step: int | None = None        # the last boundary marked
        self.stepped = False                # an optimizer step began since that boundary
        self.in_step = 0                    # optimizer steps begun and not finished
        self.error: str | None = None       # why snapshots stopped (an unpicklable state_dict)
        self.generation = 0                 # +1 at every optimizer step begun and every mark
        # The freeze: the thread that froze the boundary (a rescue); every other thread stops
        # at its next optimizer step or mark. The lock makes "not frozen, so step" atomic.
        self._gate = threading.Lock()
        self._frozen_by: int | None = None
        self._snaps: tuple[Snapshot | None, Snapshot | None] = (None, None)
        self._hooks: list[Any] = []
        self._live: list[torch.Tensor] = []
        self._copies: list[torch.Tensor] = []     # views of the flat copies, one per live buffer
        # Per (dtype, device): flat 1-d views of its live buffers, and its flat copy. Empty when
        # a buffer is not contiguous (no flat view): then each is copied on its own.
        self._groups: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        # Each optimizer's param-group settings at the last boundary (``_settings``).
        self._settings: dict[str, list[dict[str, Any]]] = {}

    def attach(self) -> None:
        """Hook every optimizer of the state and allocate the buffer copies (once)."""
        for optim, _ in self.state.optims.values():
            pre = optim.register_step_pre_hook(self._pre)
            # First among the optimizer's own pre-hooks: a failure inside any of them (a hook
            # may sync or change parameters) counts as inside the step. Conservative.
            hooks = getattr(optim, "_optimizer_step_pre_hooks", None)
            if hasattr(hooks, "move_to_end"):
                hooks.move_to_end(pre.id, last=False)
            self._hooks += [pre, optim.register_step_post_hook(self._post)]
        params = {id(p) for m in self.state.modules.values() for p in m.parameters()}
        seen: set[int] = set()
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for module in self.state.modules.values():
            for value in module.state_dict(keep_vars=True).values():
                if isinstance(value, torch.Tensor) and id(value) not in params \
                        and id(value) not in seen and value.numel() > 0:
                    seen.add(id(value))
                    by_kind.setdefault((value.dtype, value.device), []).append(value.detach())
        flat_ok = all(t.is_contiguous() for lives in by_kind.values() for t in lives)
        for (dtype, device), lives in by_kind.items():
            flat = torch.empty(sum(t.numel() for t in lives), dtype=dtype, device=device)
            self._live += lives
            self._copies += [part.view(t.shape) for part, t in
                             zip(flat.split([t.numel() for t in lives]), lives)]
            if flat_ok:
                self._groups.append(([t.view(-1) for t in lives], flat))

    def detach(self, why: str | None = None) -> None:
        """Take the hooks off; with ``why``, no step boundary is offered from now on (``error``
        says why, unless an earlier failure already does)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if why is not None and self.error is None:
            self.error = why

    def freeze(self, timeout_s: float) -> bool:
        """From now on, threads other than the caller stop at their next optimizer step or
        boundary, for good (the rescue's process exits after it). False when a mark did not
        finish within ``timeout_s`` (a ``state_dict()`` stuck inside it)."""
        if not self._gate.acquire(timeout=timeout_s):
            return False
        try:
            if self._frozen_by is None:
                self._frozen_by = threading.get_ident()
        finally:
            self._gate.release()
        return True

    def _held(self) -> bool:
        frozen = self._frozen_by
        return frozen is not None and frozen != threading.get_ident()

    def _pre(self, *_args: Any) -> None:
        if self._frozen_by == threading.get_ident():
            # The rescue's own state building: DCP initialises an optimizer that has no state
            # yet (plain SGD) with a step at lr 0, which changes nothing of the boundary.
            return
        with self._gate:
            held = self._held()
            if not held:
                self.stepped = True
                self.in_step += 1
                self.generation += 1
        if held:
            hold_until_exit("a rescue is writing the state of the last step boundary")

    def _post(self, *_args: Any) -> None:
        if self._frozen_by != threading.get_ident():
            self.in_step -= 1

    def mark(self, step: int) -> Snapshot | None:
        """The state is at boundary ``step``: snapshot it. Returns the snapshot (None once a
        snapshot failed: the rescue is then off for this process, said once)."""
        with self._gate:
            if not self._held():
                return self._mark(step)
        hold_until_exit("a rescue is writing the state of the last step boundary")
        return None     # never reached

    def _mark(self, step: int) -> Snapshot | None:
        snap = None
        if self.error is None:
            try:
                snap = Snapshot(step, *encode_parts(step, self.state.others))
            except Exception as e:  # noqa: BLE001 - a user's state_dict() that cannot pickle
                self.error = f"the step snapshot failed ({type(e).__name__}: {e})"
                log.warning("rescue off for this rank: %s", self.error)
        if self._live:
            self._copy_buffers()
        self._settings = _settings(self.state)
        self._snaps = (snap, self._snaps[0])
        self.step = step
        self.stepped = False
        self.in_step = 0
        self.generation += 1
        return snap

    def _copy_buffers(self) -> None:
        # No torch.no_grad() needed: the live buffers were detached at attach().
        if self._groups:
            for views, flat in self._groups:
                torch.cat(views, out=flat)
        else:
            foreach_copy_(self._copies, self._live)

    def why_inconsistent(self) -> str | None:
        """None when the live parameters and optimizer state are still those of the last
        boundary (so that boundary can be written), else why not."""
        if self.error is not None:
            return self.error
        if self.step is None:
            return "no step boundary was reached yet"
        if self.in_step:
            return f"an optimizer step was in progress (after the boundary of step {self.step})"
        if self.stepped:
            return (f"an optimizer step already ran after the boundary of step {self.step}, so "
                    "the parameters belong to no boundary whose other state is known")
        return None

    def snapshots(self) -> list[Snapshot]:
        """The snapshots of the last two boundaries, newest first."""
        return [s for s in self._snaps if s is not None]

    def boundary_settings(self) -> dict[str, list[dict[str, Any]]]:
        """Each optimizer's param-group settings (all but ``params``) as they were at the last
        boundary, by the optimizer's state name."""
        return self._settings

    def boundary_buffers(self) -> dict[int, torch.Tensor]:
        """The persistent buffers as they were at the last boundary, by the live buffer's
        ``data_ptr()``."""
        return {live.data_ptr(): copy for live, copy in zip(self._live, self._copies)}


def _settings(state: TrainState) -> dict[str, list[dict[str, Any]]]:
    """Each optimizer's param-group settings, copied (a tensor lr is cloned; numbers and tuples
    are immutable): a few small dicts per step."""
    return {name: [{k: v.detach().clone() if isinstance(v, torch.Tensor) else
                    copy.deepcopy(v) if isinstance(v, (list, dict)) else v
                    for k, v in group.items() if k != "params"}
                   for group in optim.param_groups]
            for name, (optim, _) in state.optims.items()}
