"""`kempner-resilience demo --slurm`: the demo's story on a real SLURM cluster.

The same story as the local demo (an uninterrupted reference run, then a run interrupted by
signals, checkpointed, requeued and resumed, then a bitwise comparison), but the interrupted run
is the shipped sbatch template rendered for the demo trainer (``demo/slurm_demo.py``), and every
step of the story is SLURM's own.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kempner_resilience.cli.common import CliError
from kempner_resilience.demo.compare import compare_weights
from kempner_resilience.demo.slurm_demo import (ClusterError, DemoJob, check_cluster,
                                                run_reference, wait_until, write_job)
from kempner_resilience.exitcodes import ExitCode, describe

__all__ = ["run_slurm_demo"]


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _describe_run(job: DemoJob, restart: int, total: int) -> str:
    r = job.report(restart) or {}
    parts = [f"run {restart + 1} (SLURM_RESTART_COUNT={restart}):"]
    if r.get("resumed_from") is not None:
        t = (r.get("timings") or {}).get("resume_s")
        parts.append(f"resumed at step {r.get('start_step')}" +
                     (f" (load {t:.2f} s)" if t else "") + ";")
    else:
        parts.append("fresh start;")
    if r.get("stop_step") is not None:
        timings = r.get("timings") or {}
        parts.append(f"all ranks stopped at step {r['stop_step']};")
        if r.get("saved_step") is not None and timings.get("emergency_save_s") is not None:
            parts.append(f"checkpoint step {r['saved_step']} committed in "
                         f"{timings['emergency_save_s']:.2f} s;")
        if timings.get("scontrol_requeue_s") is not None:
            parts.append(f"scontrol requeue {timings['scontrol_requeue_s'] * 1000:.0f} ms;")
    elif r.get("exit_code") == 0:
        parts.append(f"completed {total} steps;")
    if "exit_code" in r:
        parts.append(f"exit {describe(int(r['exit_code'])).split(':')[0]}")
    else:
        parts.append("no report (see the job log)")
    return " ".join(parts)


def run_slurm_demo(args: Any) -> int:
    """``kempner-resilience demo --slurm``: returns the process exit code."""
    if args.ranks < 1 or args.steps < 1:
        raise CliError("--ranks and --steps must be >= 1", 2)
    if getattr(args, "hang_at", -1) >= 0:
        raise CliError("--hang-at is not supported with --slurm (use the local demo)", 2)
    try:
        check_cluster()
    except ClusterError as e:
        raise CliError(str(e)) from None
    sig = args.signal
    try:
        steps_at = sorted({int(s) for s in str(args.interrupt_at).split(",") if s.strip()})
    except ValueError:
        raise CliError(f"--interrupt-at {args.interrupt_at!r}: give steps like 10,25", 2) from None
    if any(s >= args.steps for s in steps_at):
        raise CliError("--interrupt-at steps must be below --steps", 2)

    work = Path(args.workdir).resolve()
    for sub in ("reference", "slurm"):
        shutil.rmtree(work / sub, ignore_errors=True)
    (work / "reference").mkdir(parents=True)
    _say(f"kempner-resilience demo --slurm: {args.ranks} srun tasks (gloo), {args.steps} steps, "
         f"scancel --signal={sig} at steps {','.join(map(str, steps_at)) or '(none)'}; "
         f"workdir {work}")
    t0 = time.monotonic()
    try:
        ref = run_reference(work / "reference", ranks=args.ranks, steps=args.steps)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        raise CliError(f"the uninterrupted reference run failed: {e}") from None
    _say(f"reference: uninterrupted run of {args.steps} steps done "
         f"[{time.monotonic() - t0:.1f} s]")

    job = write_job(work / "slurm", ranks=args.ranks, steps=args.steps,
                    step_time=args.step_time, every_steps=args.every_steps,
                    sets=["signals.grace_s=60"], job_name="kr-demo")
    _say(f"batch script: {job.script} (the single_node template, rendered); log: {job.log}")
    t_job = time.monotonic()
    job.submit()
    _say(f"submitted job {job.job_id}")
    try:
        for i, step in enumerate(steps_at):
            job.wait_step(step, timeout=max(120.0, args.steps * args.step_time * 4))
            if job.info().get("JobState") != "RUNNING":
                job.wait_state({"RUNNING"}, timeout=120)
            t_sig = job.signal(sig)
            _say(f"  scancel --signal={sig} {job.job_id} at step {job.last_step()}")
            report = wait_until(lambda: job.report(i), 120 + args.steps * args.step_time,
                                f"run {i + 1}'s exit report")
            _say("  " + _describe_run(job, i, args.steps)
                 + f" (signal to report {time.time() - t_sig:.2f} s)")
            code = int(report.get("exit_code", -1))
            if code != int(ExitCode.REQUEUE) and code != int(ExitCode.SIGTERM):
                info = job.wait_state(timeout=60)
                raise CliError(f"the job was not requeued: {describe(code)}; JobState "
                               f"{info.get('JobState')}; log {job.log}")
            t_req = time.monotonic()
            job.wait_state({"RUNNING", "COMPLETING", "COMPLETED"}, restarts=i + 1, timeout=180)
            _say(f"  SLURM requeued job {job.job_id}: running again after "
                 f"{time.monotonic() - t_req:.1f} s (Restarts={i + 1})")
        info = job.wait_state(timeout=120 + args.steps * args.step_time * 4)
    except TimeoutError as e:
        job.cancel()
        raise CliError(f"{e}".splitlines()[0] + f"; log {job.log}") from None
    except KeyboardInterrupt:
        job.cancel()
        raise
    _say("  " + _describe_run(job, len(steps_at), args.steps))
    _say(f"job {job.job_id}: {info.get('JobState')} exit {info.get('ExitCode')} after "
         f"{info.get('Restarts')} requeue(s) [{time.monotonic() - t_job:.1f} s]")
    if info.get("JobState") != "COMPLETED" or not job.weights.exists():
        for line in job.log_text().splitlines()[-15:]:
            _say("    | " + line)
        raise CliError(f"the SLURM job ended {info.get('JobState')} ({info.get('ExitCode')}); "
                       f"log {job.log}")
    same, total, diff = compare_weights(ref, job.weights)
    _say(f"checkpoints kept in {job.checkpoints}")
    if not diff:
        _say(f"RESULT: final weights and optimizer state are bitwise IDENTICAL to the "
             f"uninterrupted run ({total} tensors) after {info.get('Restarts')} requeue(s)")
        return 0
    _say(f"RESULT: final weights DIFFER from the uninterrupted run: {len(diff)} of {total} "
         f"tensors ({', '.join(diff[:5])})")
    return 1
