"""Stops at chosen steps, for ``kempner-resilience check-resume``: a rehearsal of a real stop.

``check-resume`` proves that a script resumes exactly by comparing a run interrupted at chosen
steps with an uninterrupted one. A signal sent from outside lands at whatever step the ranks
happen to be at when it arrives, so the same check could stop inside a gradient-accumulation
window once and at its end the next time, and give two verdicts for one script. Here the run
itself raises the signal at the step boundary of a chosen step, before the boundary's poll: the
stop is then agreed at exactly that step on every rank, through the same handler, agreement,
emergency save and exit code as a signal from SLURM that arrived just then.

The plan comes in ``$KEMPNER_RESILIENCE_REHEARSAL`` (set by check-resume for its ranks only):
``STEP:SIGNAL[@RANK]`` entries separated by commas, e.g. ``3:SIGUSR1,7:SIGUSR1,5:SIGKILL@1``.
Without ``@RANK`` every rank raises the signal (as SLURM signals every task); with it only that
rank (a SIGKILLed rank: the survivors' rescue and the relaunch after 81). A step fires only
when the loop reaches it by training, never at the step a launch resumed from: the relaunch
after the stop at step 3 starts at 3 and goes on to 7. A stop can land later than planned (one
inside a gradient-accumulation window waits for the window's end, ``run/window.py``): a launch
then makes the next stop planned past where it resumed, and one that resumed past them all
makes the last (the final stop) at once, so a moved stop never leaves the run to train on.

check-resume also names, in ``$KEMPNER_RESILIENCE_CHECK_DIR``, the checkpoint directory it gave
the run. A script that sets a ``checkpoint.dir`` of its own (a config file or override in code,
as the README's example does) would train its real run forward under check-resume's stops:
``refuse_other_dir`` stops such a run at its start, before anything is written there.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from kempner_resilience.stop.agreement import StopAgreement

__all__ = ["REHEARSAL_ENV", "CHECK_DIR_ENV", "EVENTS_ENV", "OWN_DIR_REFUSED", "PlannedStop", "parse",
           "encode", "planned", "due", "rehearse", "min_gap", "refuse_other_dir"]

#: The plan, in the ranks' environment (set by check-resume; unset in every real job).
REHEARSAL_ENV = "KEMPNER_RESILIENCE_REHEARSAL"
#: The checkpoint directory check-resume gave the run (unset in every real job).
CHECK_DIR_ENV = "KEMPNER_RESILIENCE_CHECK_DIR"
#: Where rank 0 writes the epoch ends and milestones it sees (``run/events.py``; check-resume only).
EVENTS_ENV = "KEMPNER_RESILIENCE_EVENTS"
#: The words that start the refusal, which check-resume looks for in rank 0's log.
OWN_DIR_REFUSED = "check-resume refused the script's own checkpoint.dir"


@dataclass(frozen=True)
class PlannedStop:
    """Raise ``signum`` at the boundary of ``step`` (steps done), on ``rank`` or every rank."""

    step: int
    signum: int
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"a planned stop's step must be >= 0, got {self.step}")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"a planned stop's rank must be >= 0, got {self.rank}")

    def text(self) -> str:
        """This entry as ``parse`` reads it."""
        rank = "" if self.rank is None else f"@{self.rank}"
        return f"{self.step}:{signal.Signals(self.signum).name}{rank}"


def _signum(name: str) -> int:
    name = name.strip().upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise ValueError(f"{name!r} is not a signal name") from None


def parse(text: str) -> tuple[PlannedStop, ...]:
    """``"3:USR1,7:SIGUSR1,5:KILL@1"`` -> the planned stops; ValueError names a bad entry."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        step, sep, rest = item.partition(":")
        name, at, rank = rest.partition("@")
        try:
            if not sep:
                raise ValueError("give STEP:SIGNAL[@RANK]")
            out.append(PlannedStop(int(step), _signum(name), int(rank) if at else None))
        except ValueError as e:
            raise ValueError(f"{REHEARSAL_ENV} entry {item!r}: {e}") from None
    return tuple(out)


def encode(stops: tuple[PlannedStop, ...] | list[PlannedStop]) -> str:
    """The environment value for ``stops``."""
    return ",".join(s.text() for s in stops)


def planned() -> tuple[PlannedStop, ...]:
    """This process's plan, read once when the loop starts (empty in every real job: the
    per-step path then pays one truth test, not an environment lookup)."""
    text = os.environ.get(REHEARSAL_ENV)
    return parse(text) if text else ()


def due(plan: tuple[PlannedStop, ...], start: int) -> tuple[PlannedStop, ...]:
    """The stops of ``plan`` a launch that resumed at ``start`` is to make: the next planned
    step past ``start``, or, when the launch resumed past every planned step (a stop that waited
    for a gradient-accumulation window's end landed there), the last planned step, made at
    once: the final stop is never skipped, so the run still ends."""
    ahead = [s for s in plan if s.step > start] or [s for s in plan
                                                    if s.step == plan[-1].step]
    first = min((s.step for s in ahead), default=None)
    return tuple(s for s in ahead if s.step == first)


def rehearse(plan: tuple[PlannedStop, ...], step: int, start: int,
             agreement: StopAgreement) -> None:
    """At the boundary of ``step`` of a launch that started at ``start`` (its resumed step):
    raise this rank's signal of the launch's due stop (``due``), if any. ``signal.raise_signal``
    runs the Python handler before it returns, so the boundary's poll that follows already sees
    the stop request. Several ranks agree on a stop ``lead_steps`` after the boundary that saw
    the signal (``agreement.py``): the signal is raised that much earlier, so the stop lands on
    the planned step. A SIGKILL needs no agreement and comes at the planned step itself. A
    planned step the launch started too late for is raised at its first step, once."""
    if step <= start:
        return
    lead = agreement.lead_steps if agreement.distributed else 0
    for stop in due(plan, start):
        early = 0 if stop.signum == signal.SIGKILL else lead
        if max(stop.step - early, start + 1) == step and stop.rank in (None, agreement.rank):
            signal.raise_signal(stop.signum)


def min_gap(world_size: int) -> int:
    """The fewest steps between the start of a launch and a planned stop that can land on its
    step (the signal is raised ``lead`` steps before it, after the launch's first step)."""
    return 1 + (StopAgreement().lead_steps if world_size > 1 else 0)


def refuse_other_dir(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Under check-resume, raise ``ConfigError`` (exit 78) when the run's resolved
    ``checkpoint_dir`` is not the one check-resume gave it: the script set its own, and the
    check would write into (and train forward) the real run. Nothing is written before this."""
    given = os.environ.get(CHECK_DIR_ENV)
    if not given:
        return
    mine = Path(checkpoint_dir).expanduser()
    if mine.resolve() == Path(given).resolve():
        return
    from kempner_resilience.config.errors import ConfigError

    raise ConfigError([("checkpoint.dir", (
        f"{OWN_DIR_REFUSED} ({mine}), not the directory check-resume gave it ({given}); "
        "nothing was written there. Load the config with kr.load_config() (no path, no "
        "checkpoint.dir override: it reads $KEMPNER_RESILIENCE_CONFIG, which check-resume sets, "
        "and a job script can set too) and give check-resume your file and overrides with "
        "--config/--set"))])
