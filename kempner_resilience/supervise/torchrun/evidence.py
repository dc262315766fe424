"""The torchrun agent's view as the policy's evidence (``supervise/policy.py``). Pure.

An agent sees only its own node: its workers' ``{global rank: code}`` (-N: killed by signal N),
whether it was signalled, torch's restarts left, the standbys."""

from __future__ import annotations

from typing import Iterable, Mapping

from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.policy import Commits, Evidence, ends_of, job_code

__all__ = ["PEER", "observe", "agent_exit_code", "implicated_here"]

#: The node a survivor's failure points at when it is not this one (its name is unknown here).
PEER = "a peer node"


def agent_exit_code(codes: Mapping[int, int], killed: Iterable[int] = ()) -> int:
    """The policy's job code over the workers' ``{global rank: return code}`` (0 for none), e.g.
    {0: 81, 1: -SIGKILL} -> 81, {0: 81, 1: 1} -> 1."""
    return job_code(ends_of(codes, killed))[0] if codes else 0


def implicated_here(codes: Mapping[int, int], hang_seen: Iterable[int] = ()) -> str | None:
    """Why a failure points at this node, or None. ``codes``: this node's ended workers;
    ``hang_seen``: the ranks whose hang watchdog ran in Python (the channel's marks). A worker
    killed by a signal of its own (the OOM killer, a GPU fault) implicates its node; so does one
    that ended with HANG unmarked while others marked: it hung with the GIL held."""
    ends = dict(zip(sorted(codes), ends_of(codes)))
    killed = sorted({e.code for e in ends.values() if e.own_death})
    if killed:
        return f"a worker on this node was killed (exit {killed})"
    seen = set(hang_seen)
    quiet = sorted(r for r, e in ends.items() if not e.signaled and e.code == ExitCode.HANG
                   and r not in seen)
    if seen and quiet:
        return (f"rank(s) {quiet} on this node hung with the GIL held (their hang watchdog "
                f"never ran; rank(s) {sorted(seen)} saw the hang)")
    return None


def observe(codes: Mapping[int, int], *, signalled: bool, restarts_left: int,
            max_restarts: int, standbys: int | None = None, node: str | None = None,
            killed: Iterable[int] = (), commits: Commits | None = None, stalled: int = 0,
            max_no_progress: int = 0) -> Evidence:
    """The evidence of one agent's failed worker group. ``standbys``: standby agents waiting
    (None: no spares); ``node``: this node when implicated, else a peer's (``PEER``)."""
    return Evidence(ends=ends_of(codes, killed), restarts=max(0, max_restarts - restarts_left),
                    max_restarts=max_restarts, spares=standbys, stopping=signalled,
                    implicated=frozenset() if standbys is None else frozenset({node or PEER}),
                    commits=commits, stalled=stalled, max_no_progress=max_no_progress)
