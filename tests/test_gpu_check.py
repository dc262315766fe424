"""bench/gpu_check.py's verdicts, checked without a GPU against what its scenarios record.

The GPU check runs only where a GPU is lent, rarely; a verdict that cannot pass is found there
too late (one shipped that looked for "left on the gpu" in the text "no process left on the
GPU", and failed all four shutdown scenarios that had met their conditions).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod      # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("gpu_check", None)


@pytest.fixture
def clean(gc):
    return gc.GpuResidue(frozenset())


def test_a_scenario_that_left_nothing_on_the_gpu_is_clean_and_says_so(gc, clean):
    assert clean.clean
    assert str(clean) == "no process left on the GPU"


def test_a_process_left_on_the_gpu_is_not_clean_and_names_its_pid(gc):
    residue = gc.GpuResidue(frozenset({4242}))
    assert not residue.clean
    assert "4242" in str(residue)


def test_without_nvidia_smi_a_scenario_cannot_claim_the_gpu_is_free(gc):
    assert not gc.GpuResidue(None).clean


def test_exact_resume_passes_with_codes_0_75_0_and_equal_weights(gc):
    assert gc.exact_resume_ok([0, 75, 0], True)
    assert not gc.exact_resume_ok([0, 75, 0], False)
    assert not gc.exact_resume_ok([0, 1, 0], True)


def test_a_survivor_exiting_81_with_the_gpu_free_passes_the_peer_kill(gc, clean):
    assert gc.peer_killed_ok(81, clean)
    assert not gc.peer_killed_ok(1, clean)
    assert not gc.peer_killed_ok(81, gc.GpuResidue(frozenset({7})))


def test_ctrl_c_passes_with_both_ranks_130_one_emergency_checkpoint_and_nothing_killed(gc, clean):
    result = {"exit_codes": [130, 130], "interrupted": True, "killed": False}
    assert gc.ctrl_c_ok(0, result, ["step_000000003"], clean)
    assert not gc.ctrl_c_ok(0, {**result, "killed": True}, ["step_000000003"], clean)
    assert not gc.ctrl_c_ok(0, result, [], clean)
    assert not gc.ctrl_c_ok(0, {**result, "exit_codes": [130, 137]}, ["step_000000003"], clean)


def test_should_stop_passes_with_both_ranks_75_in_the_same_eval_batch(gc, clean):
    assert gc.should_stop_ok([75, 75], True, clean)
    assert not gc.should_stop_ok([75, 75], False, clean)
    assert not gc.should_stop_ok([75, 1], True, clean)


def test_a_sync_hang_passes_with_exit_42_and_the_stacks(gc, clean):
    assert gc.sync_hang_ok(42, True, clean)
    assert not gc.sync_hang_ok(42, False, clean)
    assert not gc.sync_hang_ok(None, True, clean)


def test_the_emergency_figure_is_read_from_the_line_the_bench_prints(gc):
    line = ("emergency save vs dd write+fsync: median 1.08x over 3 rounds (1.02, 1.08, 1.11); "
            "target >= 0.9")
    assert gc.emergency_median(["round 1: ...", line]) == pytest.approx(1.08)
    assert gc.emergency_ok([line])
    assert not gc.emergency_ok([line.replace("1.08x", "0.55x")])
    assert not gc.emergency_ok(["the bench crashed before its figures"])
