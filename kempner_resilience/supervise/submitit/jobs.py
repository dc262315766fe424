"""submitit integration: resilient training jobs submitted from Python or a notebook.

```python
from kempner_resilience.integrations import submitit as krs

job = krs.submit("my_pkg.train:main", folder="runs/%j", config="resilience.yaml",
                 overrides=["checkpoint.dir=/scratch/me/ckpt"],
                 slurm={"timeout_min": 240, "tasks_per_node": 4, "slurm_partition": "gpu"},
                 steps=10_000)                      # keyword arguments for main()
print(krs.wait(job).result())                      # or job.result()
```

The submitted function builds its model and trains under ``ResilientRun`` as any script would.
What this module adds is the hand-over between submitit and ``ResilientRun``:

* **Signals.** In the job process submitit installs its own handler for its preemption signal
  (``SIGUSR2``, ``$SUBMITIT_PREEMPT_SIGNAL``) that calls ``checkpoint()`` and ``scontrol
  requeue`` at once, from inside the Python signal handler, in the middle of a training step and
  before any checkpoint of ours exists; it also ignores SIGTERM. ``ResilientJob.__call__``
  replaces those handlers (``submitit_signals.SignalTakeover``) before the training function
  runs, so the ``ShutdownHandler`` of the function's ``ResilientRun`` chains to ours (which does
  nothing while a run is active), never to submitit's. The run then stops every rank at the same step boundary, commits the emergency
  DCP checkpoint, and only then rank 0 requeues (``scontrol requeue``, with the restart budget)
  and every rank exits with ``REQUEUE`` (75).
* **Signals outside a run.** A preemption signal that arrives before the function has entered
  ``ResilientRun`` (imports, building the model) is kept and replayed by the run as soon as
  a run is active, so it is handled at the first step boundary; one that arrives after the
  function finished is logged and ignored (the result is about to be written).
* **Resubmission.** The requeued job keeps its id and reruns submitit's unchanged
  ``*_submitted.pkl``: the same small ``ResilientJob`` (a function reference or import path,
  a config path, overrides, keyword arguments; never model state), whose function resumes from
  the newest committed checkpoint. ``checkpoint()`` (used only if submitit's own handler ever
  runs) returns a fresh instance with the same small arguments. ``ResilientJob`` refuses to be
  created with tensors or modules among its arguments.
* **Result.** The resumed run writes submitit's result pickle, so ``job.result()`` on the client
  returns the final result of the resumed run. Without SLURM accounting ``job.state`` reads
  UNKNOWN and ``job.result()`` would wait forever for a job that failed; ``wait(job)`` polls
  ``scontrol show job`` and raises with the log's tail instead.

Under SLURM ``submit`` runs the job under ``ResilientSlurmExecutor`` (``submitit_slurm.py``):
submitit's batch script runs ``kempner-resilience srun``'s step loop, which launches the srun
tasks and, after each step, asks the one policy whether the job runs again (relaunch in place,
requeue, or leave: a rank's exception leaves with 1), as for ``kempner-resilience sbatch`` jobs.

Without SLURM (submitit's local executor: ``AutoExecutor(folder, cluster="local")`` or
``LocalExecutor``, how a notebook user tries things first) the same flow works on this machine:
each task gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from submitit's
``SUBMITIT_LOCAL_*`` variables and ``KEMPNER_RESTART_COUNT`` (its earlier starts); ``submit``
runs the job under our controller (``submitit_local.py``), which asks the one policy whether the
tasks run again after each launch (a requeue, a rescued failure, never a rank's own error),
where submitit's reruns them only when one exits 144 (a requeue exits with 144 under it);
``interrupt(job)`` (and ``job._interrupt()`` on a job from ``submit``) sends the
preemption signal to the tasks, where submitit's own ``_interrupt()`` sends it to the local
controller, which dies of it; and ``wait`` sees at once that the controller has ended.

SIGTERM: submitit ignores it (its preemption signal is USR2; ``job._interrupt()`` sends TERM,
then USR2). ``sigterm="ignore"`` (default) keeps that contract, so ``_interrupt()`` and real
preemption with ``preempt_send_user_signal`` checkpoint and requeue. ``sigterm="stop"`` makes
SIGTERM checkpoint and stop for good (exit 143): right for sites that preempt with SIGTERM only
and requeue by themselves (``PreemptMode=REQUEUE``), and for ``scancel``; but then
``_interrupt()`` stops the job instead of requeueing it.

This module is the job adapter (``ResilientJob``) and ``submit``. A task's environment is set up
in ``submitit_env.py``, submitit's signals are taken over in ``submitit_signals.py``, a job is
interrupted and waited for in ``submitit_client.py``, and a local job's ``_interrupt()`` reaches
its tasks through ``submitit_local.py``; the names users need are re-exported here.
"""

from __future__ import annotations

import importlib
import inspect
import io
import os
import pickle
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from kempner_resilience.config import ResilienceConfig, load_config
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.submitit.client import interrupt, make_executor, wait
from kempner_resilience.supervise.submitit.env import (preempt_when_controller_dies,
                                                          setup_local_env, setup_rank_env,
                                                          write_config_file)
from kempner_resilience.supervise.submitit.signals import (SignalTakeover, in_local_task,
                                                              in_submitit_job, preempt_signal)
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.supervise.channel import CHANNEL_ENV

__all__ = ["ResilientJob", "submit", "submit_array", "make_executor", "wait", "interrupt",
           "preempt_signal",
           "check_small", "resolve_callable", "MAX_PICKLE_BYTES", "LOCAL_REQUEUE_CODE"]

log = get_logger(__name__)

# A resubmission pickle is a function reference and a few paths and numbers: a few KiB. A
# pickle much larger than this means model state (or a dataset) got captured by accident.
MAX_PICKLE_BYTES = 1 << 20

_SIGTERM_MODES = ("ignore", "stop")

# submitit.local.local.LOCAL_REQUEUE_RETURN_CODE: the local controller starts the tasks again
# when one exits with it (up to 6 times), and on no other code.
LOCAL_REQUEUE_CODE = 144


# ------------------------------------------------------------------------- the job object

def _checkpointable_base() -> type:
    try:
        from submitit.helpers import Checkpointable
    except ImportError:  # the class still works as a plain callable without submitit
        return object
    return Checkpointable


class ResilientJob(_checkpointable_base()):  # type: ignore[misc]
    """A submitit-submittable callable that runs ``fn(*args, **kwargs)`` under our signal
    handling; ``fn`` trains with ``ResilientRun`` and resumes from its checkpoints.

    Args:
        fn: a picklable top-level function, or its import path ``"pkg.module:function"``
            (``"pkg.module.function"`` works too). Resolved in the job process.
        config: a YAML config path (read in the job), a ``ResilienceConfig`` or a plain dict
            (both stored as a small dict), or None for the defaults/``$KEMPNER_RESILIENCE_CONFIG``.
        overrides: ``"section.key=value"`` strings applied on top of ``config``.
        sigterm: ``"ignore"`` (submitit's contract, default) or ``"stop"``; see the module doc.
        *args, **kwargs: passed to ``fn``; keep them small (numbers, strings, paths).

    In the job, ``fn`` gets the resolved ``ResilienceConfig`` as ``config=`` when its signature
    has a ``config`` parameter (or ``**kwargs``); the same configuration is also written to a
    YAML file that ``$KEMPNER_RESILIENCE_CONFIG`` names, so ``load_config()`` without a path
    inside ``fn`` sees it. Our defaults for a submitit job are put first: the preemption signal
    requeues, SIGTERM per ``sigterm``; a signal action set in ``overrides`` wins over them.
    """

    def __init__(self, fn: Callable[..., Any] | str, *args: Any,
                 config: str | os.PathLike[str] | ResilienceConfig | Mapping[str, Any] | None = None,
                 overrides: Iterable[str] = (), sigterm: str = "ignore", **kwargs: Any) -> None:
        if isinstance(fn, str):
            if not fn.strip():
                raise ValueError("fn: empty import path; give 'package.module:function'")
        elif not callable(fn):
            raise TypeError(f"fn must be callable or an import path, not {type(fn).__name__}")
        if sigterm not in _SIGTERM_MODES:
            raise ValueError(f"sigterm={sigterm!r}; allowed: {', '.join(_SIGTERM_MODES)}")
        if isinstance(overrides, str):
            overrides = [overrides]
        self.fn = fn
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        if isinstance(config, ResilienceConfig):
            config = config.to_dict()
        elif isinstance(config, os.PathLike):
            config = os.fspath(config)
        elif isinstance(config, Mapping):
            config = dict(config)
        self.config = config
        self.overrides = tuple(str(o) for o in overrides)
        self.sigterm = sigterm
        self.resolve_config()  # fail in the notebook, not minutes later in the queue...
        check_small(self)  # ...and never ship model state in the pickle

    # -------------------------------------------------------------- client side

    def __repr__(self) -> str:
        name = self.fn if isinstance(self.fn, str) else getattr(self.fn, "__qualname__", self.fn)
        return (f"ResilientJob({name}, args={self.args!r}, kwargs={self.kwargs!r}, "
                f"config={self.config!r}, overrides={list(self.overrides)!r}, "
                f"sigterm={self.sigterm!r})")

    def fresh(self) -> "ResilientJob":
        """A new instance with the same (small) arguments: what a resubmission carries."""
        return ResilientJob(self.fn, *self.args, config=self.config, overrides=self.overrides,
                            sigterm=self.sigterm, **self.kwargs)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """What submitit pickles for the requeued job: a fresh instance, never live state.

        Our own flow never calls this (the requeued job reruns the original pickle, which is
        the same thing); submitit's handler does when its signal lands in the instant between
        submitit installing its handlers and ``__call__`` replacing them.
        """
        from submitit.helpers import DelayedSubmission

        log.warning("submitit checkpoint() called: resubmitting %r; the training resumes from "
                    "the newest committed checkpoint", self)
        return DelayedSubmission(self.fresh(), *args, **kwargs)

    def signal_overrides(self) -> list[str]:
        """The signal actions this adapter sets for a submitit job (before the user's)."""
        preempt = signal.Signals(preempt_signal()).name
        term = "off" if self.sigterm == "ignore" else "stop"
        out = [f"signals.actions.{preempt}=requeue"]
        if preempt != "SIGTERM":
            out.append(f"signals.actions.SIGTERM={term}")
        if in_local_task() and not os.environ.get(CHANNEL_ENV):
            # Under submitit's own controller (no supervisor channel: ResilientJob submitted
            # without ``submit``), the run's SystemExit must reach __call__, which turns a
            # requeue (75) into its requeue code 144; in `exit` mode the process would leave
            # with 75 anyway. Our controller reads the run's own codes (81, 42, 75).
            out.append("watchdog.exit_mode=raise")
        return out

    def resolve_config(self) -> ResilienceConfig:
        """The configuration the function runs with (reads the YAML file, if a path)."""
        overrides = [*self.signal_overrides(), *self.overrides]
        if isinstance(self.config, dict):
            cfg = ResilienceConfig.from_dict(self.config, "config dict")
            if not overrides:
                return cfg
            import yaml

            fd, path = tempfile.mkstemp(prefix="kr_cfg_", suffix=".yaml")
            try:
                with os.fdopen(fd, "w") as f:
                    yaml.safe_dump(cfg.to_dict(), f)
                return load_config(path, overrides)
            finally:
                os.unlink(path)
        if self.config is not None and not Path(self.config).is_file() and not in_submitit_job():
            # Relative paths are read in the job's working directory; only warn here.
            log.warning("config %s is not a file here; the job will look for it in its own "
                        "working directory", self.config)
            return load_config(None, overrides)
        return load_config(self.config, overrides)

    # -------------------------------------------------------------- job side

    def __call__(self) -> Any:
        local = in_local_task()
        controller = os.getppid()
        if local:
            setup_local_env()
        else:
            setup_rank_env()
        fn = resolve_callable(self.fn)
        cfg = self.resolve_config()
        os.environ["KEMPNER_RESILIENCE_CONFIG"] = write_config_file(cfg)
        takeover = SignalTakeover(preempt_signal(), self.sigterm)
        takeover.install()
        if local:     # after the takeover: the signal must take our path, not submitit's
            preempt_when_controller_dies()
        kwargs = dict(self.kwargs)
        if _accepts(fn, "config") and "config" not in kwargs:
            kwargs["config"] = cfg
        try:
            return fn(*self.args, **kwargs)
        except SystemExit as e:
            if local and e.code == ExitCode.REQUEUE:
                if os.getppid() == controller:
                    log.warning("requeue: exiting with %d, on which submitit's local "
                                "controller starts the tasks again; they resume from the "
                                "checkpoint", LOCAL_REQUEUE_CODE)
                else:
                    log.warning("requeue: the local controller is gone (killed by submitit's "
                                "_interrupt()?); resubmit the job to resume from the "
                                "checkpoint (krs.interrupt(job) preempts a local job)")
                raise SystemExit(LOCAL_REQUEUE_CODE) from None
            raise
        finally:
            takeover.finish()


# ------------------------------------------------------------------------- helpers

def resolve_callable(fn: Callable[..., Any] | str) -> Callable[..., Any]:
    """``"pkg.mod:fn"`` or ``"pkg.mod.fn"`` -> the function; a callable is returned as is."""
    if callable(fn):
        return fn
    text = str(fn).strip()
    if ":" in text:
        mod_name, _, attr = text.partition(":")
    else:
        mod_name, _, attr = text.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"{fn!r} is not an import path; write 'package.module:function'")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{fn!r} resolves to {type(obj).__name__}, which is not callable")
    return obj


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name and p.kind is not p.POSITIONAL_ONLY or p.kind is p.VAR_KEYWORD
               for p in params)


def _refuse_model_state(obj: Any) -> None:
    torch = sys.modules.get("torch")  # no tensor can exist unless the caller imported torch
    if torch is not None and isinstance(obj, (torch.Tensor, torch.nn.Module,
                                              torch.optim.Optimizer)):
        raise TypeError(f"a {type(obj).__module__}.{type(obj).__qualname__} would be pickled "
                        "into the submission; pass paths and config, build the model inside "
                        "the submitted function")


def check_small(obj: Any, limit: int = MAX_PICKLE_BYTES) -> int:
    """Raise TypeError if ``obj`` would pickle tensors/modules/optimizers, ValueError if its
    pickle exceeds ``limit`` bytes; returns the pickle's size.

    Uses cloudpickle (what submitit uses), so functions defined in a notebook are pickled by
    value, with whatever globals they reference.
    """
    try:
        from cloudpickle import Pickler
    except ImportError:  # pragma: no cover
        Pickler = pickle.Pickler  # type: ignore[misc, assignment]

    class _Scan(Pickler):  # type: ignore[misc, valid-type]
        def reducer_override(self, o: Any) -> Any:
            _refuse_model_state(o)
            parent = getattr(super(), "reducer_override", None)
            return parent(o) if parent is not None else NotImplemented

    buf = io.BytesIO()
    _Scan(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    size = buf.tell()
    if size > limit:
        raise ValueError(f"the submission pickles to {size} bytes (> {limit}): something large "
                         "(data, model state) was captured; pass paths instead")
    return size


# ------------------------------------------------------------------------- submission

def submit(fn: Callable[..., Any] | str, *args: Any,
           folder: str | os.PathLike[str] | None = None, executor: Any = None,
           config: str | os.PathLike[str] | ResilienceConfig | Mapping[str, Any] | None = None,
           overrides: Iterable[str] = (), sigterm: str = "ignore",
           slurm: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """Submit ``fn(*args, **kwargs)`` as a resilient submitit job; returns the ``submitit.Job``.

    Either ``folder`` (logs and pickles; ``%j`` is the job id) with ``slurm`` executor
    parameters (see ``make_executor``), or a ready ``executor``. ``config``/``overrides``/
    ``sigterm`` as for ``ResilientJob``; ``kwargs`` go to ``fn``.
    """
    job = ResilientJob(fn, *args, config=config, overrides=overrides, sigterm=sigterm, **kwargs)
    return _resilient_executor(folder, executor, slurm).submit(job)


def submit_array(jobs: Iterable[ResilientJob], *,
                 folder: str | os.PathLike[str] | None = None, executor: Any = None,
                 slurm: Mapping[str, Any] | None = None) -> list[Any]:
    """Submit several ``ResilientJob``s (a sweep) as one job array; returns their jobs, in order.

    ```python
    jobs = krs.submit_array(
        [krs.ResilientJob(train, lr=lr, overrides=[f"checkpoint.dir=/scratch/me/lr{lr}"])
         for lr in (1e-3, 3e-4)],
        folder="runs/%j", slurm={"timeout_min": 240, "tasks_per_node": 4})
    ```

    Under SLURM one ``sbatch --array`` (``slurm={"slurm_array_parallelism": n}`` caps how many
    run at once); each array task is a job of its own with its own step loop, so each is
    preempted, requeued and resumed alone. Locally, one job per entry. Every job needs a
    ``checkpoint.dir`` of its own: two runs in one directory would resume from each other's
    checkpoints, so a shared one is refused here, before anything is queued.
    """
    jobs = list(jobs)
    if not jobs:
        raise ValueError("submit_array: no jobs given")
    for i, job in enumerate(jobs):
        if not isinstance(job, ResilientJob):
            raise TypeError(f"submit_array: job {i} is a {type(job).__name__}, not a "
                            "ResilientJob; wrap it: krs.ResilientJob(fn, **kwargs)")
    seen: dict[str, int] = {}
    for i, job in enumerate(jobs):
        where = os.path.normpath(RunPaths.from_config(job.resolve_config()).root)
        if where in seen:
            raise ValueError(
                f"submit_array: jobs {seen[where]} and {i} both have checkpoint.dir={where}: "
                "each would resume from the other's checkpoints. Give every job its own, e.g. "
                "overrides=[f\"checkpoint.dir=/scratch/me/sweep/{i}\"]")
        seen[where] = i
    return list(_resilient_executor(folder, executor, slurm).submit_array(jobs))


def _resilient_executor(folder: str | os.PathLike[str] | None, executor: Any,
                        slurm: Mapping[str, Any] | None) -> Any:
    """The executor ``submit`` runs a job under: ``executor`` (or one made for ``folder``),
    adopted into ours."""
    if executor is None:
        if folder is None:
            raise TypeError("submit() needs folder=... (or executor=...)")
        executor = make_executor(folder, **dict(slurm or {}))
    elif slurm:
        executor.update_parameters(**dict(slurm))
    from kempner_resilience.supervise.submitit.local import (ResilientLocalExecutor,
                                                                is_local_executor)

    if is_local_executor(executor):
        # Our controller decides whether the tasks run again (the one policy), where
        # submitit's reruns them only on its requeue code; and our job's _interrupt() reaches
        # the tasks (see submitit_local.py).
        return ResilientLocalExecutor.adopt(executor)
    from kempner_resilience.supervise.submitit.slurm import (ResilientSlurmExecutor,
                                                                is_slurm_executor)

    if is_slurm_executor(executor):
        # The batch script runs our srun step loop, which launches the tasks: one
        # supervisor on the one policy, as `kempner-resilience sbatch` jobs have it.
        return ResilientSlurmExecutor.adopt(executor)
    return executor
