"""Exit codes: the contract between a training process, its batch script and the scheduler.

``docs/exit-codes.md`` holds the same table; a test keeps the two in sync.

HANG and DEADLINE equal ``SIGRTMIN + 8`` and ``SIGRTMIN + 9`` on Linux (42, 43) on purpose: when a
hang holds the GIL no Python code can run, so the watchdogs' last resort is a kernel timer whose
signal handler is libc's ``_exit`` itself, and a handler receives the signal number as its
argument. The exit status is then exactly the documented code without any Python involved.
"""

from __future__ import annotations

import enum
import signal

__all__ = ["ExitCode", "describe", "for_signal_stop", "TABLE", "RUN_AGAIN"]


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    HANG = 42
    DEADLINE = 43
    REQUEUE = 75
    STOPPED = 76
    NO_REQUEUE = 77
    CONFIG = 78
    REQUEUE_FAILED = 79
    CHECKPOINT_FAILED = 80
    PEER_LOST = 81
    SIGINT = 128 + signal.SIGINT
    SIGTERM = 128 + signal.SIGTERM


OK = ExitCode.OK
ERROR = ExitCode.ERROR
USAGE = ExitCode.USAGE
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
SIGINT = ExitCode.SIGINT
SIGTERM = ExitCode.SIGTERM

TABLE: dict[ExitCode, str] = {
    ExitCode.OK: "all steps finished",
    ExitCode.ERROR: "an unhandled exception in the training script (Python's own code and "
                    "traceback); the process is forced out watchdog.exit_timeout_s after the "
                    "cleanups if something (an executor thread, a collective) holds it",
    ExitCode.USAGE: "the command line was wrong (CLI only)",
    ExitCode.HANG: "hang watchdog: no step finished within watchdog.hang_timeout_s; stacks were "
                   "dumped to stderr, and the replicas wrote the last step as a rescue "
                   "checkpoint when they could (rescue.*); resume from the last committed one",
    ExitCode.DEADLINE: "shutdown deadline: the graceful shutdown did not finish within the "
                       "signal's grace; stacks were dumped to stderr",
    ExitCode.REQUEUE: "emergency checkpoint committed and the job requeued (under SLURM) or to be "
                      "relaunched (local launcher): run it again",
    ExitCode.STOPPED: "stopped by a signal whose action is `stop` (not SIGINT/SIGTERM); "
                      "checkpoint committed, not requeued",
    ExitCode.NO_REQUEUE: "restart budget exhausted or no progress over several restarts: do not "
                         "requeue; look at the job's log",
    ExitCode.CONFIG: "the run could not start: an invalid configuration (a wrong or unknown key, "
                     "a missing config file) or a checkpoint.dir that cannot hold checkpoints; "
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
    ExitCode.SIGINT: "stopped by SIGINT (Ctrl+C): checkpoint committed; a second Ctrl+C exits "
                     "at once with this code",
    ExitCode.SIGTERM: "stopped by SIGTERM (preemption, scancel): checkpoint committed; a second "
                      "SIGTERM exits at once with this code",
}


# The codes after which the job is to run again, from its newest committed checkpoint: what a
# requeueing scheduler reruns (REQUEUE: the run asked for it; HANG and PEER_LOST: a failure the
# survivors may have rescued, which a site's requeue-on-failure reruns). A local launcher
# (`kempner-resilience launch`) relaunches after exactly these; every other code ends the job.
RUN_AGAIN: frozenset[ExitCode] = frozenset({ExitCode.REQUEUE, ExitCode.HANG, ExitCode.PEER_LOST})


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
