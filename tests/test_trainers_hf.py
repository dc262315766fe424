"""The Hugging Face Trainer under `kempner-resilience torchrun`: a ``Trainer.train()`` script
written the library's documented way, adopted with ``ResilientTrainer``, on two gloo ranks.
Signals go where a user's go: USR1 and SIGTERM to the launcher (what ``--signal=B:USR1`` and
a preemption send), Ctrl+C to its whole process group (a terminal). One uninterrupted run is
the reference for the module.
"""

from __future__ import annotations

import sys

import pytest

from helpers import buddy_ring_of_two, require
from trainers_helpers import (SCRIPTS, assert_same_final, committed_steps, interrupt,
                              kill_held, last_steps, run_to_end, signal, write_config)
from kempner_resilience.exitcodes import ExitCode

require("transformers")

STEPS = 40        # 16 batches an epoch on each rank: the stops fall mid-epoch


def _launch(work, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kempner_resilience.cli", "torchrun", "--standalone",
            "--nproc-per-node=2", str(SCRIPTS / "hf_train.py"), "--steps", str(STEPS),
            "--out", str(work / "final.pt"), "--progress", str(work / "progress"), *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    work = tmp_path_factory.mktemp("hf_reference")
    code, out = run_to_end(work, _launch(work, "--step-s", "0"))
    assert code == 0, out[-4000:]
    return work / "final.pt"


def test_sigterm_ctrl_c_and_usr1_each_stop_every_rank_at_one_step_with_its_code_and_the_run_resumes_bitwise(
        tmp_path, reference):
    # enable_jit_checkpoint on: its SIGTERM handling is taken over (no late save of its own)
    cmd = _launch(tmp_path, "--jit")
    stops = [(6, signal.SIGTERM, False, 143), (17, signal.SIGINT, True, 130),
             (29, signal.SIGUSR1, False, int(ExitCode.REQUEUE))]
    for at, signum, group, expected in stops:
        code, out = interrupt(tmp_path, cmd, at, signum, group)
        assert code == expected, out[-4000:]
        last = last_steps(tmp_path / "progress")
        assert last[0] == last[1], last                          # one step on every rank
        assert committed_steps(tmp_path)[-1] == last[0] + 1, out[-4000:]
        assert "Traceback" not in out, out[-4000:]
        assert not (tmp_path / "final.pt").exists()      # train() did not return as if done
    assert not (tmp_path / "hf_out").exists() or not list((tmp_path / "hf_out").glob("checkpoint-*"))
    code, out = run_to_end(tmp_path, cmd)
    assert code == 0, out[-4000:]
    assert "resumed from" in out
    assert_same_final(reference, tmp_path / "final.pt")


def test_a_rank_sigkilled_mid_run_is_rescued_at_the_last_step_boundary_and_the_relaunch_ends_bitwise(
        tmp_path, reference):
    write_config(tmp_path, every_steps=5)
    cmd = _launch(tmp_path, "--step-s", "0")        # the hold, not the step time, times the kill
    # Rank 1 dies as step 12 begins, before its forward pass; rank 0's gradient all-reduce
    # then fails, outside an optimizer step: its state is still the boundary of step 12.
    code, out = kill_held(tmp_path, cmd, 12)
    assert code == int(ExitCode.PEER_LOST), out[-4000:]
    assert "rescue: committed step 12" in out, out[-4000:]
    assert committed_steps(tmp_path)[-1] == 12                 # newer than the periodic 10
    code, out = run_to_end(tmp_path, cmd)
    assert code == 0, out[-4000:]
    assert "(step 12, reason rescue)" in out, out[-4000:]
    assert_same_final(reference, tmp_path / "final.pt")


def _tiny_trainer(tmp_path, **args):
    """A Trainer of a one-layer GPT-2 built from a config, in-process."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=4, n_embd=8, n_layer=1,
                                       n_head=1, bos_token_id=0, eos_token_id=0))
    ids = torch.zeros(4, dtype=torch.long)
    return Trainer(model, train_dataset=[{"input_ids": ids, "labels": ids}] * 4,
                   args=TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2,
                                          use_cpu=True, report_to=[], **args))


def test_the_trainers_jit_checkpoint_is_taken_over_its_sigterm_handler_and_callback_removed(tmp_path):
    from kempner_resilience.trainers.hf import ResilientTrainer

    before = signal.getsignal(signal.SIGTERM)
    trainer = _tiny_trainer(tmp_path, enable_jit_checkpoint=True)
    try:
        assert signal.getsignal(signal.SIGTERM) != before      # the Trainer's own handler
        run = ResilientTrainer({"checkpoint": {"dir": str(tmp_path / "ckpt")}}, trainer)
        assert signal.getsignal(signal.SIGTERM) == before
        names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
        assert "JITCheckpointCallback" not in names
        assert run.max_steps == 2 and trainer.optimizer is not None
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_resume_from_the_trainers_own_checkpoint_is_refused_and_nothing_is_written(tmp_path):
    from kempner_resilience.trainers.hf import ResilientTrainer

    run = ResilientTrainer({"checkpoint": {"dir": str(tmp_path / "ckpt")}},
                           _tiny_trainer(tmp_path))
    with pytest.raises(ValueError, match="resumes from the run's own checkpoint"):
        run.train(resume_from_checkpoint=True)
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step_*"))


def _trainers_own_json(trainer) -> str:
    """The ``TrainerState`` JSON the Trainer's own checkpoint writes."""
    import copy
    import json
    from dataclasses import asdict

    from transformers.trainer_callback import ExportableState

    state = copy.deepcopy(trainer.state)
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, ExportableState):
            state.stateful_callbacks[cb.__class__.__name__] = cb.state()
    return json.dumps(asdict(state), sort_keys=True)


def test_the_trainer_state_in_each_step_snapshot_is_the_json_the_trainers_checkpoint_holds_as_the_log_grows(
        tmp_path):
    import copy
    import json
    from dataclasses import asdict

    from transformers.trainer_callback import ExportableState

    from kempner_resilience.rescue.boundary import decode, encode
    from kempner_resilience.trainers.hf import TrainerProgress

    trainer = _tiny_trainer(tmp_path, logging_steps=1, logging_strategy="steps")
    trainer.train()

    def trainers_own() -> str:
        return _trainers_own_json(trainer)

    progress = TrainerProgress(trainer)

    def snapshot() -> str:           # what the step's rescue snapshot gives back
        return decode(encode(0, {"trainer": progress}))["objects"]["trainer"]["json"]

    history = trainer.state.log_history
    assert len(history) >= 2
    for entry in ({"loss": 0.5, "step": 3}, {"eval_loss": 0.25, "note": 'a "log_history": []'},
                  None):
        before = trainers_own()
        assert progress.state_dict()["json"] == before == snapshot()
        assert trainer.state.log_history is history and trainers_own() == before   # untouched
        if entry is not None:
            history.append(entry)
    history[-1]["epoch"] = 9.0               # the newest line changed after it was written
    assert progress.state_dict()["json"] == trainers_own() == snapshot()
    trainer.state.log_history = history[:1]  # a new list: written whole
    assert progress.state_dict()["json"] == trainers_own() == snapshot()


def test_a_long_log_history_goes_to_the_buddy_once_and_the_buddys_copy_is_the_trainers_json(
        tmp_path):
    import json
    import time

    from kempner_resilience.rescue.boundary import decode, encode_parts
    from kempner_resilience.trainers.hf import TrainerProgress

    trainer = _tiny_trainer(tmp_path)
    progress = TrainerProgress(trainer)
    history = trainer.state.log_history
    woken: list[str] = []
    sender, buddy = buddy_ring_of_two(woken)
    sent = []
    try:
        for step in range(1, 2001):   # a log line every step, 2,000 steps
            history.append({"loss": 1.0 / step, "learning_rate": 1e-3, "step": step,
                            "grad_norm": 0.5})
            payload, chunks = encode_parts(step, {"trainer": progress})
            sender.send(step, payload, chunks)
            sent.append(len(payload))
            # Paced as a training loop is: a sender faster than its buddy reads gives it up.
            deadline = time.monotonic() + 30
            while not (buddy.held() and buddy.held()[0].step == step) \
                    and time.monotonic() < deadline:
                time.sleep(0.0002)
        whole = buddy.held()[0].whole()
    finally:
        sender.close()
        buddy.close()
    assert decode(whole)["objects"]["trainer"]["json"] == _trainers_own_json(trainer)
    history_bytes = len(json.dumps(history))
    assert history_bytes > 150_000
    # Each step's snapshot holds the newest lines, not the whole history, and the lines
    # written before went to the buddy once.
    assert max(sent[-500:]) < 40_000
    # (the rest of what went to the buddy: frame headers and chunk ids, and the sealed chunks)
    assert sender.sent_bytes - sum(sent) < 2 * history_bytes
    assert woken == []
