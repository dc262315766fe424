"""`kempner-resilience demo`: the main job, interrupted, checkpointed, relaunched and resumed.

The local story (a launcher plays the scheduler) is here; ``--slurm`` tells the same story on a
real cluster (``demo_slurm.py``). The trainer, the launcher and the comparison are ``demo/``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from kempner_resilience.cli.common import CliError, Verb
from kempner_resilience.demo.compare import compare_weights
from kempner_resilience.demo.launcher import LocalLauncher, Launch, train_command
from kempner_resilience.supervise.local.launcher import warm_parent
from kempner_resilience.supervise.local.warm import Forker
from kempner_resilience.exitcodes import ExitCode, describe

# Codes after which the job may run again: the launcher's scheduler role. 130/143/STOPPED are
# "resubmitted by hand" in the story; REQUEUE and HANG are what a requeueing scheduler reruns.
RERUN = {int(ExitCode.REQUEUE), int(ExitCode.HANG), int(ExitCode.SIGINT),
         int(ExitCode.SIGTERM), int(ExitCode.STOPPED)}


def setup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="processes (gloo ranks); default 2")
    p.add_argument("--steps", type=int, default=40, help="training steps; default 40")
    p.add_argument("--interrupt-at", default="10,25", metavar="STEPS",
                   help="comma-separated steps at which the signal is delivered; default 10,25")
    p.add_argument("--signal", default="USR1", choices=["USR1", "USR2", "TERM", "INT"],
                   help="signal to deliver; default USR1 (SLURM's time-limit warning)")
    p.add_argument("--hang-at", type=int, default=-1, metavar="STEP",
                   help="make every rank hang inside this step once (hang watchdog demo)")
    p.add_argument("--workdir", default="demo-workdir",
                   help="where checkpoints, logs and weights go; default ./demo-workdir")
    p.add_argument("--step-time", type=float, default=0.05,
                   help="seconds each step takes at least; default 0.05")
    p.add_argument("--every-steps", type=int, default=5,
                   help="periodic checkpoint cadence; default 5")
    p.add_argument("--slurm", action="store_true",
                   help="run the same story through the sbatch template on a real cluster")


def _interrupts(text: str, sig: str) -> dict[int, str]:
    if not text.strip():
        return {}
    try:
        steps = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise CliError(f"--interrupt-at {text!r}: give steps like 10,25", 2) from None
    return {s: f"SIG{sig}" for s in steps}


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _progress(label: str, total: int) -> "callable":
    tty = sys.stdout.isatty()
    last = [-10]

    def show(index: int, step: int) -> None:
        if tty:
            done = int(30 * (step + 1) / total)
            sys.stdout.write(f"\r  {label} launch {index + 1}: [{'#' * done}{'.' * (30 - done)}]"
                             f" step {step + 1}/{total}")
            sys.stdout.flush()
        elif step - last[0] >= 10:
            last[0] = step
            _say(f"  {label} launch {index + 1}: step {step + 1}/{total}")
    return show


def _describe_launch(launch: Launch, total: int) -> str:
    r = launch.report
    parts = [f"launch {launch.index + 1}:"]
    start = r.get("start_step", launch.started_step or 0)
    if r.get("resumed_from") is not None:
        t = r.get("timings", {}).get("resume_s")
        parts.append(f"resumed at step {start}" + (f" (load {t:.2f} s)" if t else "") + ";")
    else:
        parts.append("fresh start;")
    if launch.signal_name:
        parts.append(f"{launch.signal_name} at step {launch.signal_step} ->")
    if r.get("stop_step") is not None:
        parts.append(f"all ranks stopped at step {r['stop_step']};")
        save = r.get("timings", {}).get("emergency_save_s")
        if r.get("saved_step") is not None and save is not None:
            parts.append(f"checkpoint {Path(r['saved_path']).name} committed in {save:.2f} s;")
    elif launch.exit_code == 0:
        parts.append(f"completed {total} steps;")
    elif launch.exit_code == ExitCode.HANG:
        parts.append("hang detected by the watchdog (stacks in rank*.log); resuming from the "
                     "last periodic checkpoint;")
    parts.append(f"exit {describe(launch.exit_code).split(':')[0]}")
    if launch.signal_to_exit_s is not None:
        parts.append(f"(signal to exit {launch.signal_to_exit_s:.2f} s)")
    parts.append(f"[{launch.seconds:.1f} s]")
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    if args.slurm:
        from kempner_resilience.cli.demo_slurm import run_slurm_demo

        return run_slurm_demo(args)
    if args.ranks < 1 or args.steps < 1:
        raise CliError("--ranks and --steps must be >= 1", 2)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for sub in ("reference", "resilient"):
        shutil.rmtree(work / sub, ignore_errors=True)
        (work / sub).mkdir()
    _say(f"kempner-resilience demo: {args.ranks} ranks (gloo), {args.steps} steps, "
         f"{args.signal} at steps {args.interrupt_at or '(none)'}"
         + (f", hang at step {args.hang_at}" if args.hang_at >= 0 else "")
         + f"; workdir {work}")

    # One warm parent for both runs' ranks (with warm starts on): torch is imported once.
    zygote = warm_parent(train_command(args.steps, step_time=0.0, out=work, overrides=[]),
                         args.ranks)
    try:
        return _local(args, work, zygote)
    finally:
        if zygote is not None:
            zygote.close()


def _local(args: argparse.Namespace, work: Path, zygote: Forker | None) -> int:
    """The reference run, then the resilient one, their ranks forked from ``zygote``."""
    base = ["watchdog.hang_timeout_s=" + ("5" if args.hang_at >= 0 else "120"),
            "signals.grace_s=60"]
    t0 = time.monotonic()
    ref = LocalLauncher(
        train_command(args.steps, step_time=0.0, out=work / "reference" / "weights.pt",
                      overrides=base + [f"checkpoint.dir={work / 'reference' / 'checkpoints'}",
                                        "checkpoint.every_steps=0"]),
        ranks=args.ranks, workdir=work / "reference", max_launches=1, zygote=zygote)
    ref_launch = ref.run()[-1]
    if ref_launch.interrupted:
        return _interrupted(ref_launch, work / "reference")
    if ref_launch.exit_code != 0:
        raise CliError(f"the uninterrupted reference run failed with {ref_launch.exit_code}; "
                       f"see {work / 'reference'}/rank0.0.log")
    _say(f"reference: uninterrupted run of {args.steps} steps done "
         f"[{time.monotonic() - t0:.1f} s]")

    ckpt_dir = work / "resilient" / "checkpoints"
    cmd = train_command(args.steps, step_time=args.step_time,
                        out=work / "resilient" / "weights.pt", hang_at=args.hang_at,
                        overrides=base + [f"checkpoint.dir={ckpt_dir}",
                                          f"checkpoint.every_steps={args.every_steps}"])
    launcher = LocalLauncher(cmd, ranks=args.ranks, workdir=work / "resilient",
                             interrupts=_interrupts(args.interrupt_at, args.signal),
                             on_progress=_progress("resilient", args.steps),
                             on_launch=lambda l: _say(("\n" if sys.stdout.isatty() else "")
                                                      + "  " + _describe_launch(l, args.steps)),
                             relaunch_codes=RERUN, zygote=zygote)
    launches = launcher.run()
    final = launches[-1]
    if final.interrupted:
        return _interrupted(final, work / "resilient")
    if final.exit_code != 0:
        for line in final.stderr_tail:
            _say("    | " + line)
        raise CliError(f"the resilient run ended with {describe(final.exit_code)}; logs in "
                       f"{work / 'resilient'}")

    same, total, _ = compare_weights(work / "reference" / "weights.pt",
                                     work / "resilient" / "weights.pt")
    _say(f"checkpoints kept in {ckpt_dir} (try: kempner-resilience ls {ckpt_dir})")
    if same == total:
        _say(f"RESULT: final weights and optimizer state are bitwise IDENTICAL to the "
             f"uninterrupted run ({total} tensors) after {len(launches)} launches")
        return 0
    _say(f"RESULT: final weights DIFFER from the uninterrupted run: {total - same} of {total} "
         "tensors")
    return 1


def _interrupted(launch: Launch, where: Path) -> int:
    """Ctrl+C: the ranks got one SIGINT each and stopped (checkpoint, 130), or were forced."""
    killed = f"; ranks {launch.killed} did not stop in time and were killed" if launch.killed \
        else ""
    _say(f"\ninterrupted (Ctrl+C): rank exit codes {launch.exit_codes}{killed}; logs and "
         f"checkpoints in {where}")
    return 130


VERBS = [
    Verb("demo", "run the main job: a small training run that is interrupted, checkpoints, is "
         "relaunched and resumes, then compared with an uninterrupted run", setup, run),
]
