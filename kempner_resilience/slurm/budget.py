"""Will the emergency save fit in the time SLURM leaves after its warning?

Checked at start-up (``ResilientRun``, rank 0) and by ``kempner-resilience doctor``. The inputs
are the state's size, the last measured save (its bytes and seconds, recorded in the checkpoint's
manifest) or, before any save, ``checkpoint.estimate``'s guess, and the job's ``--signal`` lead
time and ``KillWait``. ``save_budget`` is the whole computation, without any I/O.

The time model (sbatch(1), slurm.conf(5), and docs/slurm.md for what the test cluster did):

* With ``--signal=SIG@T`` the signal comes ``T`` to ``T + 60`` s before the time limit: SLURM may
  send it up to 60 s early (its limit checks run periodically), never late. So ``T`` is the worst
  case, and the jitter only adds time.
* At the limit SLURM sends SIGTERM, and SIGKILL ``KillWait`` later. The emergency save, the
  requeue and the teardown must all be done before the limit: a job SLURM is already ending is
  no job to requeue, and the SIGTERM moves the shutdown deadline to SIGTERM's grace. KillWait is
  the reserve for the exit, not time for the save.
* Without ``--signal`` that SIGTERM is the only warning: the save (no requeue) gets the smaller
  of KillWait and SIGTERM's grace.
* The signal's grace (``signals.grace_s``) bounds the whole shutdown: a save measured not to fit
  before the deadline minus ``checkpoint.save_margin_s`` is refused.
* When the allocation's end is known and ``requeue.time_limit_stop`` is on, the run stops on its
  own early enough for the estimated save (``slurm/clock.py``): a short lead is then covered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kempner_resilience.config import ResilienceConfig
from kempner_resilience.slurm.templates import (LIMIT_MARGIN_S, REQUEUE_TEARDOWN_S,
                                                requeue_signal, signal_lead_time)

__all__ = ["SaveFacts", "SaveBudget", "save_budget", "JITTER_S", "DEFAULT_KILL_WAIT_S"]

# SLURM sends --signal up to this much earlier than asked (sbatch(1)).
JITTER_S = 60
# slurm.conf's default KillWait, assumed when `scontrol show config` does not answer.
DEFAULT_KILL_WAIT_S = 30.0
_GIB = 2**30


@dataclass(frozen=True)
class SaveFacts:
    """What is known about the emergency save.

    ``save_s`` is the estimated save (``CheckpointManager.estimate``); ``measured`` says whether
    a measured save is behind it. ``state_bytes`` is the state's size, ``last_bytes`` and
    ``last_s`` the last committed save's size and duration (its manifest), when known.
    """

    save_s: float
    measured: bool = True
    state_bytes: int | None = None
    last_bytes: int | None = None
    last_s: float | None = None

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second of the last save, whole save (planning, fsyncs, commit) included."""
        if not self.last_bytes or not self.last_s or self.last_s <= 0:
            return None
        return self.last_bytes / self.last_s

    def describe(self) -> str:
        """``estimated save 15.0 s (state 12 GiB; last save 12 GiB in 12.0 s, 1 GiB/s)``."""
        parts = []
        if self.state_bytes is not None:
            parts.append(f"state {_gib(self.state_bytes)} GiB")
        bw = self.bandwidth
        if bw is not None:
            parts.append(f"last save {_gib(self.last_bytes or 0)} GiB in {self.last_s:.1f} s, "
                         f"{_gib(bw)} GiB/s")
        elif not self.measured:
            parts.append("no save measured yet: 100 MiB/s + 2 s assumed")
        detail = f" ({'; '.join(parts)})" if parts else ""
        return f"estimated emergency save {self.save_s:.1f} s{detail}"


@dataclass(frozen=True)
class SaveBudget:
    """The verdict. ``level`` is ``warn`` (the save may be lost) or ``info``; ``code`` names
    the case (docs/troubleshooting.md); ``ask_lead_s`` is the ``--signal`` lead to ask for."""

    level: str
    code: str
    fits: bool
    needed_s: float
    window_s: float
    ask_lead_s: int
    message: str
    fix: str = ""


def _gib(nbytes: float) -> str:
    return f"{nbytes / _GIB:.3g}"


def save_budget(config: ResilienceConfig, facts: SaveFacts, *, lead_s: int | None,
                signal: str | None = None, kill_wait_s: float | None = None,
                end_known: bool = False) -> SaveBudget:
    """Does the emergency save fit? ``lead_s`` None: the job has no ``--signal``.

    ``signal`` is the job's ``--signal`` (default: the config's requeue signal); ``kill_wait_s``
    None: unknown, ``DEFAULT_KILL_WAIT_S`` assumed; ``end_known``: the run knows when its
    allocation ends (then ``requeue.time_limit_stop`` can stop it in time on its own).
    """
    sig = signal or requeue_signal(config)
    short = sig.removeprefix("SIG")
    margin = config.checkpoint.save_margin_s
    save = max(float(facts.save_s), 0.0)
    ask = signal_lead_time(config, save)
    kw = DEFAULT_KILL_WAIT_S if kill_wait_s is None else float(kill_wait_s)
    kw_text = f"KillWait {kw:.0f} s" + ("" if kill_wait_s is not None else
                                         " (assumed: scontrol show config did not say)")
    covered = end_known and config.requeue.time_limit_stop
    numbers = facts.describe()
    ask_text = f"`#SBATCH --signal={short}@{ask}`"

    if lead_s is None:
        window = min(kw, config.signals.grace_for("SIGTERM"))
        needed = save + margin
        what = (f"{numbers} + checkpoint.save_margin_s {margin:.0f} s = {needed:.0f} s; without "
                f"--signal the time limit's SIGTERM is the only warning and SIGKILL comes "
                f"{kw_text} after it (SIGTERM grace {config.signals.grace_for('SIGTERM'):.0f} "
                f"s): {window:.0f} s")
        return _verdict(needed, window, ask, ask_text, what, covered,
                        "the emergency save does not fit after the time limit's SIGTERM",
                        "save-exceeds-killwait", "the emergency save cannot fit",
                        f"add {ask_text} (render a script with `kempner-resilience sbatch`)")

    needed = save + margin + REQUEUE_TEARDOWN_S
    window = float(lead_s)
    grace = config.signals.grace_for(sig)
    what = (f"{numbers} + checkpoint.save_margin_s {margin:.0f} s + requeue/teardown "
            f"{REQUEUE_TEARDOWN_S:.0f} s = {needed:.0f} s, against --signal={short}@{lead_s}: "
            f"{lead_s} s before the time limit at the latest (SLURM may send it up to "
            f"{JITTER_S} s earlier, never later; {kw_text} after the limit is for the exit, "
            "the requeue must come before it)")
    if save + margin > grace:
        # The grace to set, and the lead signal_lead_time asks for with that grace.
        g = math.ceil(needed)
        g_lead = g + math.ceil(LIMIT_MARGIN_S)
        return SaveBudget("warn", "save-exceeds-grace", False, needed, min(window, grace),
                          g_lead,
                          f"the emergency save cannot fit in the {sig} grace of {grace:.0f} s "
                          f"(signals.grace_s): {numbers} + checkpoint.save_margin_s {margin:.0f}"
                          " s; the save would be refused and the last committed checkpoint "
                          "stay the resume point",
                          f"set signals.grace_s (or signals.grace_per_signal_s.{sig}) to {g} "
                          f"or more and ask for `#SBATCH --signal={short}@{g_lead}`")
    return _verdict(needed, window, ask, ask_text, what, covered,
                    "the --signal lead is too short for the emergency save",
                    "signal-lead-short", "the emergency save cannot fit before the time limit",
                    f"ask for {ask_text}")


def _verdict(needed: float, window: float, ask: int, ask_text: str, what: str, covered: bool,
             short: str, warn_code: str, warn: str, fix: str) -> SaveBudget:
    """Fits; or does not, but the run's own time-limit stop covers it; or a warning."""
    if needed <= window:
        return SaveBudget("info", "save-fits", True, needed, window, ask,
                          f"the emergency save fits: {what}")
    if covered:
        return SaveBudget("info", "time-limit-stop-covers", False, needed, window, ask,
                          f"{short} ({what}), but the allocation's end is known and the run "
                          "stops on its own in time (requeue.time_limit_stop)",
                          f"ask for {ask_text} so the signal decides, not the fallback")
    return SaveBudget("warn", warn_code, False, needed, window, ask, f"{warn}: {what}", fix)
