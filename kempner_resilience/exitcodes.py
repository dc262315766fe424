"""Exit codes: the contract between a training process, its batch script and the scheduler.

Two tables, both here: ``TABLE``, what each code means, and ``exit_code``, the one table from
what happened (an ``Ending`` and its ``Facts``) to the code. Every way a run ends goes through
``exit_code``, whichever layer decides it (the shutdown sequence, the signal thread for a
repeated signal, the hang and deadline watchdogs); ``ROWS`` lists its rows as examples, and
``docs/exit-codes.md`` is generated from both (``scripts/regen_docs.py``; a test keeps them in
sync).

HANG and DEADLINE equal ``SIGRTMIN + 8`` and ``SIGRTMIN + 9`` on Linux (42, 43) on purpose: when a
hang holds the GIL no Python code can run, so the watchdogs' last resort is a kernel timer whose
signal handler is libc's ``_exit`` itself, and a handler receives the signal number as its
argument. The exit status is then exactly the documented code without any Python involved.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

__all__ = ["ExitCode", "describe", "brief", "BRIEF", "for_signal_stop", "TABLE", "RUN_AGAIN",
           "RESCUED", "Ending", "Saved", "Verdict", "Facts", "exit_code", "after_requeue", "Row", "ROWS", "CLI_ONLY", "endings_markdown"]


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    RESUME_INEXACT = 3
    RESUME_UNCHECKED = 4
    RESUME_NONDETERMINISTIC = 5
    RESUME_NOT_COVERED = 6
    HANG = 42
    DEADLINE = 43
    REQUEUE = 75
    STOPPED = 76
    NO_REQUEUE = 77
    CONFIG = 78
    REQUEUE_FAILED = 79
    CHECKPOINT_FAILED = 80
    PEER_LOST = 81
    LEASE_LOST = 82
    SIGINT = 128 + signal.SIGINT
    SIGTERM = 128 + signal.SIGTERM


OK = ExitCode.OK
ERROR = ExitCode.ERROR
USAGE = ExitCode.USAGE
RESUME_INEXACT = ExitCode.RESUME_INEXACT
RESUME_UNCHECKED = ExitCode.RESUME_UNCHECKED
RESUME_NONDETERMINISTIC = ExitCode.RESUME_NONDETERMINISTIC
RESUME_NOT_COVERED = ExitCode.RESUME_NOT_COVERED
HANG = ExitCode.HANG
DEADLINE = ExitCode.DEADLINE
REQUEUE = ExitCode.REQUEUE
REQUEUED = ExitCode.REQUEUE
STOPPED = ExitCode.STOPPED
NO_REQUEUE = ExitCode.NO_REQUEUE
CONFIG = ExitCode.CONFIG
REQUEUE_FAILED = ExitCode.REQUEUE_FAILED
CHECKPOINT_FAILED = ExitCode.CHECKPOINT_FAILED
PEER_LOST = ExitCode.PEER_LOST
LEASE_LOST = ExitCode.LEASE_LOST
SIGINT = ExitCode.SIGINT
SIGTERM = ExitCode.SIGTERM

TABLE: dict[ExitCode, str] = {
    ExitCode.OK: "all steps finished",
    ExitCode.ERROR: "an unhandled exception in the training script (Python's own code and "
                    "traceback); the process is forced out watchdog.exit_timeout_s after the "
                    "cleanups if something (an executor thread, a collective) holds it",
    ExitCode.USAGE: "the command line was wrong (CLI only)",
    ExitCode.RESUME_INEXACT: "`check-resume`: the script's resume is not exact: the interrupted "
                             "run's checkpoints differ from the uninterrupted run's; the report "
                             "names the entries, the first step that differs and the likely "
                             "cause (CLI only)",
    ExitCode.RESUME_UNCHECKED: "`check-resume`: nothing to compare: the script failed, timed "
                               "out, never committed a checkpoint or used a checkpoint.dir of "
                               "its own; the report says which (CLI only)",
    ExitCode.RESUME_NONDETERMINISTIC: "`check-resume`: unchecked, the script is not "
                                      "deterministic: two uninterrupted runs of it already "
                                      "differ (an unseeded initialisation or RNG, "
                                      "nondeterministic kernels), so no resume can be judged; "
                                      "the report names the first step and entries that differ "
                                      "(CLI only)",
    ExitCode.RESUME_NOT_COVERED: "`check-resume`: exact for the steps it compared, but its "
                                 "stops did not cross an event that changes state outside a "
                                 "step (an epoch end, a scheduler's milestone, an eval the "
                                 "script names with `run.event(\"eval\")`) within "
                                 "--max-steps or --timeout; the report names the event and its "
                                 "step, and the steps found exact (CLI only)",
    ExitCode.HANG: "hang watchdog: no step finished within watchdog.hang_timeout_s; stacks were "
                   "dumped to stderr, and the replicas wrote the last step as a rescue "
                   "checkpoint when they could (rescue.*); resume from the last committed one",
    ExitCode.DEADLINE: "shutdown deadline: the graceful shutdown did not finish within the "
                       "signal's grace; stacks were dumped to stderr",
    ExitCode.REQUEUE: "emergency checkpoint committed and the job requeued (under SLURM) or to be "
                      "relaunched (local launcher): run it again",
    ExitCode.STOPPED: "stopped by a signal other than SIGINT/SIGTERM whose action is `stop`, "
                      "or `requeue` with `requeue.enabled: false`; checkpoint committed, not "
                      "requeued",
    ExitCode.NO_REQUEUE: "restart budget exhausted or no progress over several restarts: do not "
                         "requeue; look at the job's log",
    ExitCode.CONFIG: "the run could not start: an invalid configuration (a wrong or unknown key, "
                     "a missing config file), a checkpoint.dir that cannot hold checkpoints, "
                     "a checkpoint whose entries differ from the live state's, or every "
                     "checkpoint of the run found damaged and set aside (checkpoint.resume: "
                     "false starts a new lineage); "
                     "stderr names the problem and the fix, without a traceback",
    ExitCode.REQUEUE_FAILED: "emergency checkpoint committed but `scontrol requeue` failed; "
                             "resubmit the job by hand",
    ExitCode.CHECKPOINT_FAILED: "the emergency checkpoint failed or could not fit before the "
                                "deadline, or checkpoint.max_failed_saves periodic checkpoints "
                                "in a row failed; the previous committed checkpoint is intact",
    ExitCode.PEER_LOST: "another rank is gone (killed, its node died or its link was cut), or "
                        "did not answer a checkpoint save's collective within "
                        "watchdog.hang_timeout_s plus the save's estimate (paused with "
                        "SIGSTOP, a frozen node): a collective or the store failed; the survivors first wrote the last "
                        "step as a rescue checkpoint when they could (rescue.*), then this rank "
                        "left without a traceback, and rank 0 requeued the job under SLURM when "
                        "a committed checkpoint exists; resume from it",
    ExitCode.LEASE_LOST: "another run took checkpoint.dir over (its lease, .lease) while this "
                         "one was paused or cut off from the filesystem longer than the lease's "
                         "timeout: this run stopped at its next step boundary without saving, "
                         "committing, deleting or writing anything more in the directory; do "
                         "not requeue: the run that holds the directory goes on",
    ExitCode.SIGINT: "stopped by SIGINT (Ctrl+C): checkpoint committed; a second Ctrl+C exits "
                     "at once with this code",
    ExitCode.SIGTERM: "stopped by SIGTERM (preemption, scancel): checkpoint committed; a second "
                      "SIGTERM exits at once with this code",
}


#: One short sentence per code, for the exit line a run prints last: ``TABLE`` (and
#: ``kempner-resilience exit-codes``) holds the full explanation.
BRIEF: dict[ExitCode, str] = {
    ExitCode.OK: "all steps finished",
    ExitCode.ERROR: "the job ends on an error; not requeued",
    ExitCode.HANG: "no step finished within watchdog.hang_timeout_s",
    ExitCode.DEADLINE: "the shutdown overran its grace",
    ExitCode.REQUEUE: "checkpoint committed; run it again",
    ExitCode.STOPPED: "stopped by a signal; checkpoint committed, not requeued",
    ExitCode.NO_REQUEUE: "restart budget spent or no progress; not requeued",
    ExitCode.CONFIG: "the run could not start; stderr names the fix",
    ExitCode.REQUEUE_FAILED: "checkpoint committed, but the requeue failed; resubmit the job",
    ExitCode.CHECKPOINT_FAILED: "the checkpoint failed; the previous one is intact",
    ExitCode.PEER_LOST: "another rank is gone; the newest committed checkpoint is the resume "
                        "point",
    ExitCode.LEASE_LOST: "another run holds checkpoint.dir now; do not requeue",
    ExitCode.SIGINT: "stopped by SIGINT; checkpoint committed",
    ExitCode.SIGTERM: "stopped by SIGTERM; checkpoint committed",
}


def brief(code: int) -> str:
    """``NAME (code): one short sentence``, for a run's exit line (``describe`` says all)."""
    try:
        c = ExitCode(code)
    except ValueError:
        return describe(code)
    return f"{c.name} ({code}): {BRIEF.get(c, TABLE[c])}"


# The restartable endings, defined once here (the code contract, in the core layer) and read by
# the launch side's one policy (``supervise/policy.py``), which the srun steps, the torchrun
# spares and the local launcher take them from. RESCUED: a failure the survivors may have
# rescued (a peer lost, a hang), worth a relaunch in place. RUN_AGAIN: those and REQUEUE (the run
# asked for it): what a requeueing scheduler reruns, from the newest committed checkpoint.
# Whether a job whose ranks ended with these does run again (a committed checkpoint, the restart
# budget, the no-progress guard, a spare) is the policy's decision. LEASE_LOST above all must
# never be here: another run holds the directory, and running this one again would only start a
# fight over it.
RESCUED: frozenset[ExitCode] = frozenset({ExitCode.HANG, ExitCode.PEER_LOST})
RUN_AGAIN: frozenset[ExitCode] = RESCUED | {ExitCode.REQUEUE}


def for_signal_stop(signum: int) -> ExitCode:
    """The code for "stopped by ``signum``, not requeued": 130/143 by convention, else STOPPED."""
    if signum == signal.SIGINT:
        return ExitCode.SIGINT
    if signum == signal.SIGTERM:
        return ExitCode.SIGTERM
    return ExitCode.STOPPED


def describe(code: int) -> str:
    try:
        return f"{ExitCode(code).name} ({code}): {TABLE[ExitCode(code)]}"
    except ValueError:
        if code > 128:
            try:
                return f"{code}: killed by {signal.Signals(code - 128).name}"
            except ValueError:
                pass
        return f"{code}: not a kempner_resilience code"


# ------------------------------------------------------------------ what happened -> the code

class Ending(enum.Enum):
    """How a run ended (the ``ending`` of the run ledger's ``exit`` event)."""

    COMPLETED = "completed"            # every step ran
    LEFT_EARLY = "left-early"          # the script left run.steps before its last step (a
                                       # break, a return): ranks still in the loop lose it
    SIGNAL = "signal"                  # a shutdown signal (or the allocation's end): all ranks
                                       # stopped at one step, saved, maybe requeued
    FORCED = "forced"                  # a second SIGINT/SIGTERM during the shutdown: out at once
    SAVES_FAILING = "saves-failing"    # checkpoint.max_failed_saves periodic saves in a row failed
    PEER_LOST = "peer-lost"            # a collective failed because another rank is gone
    ERROR = "error"                    # the user's code raised
    HANG = "hang"                      # no step finished within watchdog.hang_timeout_s
    DEADLINE = "deadline"              # the graceful shutdown overran the signal's grace
    STARTUP = "startup-error"          # a start-up error (config, checkpoint.dir) nothing caught
    LEASE_LOST = "lease-lost"          # another run took checkpoint.dir over: stopped, no save


class Saved(enum.Enum):
    """The emergency checkpoint of a stop."""

    COMMITTED = "committed"            # written and committed (or the step was already)
    FAILED = "failed"                  # failed or refused; the previous checkpoint is intact
    NOTHING = "nothing"                # no state to save (ResilientRun without state=)


class Verdict(str, enum.Enum):
    """What the requeue step did: a verdict, which the table turns into a code."""

    REQUEUED = "requeued"              # `scontrol requeue` succeeded (or, outside SLURM, the
                                       # local launcher is asked to relaunch)
    BUDGET_SPENT = "budget-spent"      # requeue.max_restarts reached
    NO_PROGRESS = "no-progress"        # the committed step did not advance over
                                       # requeue.max_no_progress restarts
    SCONTROL_FAILED = "scontrol-failed"  # `scontrol requeue` failed (missing, refused, timed out)
    DISABLED = "disabled"              # requeue.enabled is false
    UNHEARD = "unheard"                # this rank did not learn rank 0's verdict in time

    def __str__(self) -> str:
        return self.value


@dataclass
class Facts:
    """What happened, as far as the exit code cares; ``exit_code`` turns it into the code."""

    ending: Ending
    step: int = 0                      # the last step boundary reached
    signum: int | None = None          # SIGNAL, FORCED: the signal
    saved: Saved = Saved.NOTHING       # SIGNAL: the emergency checkpoint
    requeue: Verdict | None = None     # SIGNAL with action `requeue`: the requeue's verdict
    peer_forced_code: int | None = None  # another rank was forced out with this (130/143)
    peer_code: int | None = None       # PEER_LOST, HANG without a supervisor: the job's code from
                                       # the ranks' recorded endings (supervise/endings.py) when it
                                       # ends the job (a peer's exception: 1)


_REQUEUE_CODES = {Verdict.REQUEUED: ExitCode.REQUEUE, Verdict.BUDGET_SPENT: ExitCode.NO_REQUEUE,
                  Verdict.NO_PROGRESS: ExitCode.NO_REQUEUE,
                  Verdict.SCONTROL_FAILED: ExitCode.REQUEUE_FAILED,
                  Verdict.UNHEARD: ExitCode.REQUEUE_FAILED}
_KNOWN = frozenset(int(c) for c in ExitCode)
_FIXED = {Ending.COMPLETED: ExitCode.OK, Ending.LEFT_EARLY: ExitCode.OK,
          Ending.ERROR: ExitCode.ERROR,
          Ending.PEER_LOST: ExitCode.PEER_LOST, Ending.HANG: ExitCode.HANG,
          Ending.DEADLINE: ExitCode.DEADLINE, Ending.STARTUP: ExitCode.CONFIG,
          Ending.SAVES_FAILING: ExitCode.CHECKPOINT_FAILED,
          Ending.LEASE_LOST: ExitCode.LEASE_LOST}


def exit_code(f: Facts) -> ExitCode:
    """The one table from what happened to the exit code; the rules in order of precedence."""
    if f.peer_forced_code is not None:             # the job ends as the forced-out rank did
        return ExitCode(f.peer_forced_code)
    if f.peer_code is not None:        # a peer's own ending ends the job: so does this rank's
        return ExitCode(f.peer_code) if f.peer_code in _KNOWN else ExitCode.ERROR
    if f.ending in _FIXED:
        return _FIXED[f.ending]
    if f.ending is Ending.SIGNAL and f.saved is Saved.FAILED:
        return ExitCode.CHECKPOINT_FAILED
    if f.ending is Ending.SIGNAL and f.requeue in _REQUEUE_CODES:
        return _REQUEUE_CODES[f.requeue]
    # FORCED, or SIGNAL and not requeued (action `stop`, or requeue.enabled false).
    assert f.signum is not None, f"{f.ending.value} needs the signal"
    return for_signal_stop(f.signum)               # 130, 143, or STOPPED


def after_requeue(code: int, verdict: Verdict | None) -> int:
    """The code of a process that asked for the job's requeue and is the job's one SLURM process
    (a Ray driver): ``code`` when the job was requeued or no requeue was tried, else the table's
    word for why not (77: the budget or no progress; 79: ``scontrol`` failed, resubmit)."""
    if verdict is Verdict.REQUEUED or verdict not in _REQUEUE_CODES:
        return int(code)     # requeued, not tried, or off (requeue.enabled false)
    return int(_REQUEUE_CODES[verdict])


@dataclass(frozen=True)
class Row:
    """One row of the table, as an example of the facts it covers (docs/exit-codes.md)."""

    facts: Facts
    when: str

    @property
    def code(self) -> ExitCode:
        return exit_code(self.facts)


def _stop(signum: int, when: str, saved: Saved = Saved.COMMITTED,
          requeue: Verdict | None = None) -> Row:
    return Row(Facts(Ending.SIGNAL, signum=signum, saved=saved, requeue=requeue), when)


_TERM, _INT, _USR1 = signal.SIGTERM, signal.SIGINT, signal.SIGUSR1

ROWS: tuple[Row, ...] = (
    Row(Facts(Ending.COMPLETED), "every step ran"),
    Row(Facts(Ending.LEFT_EARLY), "this rank's script left `run.steps` before its last step (a "
        "`break`, a `return`); a rank still in the loop loses it and leaves with 1"),
    _stop(_USR1, "a signal whose action is `requeue` (SIGUSR1 by default, or the allocation's "
          "end); checkpoint committed; requeued", requeue=Verdict.REQUEUED),
    _stop(_USR1, "the same; not requeued: requeue.max_restarts reached",
          requeue=Verdict.BUDGET_SPENT),
    _stop(_USR1, "the same; not requeued: no progress over requeue.max_no_progress restarts",
          requeue=Verdict.NO_PROGRESS),
    _stop(_USR1, "the same; `scontrol requeue` failed", requeue=Verdict.SCONTROL_FAILED),
    _stop(_USR1, "the same; this rank did not learn rank 0's requeue verdict in time",
          requeue=Verdict.UNHEARD),
    _stop(_USR1, "the same, with `requeue.enabled: false`", requeue=Verdict.DISABLED),
    _stop(_TERM, "SIGTERM with action `requeue` and `requeue.enabled: false`",
          requeue=Verdict.DISABLED),
    _stop(_INT, "SIGINT with action `requeue` and `requeue.enabled: false`",
          requeue=Verdict.DISABLED),
    _stop(_TERM, "SIGTERM with action `stop` (the default); checkpoint committed"),
    _stop(_INT, "SIGINT with action `stop` (the default); checkpoint committed"),
    _stop(signal.SIGHUP, "another signal with action `stop`; checkpoint committed"),
    _stop(_USR1, "any stop whose emergency checkpoint failed or could not fit",
          saved=Saved.FAILED),
    Row(Facts(Ending.SAVES_FAILING), "checkpoint.max_failed_saves periodic saves in a row "
        "failed"),
    Row(Facts(Ending.FORCED, signum=_INT), "a second SIGINT during the shutdown"),
    Row(Facts(Ending.FORCED, signum=_TERM), "a second SIGTERM during the shutdown"),
    Row(Facts(Ending.SIGNAL, signum=_USR1, saved=Saved.COMMITTED, requeue=Verdict.REQUEUED,
              peer_forced_code=int(ExitCode.SIGTERM)),
        "any ending on a rank whose peer was forced out (130 or 143): that rank's code"),
    Row(Facts(Ending.PEER_LOST), "another rank is gone (after the survivors' rescue)"),
    Row(Facts(Ending.PEER_LOST, peer_code=int(ExitCode.ERROR)),
        "without a supervisor, another rank gone by an ending of its own that ends the job (it "
        "raised, or left `run.steps` early), as rank 0 read the ranks' endings: that ending's "
        "code (a code outside this table: 1), never requeued"),
    Row(Facts(Ending.HANG), "the hang watchdog, or its backstop when the hang holds the GIL "
        "(after the rescue)"),
    Row(Facts(Ending.HANG, peer_code=int(ExitCode.ERROR)),
        "without a supervisor, a hang while another rank had ended on its own (with NCCL a "
        "peer that raised leaves the others stuck in the collective), as rank 0 read the "
        "ranks' endings: that ending's code, never requeued"),
    Row(Facts(Ending.DEADLINE), "the graceful shutdown overran the signal's grace"),
    Row(Facts(Ending.ERROR), "the training script raised"),
    Row(Facts(Ending.STARTUP), "a start-up error (configuration, checkpoint.dir) nothing caught"),
    Row(Facts(Ending.LEASE_LOST), "another run took checkpoint.dir over while this one was "
        "paused: stopped at the next step boundary, nothing saved, never requeued"),
)

# Codes no run produces: the command line's own.
CLI_ONLY: frozenset[ExitCode] = frozenset({ExitCode.USAGE, ExitCode.RESUME_INEXACT,
                                          ExitCode.RESUME_UNCHECKED,
                                          ExitCode.RESUME_NONDETERMINISTIC,
                                          ExitCode.RESUME_NOT_COVERED})


def _signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else ""


def endings_markdown() -> str:
    """The table's rows as docs/exit-codes.md shows them (``scripts/regen_docs.py``)."""
    lines = ["| ending | signal | requeue | when | code |", "| --- | --- | --- | --- | --- |"]
    for r in ROWS:
        f = r.facts
        lines.append(f"| `{f.ending.value}` | {_signal_name(f.signum)} | "
                     f"{'' if f.requeue is None else f'`{f.requeue.value}`'} | {r.when} | "
                     f"{int(r.code)} `{r.code.name}` |")
    return "\n".join(lines)
