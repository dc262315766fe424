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
(pending in the queue, or a node lost before it could say goodbye). An in-job restart (a
``restart`` event: the batch job started the training again inside its allocation, no requeue)
begins an attempt of its own, and the time between it and the attempt before is ``in_job``
(the allocation was held: detection, rescue, relaunch), not queue. Its ``recovery`` splits the
time from the failure to its first step into ``detection``, ``rescue``, ``relaunch`` (from the
``restart`` event) and its own ``startup`` and ``load``. Goodput is ``kept`` over the allocated
time (the attempts' wall times and the in-job gaps); ``wall_goodput`` is ``kept`` over the
whole span, queue included.

A ledger is read as ``read_ledger`` returns it (every known field of the right type, or absent)
and any such ledger gives an analysis: a missing time is taken from the attempt's other events,
times out of order are clamped so the parts stay non-negative. A ledger that holds events of
several runs (a directory reused, a ledger copied in) is analysed for one run id, the newest
unless one is asked for; ``Goodput.other_runs`` names the others.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from kempner_resilience.core.ledger import read_ledger
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["Attempt", "Goodput", "analyze", "analyze_dir", "run_ids", "split_attempts",
           "PARTS", "RECOVERY"]

PARTS = ("startup", "load", "save_blocking", "kept", "lost", "shutdown")
#: An in-job restart's recovery, from the failure to the new attempt's first step, in order.
RECOVERY = ("detection", "rescue", "relaunch", "startup", "load")


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
    rescue_step: int | None = None  # a rescue checkpoint committed by a survivor
    failed_saves: int = 0           # periodic saves that failed (training went on)
    failures: list[str] = field(default_factory=list)   # "step N: reason", the first few
    parts: dict[str, float] = field(default_factory=dict)
    queue_after_s: float | None = None   # to the next attempt's start (in the queue)
    relaunch: int = 0                    # in-job restart count (0: a launch of the job)
    restart: dict[str, Any] | None = None    # the ``restart`` event that started it (in-job)
    in_job_after_s: float | None = None  # to the next attempt's start, in the allocation

    @property
    def recovery(self) -> dict[str, float]:
        """An in-job restart's time from the failure to its first step, split as ``RECOVERY``
        (empty for a launch of the job)."""
        if self.restart is None:
            return {}
        r = self.restart
        return {"detection": _num(r.get("detect_s"), 0.0), "rescue": _num(r.get("rescue_s"), 0.0),
                "relaunch": _num(r.get("relaunch_s"), 0.0), "startup": self.parts["startup"],
                "load": self.parts["load"]}

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
    other_runs: dict[str, int] = field(default_factory=dict)   # run id -> its events, not here

    @property
    def goodput(self) -> float:
        return self.parts["kept"] / self.allocated_s if self.allocated_s > 0 else 0.0

    @property
    def wall_goodput(self) -> float:
        return self.parts["kept"] / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "goodput": self.goodput,
                "wall_goodput": self.wall_goodput, "allocated_s": self.allocated_s,
                "wall_s": self.wall_s, "parts_s": self.parts, "other_runs": self.other_runs,
                "attempts": [dict(asdict(a), wall_s=a.wall_s, recovery=a.recovery)
                             for a in self.attempts]}


def split_attempts(events: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events of each attempt: a new one at each ``start``, and at each ``restart`` (an
    in-job restart, written just before the ``start`` of the attempt it launched)."""
    groups: list[list[dict[str, Any]]] = []
    for e in events:
        joins = e["ev"] == "start" and groups and \
            [x["ev"] for x in groups[-1]] == ["restart"]
        if (e["ev"] in ("start", "restart") and not joins) or not groups:
            groups.append([])
        groups[-1].append(e)
    return groups


def _num(x: Any, default: float) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else default


def _attempt(i: int, evs: list[dict[str, Any]]) -> tuple[Attempt, dict[str, Any]]:
    by: dict[str, dict[str, Any]] = {}
    saves_blocking, saves, committed, rescue_step = 0.0, 0, None, None
    failed, failures = 0, []
    for e in evs:
        by.setdefault(e["ev"], e)
        if e["ev"] == "save":
            saves += 1
            saves_blocking += _num(e.get("blocking_s"), 0.0)
            committed = e.get("step", committed)
        elif e["ev"] == "saves":
            saves += e.get("n") or 0
            saves_blocking += _num(e.get("blocking_s"), 0.0)
            committed = e.get("last_step", committed)
        elif e["ev"] == "save_failed":
            failed += 1
            if len(failures) < 3:
                failures.append(f"step {e.get('step', '?')}: {e.get('reason') or '?'}")
        elif e["ev"] == "emergency_save" and e.get("saved") == "committed":
            committed = e.get("step", committed)
        elif e["ev"] == "rescue" and e.get("committed") and e.get("step") is not None:
            # Recorded by rank 0 and by the writer: the same step, maybe twice.
            committed = rescue_step = max(e["step"], rescue_step or 0)
    start, resume, loop = by.get("start", evs[0]), by.get("resume"), by.get("loop")
    restart = by.get("restart")
    stop, ext = by.get("stop"), by.get("exit")
    times = [e["t"] for e in evs if e.get("t") is not None]
    t0 = _num(start.get("t0"), _num(start.get("t"), min(times, default=0.0)))
    end = _num((ext or {}).get("t"), max(times, default=t0))
    end = max(end, t0)                   # clocks that went back: no negative wall time
    start_step = (resume or {}).get("step")
    if start_step is None:
        start_step = (loop or {}).get("step") or 0
    steps_seen = [e["step"] for e in evs if e.get("step") is not None]
    last = ext["step"] if ext and ext.get("step") is not None else \
        max(steps_seen + [start_step])
    a = Attempt(i, start.get("restart_count"), start.get("job_id"), start.get("hosts"),
                start.get("world_size"), t0, end, start_step, last, saves=saves,
                stop_signal=(stop or {}).get("signal"), stop_step=(stop or {}).get("step"),
                exit_code=(ext or {}).get("code"), ending=(ext or {}).get("ending"),
                crashed=ext is None, rescue_step=rescue_step, failed_saves=failed,
                failures=failures, relaunch=start.get("relaunch") or 0,
                restart=None if restart is None else
                {k: v for k, v in restart.items() if k not in ("ev", "run_id", "attempt")})
    load = _num((resume or {}).get("load_s"), 0.0)
    t_loop = min(max(_num((loop or {}).get("t"), end), t0), end)
    if stop and stop.get("t") is not None:
        loop_end = stop["t"]
    elif ext and ext.get("loop_end_t") is not None:
        loop_end = ext["loop_end_t"]
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


def run_ids(events: list[dict[str, Any]]) -> dict[str, int]:
    """``{run_id: number of events}``, the newest run (that of the last event naming one) last."""
    counts: dict[str, int] = {}
    for e in events:
        rid = e.get("run_id")
        if rid is not None:
            counts[rid] = counts.pop(rid, 0) + 1     # re-inserted: ordered by last appearance
    return counts


def analyze(events: list[dict[str, Any]], run_id: str | None = None) -> Goodput:
    """Attempts and goodput from ledger events (as ``read_ledger`` returns them), for
    ``run_id`` (default: the newest run in the ledger; events naming no run belong to any)."""
    ids = run_ids(events)
    if run_id is None and ids:
        run_id = list(ids)[-1]
    others = {r: n for r, n in ids.items() if r != run_id}
    if others:
        events = [e for e in events if e.get("run_id") in (run_id, None)]
    pairs = [_attempt(i, g) for i, g in enumerate(split_attempts(events))]
    attempts = [a for a, _ in pairs]
    for k, (a, extra) in enumerate(pairs):
        if k + 1 < len(attempts):
            nxt = attempts[k + 1]
            kept_upto = nxt.start_step
            if nxt.restart is not None:     # relaunched in the allocation: held, not queued
                a.in_job_after_s = max(nxt.t0 - a.end, 0.0)
            else:
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
    parts["in_job"] = sum(a.in_job_after_s or 0.0 for a in attempts)
    allocated = sum(a.wall_s for a in attempts) + parts["in_job"]
    wall = (attempts[-1].end - attempts[0].t0) if attempts else 0.0
    return Goodput(run_id, attempts, parts, allocated, wall, others)


def analyze_dir(path: str | os.PathLike[str], run_id: str | None = None) -> Goodput:
    """``path``: checkpoint.dir (holding ``ledger.jsonl``) or the ledger file itself."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.fspath(RunPaths(Path(p)).ledger)
    return analyze(read_ledger(p), run_id)
