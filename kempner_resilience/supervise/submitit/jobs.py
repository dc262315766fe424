"""submitit integration: resilient training jobs submitted from Python or a notebook
(``docs/submitit.md``). The submitted function trains under ``ResilientRun`` as any script would:

* Signals. ``ResilientJob.__call__`` takes over submitit's (``env.SignalTakeover``) before the
  function runs: the run stops every rank at one boundary, commits, and rank 0 requeues.
* Resubmission. A requeued job reruns submitit's unchanged ``*_submitted.pkl``: a small
  ``ResilientJob`` (never model state, which ``check_small`` refuses) that resumes.
* Supervision. ``submit`` adopts a SLURM executor into ``slurm.py``'s (our srun step loop)
  and a local one into ``local.py``'s (our controller): both ask the one policy.
"""

from __future__ import annotations

import importlib
import inspect
import io
import os
import pickle
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from kempner_resilience.config import ResilienceConfig, load_config
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.submitit.client import interrupt, make_executor, wait
from kempner_resilience.supervise.submitit.env import (SignalTakeover, in_local_task,
                                                       in_submitit_job, preempt_signal,
                                                       preempt_when_controller_dies,
                                                       setup_local_env, setup_rank_env,
                                                       write_config_file)
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.supervise.channel import CHANNEL_ENV
from kempner_resilience.supervise.submitit.evidence import LOCAL_REQUEUE_CODE

__all__ = ["ResilientJob", "submit", "submit_array", "make_executor", "wait", "interrupt",
           "preempt_signal",
           "check_small", "resolve_callable", "MAX_PICKLE_BYTES", "LOCAL_REQUEUE_CODE"]

log = get_logger(__name__)

# A resubmission pickle is a function reference and a few paths and numbers: a few KiB. A
# pickle much larger than this means model state (or a dataset) got captured by accident.
MAX_PICKLE_BYTES = 1 << 20

_SIGTERM_MODES = ("ignore", "stop")


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

    ``fn``: a picklable top-level function or its import path (``"pkg.module:function"``),
    resolved in the job. ``config``: a YAML path (read in the job), a ``ResilienceConfig`` or a
    dict, or None for the defaults. ``overrides`` (``"section.key=value"``) apply on top, after
    our signal defaults (the preemption signal requeues, SIGTERM per ``sigterm``). Keep
    ``args``/``kwargs`` small. In the job, ``fn`` gets the resolved config as ``config=`` when
    it takes one; ``$KEMPNER_RESILIENCE_CONFIG`` names a copy for ``load_config()``.
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
        self.overrides = (str(overrides),) if isinstance(overrides, str) else tuple(map(str, overrides))
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
        Only submitit's own handler calls it, when its signal lands before ``__call__``
        replaced it."""
        from submitit.helpers import DelayedSubmission

        log.warning("submitit checkpoint() called: resubmitting %r; the training resumes from "
                    "the newest committed checkpoint", self)
        return DelayedSubmission(self.fresh(), *args, **kwargs)

    def signal_overrides(self) -> list[str]:
        """The signal actions this adapter sets for a submitit job (before the user's)."""
        preempt = signal.Signals(preempt_signal()).name
        out = [f"signals.actions.{preempt}=requeue"]
        if preempt != "SIGTERM":
            out.append(f"signals.actions.SIGTERM={'off' if self.sigterm == 'ignore' else 'stop'}")
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
            return load_config(cfg.to_dict(), overrides) if overrides else cfg
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
        takeover = SignalTakeover(preempt_signal(), self.sigterm).install()
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
    mod_name, _, attr = text.partition(":") if ":" in text else text.rpartition(".")
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
    pickle exceeds ``limit`` bytes; returns the pickle's size. Pickles with cloudpickle, as
    submitit does (a notebook's function goes by value, with its globals)."""
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
    Either ``folder`` (``%j``: the job id) with ``slurm`` parameters (``make_executor``), or a
    ready ``executor``; the rest as for ``ResilientJob``."""
    job = ResilientJob(fn, *args, config=config, overrides=overrides, sigterm=sigterm, **kwargs)
    return _resilient_executor(folder, executor, slurm).submit(job)


def submit_array(jobs: Iterable[ResilientJob], *,
                 folder: str | os.PathLike[str] | None = None, executor: Any = None,
                 slurm: Mapping[str, Any] | None = None) -> list[Any]:
    """Submit several ``ResilientJob``s (a sweep) as one job array; their jobs, in order.
    Under SLURM one ``sbatch --array``, each task a job of its own (preempted, requeued and
    resumed alone); locally, one job per entry. A ``checkpoint.dir`` shared by two jobs is
    refused before anything is queued: each would resume from the other's checkpoints."""
    jobs = list(jobs)
    if not jobs:
        raise ValueError("submit_array: no jobs given")
    wrong = next((i for i, job in enumerate(jobs) if not isinstance(job, ResilientJob)), None)
    if wrong is not None:
        raise TypeError(f"submit_array: job {wrong} is a {type(jobs[wrong]).__name__}, not a "
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
        return ResilientLocalExecutor.adopt(executor)
    from kempner_resilience.supervise.submitit.slurm import (ResilientSlurmExecutor,
                                                                is_slurm_executor)

    if is_slurm_executor(executor):
        return ResilientSlurmExecutor.adopt(executor)
    return executor
