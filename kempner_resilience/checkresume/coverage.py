"""Which events that change state outside a step the interrupted run's stops cover.

A value the loop changes at an epoch end and carries in a variable (a learning rate annealed
there, ``best_val_loss``), or an eval loader whose persistent workers draw from the global RNG
only the first time, makes a real resume diverge only when the resume crosses that event. The
run names the events it sees and foresees (``run/events.py``: a ``ResumableLoader``'s epoch
end, a scheduler's milestone, an eval the script names with ``run.event("eval")``) in its
events file; here they are read and judged.

An event whose occurrences fall at steps ``e1 < e2`` is covered by a run stopped at ``s`` and
trained to ``end`` when ``e1 < s < e2 <= end - 1``: the resumed process lacks what the first
occurrence set, and goes through the next one itself (a fresh process meets it, as a real
resume does). An event seen once, with no next one foreseen, is covered by a stop after it;
but a named event recurs (an eval every N steps), and what it left out of state shows only at
its next occurrence: seen once, it is not covered, and the report says how to reach the next.
``cover`` plans one more interrupted run whose stops cross each event the default window does
not, within ``--max-steps`` and the time the first run took; what it cannot reach is named.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["Event", "Plan", "read_events", "covers", "cover", "merge", "met_after"]


@dataclass(frozen=True)
class Event:
    """An event's first two occurrences (the checkpoint steps after them)."""

    kind: str                       # "the epoch end of 'data'"
    first: int
    second: int | None = None
    foreseen: bool = False          # ``first`` was foreseen from the rate, not seen
    recurs: bool = False            # a named event (an eval): covered only across two

    def words(self) -> str:
        if self.recurs and self.second is not None:    # crossed between these two
            at = f"{self.kind} at steps {self.first} and {self.second}"
        else:
            at = f"{self.kind} at step {self.first}"
        return at + (" (foreseen)" if self.foreseen else "")


def _read(paths: Iterable[Path]) -> tuple[dict[str, set[int]], dict[str, list[int]], set[str]]:
    """What the files say: each kind's steps seen, its last foresight, the kinds that recur."""
    seen: dict[str, set[int]] = {}
    ahead: dict[str, list[int]] = {}
    recurs: set[str] = set()
    for path in paths:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            try:
                item = json.loads(line)
                kind = str(item["kind"])
            except (ValueError, KeyError, TypeError):
                continue            # a line cut by a killed rank
            if "seen" in item:
                seen.setdefault(kind, set()).add(int(item["seen"]))
                if item.get("recurs"):
                    recurs.add(kind)
            elif "next" in item:
                ahead[kind] = [int(s) for s in item["next"]]
    return seen, ahead, recurs


def read_events(paths: Iterable[Path]) -> list[Event]:
    """The events the runs' files name, first occurrence first: what was seen, then what the
    last line of each kind foresaw past it."""
    seen, ahead, recurs = _read(paths)
    out = []
    for kind in sorted(set(seen) | set(ahead)):
        steps = sorted(seen.get(kind, ()))
        last = steps[-1] if steps else 0
        later = [s for s in ahead.get(kind, ()) if s > last]
        both = (steps + later)[:2]
        out.append(Event(kind, both[0], both[1] if len(both) > 1 else None,
                         foreseen=not steps, recurs=kind in recurs))
    return sorted(out, key=lambda e: (e.first, e.kind))


def met_after(paths: Iterable[Path], stop: int, step: int) -> list[str]:
    """The events a process resumed at ``stop`` met again before the checkpoint of ``step``:
    seen once before ``stop`` and once in ``(stop, step]`` (what the first occurrence left
    outside state shows at the second)."""
    seen, _, _ = _read(paths)
    return [f"{kind} at step {min(s for s in steps if stop < s <= step)}"
            for kind, steps in sorted(seen.items())
            if any(s <= stop for s in steps) and any(stop < s <= step for s in steps)]


def merge(*lists: Sequence[Event]) -> list[Event]:
    """One event per kind: the one seen (not foreseen) first, from the earliest list."""
    out: dict[str, Event] = {}
    for events in lists:
        for e in events:
            if e.kind not in out or (out[e.kind].foreseen and not e.foreseen):
                out[e.kind] = e
    return sorted(out.values(), key=lambda e: (e.first, e.kind))


def covers(event: Event, stops: Sequence[int], end: int) -> bool:
    """A run stopped at ``stops`` and trained to ``end`` resumes across ``event``."""
    if event.second is None and event.recurs:
        return False                # its next occurrence unknown: nothing to stop before
    for s in stops:
        if s <= event.first or s >= end:
            continue
        if event.second is None or (s < event.second and event.second < end):
            return True
    return False


@dataclass(frozen=True)
class Plan:
    """One more interrupted run: its stops and end; the events no run can cover, and why."""

    stops: tuple[int, ...] = ()
    end: int = 0
    crosses: tuple[Event, ...] = ()
    beyond: tuple[tuple[Event, str], ...] = ()


def cover(events: Sequence[Event], stops: Sequence[int], end: int, *, gap: int,
          max_steps: int, step_s: float, timeout_s: float, start_s: float = 0.0) -> Plan:
    """The stops that cross each event ``stops``/``end`` do not, one after each event's first
    occurrence, and the end past its second; within ``max_steps`` and, at ``step_s`` seconds
    a step and ``start_s`` a launch (the first run's pace), within ``timeout_s``: the run
    that crosses is two launches, the stop's and the resume's."""
    plan: list[int] = []
    last_end = 0
    crosses: list[Event] = []
    beyond: list[tuple[Event, str]] = []
    for e in events:
        if covers(e, stops, end) or covers(e, plan, last_end):
            continue
        if e.second is None and e.recurs:
            beyond.append((e, f"seen once, and not again by step {end}: its next occurrence, "
                              "where a value it left out of state would show, is not known; "
                              "raise --steps past it (check-resume learns how often it comes "
                              "from two)"))
            continue
        s = max(e.first + 1, (plan[-1] + gap) if plan else gap)
        if e.second is not None and s >= e.second:
            beyond.append((e, f"its occurrences at steps {e.first} and {e.second} are too "
                              f"close for a stop between them ({gap} steps apart at least)"))
            continue
        need = max((e.second or s) + 1, s + gap, last_end)
        if need > max_steps:
            beyond.append((e, f"crossing it takes {need} steps, beyond --max-steps "
                              f"{max_steps}"))
            continue
        if 2 * start_s + step_s * need > timeout_s:
            beyond.append((e, f"crossing it takes {need} steps, about "
                              f"{math.ceil(2 * start_s + step_s * need)} s at the first run's "
                              "pace, beyond "
                              f"--timeout {timeout_s:g}"))
            continue
        plan.append(s)
        last_end = need
        crosses.append(e)
    return Plan(tuple(plan), last_end, tuple(crosses), tuple(beyond))
