"""A Hugging Face Trainer script written the library's documented way, adopted in two marked
lines (the import, and ``ResilientTrainer(...).train()`` in place of ``trainer.train()``).
A tiny GPT-2 built from a config (no download). Rank 0 saves the final model, optimizer,
scheduler, RNG and loop position to --out; each step is a line in --progress
(``rank R step S``). Config: $KEMPNER_RESILIENCE_CONFIG."""

import argparse
import os
import sys
import time

PLAIN = "--plain" in sys.argv       # the script as it was before (bench/trainers_bench.py)
if not PLAIN:
    import kempner_resilience as kr                                   # first, before torch
    from kempner_resilience.trainers.hf import ResilientTrainer       # marked
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments, set_seed)

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--out")
ap.add_argument("--progress")
ap.add_argument("--step-s", type=float, default=0.05)
ap.add_argument("--jit", action="store_true", help="TrainingArguments(enable_jit_checkpoint)")
ap.add_argument("--ignore-data-skip", action="store_true",
                help="TrainingArguments(ignore_data_skip): a resumed epoch starts again")
ap.add_argument("--plain", action="store_true", help="without the package: trainer.train()")
ap.add_argument("--times", help="rank 0 appends each step's end (time.perf_counter) here")
ap.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps")
ap.add_argument("--hold", help="as step --hold-at begins, wait while this file exists (at most "
                "300 s): after the boundary of the steps before, before the step's collectives")
ap.add_argument("--hold-at", type=int, default=8)
args = ap.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (128, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Progress(TrainerCallback):
    def on_step_begin(self, targs, state, control, **kw):
        if args.hold and state.global_step == args.hold_at:
            if args.progress:
                with open(args.progress, "a") as f:
                    f.write(f"rank {targs.process_index} holds at {state.global_step} "
                            f"pid {os.getpid()}\n")
            deadline = time.monotonic() + 300
            while os.path.exists(args.hold) and time.monotonic() < deadline:
                time.sleep(0.05)

    def on_step_end(self, targs, state, control, **kw):
        time.sleep(args.step_s)
        if args.progress:
            with open(args.progress, "a") as f:
                f.write(f"rank {targs.process_index} step {state.global_step - 1}\n")
        if args.times and targs.process_index == 0:
            with open(args.times, "a") as f:
                f.write(f"{time.perf_counter()}\n")


set_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                   n_head=2, bos_token_id=0, eos_token_id=0))
targs = TrainingArguments(output_dir="hf_out", max_steps=args.steps, per_device_train_batch_size=4,
                          learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=5,
                          save_strategy="no", report_to=[], logging_strategy="no",
                          disable_tqdm=True, use_cpu=True, seed=0,
                          ddp_find_unused_parameters=False,
                          enable_jit_checkpoint=args.jit,
                          ignore_data_skip=args.ignore_data_skip,
                          eval_strategy="steps" if args.eval_every else "no",
                          eval_steps=args.eval_every or None)
trainer = Trainer(model, args=targs, train_dataset=Tokens(), callbacks=[Progress()],
                  eval_dataset=Tokens() if args.eval_every else None)
if PLAIN:
    trainer.train()
else:
    ResilientTrainer(None, trainer).train()                            # marked: was trainer.train()

if trainer.args.process_index == 0 and args.out:
    torch.save({"model": trainer.model.state_dict(), "optim": trainer.optimizer.state_dict(),
                "sched": trainer.lr_scheduler.state_dict(), "rng": torch.get_rng_state(),
                "step": trainer.state.global_step, "epoch": trainer.state.epoch}, args.out)
