"""The run's state: the parts a run is made of and what happened so far, in one typed record.

The set-up sequence (``begin.begin``) builds it and fills it, one part per step; the loop
(``run.ResilientRun``) moves ``step`` and records the commits it makes; the shutdown sequence
(``shutdown/``) reads it and records how the run ended. The modules that use it import this
one, never each other, so the types point one way: this module names the parts' classes (under
``TYPE_CHECKING``: a run without state never imports torch) and imports nothing that imports it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from kempner_resilience.stop.agreement import StopAgreement
from kempner_resilience.config import ExitMode, ResilienceConfig
from kempner_resilience.exitcodes import Facts
from kempner_resilience.core.ledger import Ledger
from kempner_resilience.integrations.trackers import Trackers
from kempner_resilience.stop.signals import ShutdownHandler
from kempner_resilience.slurm.clock import RunClock
from kempner_resilience.stop.teardown import CleanupResult, TeardownStack
from kempner_resilience.stop.watchdog import HangWatchdog
from kempner_resilience.supervise.channel import Channel, report_now

if TYPE_CHECKING:
    from kempner_resilience.checkpoint.info import CheckpointInfo
    from kempner_resilience.checkpoint.manager import CheckpointManager
    from kempner_resilience.rescue.rescuer import Rescuer
    from kempner_resilience.slurm.env import SlurmJob

__all__ = ["RunState"]


@dataclass
class RunState:
    """What the loop and the shutdown work with; ``begin.begin`` builds and fills it."""

    config: ResilienceConfig
    handler: ShutdownHandler
    hang: HangWatchdog
    teardown: TeardownStack
    exit_mode: ExitMode
    agreement: StopAgreement = field(default_factory=StopAgreement)
    ledger: Ledger = field(default_factory=lambda: Ledger(None))   # rank 0's run ledger
    clock: RunClock = field(default_factory=lambda: RunClock(None))  # the allocation's end
    trackers: Trackers = field(default_factory=Trackers)  # told how the attempt ends (W&B)
    run_id: str | None = None
    loop_end_wall: float | None = None  # time.time() when steps() ran out of steps
    ckpt: CheckpointManager | None = None  # when the run has state
    rescue: Rescuer | None = None     # when the state is replicated (rescue/)
    slurm: SlurmJob | None = None     # inside a SLURM job
    last_saved: CheckpointInfo | None = None   # the newest commit by this process
    resumed_from: CheckpointInfo | None = None  # the checkpoint the run resumed from
    completed_step: int | None = None  # rank 0: the total a finished loop of this run reached
    start_step: int = 0
    step: int = 0                     # completed steps: the current step boundary
    timings: dict[str, float] = field(default_factory=dict)
    cleanup_results: list[CleanupResult] = field(default_factory=list)
    left_behind: list[str] = field(default_factory=list)  # what teardown could not end
    save_lost_peer: bool = False      # the emergency save failed because a rank is gone
    outcome: Facts | None = None      # how the run ended, once recorded (outcome.record)
    supervisor: Channel | None = None  # rank 0 under a supervisor: where it reports the run

    @property
    def rank(self) -> int:
        return self.agreement.rank

    def committed_step(self) -> int | None:
        info = self.last_saved or self.resumed_from
        return None if info is None else int(info.step)

    def saved(self, info: CheckpointInfo) -> None:
        """This process committed ``info`` (a periodic, manual, emergency or rescue save): the
        step a requeue comes back to."""
        self.last_saved = info
        self.tell_supervisor()

    def tell_supervisor(self, code: int | None = None) -> None:
        """Rank 0 under a supervisor (``supervise/channel.py``): which run this is (its resolved
        checkpoint.dir, run id, requeue settings), its committed step and, once it ended, its
        exit code. Never raises; nothing without a supervisor or without checkpoints."""
        if self.supervisor is None or self.ckpt is None:
            return
        report_now(self.supervisor, self.ckpt.root, run_id=self.run_id,
                   committed=self.committed_step(), code=code,
                   requeue=asdict(self.config.requeue))

