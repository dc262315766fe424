"""The parts a run is made of, built once by its set-up sequence and then never changed.

``ResilientRun`` builds the first few (config, signal handler, hang watchdog, teardown stack,
exit mode); ``begin.begin`` returns a new ``RunParts`` with the rest, each from the return
value of the step that built it. Frozen: what changes while the run goes on is its progress
(``progress.py``), so a reader of the parts never wonders who else writes them. The parts'
classes are named under ``TYPE_CHECKING`` where importing them would import torch (a run
without state never does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kempner_resilience.config import ExitMode, ResilienceConfig
from kempner_resilience.core.ledger import Ledger
from kempner_resilience.integrations.trackers import Trackers
from kempner_resilience.slurm.clock import RunClock
from kempner_resilience.stop.agreement import StopAgreement
from kempner_resilience.stop.signals import ShutdownHandler
from kempner_resilience.stop.teardown import TeardownStack
from kempner_resilience.stop.watchdog import HangWatchdog
from kempner_resilience.supervise.rank import Channel

if TYPE_CHECKING:
    from kempner_resilience.checkpoint.info import CheckpointInfo
    from kempner_resilience.checkpoint.manager import CheckpointManager
    from kempner_resilience.rescue.rescuer import Rescuer
    from kempner_resilience.slurm.env import SlurmJob

__all__ = ["RunParts"]


@dataclass(frozen=True)
class RunParts:
    """What the loop and the shutdown work with; the defaults are a run not yet set up."""

    config: ResilienceConfig
    handler: ShutdownHandler
    hang: HangWatchdog
    teardown: TeardownStack
    exit_mode: ExitMode
    agreement: StopAgreement = field(default_factory=StopAgreement)
    # Rank 0's run ledger (another rank's records only its rescue); disowned, never replaced,
    # when another run takes the directory over (Ledger.disown).
    ledger: Ledger = field(default_factory=lambda: Ledger(None))
    clock: RunClock = field(default_factory=lambda: RunClock(None))  # the allocation's end
    trackers: Trackers = field(default_factory=Trackers)  # told how the attempt ends (W&B)
    run_id: str | None = None
    ckpt: CheckpointManager | None = None  # when the run has state
    rescue: Rescuer | None = None     # when the state is replicated (rescue/)
    slurm: SlurmJob | None = None     # inside a SLURM job
    supervisor: Channel | None = None  # rank 0 under a supervisor: where it reports the run
    resumed_from: CheckpointInfo | None = None  # the checkpoint the run resumed from
    start_step: int = 0               # the resumed checkpoint's step, or 0
    completed_step: int | None = None  # rank 0: the total a finished loop of this run reached
    # This attempt's token, the same on every rank of a distributed run with checkpoints (the
    # names of its forced-exit marker and of its ranks' endings); None otherwise.
    attempt_token: str | None = None

    @property
    def rank(self) -> int:
        return self.agreement.rank
