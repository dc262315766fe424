"""The ranks' endings when no supervisor watches them: rank 0 decides from them, by the policy.

Under a plain ``srun`` rank 0 sees only "a peer is gone" ([81, 1] was requeued until the
budget ran out). So each rank records how it ended (``RankEnding``) before it dies, rank 0 asks
the policy with its peers' endings (``peer_decision``), and since srun's status is the highest
task code the other survivors leave with its decision (``note_verdict``, ``read_verdict``). The
Ray driver reads them too (``endings_since``). docs/design.md, "No supervisor: the ranks'
endings reach rank 0".
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Collection, Iterable, Protocol

from kempner_resilience.core.fileio import load_json_bounded
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.channel import count, hear, tell
from kempner_resilience.supervise.policy import KILLED, Action, Decision, Evidence, RankEnd, decide

__all__ = ["RankEnding", "RescueView", "note_ending", "read_endings", "endings_since", "survivors",
           "peer_decision", "note_verdict", "read_verdict", "PEER_WAIT_S", "VERDICT_WAIT_S"]

_log = get_logger(__name__)

#: How long rank 0 waits for the endings of ranks it has not seen. A rank that failed on its own
#: wrote its ending before rank 0 could notice (first thing in its failure path, before its
#: sockets closed); a fellow survivor writes as soon as it notices the same loss, before the
#: rescue rank 0 ran first. Only a killed rank never writes: every killed-peer failure pays
#: this wait before its requeue (measured: rank 0 left 5.15 s after its killed peer with 5 s,
#: 0.19 s before), so it is short.
PEER_WAIT_S = 2.0
#: How long a survivor waits for rank 0's decision once rank 0 is seen deciding: rank 0's own
#: wait for the endings, and its rescue beside this rank's.
VERDICT_WAIT_S = PEER_WAIT_S + 5.0
_POLL_S = 0.2


class RescueView(Protocol):
    """What rank 0 reads of this failure's rescue (``rescue/files.RescueFiles``)."""

    def offered(self) -> set[int]: ...
    def died(self) -> set[int]: ...


@dataclass(frozen=True)
class RankEnding:
    """How one rank ended: ``kind`` is the run's ``Ending`` value (``error``, ``peer-lost``,
    ``completed``, ...), ``code`` its exit code, ``step`` the step boundary it reached."""

    rank: int
    kind: str
    code: int
    step: int

    @classmethod
    def from_json(cls, data: object) -> "RankEnding":
        """From the file's content; ValueError names what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("not a rank's ending")
        try:
            rank, code, step = (data[k] for k in ("rank", "code", "step"))
            kind = data["kind"]
        except KeyError as e:
            raise ValueError(f"a rank's ending without {e}") from None
        if any(count(v, None) is None for v in (rank, code, step)) or not isinstance(kind, str):
            raise ValueError(f"a rank's ending with a wrong type: {data!r}")
        return cls(rank, kind, code, step)

    def end(self) -> RankEnd:
        """As the policy's ``RankEnd``: an exit with ``code`` (a rank that wrote its ending
        was not killed by a signal)."""
        return RankEnd(self.code)


def note_ending(paths: RunPaths, token: str, ending: RankEnding) -> None:
    """Write ``ending`` as this rank's, replacing an earlier word of this attempt (a survivor
    says 81 at once, then its final code). Never raises: a rank's exit never waits for it."""
    tell(paths.rank_ending(token, ending.rank), asdict(ending),
         "rank 0 this rank's ending (it will count it as killed)", mkdir=True)


def read_endings(paths: RunPaths, token: str, ranks: Iterable[int],
                 wait_s: float = PEER_WAIT_S,
                 settled: Callable[[], Collection[int]] | None = None) -> dict[int, RankEnding]:
    """The recorded endings of ``ranks`` in attempt ``token``, waiting up to ``wait_s`` for
    those not recorded yet (polled: a rank that is still leaving writes within a moment), but
    not for those in ``settled()`` (asked at each poll)."""
    want = set(ranks)
    seen: dict[int, RankEnding] = {}
    end = time.monotonic() + max(wait_s, 0.0)
    while True:
        for r in sorted(want - set(seen)):
            got = hear(paths.rank_ending(token, r), "a rank's ending %s is unreadable (%s): counted as "
                       "not recorded", RankEnding.from_json)
            if got is not None and got.rank == r:
                seen[r] = got
        missing = want - set(seen)
        if not missing or time.monotonic() >= end \
                or (settled is not None and missing <= set(settled())):
            return seen
        time.sleep(_POLL_S)


def endings_since(paths: RunPaths, known: Collection[Path], ranks: Iterable[int]
                  ) -> dict[int, RankEnding]:
    """The endings ``ranks`` recorded in the attempts whose directories are not in ``known``
    (``paths.all_endings()`` listed before those attempts began), without waiting: for a
    supervisor that never learns the attempt's token (the Ray driver, whose actors form their
    group themselves). A rank's process that died after it recorded (the hang watchdog's exit)
    said how it ended; its supervisor sees only that it is gone."""
    ranks = list(ranks)
    prefix = paths.endings("").name
    seen: dict[int, RankEnding] = {}
    for directory in paths.all_endings():
        if directory not in known:
            seen.update(read_endings(paths, directory.name[len(prefix):], ranks, wait_s=0.0))
    return seen


def survivors(rescue: RescueView | None) -> set[int]:
    """The ranks that offered their state to this failure's rescue and did not die: survivors
    of the same loss, whose ending can only be a lost peer (81)."""
    return rescue.offered() - rescue.died() if rescue is not None else set()


def peer_decision(paths: RunPaths, token: str, own: RankEnd, rank: int, world_size: int,
                  wait_s: float = PEER_WAIT_S, rescue: RescueView | None = None
                  ) -> tuple[Decision, dict[int, RankEnding]]:
    """The one policy's decision from the ranks' endings, and the endings read: this rank's
    ``own``, each peer's recorded one, SIGKILL for a peer that recorded none (it died before it
    could: killed). Only the endings decide here (no budget, no commits): whether the job is to run again
    at all; the restart budget and the no-progress guard are the requeue's, asked of the same
    policy (``slurm/requeue.scheduler_decision``, over the restart record).

    ``rescue``: this failure's rescue files. A peer with no ending yet that offered its state
    there is a survivor of the same loss: its ending can only be a lost peer (81), so it counts
    as one, unwaited. A peer its buddy saw die never writes one. So once every silent peer is
    one or the other, the wait ends: a survivor stuck in a collective with this rank writes its
    ending only after this rank's exit, and srun's KillWait does not wait for both."""
    settled = None if rescue is None else (lambda: rescue.offered() | rescue.died())
    seen = read_endings(paths, token, (r for r in range(world_size) if r != rank), wait_s,
                        settled)
    alive = survivors(rescue)
    ends = (own if r == rank else seen[r].end() if r in seen
            else RankEnd(int(ExitCode.PEER_LOST)) if r in alive else KILLED
            for r in range(world_size))
    return decide(Evidence(tuple(ends))), seen


def note_verdict(paths: RunPaths, token: str, decision: Decision) -> None:
    """Rank 0's decision from the endings, for the other survivors: the job's code, and
    whether it leaves (no requeue). Never raises."""
    tell(paths.job_verdict(token), {"leave": decision.action is Action.LEAVE,
                                    "code": int(decision.code)}, "the other ranks the job's code",
         mkdir=True)


def read_verdict(paths: RunPaths, token: str, seen_s: float = 2.0,
                 wait_s: float = VERDICT_WAIT_S) -> int | None:
    """A survivor other than rank 0: the job's code when rank 0 decided that the job leaves,
    else None (it runs again, or rank 0 is gone: no ending of its own within ``seen_s``, or
    said nothing within ``wait_s``)."""
    if not read_endings(paths, token, (0,), seen_s):
        return None
    end = time.monotonic() + max(wait_s, 0.0)
    path = paths.job_verdict(token)
    while True:
        try:
            data = load_json_bounded(path)
        except FileNotFoundError:
            data = None
        except (OSError, ValueError) as e:
            _log.warning("rank 0's decision %s is unreadable (%s)", path, e)
            return None
        if isinstance(data, dict):
            return count(data.get("code"), None) if data.get("leave") is True else None
        if time.monotonic() >= end:
            return None
        time.sleep(_POLL_S)
