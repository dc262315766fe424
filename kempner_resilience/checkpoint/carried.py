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
across ranks.

``PendingGrads`` tells such gradients from the ones a finished step leaves behind
(``zero_grad()`` at the start of the next step). Its post-step hook (public API) runs at every
training step, so it does O(1) work: it notes the tensor and version of a few sentinel
gradients (``SENTINELS``, spread over the parameters that had a gradient), not of all of them
(that cost 42 us per step at 200 parameter tensors and 585 us at 800, see
docs/benchmarks.md). Only a save or a stop decision looks at every gradient: when a sentinel's
gradient changed since the step (a backward accumulated into it, ``zero_grad`` zeroed or
dropped it), every gradient that is not all zeros is pending; when none changed, none is.
Saving a gradient the step had applied already is still exact (the uninterrupted loop carries
it just the same; ``zero_grad`` comes before it is used again). What it cannot see: a backward
after the step that reaches none of the sentinels while it reaches other parameters.
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

__all__ = ["PendingGrads", "SENTINELS", "unsaved_schedulers"]


SENTINELS = 8
"""Gradients the post-step hook notes per optimizer step: the first, the last and some spread
between them, among the parameters that had a gradient (O(1) per step whatever the model)."""


def _params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optim.param_groups for p in g["params"]]


def _spread(items: list[Any], k: int) -> list[Any]:
    """Up to ``k`` of ``items``: the first, the last and evenly spaced between them."""
    if len(items) <= k:
        return list(items)
    return [items[round(j * (len(items) - 1) / (k - 1))] for j in range(k)]


def _mark(g: torch.Tensor | None) -> tuple[Any, int] | None:
    """A gradient as the step left it: the tensor (weakly: zero_grad may free it) and its
    version (a backward accumulating in place bumps it)."""
    return None if g is None else (weakref.ref(g), tensor_version(g))


def _changed(p: torch.Tensor, mark: tuple[Any, int] | None) -> bool:
    g = p.grad
    if mark is None:
        return g is not None
    return g is None or mark[0]() is not g or mark[1] != tensor_version(g)


class PendingGrads:
    """The gradients of the state's optimizers' parameters accumulated since each optimizer's
    last step: captured with a checkpoint and restored at resume."""

    def __init__(self, optims: Mapping[str, torch.optim.Optimizer]) -> None:
        self._optims = dict(optims)
        # id(optimizer) -> its sentinel parameters, and their gradients as the optimizer's
        # last step left them (``_mark``).
        self._sentinels: dict[int, list[torch.Tensor]] = {}
        self._marks: dict[int, list[tuple[Any, int] | None]] = {}
        # Optimizers whose gradients a resume put back: pending until their next step.
        self._restored: set[int] = set()
        self._handles = [o.register_step_post_hook(self._stepped) for o in self._optims.values()]
        self._said = False
        self._paused = False
        #: How many times the optimizers stepped (in the loop's steps): a count that did not
        #: change over one step and then did marks an accumulation window's end.
        self.steps = 0
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
        # On every training step: O(SENTINELS), never a walk over all parameters (but when no
        # sentinel has a gradient: they are picked again among the parameters that have one).
        if self._paused:
            return
        self.steps += 1
        key = id(optim)
        sentinels = self._sentinels.get(key)
        if sentinels is None or all(p.grad is None for p in sentinels):
            params = _params(optim)
            sentinels = _spread([p for p in params if p.grad is not None] or params, SENTINELS)
            self._sentinels[key] = sentinels
        self._marks[key] = [_mark(p.grad) for p in sentinels]
        self._restored.discard(key)

    def _touched(self, optim: torch.optim.Optimizer) -> bool:
        """Whether anything wrote ``optim``'s gradients since its last step."""
        key = id(optim)
        if key in self._restored:
            return True
        marks = self._marks.get(key, [])
        if all(m is None for m in marks):
            # The sentinels are picked among the parameters with a gradient: none had one
            # at the step, so any gradient now was written after it (a save's walk, not a step's).
            return any(p.grad is not None for p in _params(optim))
        return any(_changed(p, m) for p, m in zip(self._sentinels.get(key, ()), marks))

    def pending(self) -> dict[str, dict[int, torch.Tensor]]:
        """optimizer name -> parameter index -> its gradient, for the gradients not applied
        yet (the live tensors: the caller copies them)."""
        out: dict[str, dict[int, torch.Tensor]] = {}
        for name, optim in self._optims.items():
            if not self._touched(optim):
                continue              # as the last step left them: applied already
            for i, p in enumerate(_params(optim)):
                g = p.grad
                if g is None or g.is_sparse:
                    continue
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
            if grads:
                self._restored.add(id(self._optims[name]))
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
