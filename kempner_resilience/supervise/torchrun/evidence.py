"""The torchrun agent's observation as the one policy's evidence (``supervise/policy.py``).

An agent sees only its own node: its workers' return codes (``{global rank: code}``, -N for a
death by signal N), whether it was signalled, torch's restarts left, and the standbys.
``observe`` turns exactly that into ``Evidence``, so the failure matrix feeds this backend the
same rows as the others. Pure: no torch, no I/O.

With spares, a relaunch takes a standby's place: the failed worker's node if it is this one,
else a peer's (``PEER``, its name unknown here). So the evidence implicates one node and a
relaunch needs one spare.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.policy import Commits, Evidence, ends_of, job_code

__all__ = ["PEER", "rank_ends", "observe", "agent_exit_code", "implicated_here"]

#: The node a survivor's failure points at when it is not this one (its name is unknown here).
PEER = "a peer node"


#: The endings of ``{global rank: return code}``, lowest rank first (``policy.ends_of``).
rank_ends = ends_of


def agent_exit_code(codes: Mapping[int, int], killed: Iterable[int] = ()) -> int:
    """The agent's exit code from its workers' ``{global rank: return code}``: the policy's job
    code, e.g. {0: 81, 1: -SIGKILL} -> 81, {0: 81, 1: 1} -> 1; 0 when there are none."""
    return job_code(ends_of(codes, killed))[0] if codes else 0


def implicated_here(codes: Mapping[int, int], hang_seen: Iterable[int] = ()) -> str | None:
    """Why this node is the one a failure points at, or None. ``codes``: this node's ended
    workers; ``hang_seen``: the ranks of the launch whose hang watchdog ran in Python (the
    supervisor channel's marks). A worker killed by a signal of its own (the OOM killer, a GPU
    fault) implicates its node; so does a worker that ended with HANG without a mark while
    others marked: it was hung with the GIL held (its backstop ended it), its peers were not."""
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
    """The policy's evidence from one agent's view of a failed worker group. ``standbys``:
    standby agents waiting (None: no spares, the group restarts where it ran); ``node``: this
    node when it is implicated (``implicated_here``), else a peer's is."""
    implicated: frozenset[str] = frozenset()
    if standbys is not None:
        implicated = frozenset({node or PEER})
    return Evidence(ends=ends_of(codes, killed), restarts=max(0, max_restarts - restarts_left),
                    max_restarts=max_restarts, implicated=implicated, spares=standbys,
                    stopping=signalled, commits=commits, stalled=stalled,
                    max_no_progress=max_no_progress)
