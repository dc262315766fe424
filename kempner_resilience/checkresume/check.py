"""``check-resume``: does this script resume exactly? Two runs of it, compared step by step.

The script runs twice on the same local ranks, each in a fresh checkpoint directory with a
commit at every step (``runs.py``): once straight to step ``steps`` (the reference), once stopped
at the ``interrupt_at`` steps by a real signal (or a SIGKILLed rank) and relaunched from its
checkpoint each time, as SLURM's requeue would, to the same step. Both end with a stop at
``steps`` (SIGTERM, a checkpoint), so a script written for a long job is checked in a few steps.
A resume is exact when every checkpoint of the interrupted run equals the reference's of the
same step, entry by entry and bitwise (``compare.py``). The first step that differs, what
differs there and how long after which stop, gives the likely cause (``diagnose.py``).
"""

from __future__ import annotations

import enum
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kempner_resilience.checkresume.compare import EntryDiff, diff_snapshots
from kempner_resilience.checkresume.diagnose import likely_causes
from kempner_resilience.checkresume.runs import RunResult, run_script
from kempner_resilience.checkresume.snapshot import Kind, Snapshot, read_snapshot
from kempner_resilience.exitcodes import ExitCode, for_signal_stop
from kempner_resilience.stop.rehearsal import PlannedStop, min_gap

__all__ = ["CheckOptions", "Outcome", "Verdict", "check_resume"]

# The stop that ends both runs at ``steps``: SIGTERM, whose action the run's config makes `stop`.
_FINAL = signal.SIGTERM


class Outcome(enum.Enum):
    """check-resume's answer, and its exit code."""

    EXACT = int(ExitCode.OK)
    INEXACT = int(ExitCode.RESUME_INEXACT)
    UNCHECKED = int(ExitCode.RESUME_UNCHECKED)


@dataclass(frozen=True)
class CheckOptions:
    """What to check: the command every rank runs and how the two runs go."""

    command: tuple[str, ...]
    ranks: int = 1
    steps: int = 10
    interrupt_at: tuple[int, ...] = (3, 7)
    signal_name: str = "SIGUSR1"
    kill_rank: int | None = None          # SIGKILL this rank at the interrupts instead
    timeout_s: float = 120.0              # per run
    workdir: Path | None = None           # kept; None: a temporary one, removed when exact
    config: Mapping[str, Any] = field(default_factory=dict)   # the user's resolved config

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("give the command every rank runs (after `--`)")
        if self.ranks < 1:
            raise ValueError(f"--ranks {self.ranks}: give 1 or more")
        if self.steps < 2:
            raise ValueError(f"--steps {self.steps}: give 2 or more")
        if not self.interrupt_at:
            raise ValueError("--interrupt-at: give at least one step")
        gap = min_gap(self.ranks)
        marks = [0, *self.interrupt_at, self.steps]
        if any(b - a < gap for a, b in zip(marks, marks[1:])):
            raise ValueError(f"--interrupt-at {','.join(map(str, self.interrupt_at))}: give "
                             f"increasing steps, at least {gap} apart, after step 0 and "
                             f"{gap} before --steps {self.steps} (with {self.ranks} ranks a stop "
                             f"is agreed {gap - 1} steps after the signal)")
        self.signum                        # raises ValueError for an unknown name
        if self.kill_rank is not None and not 0 <= self.kill_rank < self.ranks:
            raise ValueError(f"--kill-rank {self.kill_rank}: give a rank between 0 and "
                             f"{self.ranks - 1}")
        if self.kill_rank is not None and self.ranks < 2:
            raise ValueError("--kill-rank needs --ranks 2 or more (survivors to rescue)")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout {self.timeout_s}: give a positive number of seconds")

    @property
    def signum(self) -> int:
        name = self.signal_name.upper()
        try:
            return int(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
        except KeyError:
            raise ValueError(f"--signal {self.signal_name}: not a signal name") from None

    def interrupts(self) -> list[PlannedStop]:
        if self.kill_rank is not None:
            return [PlannedStop(s, signal.SIGKILL, self.kill_rank) for s in self.interrupt_at]
        return [PlannedStop(s, self.signum) for s in self.interrupt_at]


@dataclass(frozen=True)
class Verdict:
    """What check-resume found."""

    outcome: Outcome
    workdir: Path
    problem: str | None = None                 # UNCHECKED: why nothing could be compared
    stops: tuple[int, ...] = ()                # the steps the interrupted run stopped at
    compared: tuple[int, ...] = ()             # the steps compared, in order
    first_step: int | None = None              # the first step that differs
    first_diffs: tuple[EntryDiff, ...] = ()
    after_stop: int | None = None              # the last stop before first_step
    final_step: int | None = None
    final_diffs: tuple[EntryDiff, ...] = ()
    causes: tuple[str, ...] = ()
    unseeded: tuple[str, ...] = ()             # RNG streams left out: they differ before any stop

    @property
    def code(self) -> int:
        return self.outcome.value


def _failure(run: RunResult, what: str) -> str | None:
    """Why ``run`` cannot be compared, or None."""
    if run.timed_out:
        return (f"the {what} run did not end within --timeout: the ranks were stopped; raise "
                "--timeout or lower --steps")
    if not run.launches:
        return f"the {what} run never started"
    given = str(run.root)
    for launch in run.launches:
        if launch.run_dir is not None and launch.run_dir != given:
            return (f"the script used checkpoint.dir {launch.run_dir}, not the fresh directory "
                    "check-resume gave it: it loads its config from a file or overrides of its "
                    "own. Let $KEMPNER_RESILIENCE_CONFIG reach it (kr.load_config() without a "
                    "path, or ResilientRun without a config) and pass your settings to "
                    "check-resume with --config/--set")
    last = run.launches[-1]
    ok = {int(ExitCode.OK), int(for_signal_stop(_FINAL))}
    if last.code not in ok:
        tail = run.log_tail()
        return (f"the {what} run's launch {last.index + 1} ended with {last.code} (ranks "
                f"{list(last.exit_codes)}), not at the final step; rank 0's log ends:\n{tail}")
    if not run.committed:
        return (f"the {what} run committed no checkpoint: does the script iterate run.steps() "
                "inside a ResilientRun with state={...}?")
    return None


def _snapshots(run: RunResult, cache: dict[tuple[str, int], Snapshot], step: int) -> Snapshot:
    key = (run.name, step)
    if key not in cache:
        cache[key] = read_snapshot(run.committed[step], step)
    return cache[key]


def check_resume(opts: CheckOptions) -> Verdict:
    """Run both runs and compare them (main thread only: the launcher handles signals)."""
    work = opts.workdir or Path(tempfile.mkdtemp(prefix="kempner-check-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    final = PlannedStop(opts.steps, _FINAL)
    common = dict(work=work, ranks=opts.ranks, config=opts.config, timeout_s=opts.timeout_s)
    ref = run_script(list(opts.command), name="uninterrupted", stops=[final], relaunches=0,
                     **common)
    problem = _failure(ref, "uninterrupted")
    if problem:
        return Verdict(Outcome.UNCHECKED, work, problem)
    interrupts = opts.interrupts()
    again = frozenset() if opts.kill_rank is not None else frozenset(
        {int(for_signal_stop(opts.signum))})
    got = run_script(list(opts.command), name="interrupted", stops=interrupts + [final],
                     relaunches=len(interrupts), relaunch_codes=again, **common)
    problem = _failure(got, "interrupted")
    # Where each relaunch resumed: the stops as the checkpoints saw them (a killed rank's
    # launch reports no stop step of its own).
    stops = tuple(l.start_step for l in got.launches[1:] if l.start_step is not None)
    if problem is None and len(got.launches) < 2:
        problem = (f"the interrupted run was never interrupted: it ended at step "
                   f"{max(got.committed)} before step {opts.interrupt_at[0]}; lower "
                   "--interrupt-at and --steps to fit the script's steps")
    if problem:
        return Verdict(Outcome.UNCHECKED, work, problem, stops)
    steps = sorted(set(ref.committed) & set(got.committed))
    cache: dict[tuple[str, int], Snapshot] = {}
    compared: list[int] = []
    first: tuple[int, list[EntryDiff]] | None = None
    unseeded: set[str] = set()

    def diff(step: int) -> list[EntryDiff]:
        return [d for d in diff_snapshots(_snapshots(ref, cache, step),
                                          _snapshots(got, cache, step))
                if d.key not in unseeded]

    for step in steps:
        compared.append(step)
        diffs = diff(step)
        if diffs and stops and step <= stops[0] and all(d.kind is Kind.RNG for d in diffs):
            # Before the first stop both runs did the same: an RNG stream that differs there
            # is one the script never seeded (Python's, NumPy's); the model does not depend on
            # it as long as nothing else differs. It is left out of the comparison.
            unseeded |= {d.key for d in diffs}
            continue
        if diffs:
            first = (step, diffs)
            break
    final_step = steps[-1]
    if first is None:
        return Verdict(Outcome.EXACT, work, None, stops, tuple(compared), final_step=final_step,
                       unseeded=tuple(sorted(unseeded)))
    if final_step not in compared:
        compared.append(final_step)
    final_diffs = diff(final_step)
    step, diffs = first
    before = [s for s in stops if s < step]
    after_stop = before[-1] if before else None
    has_scheduler = any(k is Kind.SCHEDULER for k in _snapshots(ref, cache, step).kinds.values())
    causes = likely_causes(diffs, step, after_stop, has_scheduler)
    return Verdict(Outcome.INEXACT, work, None, stops, tuple(compared), step, tuple(diffs),
                   after_stop, final_step, tuple(final_diffs), tuple(causes),
                   tuple(sorted(unseeded)))


def cleanup(verdict: Verdict, keep: bool) -> None:
    """Remove the work directory of an exact check unless asked to keep it."""
    if verdict.outcome is Outcome.EXACT and not keep:
        shutil.rmtree(verdict.workdir, ignore_errors=True)
