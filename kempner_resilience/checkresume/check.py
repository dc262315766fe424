"""``check-resume``: does this script resume exactly? Two runs of it, compared step by step.

The script runs twice on the same local ranks, each in a fresh checkpoint directory with a
commit at every step (``runs.py``): once straight to step ``steps`` (the reference), once stopped
at the ``interrupt_at`` steps by a real signal (or a SIGKILLed rank) and relaunched from its
checkpoint each time, as SLURM's requeue would, to the same step. Both end with a stop at
``steps`` (SIGTERM, a checkpoint), so a script written for a long job is checked in a few steps.
A resume is exact when every checkpoint of the interrupted run equals the reference's of the
same step, entry by entry and bitwise (``compare.py``). The first step that differs, what
differs there and how long after which stop, gives the likely cause (``diagnose.py``).
On 2+ ranks with the rescue on, one more run SIGKILLs the last rank at the first interrupt
and resumes from the survivors' rescue checkpoint (``_rescued``): the path a lost node takes.
"""

from __future__ import annotations

import enum
import shutil
import signal
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from kempner_resilience.checkpoint import MANIFEST_NAME
from kempner_resilience.checkresume.compare import EntryDiff, diff_snapshots, equal_values
from kempner_resilience.checkresume.coverage import (Plan, cover, covers, merge, met_after,
                                                      read_events)
from kempner_resilience.checkresume.diagnose import (NONDETERMINISTIC, RUN_SAID,
                                                      across_event_cause, after_event_cause,
                                                      likely_causes, own_dir_line,
                                                      restart_count_readers)
from kempner_resilience.checkresume.options import CheckOptions
from kempner_resilience.checkresume.runs import RunResult, run_script, warm_ranks
from kempner_resilience.checkresume.snapshot import Kind, Snapshot, read_snapshot
from kempner_resilience.exitcodes import ExitCode, for_signal_stop
from kempner_resilience.stop.rehearsal import OWN_DIR_REFUSED, PlannedStop, min_gap
from kempner_resilience.supervise.local.warm import Forker

__all__ = ["CheckOptions", "Outcome", "Verdict", "check_resume", "cleanup"]

#: How a NOT COVERED entry for the rescue begins (the others name an event).
RESCUE_NOT_COVERED = "a resume from the rescue"

# The stop that ends both runs at ``steps``: SIGTERM, whose action the run's config makes `stop`.
_FINAL = signal.SIGTERM


class Outcome(enum.Enum):
    """check-resume's answer, and its exit code."""

    EXACT = int(ExitCode.OK)
    INEXACT = int(ExitCode.RESUME_INEXACT)
    UNCHECKED = int(ExitCode.RESUME_UNCHECKED)
    NONDETERMINISTIC = int(ExitCode.RESUME_NONDETERMINISTIC)
    NOT_COVERED = int(ExitCode.RESUME_NOT_COVERED)


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
    unseeded: tuple[str, ...] = ()             # RNG streams left out: never drawn from
    how: str = ""                              # "stopped by SIGUSR1 at steps 3, 7", ...
    layouts: tuple[str, ...] = ()              # DDP bucket records that differ, not compared
    disk_bytes: int | None = None              # what the runs wrote under workdir
    also: str = ""                             # the run stopped across events, if one ran
    crossed: tuple[str, ...] = ()              # the events a stop crossed
    not_covered: tuple[str, ...] = ()          # NOT_COVERED: the events none crossed, and why
    notes: tuple[str, ...] = ()                # what an exact verdict still tells the user

    @property
    def code(self) -> int:
        return self.outcome.value


def _failure(run: RunResult, what: str, timeout_s: float, command: tuple[str, ...] = ()
             ) -> str | None:
    """Why ``run`` cannot be compared, or None (``command``: the script's, to quote its line
    that sets checkpoint.dir)."""
    if run.timed_out:
        return (f"the {what} run did not end within --timeout {timeout_s:g} s: its ranks were "
                "stopped (a step that hangs, or steps too slow for the budget); raise --timeout "
                "or lower --steps")
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
    if last.code == int(ExitCode.CONFIG) and OWN_DIR_REFUSED in run.log_text():
        line = own_dir_line(command)
        change = (f"; the line to change: {line}" if line else "")
        return (f"the script sets its own checkpoint.dir (its real run's), so it was refused "
                f"at its start, before its first step: nothing was written there{change}. "
                "Load the config with kr.load_config() (no path, no checkpoint.dir override: "
                "it reads $KEMPNER_RESILIENCE_CONFIG, which check-resume sets and a job script "
                "can set too) and give check-resume your settings with --config/--set")
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


def check_resume(opts: CheckOptions, zygote: Forker | None = None) -> Verdict:
    """Run both runs and compare them (main thread only: the launcher handles signals); the
    verdict says how much disk the runs used. ``zygote``: the warm-start process every run
    forks its ranks from (``runs.warm_ranks``, started by a caller that has not imported torch
    yet, so both imports run at once); None: one of the check's own, when the command can
    start warm."""
    work = opts.workdir or Path(tempfile.mkdtemp(prefix="kempner-check-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    if zygote is not None:
        verdict = _check(opts, work, zygote)
    else:
        with warm_ranks(opts.command, opts.ranks) as own:
            verdict = _check(opts, work, own)
    return replace(verdict, disk_bytes=_disk_use(work))


def _disk_use(root: Path) -> int:
    """Bytes of the files under ``root`` (the checkpoints and logs of every run)."""
    total = 0
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
        except OSError:
            continue
    return total


def _interrupted(opts: CheckOptions, common: dict, name: str, at: tuple[int, ...], end: int,
                 every: int) -> tuple[RunResult, tuple[int, ...], str | None]:
    """An interrupted run stopped at ``at`` and finally at ``end``; where its relaunches
    resumed; and why it cannot be compared (None: it can)."""
    kill = opts.kill_rank is not None
    interrupts = [PlannedStop(s, signal.SIGKILL, opts.kill_rank) if kill
                  else PlannedStop(s, opts.signum) for s in at]
    again = frozenset() if kill else frozenset({int(for_signal_stop(opts.signum))})
    # A killed rank's run commits only its stops: the survivors' rescue writes the killed step.
    got = run_script(list(opts.command), name=name, stops=interrupts + [PlannedStop(end, _FINAL)],
                     relaunches=len(interrupts), relaunch_codes=again,
                     every_steps=0 if kill else every, **common)
    problem = _failure(got, name, opts.timeout_s, opts.command)
    # Where each relaunch resumed: the stops as the checkpoints saw them (a killed rank's
    # launch reports no stop step of its own).
    stops = tuple(l.start_step for l in got.launches[1:] if l.start_step is not None)
    if problem is None and len(got.launches) < 2:
        problem = (f"the {name} run was never interrupted: it ended at step "
                   f"{max(got.committed)} before step {at[0]}; lower "
                   "--interrupt-at and --steps to fit the script's steps")
    # The survivors' own words say why when they tried (a peer that died inside a
    # gradient-accumulation window: the survivor stepped ahead to the window's all-reduce),
    # and the relaunch, with no rescue to resume from, met the same kill again.
    skipped = got.said(["rescue skipped:"])[:1] if kill else []
    missed = stops != at[:len(stops)] or problem is not None
    if kill and missed and (skipped or problem is None):
        why = (f"the run said: {skipped[0]}" if skipped else "rescue.enabled off, or a rank's "
               "state held by that rank alone, as with FSDP")
        problem = (f"after rank {opts.kill_rank} was killed at steps "
                   f"{', '.join(map(str, at))} the relaunches resumed from steps "
                   f"{', '.join(map(str, stops)) or 'none'}: the survivors wrote no rescue "
                   f"checkpoint ({why}); a lost rank then costs the steps since the last "
                   "checkpoint")
    return got, stops, problem


def _how(opts: CheckOptions, stops: tuple[int, ...], planned: tuple[int, ...]) -> str:
    at = ", ".join(map(str, stops))
    if opts.kill_rank is not None:
        return f"with rank {opts.kill_rank} SIGKILLed at step(s) {at}"
    moved = "" if stops == planned else (
        f" (planned at {', '.join(map(str, planned))}: a stop inside a gradient-"
        "accumulation window waits for the window's end)")
    return f"stopped by {signal.Signals(opts.signum).name} at step(s) {at}{moved}"


def _pace(run: RunResult, end: int) -> tuple[float, float]:
    """The run's seconds per step and per launch's start-up: a step's from the commit times
    of consecutive steps (the median, so a relaunch between two steps does not count), the
    start-up's from the rest of the run's wall time. A launch's start-up (Python, torch, the
    script's set-up) can be most of a short run, and is paid once per launch, not per step."""
    times = []
    for step, path in sorted(run.committed.items()):
        try:
            times.append((step, (path / MANIFEST_NAME).stat().st_mtime))
        except OSError:
            continue
    gaps = sorted((t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(times, times[1:])
                  if s1 > s0 and t1 >= t0)
    if not gaps:
        return run.wall_s / max(1, end), 0.0
    step_s = gaps[len(gaps) // 2]
    return step_s, max(0.0, run.wall_s - step_s * end) / max(1, len(run.launches))


def _check(opts: CheckOptions, work: Path, zygote: Forker | None = None) -> Verdict:
    """The runs and their comparison, in ``work``.

    The interrupted run goes first: a stop can land later than planned (one inside a
    gradient-accumulation window waits for the window's end), and the uninterrupted run then
    trains to where the interrupted one really ended, so every resume is compared. The
    events it saw or foresaw (an epoch end, a milestone: ``coverage.py``) that its stops did
    not cross get a second interrupted run, stopped across them, when the budget allows."""
    common = dict(work=work, ranks=opts.ranks, config=opts.config, timeout_s=opts.timeout_s,
                  zygote=zygote)
    got, stops, problem = _interrupted(opts, common, "interrupted", opts.interrupt_at,
                                       opts.steps, 1)
    if problem:
        return Verdict(Outcome.UNCHECKED, work, problem, stops)
    end = got.launches[-1].stop_step or max(got.committed)
    step_s, start_s = _pace(got, end)
    plan = cover(read_events([got.events_file]), stops, end, gap=min_gap(opts.ranks),
                 max_steps=opts.max_steps, step_s=step_s, start_s=start_s,
                 timeout_s=opts.timeout_s)
    # A checkpoint per step up to about twice the default window, then fewer: disk bounded.
    every = max(1, plan.end // (2 * opts.steps))
    # A divisor of the first run's end, so that the uninterrupted run commits that step too
    # and the first run's resumes are compared where they all crossed.
    every = max(d for d in range(1, min(every, end) + 1) if end % d == 0)
    across, across_stops, across_end = None, (), 0
    if plan.stops:
        across, across_stops, problem = _interrupted(opts, common, "across-events",
                                                     plan.stops, plan.end, every)
        if problem:
            return Verdict(Outcome.UNCHECKED, work, problem, stops)
        across_end = across.launches[-1].stop_step or max(across.committed)
    ref_end = max(end, across_end)
    ref = run_script(list(opts.command), name="uninterrupted",
                     stops=[PlannedStop(ref_end, _FINAL)], relaunches=0, every_steps=every,
                     **common)
    problem = _failure(ref, "uninterrupted", opts.timeout_s, opts.command)
    if problem:
        return Verdict(Outcome.UNCHECKED, work, problem, stops)
    cmp = _Comparer(ref)
    readers = restart_count_readers(opts.command)
    killed = opts.kill_rank is not None
    verdict = _compare(cmp, got, work, stops, _how(opts, stops, opts.interrupt_at),
                       killed=killed, readers=readers)
    if verdict.outcome is Outcome.EXACT and across is not None:
        events = ", ".join(e.words() for e in plan.crosses)
        other = _compare(cmp, across, work, across_stops,
                         f"{_how(opts, across_stops, plan.stops)} (across {events})",
                         killed=killed, readers=readers, across=True)
        if other.outcome is Outcome.INEXACT and other.after_stop in across_stops:
            said = [c for c in other.causes if c.startswith("the run said: ")]
            other = replace(other, causes=tuple(said + [across_event_cause(events)] + [
                c for c in other.causes if c not in said]))
        verdict = other if other.outcome is not Outcome.EXACT else replace(
            verdict, also=other.how, compared=tuple(sorted(set(verdict.compared) |
                                                           set(other.compared))),
            unseeded=tuple(sorted(set(verdict.unseeded) | set(other.unseeded))),
            layouts=tuple(sorted(set(verdict.layouts) | set(other.layouts))))
    missed: list[str] = []
    if verdict.outcome is Outcome.EXACT and _rescues(opts):
        verdict, missed = _rescued(opts, common, cmp, verdict, end, readers)
    if verdict.outcome is Outcome.EXACT:
        return _coverage(verdict, ref, [(got, stops, end), (across, across_stops, across_end)],
                         plan, missed)
    if verdict.outcome is not Outcome.INEXACT:
        return verdict
    # Does the script repeat itself? A second straight run says whether the difference is the
    # resume's or the script's own (unseeded, nondeterministic): only measured, never guessed.
    again = run_script(list(opts.command), name="uninterrupted-again",
                       stops=[PlannedStop(ref_end, _FINAL)], relaunches=0, every_steps=every,
                       **common)
    if _failure(again, "second uninterrupted", opts.timeout_s, opts.command) is not None:
        return verdict
    return _repeats(cmp, again, verdict)


def _rescues(opts: CheckOptions) -> bool:
    """Whether the default check also resumes from a rescue: 2+ ranks, the rescue on in the
    user's config, and no --kill-rank (whose run is that check already)."""
    rescue = opts.config.get("rescue") or {}
    return opts.ranks > 1 and opts.kill_rank is None and bool(rescue.get("enabled", True))


def _rescued(opts: CheckOptions, common: dict, cmp: _Comparer, verdict: Verdict, end: int,
             readers: list[str]) -> tuple[Verdict, list[str]]:
    """The run whose last rank is SIGKILLed at the first interrupt: the survivors write the
    rescue checkpoint, the relaunch resumes from it and trains to ``end`` (a step the
    uninterrupted run committed). Run only after an exact verdict (an inexact one is the
    answer already); its own verdict when it differs, or ``verdict`` with it noted; and what
    it could not cover (no rescue checkpoint written), for the NOT COVERED list."""
    killing = replace(opts, kill_rank=opts.ranks - 1)
    at = opts.interrupt_at[:1]
    got, stops, problem = _interrupted(killing, common, "rescued", at, end, 1)
    skipped = got.said(["rescue skipped:"])[:1]
    if problem is not None and skipped:
        # The survivors declined on purpose (a peer lost inside a gradient-accumulation
        # window, or inside Lightning's optimizer.step(closure)): a real lost rank then resumes
        # from the last committed checkpoint, the path the signal stops already proved exact.
        # The script is not at fault, so the verdict stays exact and says what a loss costs.
        note = (f"a lost rank is not rescued in this script: it costs the steps since the last "
                f"checkpoint (rank {killing.kill_rank} SIGKILLed at step {at[0]}; the run said: "
                f"{skipped[0]})")
        return replace(verdict, notes=verdict.notes + (note,)), []
    if problem is not None:
        return verdict, [f"{RESCUE_NOT_COVERED}, {_how(killing, at, at)}: {problem}"]
    how = _how(killing, stops, at)
    other = _compare(cmp, got, verdict.workdir, stops, how, killed=True, readers=readers)
    if other.outcome is not Outcome.EXACT:
        return other, []
    how += " and resumed from the survivors' rescue checkpoint"
    also = f"{verdict.also}, and the run {how}" if verdict.also else how
    return replace(verdict, also=also, compared=tuple(sorted(set(verdict.compared) |
                                                           set(other.compared)))), []


def _coverage(verdict: Verdict, ref: RunResult,
              runs: list[tuple[RunResult | None, tuple[int, ...], int]], plan: Plan,
              missed_too: Sequence[str] = ()) -> Verdict:
    """An exact ``verdict`` with the events its runs crossed, or NOT_COVERED naming those no
    run crossed (and ``missed_too``: a rescue not written): what the uninterrupted run saw
    first, then what the others saw or foresaw."""
    events = merge(read_events([ref.events_file]),
                   read_events([r.events_file for r, _, _ in runs if r is not None]))
    why = {e.kind: reason for e, reason in plan.beyond}
    crossed, missed = [], []
    for e in events:
        if any(r is not None and covers(e, s, end) for r, s, end in runs):
            crossed.append(e.words())
        else:
            missed.append(f"{e.words()}: " + why.get(e.kind, (
                f"no stop fell between it and its next occurrence"
                + (f" at step {e.second}" if e.second is not None else ""))))
    missed += list(missed_too)
    verdict = replace(verdict, crossed=tuple(crossed), not_covered=tuple(missed))
    return replace(verdict, outcome=Outcome.NOT_COVERED) if missed else verdict


def _idle_streams(ref: RunResult, cache: dict[tuple[str, int], Snapshot]) -> set[str]:
    """The RNG streams the loop never draws from: the same in the uninterrupted run's first and
    last checkpoints (an RNG state never comes back to where it was). Left unseeded (Python's,
    NumPy's in a torch script), they differ between two runs and mean nothing for training."""
    a, b = _snapshots(ref, cache, min(ref.committed)), _snapshots(ref, cache, max(ref.committed))
    return {k for k, kind in a.kinds.items() if kind is Kind.RNG and k in b.entries
            and equal_values(a.entries[k], b.entries[k])}


@dataclass
class _Walk:
    """Two runs' checkpoints compared step by step: what a walk found."""

    compared: list[int]
    first: tuple[int, list[EntryDiff]] | None = None
    left_out: set[str] = field(default_factory=set)     # idle RNG streams that differ
    layouts: set[str] = field(default_factory=set)      # DDP bucket records that differ


class _Comparer:
    """Compares runs against the uninterrupted one (``ref``), each checkpoint read once."""

    def __init__(self, ref: RunResult) -> None:
        self.ref = ref
        self.cache: dict[tuple[str, int], Snapshot] = {}
        self.idle = _idle_streams(ref, self.cache)

    def diff(self, got: RunResult, step: int, walk: _Walk) -> list[EntryDiff]:
        out = diff_snapshots(_snapshots(self.ref, self.cache, step),
                             _snapshots(got, self.cache, step))
        walk.left_out.update(d.key for d in out if d.key in self.idle)
        # Compared by what they determine (the gradients' sum, in the model and optimizer).
        walk.layouts.update(d.key for d in out if d.kind is Kind.LAYOUT)
        return [d for d in out if d.key not in self.idle and d.kind is not Kind.LAYOUT]

    def walk(self, got: RunResult) -> _Walk:
        """Every common step in order, up to the first that differs."""
        walk = _Walk([])
        for step in sorted(set(self.ref.committed) & set(got.committed)):
            walk.compared.append(step)
            diffs = self.diff(got, step, walk)
            if diffs:
                walk.first = (step, diffs)
                break
        return walk


def _compare(cmp: _Comparer, got: RunResult, work: Path, stops: tuple[int, ...], how: str, *,
             killed: bool, readers: list[str], across: bool = False) -> Verdict:
    """The two runs' checkpoints of every common step, in order, up to the first that differs;
    then the last one; then the likely cause (``readers``: the script's files that read
    KEMPNER_RESTART_COUNT; ``across``: the run stopped across events, whose cause the caller
    names)."""
    ref, cache = cmp.ref, cmp.cache
    walk = cmp.walk(got)
    compared = walk.compared
    final_step = max(set(ref.committed) & set(got.committed))
    if walk.first is None:
        return Verdict(Outcome.EXACT, work, None, stops, tuple(compared), final_step=final_step,
                       unseeded=tuple(sorted(walk.left_out)), how=how,
                       layouts=tuple(sorted(walk.layouts)))
    if final_step not in compared:
        compared.append(final_step)
    final_diffs = cmp.diff(got, final_step, walk)
    step, diffs = walk.first
    before = [s for s in stops if s < step]
    after_stop = before[-1] if before else None
    said = got.said(RUN_SAID)[:3]
    if killed and step in stops:
        causes = [f"the survivors' rescue checkpoint of step {step} (written after the rank was "
                  "killed) differs from the uninterrupted run's: state of the killed rank that "
                  "no survivor held (a per-rank object, its RNG streams) is missing or stale"]
    else:
        has_scheduler = any(k is Kind.SCHEDULER
                            for k in _snapshots(ref, cache, step).kinds.values())
        causes = likely_causes(diffs, step, after_stop, has_scheduler, readers, said)
        # An event the resumed process met again before the difference (an eval it left
        # best_val_loss out of state at, an epoch end): what the first one set shows there.
        met = met_after([ref.events_file, got.events_file], after_stop, step) \
            if after_stop is not None and not across else []
        if met:
            causes = [after_event_cause(", ".join(met), after_stop, step)] + list(causes)
    # What the resumed run measured itself comes first: its own warnings name the cause exactly.
    causes = [f"the run said: {m}" for m in said] + list(causes)
    return Verdict(Outcome.INEXACT, work, None, stops, tuple(compared), step, tuple(diffs),
                   after_stop, final_step, tuple(final_diffs), tuple(causes),
                   tuple(sorted(walk.left_out)), how, layouts=tuple(sorted(walk.layouts)))


def _repeats(cmp: _Comparer, again: RunResult, inexact: Verdict) -> Verdict:
    """``inexact``, or NONDETERMINISTIC when a second uninterrupted run (``again``) already
    differs from the first: then no resume can be judged against it."""
    walk = cmp.walk(again)
    if walk.first is None:
        return inexact
    step, diffs = walk.first
    return replace(inexact, outcome=Outcome.NONDETERMINISTIC, first_step=step,
                   first_diffs=tuple(diffs), after_stop=None, final_step=None, final_diffs=(),
                   causes=(NONDETERMINISTIC,), compared=tuple(walk.compared))


def cleanup(verdict: Verdict, keep: bool) -> None:
    """Remove the work directory of an exact check unless asked to keep it."""
    if verdict.outcome is Outcome.EXACT and not keep:
        shutil.rmtree(verdict.workdir, ignore_errors=True)
