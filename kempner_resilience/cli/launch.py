"""`kempner-resilience launch`: run one's own script on local ranks until it is done.

    kempner-resilience launch --ranks 2 [--max-restarts 20] -- python train.py [args]

The loop SLURM runs for a requeueable job, on one machine (``supervise/local/launcher.py``): every
rank gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT and ``KEMPNER_RESTART_COUNT``; a
launch whose ranks ended in a way worth running again (75 REQUEUE, 42 HANG, 81 PEER_LOST, a rank
killed) is started again from the newest checkpoint, within the restart budget: the launch-side
policy decides (``supervise/policy.py``), with its one rule for the job's code. Once a rank has
ended, the others get --stop-timeout to end too and are then killed, so a frozen rank never
holds the launch. Ctrl+C (or a SIGTERM to this process) gives each rank one SIGINT (SIGTERM):
they checkpoint and exit 130 (143), and there is no relaunch. The exit status is the job's code
of the last launch.
"""

from __future__ import annotations

import argparse
import os
import shutil

from kempner_resilience.cli.common import CliError, Verb
from kempner_resilience.exitcodes import RUN_AGAIN, describe
from kempner_resilience.core.log import get_logger

__all__ = ["VERBS"]

_log = get_logger(__name__)

DEFAULT_MAX_RESTARTS = 20     # the same as requeue.max_restarts' default


def _setup(p: argparse.ArgumentParser) -> None:
    p.usage = "%(prog)s --ranks N [--max-restarts K] -- COMMAND [ARGS...]"
    p.add_argument("--ranks", type=int, default=1, metavar="N",
                   help="processes to start (ranks 0..N-1 on this machine); default 1")
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS, metavar="K",
                   help="relaunch at most K times (0: run once); default "
                        f"{DEFAULT_MAX_RESTARTS}, as requeue.max_restarts, which the ranks "
                        "check against KEMPNER_RESTART_COUNT themselves")
    p.add_argument("--stop-timeout", type=float, default=120.0, metavar="S",
                   help="after Ctrl+C or SIGTERM, seconds the ranks get to checkpoint and exit "
                        "before they are killed; also, once one rank has ended, seconds the "
                        "others get to end before they are killed (SIGTERM, SIGKILL 10 s "
                        "later); default 120. Survivors whose lost peer shows only through "
                        "their hang watchdog need more than watchdog.hang_timeout_s + "
                        "rescue.budget_s to commit the rescue")
    p.add_argument("--warm", action="store_true",
                   help="fork the ranks of every launch from one process that imported torch "
                        "once: a relaunch costs a fork instead of Python's and torch's start-up "
                        "(a command `python script.py ...` or `python -m module ...` only; the "
                        "ranks are that process's children). Also KEMPNER_RESILIENCE_WARM=1")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the command every rank runs, e.g. python train.py --lr 0.1")
    codes = ", ".join(f"{int(c)} {c.name}" for c in sorted(RUN_AGAIN))
    p.epilog = (f"Relaunched after {codes} or a rank killed by a signal (what a requeueing "
                "scheduler reruns); stops on 0, on any other code and when the budget is spent "
                "(then 77 NO_REQUEUE where the ranks asked to run again with 75). "
                "The exit status is the job's code of the last launch, one rule over the ranks' "
                "codes (docs/design.md, \"One supervisor policy\"): a rank's own code (1 ERROR, "
                "78 CONFIG, ...) over its peers' 81 PEER_LOST, so [81, 1] exits 1 without a "
                "relaunch; ranks that exited 0 while the others lost them left run.steps early "
                "and the job exits 1; then 75; then 81/42 (a rank SIGKILLed beside survivors' "
                "81: 81); then 128+N for a rank killed by signal N. 130 after Ctrl+C.")


def _run(args: argparse.Namespace) -> int:
    from kempner_resilience.supervise.local.launcher import LocalLauncher, Launch

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise CliError("give the command every rank runs, e.g. `kempner-resilience launch "
                       "--ranks 2 -- python train.py`", 2)
    if args.ranks < 1:
        raise CliError(f"--ranks {args.ranks}: give 1 or more", 2)
    if args.max_restarts < 0:
        raise CliError(f"--max-restarts {args.max_restarts}: give 0 (run once) or more", 2)
    if args.stop_timeout <= 0:
        raise CliError(f"--stop-timeout {args.stop_timeout}: give a positive number of "
                       "seconds", 2)
    if args.warm:
        os.environ["KEMPNER_RESILIENCE_WARM"] = "1"
    if shutil.which(command[0]) is None:
        raise CliError(f"{command[0]!r}: no such command (not a file, not on PATH)", 2)

    def told(launch: Launch) -> None:
        from kempner_resilience.supervise.policy import Action, Guard

        code, decision = launch.exit_code, launch.decision
        what = f"launch {launch.index + 1} (KEMPNER_RESTART_COUNT={launch.index}): ranks " \
               f"exited {launch.exit_codes} -> {describe(code).split(':')[0]}"
        if launch.killed:
            what += f"; ranks {launch.killed} did not stop within --stop-timeout and were killed"
        if launch.interrupted:
            _log.warning("%s; stopped by a signal to the launcher: not relaunched", what)
        elif decision is not None and decision.action is not Action.LEAVE:
            _log.warning("%s; relaunching (restart %d of %d): %s", what, launch.index + 1,
                         args.max_restarts, decision.why)
        elif code == 0:
            _log.info("%s: done", what)
        elif decision is not None and decision.guard is Guard.BUDGET:
            _log.error("%s; the restart budget (--max-restarts %d) is spent: not relaunched, "
                       "exit %d", what, args.max_restarts, code)
        else:
            _log.error("%s; not relaunched: %s", what,
                       decision.why if decision is not None else "")

    launcher = LocalLauncher(command, ranks=args.ranks, workdir=None,
                             max_launches=args.max_restarts + 1, on_launch=told,
                             stop_timeout_s=args.stop_timeout)
    launches = launcher.run()
    return launches[-1].exit_code


VERBS = [
    Verb("launch", "run your script as N local ranks and relaunch it from its checkpoint while "
         "it asks to run again (75), as SLURM's requeue would; Ctrl+C checkpoints", _setup,
         _run),
]
