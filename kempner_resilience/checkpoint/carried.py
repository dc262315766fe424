"""What a training loop carries from one step to the next besides the weights and the optimizer,
found at run time: gradients accumulated but not applied yet, and an LR scheduler that drives a
saved optimizer without being saved itself.

Gradient accumulation: a stop (or a periodic save) at a step boundary inside an accumulation
window finds gradients that the next ``optim.step()`` would have applied. Dropped, the resumed
window applies fewer micro-batches than the uninterrupted one (the issue measured a max weight
difference of 0.027). A checkpoint taken inside a window saves them: a periodic save, a
single rank's stop, and a stop whose window did not close within ``run/window.py``'s bound (a
stop of several ranks waits for the window's end first, see there). Under DDP's ``no_sync``
every rank holds gradients of its own: they go into the rank's own blob, never deduplicated
across ranks. ``PendingGrads`` tells such gradients from the ones a
finished step leaves behind (``zero_grad()`` at the start of the next step): it notes each
gradient's tensor and version after every ``optimizer.step()`` (a post-step hook, public API), and
at a save takes those changed since then, and not all zeros (``zero_grad(set_to_none=False)``).

Schedulers: torch's ``LRScheduler`` wraps its optimizer's ``step`` when it is made
(``torch_private.lr_scheduler_attached``); an optimizer in the state whose step is wrapped, with no
state entry (or attribute of one) that is a scheduler of it, restarts its schedule at resume.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator, Mapping

import torch

from kempner_resilience.core.log import get_logger, rank
from kempner_resilience.core.torch_private import lr_scheduler_attached, tensor_version

log = get_logger(__name__)

__all__ = ["PendingGrads", "unsaved_schedulers"]


def _params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optim.param_groups for p in g["params"]]


class PendingGrads:
    """The gradients of the state's optimizers' parameters accumulated since each optimizer's
    last step: captured with a checkpoint and restored at resume."""

    def __init__(self, optims: Mapping[str, torch.optim.Optimizer]) -> None:
        self._optims = dict(optims)
        # id(optimizer) -> per parameter: (its gradient, weakly, and that tensor's version)
        # as the optimizer's last step left them.
        self._applied: dict[int, list[tuple[Any, int] | None]] = {}
        self._handles = [o.register_step_post_hook(self._stepped) for o in self._optims.values()]
        self._said = False
        self._paused = False
        # Gradients already there when the run is set up were left by a step before it (a
        # warm-up, a step taken before the state was wrapped), not accumulated by this run's
        # loop: as the last step left them. A resume's restored gradients are new tensors.
        for optim in self._optims.values():
            self._stepped(optim, (), {})

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Steps taken meanwhile are not the loop's: torch's ``get_optimizer_state_dict``
        makes a stateless optimizer's state up with a zero-gradient step (the real gradients
        set aside, then put back), which must not count as applying them."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _stepped(self, optim: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._paused:
            return
        self._applied[id(optim)] = [None if p.grad is None else
                                    (weakref.ref(p.grad), tensor_version(p.grad))
                                    for p in _params(optim)]

    def pending(self) -> dict[str, dict[int, torch.Tensor]]:
        """optimizer name -> parameter index -> its gradient, for the gradients not applied
        yet (the live tensors: the caller copies them)."""
        out: dict[str, dict[int, torch.Tensor]] = {}
        for name, optim in self._optims.items():
            seen = self._applied.get(id(optim), [])
            for i, p in enumerate(_params(optim)):
                g = p.grad
                if g is None or g.is_sparse:
                    continue
                old = seen[i] if i < len(seen) else None
                if old is not None and old[0]() is g and old[1] == tensor_version(g):
                    continue          # as the last step left it: applied already
                if bool(g.detach().any()):
                    out.setdefault(name, {})[i] = g.detach()
        return out

    def say(self, step: int, pending: Mapping[str, Mapping[int, torch.Tensor]]) -> None:
        """Rank 0, once: a save inside an accumulation window keeps its gradients."""
        if self._said or rank() != 0:
            return
        self._said = True
        log.warning("step %d is inside a gradient-accumulation window (%s hold gradients no "
                    "optimizer step applied yet): the checkpoint keeps them and a resume puts "
                    "them back, so the window goes on exactly", step,
                    ", ".join(f"{len(g)} parameters of {n!r}" for n, g in pending.items()))

    def restore(self, saved: Mapping[str, Mapping[int, torch.Tensor]] | None) -> None:
        """Put saved pending gradients back on their parameters (before any backward)."""
        for name, grads in (saved or {}).items():
            if name not in self._optims:
                log.warning("checkpoint holds accumulated gradients of %r, which is not in "
                            "the state; not restored", name)
                continue
            params = _params(self._optims[name])
            for i, g in grads.items():
                p = params[i]
                if p.grad is None:
                    p.grad = g.to(device=p.device, dtype=p.dtype)
                else:
                    p.grad.copy_(g)


def _schedules(value: Any, optim: torch.optim.Optimizer) -> bool:
    """``value`` (or one of its attributes) is a saved scheduler of ``optim``."""
    inner: Iterable[Any] = vars(value).values() if hasattr(value, "__dict__") else ()
    for v in (value, *inner):
        if getattr(v, "optimizer", None) is optim and callable(getattr(v, "state_dict", None)):
            return True
    return False


def unsaved_schedulers(optims: Mapping[str, torch.optim.Optimizer],
                       others: Mapping[str, Any]) -> list[str]:
    """The names of the state's optimizers that an LR scheduler drives while no state entry
    saves one of theirs."""
    return [name for name, optim in optims.items()
            if lr_scheduler_attached(optim)
            and not any(_schedules(v, optim) for v in others.values())]
