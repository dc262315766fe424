"""The likely cause of an inexact resume, read from what differs at the first step that differs.

The first diverging checkpoint says the most: later ones differ everywhere, because a different
update spreads through every weight. What differs there, and how many steps after the stop,
points at the usual traps:

- only the optimizer's learning rate, and no scheduler in the checkpoint: an LR scheduler not
  in ``state`` restarted at the resume (the optimizer's restored lr is right for one step, then
  the scheduler's own count sets another);
- a scheduler's own entries: it is in ``state`` but restored differently;
- the data position: the loader is not in ``state``, or batches were drawn outside the steps;
- RNG streams and generators, named by their path in the checkpoint: a global RNG drawn from
  where the checkpoint cannot see it (a batch drawn before the loop), a generator a state object
  saves drawn from differently;
- model and optimizer only, with the data position and RNG streams equal: the step trained on
  something the checkpoint does not hold, a variable carried from one step to the next. Right
  after the stop that is typically a prefetched batch; some steps after it, gradients
  accumulated over a window the stop cut (the optimizer steps only at the window's end);
- any of these before the first stop: the script does not repeat itself even uninterrupted.

Whether a script repeats itself is measured, not guessed: when the interrupted run differs,
``check.py`` runs the uninterrupted one a second time, and two straight runs that differ make
the verdict "not deterministic" (its own exit code) instead of a cause.

Two causes no checkpoint shows. A ``torch.Generator`` of the script's own left out of state
(noise drawn from it) restarts at a resume: only model and optimizer differ, as with a carried
batch. The run measures it (``checkpoint/generators.py`` names a generator of the script's that
the loop drew from and no save holds), and its warning takes the place of that guess.

The other: the script reads ``KEMPNER_RESTART_COUNT``, which the launcher
sets to each launch's number (0 in the uninterrupted run, 1, 2, ... after each resume). What
depends on it differs after a resume while nothing carried is missing from state, so the
checkpoints alone would point at a carried variable. The script's source says it: the files of
the command and the Python files beside them are searched for the name
(``restart_count_readers``), and a match is named first, in place of that guess.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Sequence

from kempner_resilience.checkpoint.generators import UNSAVED_GENERATOR
from kempner_resilience.checkresume.compare import EntryDiff
from kempner_resilience.checkresume.snapshot import Kind

__all__ = ["likely_causes", "restart_count_readers", "restart_count_cause", "own_dir_line",
           "CARRIED", "ACCUMULATED", "SCHEDULER", "NONDETERMINISTIC", "RESTART_COUNT_VAR",
           "RUN_SAID", "across_event_cause", "after_event_cause"]

#: What the launcher sets to each launch's number (``supervise/local/launcher.py``).
RESTART_COUNT_VAR = "KEMPNER_RESTART_COUNT"
# A script's directory is searched for the name: bounded, a large tree is not walked.
_MAX_FILES, _MAX_BYTES = 200, 4 << 20

CARRIED = ("a variable carried from one step to the next is not in state (a prefetched batch, "
           "accumulated gradients, a running value the update uses): the first step after the "
           "resume trained on something else than the uninterrupted run's step did. Everything "
           "the loop carries across steps goes in state (a custom object with state_dict() and "
           "load_state_dict()), or is recomputed at the top of each step (fetch the batch "
           "inside the loop, not at the end of the previous step)")
ACCUMULATED = ("a value the loop carries across steps is not in state, and it changed the update "
               "only later: a running value set outside the optimizer's state (a learning rate "
               "changed by hand at an epoch end or an eval, best_val_loss, a patience counter), "
               "or gradients accumulated over several steps and lost at the stop (model and "
               "optimizer then stay equal until the window's optimizer step). Put what the loop "
               "carries in state (an object with state_dict() and load_state_dict()), and stop "
               "only at a window's end")
SCHEDULER = ("an LR scheduler not in state: the resumed run's scheduler started again from its "
             "first step, so the optimizer's learning rate differs from the step after the "
             "resume on; put the scheduler in state={..., \"sched\": scheduler}")
NONDETERMINISTIC = ("the script does not repeat itself even uninterrupted (an unseeded "
                    "initialisation or RNG, nondeterministic kernels, data that depends on time "
                    "or order of arrival): seed it (torch.manual_seed, and random/numpy where "
                    "it draws from them) and make it deterministic so that a resume can be "
                    "checked")


def _script_files(command: Sequence[str], base: Path) -> list[Path]:
    """The files of ``command`` (a script, ``-m module``) and the Python files beside them;
    bounded."""
    scripts: list[Path] = []
    for i, arg in enumerate(command[1:], 1):
        path = base / arg
        if command[i - 1] == "-m":
            mod = base / arg.replace(".", "/")
            path = next((p for p in (mod.with_suffix(".py"), mod / "__main__.py")
                         if p.is_file()), path)
        if path.suffix == ".py" and path.is_file():
            scripts.append(path)
    return list(dict.fromkeys(scripts + sorted(
        p for s in scripts for p in s.parent.glob("*.py"))))[:_MAX_FILES]


def _read(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_BYTES)
    except OSError:
        return b""


def _shown(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def restart_count_readers(command: Sequence[str], cwd: str | os.PathLike[str] | None = None
                          ) -> list[str]:
    """The files of ``command`` (a script, ``-m module``) and the Python files beside them that
    name ``KEMPNER_RESTART_COUNT``, relative to ``cwd`` where they are under it; bounded."""
    base = Path(cwd or os.getcwd())
    return [_shown(path, base) for path in _script_files(command, base)
            if RESTART_COUNT_VAR.encode() in _read(path)]


def own_dir_line(command: Sequence[str], cwd: str | os.PathLike[str] | None = None
                 ) -> str | None:
    """Where the script sets its own ``checkpoint.dir``: ``train.py:12: cfg = ...``, the first
    line of its files naming ``checkpoint.dir`` (else one calling ``load_config`` with a path);
    None when no line says it."""
    base = Path(cwd or os.getcwd())
    fallback = None
    for path in _script_files(command, base):
        for n, line in enumerate(_read(path).decode(errors="replace").splitlines(), 1):
            code = line.split("#", 1)[0]
            where = f"{_shown(path, base)}:{n}: {line.strip()}"
            if "checkpoint.dir" in code or re.search(r"[\"']dir[\"']\s*:", code):
                return where
            if fallback is None and re.search(r"load_config\(\s*[^)\s]", code):
                fallback = where
    return fallback


def restart_count_cause(readers: Sequence[str]) -> str:
    """The cause when the script reads the launch's number (``readers``: where)."""
    return (f"the script reads {RESTART_COUNT_VAR} ({', '.join(readers[:3])}): the launcher "
            "sets it to the launch's number, 0 in the uninterrupted run and 1, 2, ... after "
            "each resume, so whatever depends on it (a seed, a learning rate, a data offset, a "
            "step count) differs after a resume, and no checkpoint can restore it. Derive such "
            "values from what the checkpoint restores (the step run.steps yields, state) "
            "instead")


#: The run's own warnings that measure a resume's inexactness (checkpoint/data.py,
#: loaderfit.py, carried.py, generators.py, trainers/hf.py): when the interrupted run said one,
#: it is the cause, word for word.
RUN_SAID = ("before the checkpoint was restored", "batches taken before the first step",
            "which no checkpoint saves", "without its own generator",
            "resumes from a checkpoint saved with another loader", "draws from a global RNG",
            "but is not in the state", "holds accumulated gradients",
            "starts the resumed epoch from its first batch", UNSAVED_GENERATOR)


_EVENT_STATE = ("A value the loop changes there and carries in a variable (a learning rate "
                "annealed at an epoch end or on a plateau, best_val_loss, a patience counter) "
                "restarts from its first value in the resumed process; an eval loader with "
                "persistent workers and no generator of its own draws its workers' seed from "
                "the global RNG at its first pass only, so the resumed process draws once more. "
                "Put such values in state (an object with state_dict() and load_state_dict()); "
                "give the eval loader generator=torch.Generator()")


def across_event_cause(events: str) -> str:
    """The cause when only the run stopped across ``events`` (an epoch end, a milestone)
    differs: the run stopped at the default steps, inside the epoch, resumed exactly."""
    return (f"state that changes at {events} is not in state: the run stopped at the chosen "
            f"steps resumed exactly, the one stopped after that event did not. {_EVENT_STATE}")


def after_event_cause(events: str, stop: int, step: int) -> str:
    """The cause when the first difference, at ``step``, follows the first occurrence of
    ``events`` (an eval the script named, an epoch end) in the process resumed at ``stop``,
    and the uninterrupted run had met it before ``stop`` too."""
    return (f"what {events} changes is not in state: the process resumed at step {stop} met "
            f"it again (it also came before the stop), and differs from step {step} on. "
            f"{_EVENT_STATE}")


def _rng_cause(keys: Iterable[str]) -> str:
    """The cause when RNG entries differ, naming them: a global stream (``rank0:rng.torch``) or
    a generator a state object saves (``rank0:objects.data.generators.0``)."""
    keys = sorted(keys)
    streams = [k for k in keys if k.split(":", 1)[-1].startswith("rng.")]
    owned = [k for k in keys if k not in streams]
    what = []
    if streams:
        what.append("the global RNG stream" + ("s " if len(streams) > 1 else " ")
                    + ", ".join(streams[:3]))
    if owned:
        objs = sorted({k.split(":", 1)[-1].split(".")[1] for k in owned
                       if k.split(":", 1)[-1].startswith("objects.")})
        what.append("the torch.Generator" + ("s" if len(owned) > 1 else "") + " of "
                    + ", ".join(f"state[{o!r}]" for o in objs) + f" ({', '.join(owned[:3])})")
    return (f"a torch.Generator (or RNG stream) the script draws from is not in state, or is "
            f"drawn from outside the steps: {' and '.join(what)} differ"
            + ("s" if len(keys) == 1 else "") + " after the resume. The resumed run drew "
            "random numbers the uninterrupted one did not, or in another order (a batch drawn "
            "before the loop or at start-up; a sampler, augmentation or noise drawn from a "
            "generator of its own): put every torch.Generator the loop draws from in state "
            "(state={..., \"noise\": generator}) and draw nothing outside run.steps")


def _names(diffs: Iterable[EntryDiff], kind: Kind) -> list[str]:
    return sorted({d.key for d in diffs if d.kind is kind})


def likely_causes(diffs: list[EntryDiff], step: int, stop: int | None,
                  has_scheduler: bool, restart_readers: Sequence[str] = (),
                  said: Sequence[str] = ()) -> list[str]:
    """The likely causes of ``diffs`` at ``step``, the first step that differs; ``stop`` is the
    last stop of the interrupted run before it (None: it differs before any stop);
    ``has_scheduler``: the checkpoints hold a scheduler's state; ``restart_readers``: the
    script's files that read ``KEMPNER_RESTART_COUNT`` (``restart_count_readers``); ``said``:
    the run's own warnings (``RUN_SAID``), which the caller passes on first."""
    if stop is None:
        return [NONDETERMINISTIC]
    causes = _from_entries(diffs, step, stop, has_scheduler)
    # The guess by elimination (model and optimizer only) gives way to what was measured: the
    # script's source reads the launch's number, or the run saw a generator of the script's,
    # which no checkpoint holds, drawn from in the loop.
    if restart_readers or any(UNSAVED_GENERATOR in m for m in said):
        causes = [c for c in causes if c != CARRIED and not c.startswith(ACCUMULATED)]
    return [restart_count_cause(restart_readers)] + causes if restart_readers else causes


def _from_entries(diffs: list[EntryDiff], step: int, stop: int,
                  has_scheduler: bool) -> list[str]:
    """The causes that what differs points at, the script's source aside."""
    kinds = {d.kind for d in diffs}
    causes = []
    if Kind.SCHEDULER in kinds:
        causes.append(f"the LR scheduler's state is restored differently ({', '.join(_names(diffs, Kind.SCHEDULER)[:3])}): "
                      "its load_state_dict() or the order of its steps after the resume")
    elif Kind.LR in kinds:
        causes.append(SCHEDULER if not has_scheduler else
                      "the optimizer's learning rate differs after the resume: something sets "
                      "it outside state (a schedule computed from a counter of its own)")
    if Kind.LOADER in kinds:
        causes.append("the data loader's position differs: the loader is not in state, or "
                      "batches were drawn outside run.steps (a batch fetched before the loop "
                      "or after the last step), or zip(loader, run.steps(n)) with the loader "
                      "first, which draws one batch more at every stop")
    if Kind.RNG in kinds:
        causes.append(_rng_cause(d.key for d in diffs if d.kind is Kind.RNG))
    if Kind.OBJECT in kinds:
        causes.append(f"the state of {', '.join(_names(diffs, Kind.OBJECT)[:3])} differs: "
                      "its state_dict() does not hold everything it carries across steps")
    if not causes and kinds <= {Kind.MODEL, Kind.OPTIMIZER}:
        causes.append(CARRIED if step - stop <= 1 else
                      f"{ACCUMULATED} (first difference {step - stop} steps after the stop)")
    if not causes:
        causes.append("bookkeeping entries differ: " + ", ".join(sorted(d.key for d in diffs)[:3]))
    return causes
