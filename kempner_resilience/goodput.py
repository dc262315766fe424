"""Goodput from a run ledger: where the wall time of a run went, attempt by attempt.

Each attempt's wall time (from its start, ``t0``, to its last event) is split into parts that
add up to it exactly:

* ``startup``: before the first step (interpreter, imports, process group, model build), less
  the checkpoint load;
* ``load``: loading the checkpoint it resumed from;
* ``save_blocking``: periodic and manual saves, as long as training waited for them;
* ``kept``: steps whose result survived (covered by the checkpoint the next attempt resumed
  from, or by the end of the run);
* ``lost``: steps redone later (run after the checkpoint the next attempt resumed from), split
  from the loop's time in proportion to the step counts (the ledger has no per-step timings);
* ``shutdown``: from the agreed stop (or the loop's end) to the exit: emergency save, requeue,
  teardown.

Between attempts, ``queue`` is the time from one attempt's last event to the next one's start
(pending in the queue, or a node lost before it could say goodbye). Goodput is ``kept`` over the
allocated time (the attempts' wall times); ``wall_goodput`` is ``kept`` over the whole span,
queue included.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from kempner_resilience.ledger import LEDGER_NAME, read_ledger

__all__ = ["Attempt", "Goodput", "analyze", "analyze_dir", "PARTS"]

PARTS = ("startup", "load", "save_blocking", "kept", "lost", "shutdown")


@dataclass
class Attempt:
    """One attempt (a launch of the job), as the ledger tells it."""

    index: int
    restart_count: int | None
    job_id: str | None
    hosts: str | None
    world_size: int | None
    t0: float
    end: float
    start_step: int
    last_step: int
    kept_steps: int = 0
    saves: int = 0
    stop_signal: str | None = None
    stop_step: int | None = None
    exit_code: int | None = None
    ending: str | None = None
    crashed: bool = False           # no exit event: killed or lost
    parts: dict[str, float] = field(default_factory=dict)
    queue_after_s: float | None = None   # to the next attempt's start

    @property
    def wall_s(self) -> float:
        return self.end - self.t0


@dataclass
class Goodput:
    run_id: str | None
    attempts: list[Attempt]
    parts: dict[str, float]          # summed over attempts, plus "queue"
    allocated_s: float
    wall_s: float

    @property
    def goodput(self) -> float:
        return self.parts["kept"] / self.allocated_s if self.allocated_s > 0 else 0.0

    @property
    def wall_goodput(self) -> float:
        return self.parts["kept"] / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "goodput": self.goodput,
                "wall_goodput": self.wall_goodput, "allocated_s": self.allocated_s,
                "wall_s": self.wall_s, "parts_s": self.parts,
                "attempts": [dict(asdict(a), wall_s=a.wall_s) for a in self.attempts]}


def _split(events: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    groups: list[list[dict[str, Any]]] = []
    for e in events:
        if e["ev"] == "start" or not groups:
            groups.append([])
        groups[-1].append(e)
    return groups


def _f(x: Any, default: float = 0.0) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return default


def _attempt(i: int, evs: list[dict[str, Any]]) -> tuple[Attempt, dict[str, Any]]:
    by: dict[str, dict[str, Any]] = {}
    saves_blocking, saves, committed = 0.0, 0, None
    for e in evs:
        by.setdefault(e["ev"], e)
        if e["ev"] == "save":
            saves += 1
            saves_blocking += _f(e.get("blocking_s"))
            committed = e.get("step", committed)
        elif e["ev"] == "saves":
            saves += int(e.get("n") or 0)
            saves_blocking += _f(e.get("blocking_s"))
            committed = e.get("last_step", committed)
        elif e["ev"] == "emergency_save" and e.get("saved") == "committed":
            committed = e.get("step", committed)
        elif e["ev"] == "rescue" and e.get("committed"):
            committed = e.get("step", committed)
    start, resume, loop = by.get("start", evs[0]), by.get("resume"), by.get("loop")
    stop, ext = by.get("stop"), by.get("exit")
    t0 = _f(start.get("t0"), _f(start.get("t")))
    end = _f(ext["t"]) if ext else max(_f(e.get("t")) for e in evs)
    start_step = int(resume["step"]) if resume else int((loop or {}).get("step") or 0)
    steps_seen = [int(e["step"]) for e in evs if isinstance(e.get("step"), int)]
    last = int(ext["step"]) if ext and isinstance(ext.get("step"), int) else \
        max(steps_seen + [start_step])
    a = Attempt(i, start.get("restart_count"), start.get("job_id"), start.get("hosts"),
                start.get("world_size"), t0, end, start_step, last, saves=saves,
                stop_signal=(stop or {}).get("signal"), stop_step=(stop or {}).get("step"),
                exit_code=(ext or {}).get("code"), ending=(ext or {}).get("ending"),
                crashed=ext is None)
    load = _f((resume or {}).get("load_s"))
    t_loop = _f(loop["t"]) if loop else end
    if stop:
        loop_end = _f(stop["t"])
    elif ext and ext.get("loop_end_t") is not None:
        loop_end = _f(ext["loop_end_t"])
    else:
        loop_end = end
    loop_end = min(max(loop_end, t_loop), end)
    load = min(load, t_loop - t0)
    a.parts = {"startup": (t_loop - t0) - load, "load": load, "save_blocking": 0.0,
               "kept": 0.0, "lost": 0.0, "shutdown": end - loop_end}
    blocking = min(saves_blocking, loop_end - t_loop)
    a.parts["save_blocking"] = blocking
    a.parts["kept"] = (loop_end - t_loop) - blocking   # split into kept/lost by the caller
    return a, {"committed": committed, "completed": (ext or {}).get("ending") == "completed"}


def analyze(events: list[dict[str, Any]]) -> Goodput:
    """Attempts and goodput from ledger events (as ``read_ledger`` returns them)."""
    pairs = [_attempt(i, g) for i, g in enumerate(_split(events))]
    attempts = [a for a, _ in pairs]
    for k, (a, extra) in enumerate(pairs):
        if k + 1 < len(attempts):
            nxt = attempts[k + 1]
            kept_upto = nxt.start_step
            a.queue_after_s = nxt.t0 - a.end
        elif extra["completed"]:
            kept_upto = a.last_step
        else:
            kept_upto = extra["committed"] if extra["committed"] is not None else a.start_step
        run = max(a.last_step - a.start_step, 0)
        a.kept_steps = min(max(kept_upto - a.start_step, 0), run)
        loop_s = a.parts["kept"]
        share = a.kept_steps / run if run else 1.0
        a.parts["kept"] = loop_s * share
        a.parts["lost"] = loop_s - a.parts["kept"]
    parts = {p: sum(a.parts[p] for a in attempts) for p in PARTS}
    parts["queue"] = sum(a.queue_after_s or 0.0 for a in attempts)
    allocated = sum(a.wall_s for a in attempts)
    wall = (attempts[-1].end - attempts[0].t0) if attempts else 0.0
    run_id = next((e.get("run_id") for e in events if e.get("run_id")), None)
    return Goodput(run_id, attempts, parts, allocated, wall)


def analyze_dir(path: str | os.PathLike[str]) -> Goodput:
    """``path``: checkpoint.dir (holding ``ledger.jsonl``) or the ledger file itself."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, LEDGER_NAME)
    return analyze(read_ledger(p))
