"""The run's state: the parts its set-up built are frozen, its progress is its own, and the
shutdown steps return what they did instead of writing into a shared record."""

from __future__ import annotations

import dataclasses

import pytest

import kempner_resilience as kr
from kempner_resilience.config import ExitMode
from kempner_resilience.exitcodes import Ending, Facts
from kempner_resilience.runstate import Progress, RunParts, RunState
from kempner_resilience.shutdown import stages
from kempner_resilience.stop.signals import ShutdownHandler
from kempner_resilience.stop.teardown import TeardownStack
from kempner_resilience.stop.watchdog import HangWatchdog


def _state() -> RunState:
    cfg = kr.load_config(None)
    parts = RunParts(cfg, ShutdownHandler(cfg.signals), HangWatchdog(0),
                     TeardownStack(cfg.watchdog.cleanup_timeout_s), ExitMode.RAISE)
    return RunState(parts, Progress())


def test_the_parts_cannot_be_changed_after_they_were_built():
    parts = _state().parts
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.run_id = "another"          # type: ignore[misc]
    assert dataclasses.replace(parts, run_id="r1").run_id == "r1" and parts.run_id is None


def test_progress_moves_only_through_its_own_methods():
    progress = Progress()
    with pytest.raises(AttributeError):
        progress.step = 5                 # type: ignore[misc]
    progress.resumed(40, 1.5)
    assert progress.advance() == 41 and progress.step == 41
    progress.took("requeue_s", 0.25)
    assert progress.timings == {"resume_s": 1.5, "requeue_s": 0.25}
    assert progress.outcome is None
    progress.ended(Facts(Ending.COMPLETED, 41))
    assert progress.outcome.ending is Ending.COMPLETED


def test_the_teardown_step_returns_what_it_did_and_writes_nothing_into_the_state():
    state = _state()
    ran = []
    state.parts.teardown.add(lambda: ran.append("mine"), name="mine")
    done = stages.teardown(state, peers_alive=True)
    assert ran == ["mine"]
    assert [r.name for r in done.results][0] == "mine" and all(r.ok for r in done.results)
    assert done.seconds >= 0 and done.left_behind == ()
    assert state.progress.cleanup_results == [] and state.progress.timings == {}


def test_a_run_reads_its_step_and_timings_from_its_progress(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    with kr.ResilientRun(exit_mode="raise") as run:
        assert [s for s in run.steps(3)] == [0, 1, 2]
        assert run.step == 3 and run.start_step == 0 and run.resumed_from is None
    assert run.exit_code == 0 and run.run_id
