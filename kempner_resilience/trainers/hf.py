"""The Hugging Face ``Trainer``: a ``Trainer.train()`` script under ``ResilientRun`` in three lines.

```python
from kempner_resilience.trainers.hf import ResilientTrainer                  # +1
trainer = Trainer(model, args=TrainingArguments(...), train_dataset=ds)
ResilientTrainer(cfg, trainer).train()                                       # +2 (was trainer.train())
```

Why the run drives the Trainer's loop from a callback and resumes through the Trainer's own
``resume_from_checkpoint``: the Trainer works out which epoch and batch to resume from (locals
of its loop) before any callback runs, so a callback alone cannot resume the data position.
Here the Trainer's own skip does it, fed from the run's verified checkpoint:

* The optimizer and scheduler are created before ``train()`` (``create_optimizer``,
  ``create_scheduler``, as the Trainer would), so the run's state holds the model, the
  optimizer, the scheduler, the scaler, and the Trainer's ``TrainerState`` (``global_step``,
  epoch, logs, stateful callbacks); the run resumes them when it is entered.
* After a resume, each rank writes a folder holding only what the Trainer reads to find its
  data position: ``trainer_state.json`` and its RNG file, both from the run's checkpoint. It is
  passed as ``resume_from_checkpoint``: the Trainer skips the trained batches of the epoch and
  puts the RNG back after the skip. Its loaders of weights, optimizer and scheduler are switched
  off meanwhile (the run already loaded them, checked against the manifest).
* A callback's ``on_step_end`` is the run's step boundary (``run.steps``): heartbeat,
  periodic save, and the stop agreed on every rank. A stop saves there and raises
  ``SystemExit`` with the documented code, out of ``train()``: a script's "final" save after
  ``train()`` never runs on a stopped run.
* ``TrainingArguments(ignore_data_skip=True)`` is the user's choice (no skip: a faster
  resume of a large epoch), and a resume says that it is not exact: the resumed epoch starts
  again from its first batch.
* ``TrainingArguments(enable_jit_checkpoint=True)`` is taken over: its SIGTERM handler and
  callback are removed, and SIGTERM stops at the step boundary like the other signals.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, fields as dataclass_fields, is_dataclass
from pathlib import Path
from typing import Any, Mapping

from kempner_resilience.config import ExitMode, ResilienceConfig
from kempner_resilience.core.log import announce, get_logger
from kempner_resilience.rescue.chunks import GrowingText
from kempner_resilience.run.resilient import ResilientRun

__all__ = ["ResilientTrainer", "TrainerProgress"]

log = get_logger(__name__)

_STATE_FILE = "trainer_state.json"     # transformers.trainer.TRAINER_STATE_NAME
_EMPTY = GrowingText()                 # never appended to


class TrainerProgress:
    """The Trainer's ``TrainerState`` as an entry of the run's state: where the loop is
    (``global_step``, ``epoch``), its log history, and its stateful callbacks' state (as the
    Trainer's own checkpoint writes them)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.loaded: str | None = None     # the JSON a resume restored
        # The log history written so far: (the list, entries written, the last one written),
        # and those entries' JSON.
        self._history: tuple[list[Any], int, Any] | None = None
        self._text = GrowingText()

    def state_dict(self) -> dict[str, Any]:
        """The ``TrainerState`` as JSON, with the stateful callbacks' state as the Trainer's own
        checkpoint merges it."""
        head, history, tail = self._json()
        return {"json": head + history.value(tail[0]) + tail[1]}

    def snapshot_state(self) -> dict[str, Any]:
        """``state_dict()`` for the step's rescue snapshot (at every step boundary): the same
        JSON, but the log history written at earlier steps goes in as sealed chunks, which the
        buddy link sends once (``rescue.chunks``)."""
        head, history, tail = self._json()
        return {"json": history.parts(head, tail[0] + tail[1])}

    def _json(self) -> tuple[str, GrowingText, tuple[str, str]]:
        """The JSON in three parts: up to the log history's first entry, the history's entries
        but the last (each followed by ", "), and (the last entry, the rest). Written straight
        from the live fields, not from a deep copy and ``asdict`` (80 of the 90 us this took);
        the live state is not changed."""
        from transformers.trainer_callback import ExportableState

        t = self.trainer
        state = t.state
        fields = {f.name: getattr(state, f.name) for f in dataclass_fields(state)}
        callbacks = dict(state.stateful_callbacks)
        for cb in [*t.callback_handler.callbacks, t.control]:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(callbacks.get(name), list):
                    callbacks[name] = [*callbacks[name], cb.state()]
                else:
                    callbacks[name] = cb.state()
        fields["stateful_callbacks"] = callbacks
        history = fields["log_history"]
        if not isinstance(history, list) or not history:
            return json.dumps(fields, sort_keys=True, default=_as_json), _EMPTY, ("", "")
        fields["log_history"] = []
        text = json.dumps(fields, sort_keys=True, default=_as_json)
        # The key's first match: a string holding it would have its quotes escaped.
        at = text.index('"log_history": [') + len('"log_history": [')
        return text[:at], self._written(history), \
            (json.dumps(history[-1], sort_keys=True, default=_as_json), text[at:])

    def _written(self, history: list[Any]) -> GrowingText:
        """The log history's entries but the last, as JSON (each followed by ", ", as
        ``json.dumps`` joins a list's items). The Trainer only appends to it, so the entries
        written at an earlier step are kept and only the new ones written (about 5 us each
        here). The last entry is always written again (a callback may still add to the newest
        line), and a list replaced or cut short is written whole."""
        done = 0
        if self._history is not None:
            lst, done, last = self._history
            if lst is not history or done > len(history) - 1 or \
                    (done and history[done - 1] is not last):
                done = 0
                self._text.clear()
        for e in history[done:len(history) - 1]:
            self._text.append(json.dumps(e, sort_keys=True, default=_as_json) + ", ")
        done = len(history) - 1
        self._history = (history, done, history[done - 1] if done else None)
        return self._text

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.loaded = str(sd["json"])

    @property
    def global_step(self) -> int:
        return int(json.loads(self.loaded)["global_step"]) if self.loaded else 0


def _boundary_callback(run: "ResilientTrainer") -> Any:
    """The callback that makes each optimizer step of the Trainer a step of the run (a
    ``TrainerCallback``, defined here: transformers is imported only when it is used)."""
    from transformers import TrainerCallback

    class RunBoundary(TrainerCallback):
        # The Trainer logs, evaluates and saves a step's results after its on_step_end. The
        # step's boundary (a stop's checkpoint, the rescue's mark) waits until they are done,
        # or a resume from it would skip them: an eval draws the loader's seed from the global
        # RNG and appends to log_history, so the resumed run would train on a different RNG.
        pending = False

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            run._loop_begins(state)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if control.should_log or control.should_evaluate or control.should_save:
                self.pending = True
            else:
                self._boundary(control)

        def _boundary(self, control: Any) -> None:
            self.pending = False
            if run._boundary():        # all steps ran: the Trainer ends by itself
                control.should_training_stop = True

        def _after(self, control: Any) -> None:
            # The CallbackHandler clears each flag before its event: none left, all done.
            if self.pending and not (control.should_log or control.should_evaluate
                                     or control.should_save):
                self._boundary(control)

        def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._after(control)

        def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # An eval changes what the Trainer carries (best_metric, early stopping's
            # patience): check-resume stops across one (run.event; a real job ignores it).
            run.event("eval")
            self._after(control)

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._after(control)

        # A flag the Trainer left set without acting on it (a log with nothing new): the
        # boundary is taken at the next event of the loop at the latest.
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.pending:
                self._boundary(control)

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.pending:
                self._boundary(control)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.pending:
                self._boundary(control)

    return RunBoundary()


class ResilientTrainer(ResilientRun):
    """``ResilientRun`` for a script that trains with ``transformers.Trainer``.

    Args:
        config: as for ``ResilientRun`` (a ``ResilienceConfig``, a YAML path, a mapping, or
            None for the defaults / ``$KEMPNER_RESILIENCE_CONFIG``).
        trainer: the script's ``Trainer``, built and not trained yet.
        overrides, exit_mode, run_id: as for ``ResilientRun``.

    Call ``train()`` in place of ``trainer.train()``: it returns the Trainer's ``TrainOutput``
    when every step ran, and raises ``SystemExit`` with the documented code after a stop.
    """

    def __init__(self, config: ResilienceConfig | str | os.PathLike[str] | Mapping[str, Any]
                 | None, trainer: Any, *, overrides: tuple[str, ...] = (),
                 exit_mode: ExitMode | str | None = None, run_id: str | None = None) -> None:
        if not all(hasattr(trainer, a) for a in ("train", "args", "callback_handler")):
            raise TypeError(f"trainer must be a transformers.Trainer, not a "
                            f"{type(trainer).__name__}")
        if trainer.model_init is not None:
            raise ValueError("a Trainer with model_init builds its model inside train(), after "
                             "the run resumed the state: pass the model to Trainer(model=...)")
        self.trainer = trainer
        self.progress = TrainerProgress(trainer)
        self._took_over_jit = self._take_over_jit_checkpoint()
        self.max_steps = self._create_optimizer_and_scheduler()
        state: dict[str, Any] = {"model": trainer.model, "optim": trainer.optimizer,
                                 "sched": trainer.lr_scheduler, "trainer": self.progress}
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        self._loop: Any = None
        super().__init__(config, state, overrides=overrides, exit_mode=exit_mode,
                         run_id=run_id)

    # ------------------------------------------------------------------ set-up

    def _take_over_jit_checkpoint(self) -> bool:
        """``enable_jit_checkpoint``: its SIGTERM handler put back and its callback removed,
        so the run's handler gets SIGTERM (a handler of its own would save again, late).
        True when there was one."""
        found = False
        for cb in list(self.trainer.callback_handler.callbacks):
            if type(cb).__name__ != "JITCheckpointCallback":
                continue
            manager = getattr(cb, "jit_manager", None)
            old = getattr(manager, "_original_sigterm_handler", None)
            if old is not None:
                import signal

                signal.signal(signal.SIGTERM, old)
            self.trainer.remove_callback(cb)
            found = True
        return found

    def _create_optimizer_and_scheduler(self) -> int:
        """The Trainer's optimizer and scheduler, created now as ``train()`` would, so the run
        can resume them; returns the run's total, the Trainer's ``max_steps``."""
        t = self.trainer
        loader = t.get_train_dataloader()
        max_steps = int(t.set_initial_training_values(t.args, loader)[-1])
        t.create_optimizer()
        t.create_scheduler(num_training_steps=max_steps, optimizer=t.optimizer)
        # A scheduler the Trainer created is made again at train(); this one is the user's now.
        t._created_lr_scheduler = False
        return max_steps

    # ------------------------------------------------------------------ train

    def train(self, **kwargs: Any) -> Any:
        """``trainer.train(**kwargs)`` under the run: resumed from its newest committed
        checkpoint, stopped at an optimizer step on every rank, saved, and left with the
        documented code (``SystemExit``). Returns the Trainer's ``TrainOutput``."""
        if kwargs.get("resume_from_checkpoint"):
            raise ValueError("ResilientTrainer.train resumes from the run's own checkpoint "
                             "(checkpoint.dir): leave resume_from_checkpoint out")
        kwargs.pop("resume_from_checkpoint", None)
        t = self.trainer
        t.add_callback(_boundary_callback(self))
        with self:
            if self._took_over_jit and self.rank == 0:    # seen even with logging unset
                announce(log, "the Trainer's enable_jit_checkpoint is taken over: SIGTERM "
                         "stops every rank at one step with a committed checkpoint")
            folder = self._resume_folder() if self.resumed_from is not None else None
            if folder is not None and t.args.ignore_data_skip and self.rank == 0:
                log.warning("TrainingArguments(ignore_data_skip=True): the Trainer starts the "
                            "resumed epoch from its first batch, not after the batches step %d "
                            "already trained, so the steps after this resume train on other "
                            "batches than a run without a stop (not an exact resume); leave "
                            "ignore_data_skip False to skip them", self.step)
            saved = {n: t.__dict__.get(n) for n in _LOADERS}
            try:
                if folder is not None:      # the run loaded these: the Trainer must not
                    for n in _LOADERS:
                        setattr(t, n, _nothing)
                out = t.train(resume_from_checkpoint=folder, **kwargs)
            finally:
                for n, fn in saved.items():
                    if fn is None:
                        t.__dict__.pop(n, None)
                    else:
                        setattr(t, n, fn)
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
        return out

    def _resume_folder(self) -> str:
        """This rank's folder of what the Trainer reads to find its data position after a
        resume: the resumed ``trainer_state.json`` and the RNG streams as the run restored
        them, in the Trainer's own format."""
        folder = tempfile.mkdtemp(prefix=f"kr-hf-resume-{os.getpid()}-")
        Path(folder, _STATE_FILE).write_text(self.progress.loaded or "{}")
        self.trainer._save_rng_state(folder)
        return folder

    def _loop_begins(self, state: Any) -> None:
        """``on_train_begin``: the run's loop starts at the Trainer's step."""
        if int(state.global_step) != self.step:
            raise RuntimeError(f"the Trainer starts at step {state.global_step}, the run at "
                               f"{self.step}: was train() called with a checkpoint of its own?")
        self._loop = self.steps(self.max_steps)
        self._advance()

    def _boundary(self) -> bool:
        """``on_step_end``: one step done. A stop saves and raises ``SystemExit`` here;
        True once every step ran."""
        if self._loop is None:
            raise RuntimeError("on_step_end before on_train_begin")
        return self._advance()

    def _advance(self) -> bool:
        try:
            next(self._loop)
        except StopIteration:
            return True
        return False


def _as_json(value: Any) -> Any:
    """A dataclass inside the ``TrainerState`` as ``asdict`` makes it (the JSON the Trainer's
    own ``asdict`` would give); anything else JSON cannot write is an error, as there."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# The Trainer's loaders of what the run restores itself (weights, optimizer, scheduler, scaler).
_LOADERS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler")


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None
