"""The cyclic garbage collector is held off over an emergency save and comes back as it was."""

from __future__ import annotations

import gc
import threading
import traceback
from pathlib import Path

from checkpoint_helpers import toy
from kempner_resilience.checkpoint import CheckpointManager
from kempner_resilience.config import CheckpointConfig
from kempner_resilience.core.gcpause import gc_paused


def test_an_emergency_save_runs_no_garbage_collection_and_leaves_the_collector_on(
        tmp_path: Path) -> None:
    state = toy.build(0)
    toy.train_step(state)
    mgr = CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt")), state)
    gc.collect()
    gc.set_threshold(1)                 # without the pause, nearly every allocation collects
    collections: list[str] = []        # where a collection ran inside the save's write

    def callback(phase: str, info: dict) -> None:
        saving = [f for f in traceback.extract_stack() if f.filename.endswith("saver.py")]
        if phase == "start" and saving:
            collections.append(f"{saving[-1].name}:{saving[-1].lineno}")

    gc.callbacks.append(callback)
    try:
        info = mgr.emergency_save(1)
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(700, 10, 10)
    assert info is not None and info.step == 1 and info.reason == "emergency"
    assert collections == []
    assert gc.isenabled()


def test_the_collector_comes_back_only_when_the_last_of_overlapping_pauses_ends() -> None:
    assert gc.isenabled()
    inner_done, outer_may_end = threading.Event(), threading.Event()
    seen: list[bool] = []

    def other_thread() -> None:
        with gc_paused():
            inner_done.set()
            outer_may_end.wait(10)

    with gc_paused():
        t = threading.Thread(target=other_thread)
        t.start()
        inner_done.wait(10)
    seen.append(gc.isenabled())         # ours ended, the other thread's has not
    outer_may_end.set()
    t.join(10)
    seen.append(gc.isenabled())
    assert seen == [False, True]


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
