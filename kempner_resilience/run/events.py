"""Under ``check-resume``: the events that change state outside a step, seen by the run itself.

A resume that is exact inside an epoch can still diverge across its end: a learning rate or a
``best_val_loss`` the loop changes there and carries in a variable, an eval loader whose
persistent workers draw a seed from the global RNG the first time only. check-resume's default
window (10 steps) reaches none of these, so the run tells it where they are: rank 0 watches the
objects in ``state`` at every step boundary and writes what it sees to the file named in
``$KEMPNER_RESILIENCE_EVENTS`` (set by check-resume only; a real job never builds a watcher).

What it can see, and foresee from the rate it measured since the launch began:

- a ``ResumableLoader``'s epoch end: its epoch and batch count the batches taken, ``len()`` the
  batches per pass;
- an LR scheduler's milestone: a ``StepLR``'s ``step_size``, a ``MultiStepLR``'s milestones,
  against its ``last_epoch`` (a scheduler stepped once an epoch is foreseen once it moved);
- an event the script names with ``run.event("eval")`` (an eval every N steps, as nanoGPT's
  ``iter_num % eval_interval == 0``): nothing in ``state`` shows it, so the script says so.
  Its next occurrences are foreseen from the last two: an eval recurs, and a value it left out
  of state (``best_val_loss``, an lr annealed on a plateau) shows only at the next one.

Each line of the file is JSON: ``{"kind": K, "seen": E}`` when the event ``K`` happened before
the checkpoint of step ``E`` (with ``"recurs": true`` for a named event: a first occurrence
alone does not cover it); ``{"kind": K, "next": [E1, E2]}`` for its next two occurrences as
foreseen at that boundary (the last such line counts).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Mapping

from kempner_resilience.core.log import get_logger
from kempner_resilience.stop.rehearsal import EVENTS_ENV

__all__ = ["EventWatch", "event_kind", "watch"]

log = get_logger(__name__)


def _loader_count(obj: Any) -> Callable[[], tuple[float, float]] | None:
    """``(passes done, batches taken)`` of a ResumableLoader with a length; else None."""
    from kempner_resilience.checkpoint.data import ResumableLoader

    if not isinstance(obj, ResumableLoader):
        return None
    try:
        per = len(obj)
    except TypeError:
        return None
    if per <= 0:
        return None

    def count() -> tuple[float, float]:
        taken = obj.epoch * per + obj.batch
        return float(taken // per), float(taken) / per
    return count


def _milestones(obj: Any) -> Callable[[], tuple[float, float]] | None:
    """``(milestones passed, position in milestones)`` of a StepLR or MultiStepLR; else None."""
    import torch

    sched = torch.optim.lr_scheduler
    if isinstance(obj, sched.StepLR):
        size = max(1, int(obj.step_size))

        def count() -> tuple[float, float]:
            return float(max(0, obj.last_epoch) // size), max(0, obj.last_epoch) / size
        return count
    if isinstance(obj, sched.MultiStepLR):
        marks = sorted(obj.milestones)

        def count() -> tuple[float, float]:
            at = max(0, obj.last_epoch)
            done = sum(1 for m in marks if m <= at)
            if done >= len(marks):
                return float(done), float(done)
            lo = marks[done - 1] if done else 0
            return float(done), done + (at - lo) / max(1, marks[done] - lo)
        return count
    return None


class _Counter:
    """One watched object: a count of its events, and where the next ones fall."""

    def __init__(self, kind: str, count: Callable[[], tuple[float, float]]) -> None:
        self.kind = kind
        self.count = count
        self.done, self.pos0 = count()
        self.step0: int | None = None

    def at(self, step: int) -> tuple[bool, list[int]]:
        """(an event happened since the last boundary, the next two foreseen steps)."""
        done, pos = self.count()
        happened = done > self.done
        self.done = done
        if self.step0 is None:
            self.step0, self.pos0 = step, pos
        rate = (pos - self.pos0) / (step - self.step0) if step > self.step0 else 0.0
        if rate <= 0:
            return happened, []
        first = step + max(1, math.ceil((done + 1 - pos) / rate - 1e-9))
        return happened, [first, first + max(1, math.ceil(1 / rate - 1e-9))]


def event_kind(name: str) -> str:
    """How the report names an event the script named: ``"eval"`` -> ``"the eval"``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"run.event({name!r}): give the event a name, e.g. run.event('eval')")
    return f"the {' '.join(name.split())}"


class EventWatch:
    """Rank 0's watcher of the objects in ``state`` and of the events the script names (see
    the module docstring)."""

    def __init__(self, counters: list[_Counter], path: str) -> None:
        self._counters = counters
        self._path = path
        self._foreseen: dict[str, list[int]] = {}
        self._named: list[str] = []                  # named in the step now running
        self._last: dict[str, list[int]] = {}        # a named event's last two occurrences
        self._broken = False

    def named(self, kind: str) -> None:
        """The script said ``kind`` happened in the step now running (``run.event``)."""
        if kind not in self._named:
            self._named.append(kind)

    def at(self, step: int) -> None:
        """The boundary of ``step``: write what happened and what is foreseen, when it changed."""
        if self._broken:
            return
        lines: list[dict] = []
        for c in self._counters:
            happened, ahead = c.at(step)
            if happened:
                lines.append({"kind": c.kind, "seen": step})
            if ahead and ahead != self._foreseen.get(c.kind):
                self._foreseen[c.kind] = ahead
                lines.append({"kind": c.kind, "next": ahead})
        for kind in self._named:
            lines.append({"kind": kind, "seen": step, "recurs": True})
            last = self._last.setdefault(kind, [])
            last[:] = (last + [step])[-2:]
            if len(last) == 2 and last[1] > last[0]:    # an eval every N steps: the next two
                period = last[1] - last[0]
                lines.append({"kind": kind, "next": [step + period, step + 2 * period]})
        self._named = []
        if not lines:
            return
        try:
            with open(self._path, "a") as f:
                f.write("".join(json.dumps(line) + "\n" for line in lines))
        except OSError as e:       # check-resume then says it could not see the events
            log.warning("check-resume: cannot write the events file %s: %s", self._path, e)
            self._broken = True


def watch(objects: Mapping[str, Any], rank: int) -> EventWatch | None:
    """The watcher for ``objects`` (state's non-tensor entries) and the events the script
    names, on rank 0 under check-resume only; None otherwise (a real job, another rank)."""
    path = os.environ.get(EVENTS_ENV)
    if not path or rank != 0:
        return None
    counters = []
    for name, obj in objects.items():
        loader = _loader_count(obj)
        if loader is not None:
            counters.append(_Counter(f"the epoch end of {name!r}", loader))
            continue
        sched = _milestones(obj)
        if sched is not None:
            counters.append(_Counter(f"a milestone of scheduler {name!r}", sched))
    return EventWatch(counters, path)
