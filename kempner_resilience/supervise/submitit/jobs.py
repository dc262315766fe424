"""submitit integration: resilient training jobs submitted from Python or a notebook.

``ResilientJob`` runs the submitted function under ``ResilientRun`` in a task set up for it
(ranks, config file, submitit's signals taken over); a requeued job reruns its small pickle and
resumes; ``submit`` puts it under our supervisor (``local.py``, ``slurm.py``) and ``wait``
follows it through requeues. See ``docs/submitit.md``.
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
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from kempner_resilience.config import ResilienceConfig, load_config, normalize_signal
from kempner_resilience.core.fileio import write_atomic
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.core.startup import record_early_signal
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.channel import CHANNEL_ENV
from kempner_resilience.supervise.submitit.evidence import LOCAL_REQUEUE_CODE

__all__ = ["ResilientJob", "submit", "submit_array", "make_executor", "wait", "interrupt",
           "preempt_signal", "check_small", "resolve_callable", "MAX_PICKLE_BYTES",
           "LOCAL_REQUEUE_CODE"]

# One logger for the whole integration (local.py's too): users filter their logs on it.
log = get_logger(__name__)

# A resubmission pickle is a function reference and a few paths and numbers: a few KiB. A
# pickle much larger than this means model state (or a dataset) got captured by accident.
MAX_PICKLE_BYTES = 1 << 20

_SIGTERM_MODES = ("ignore", "stop")

try:
    from submitit.helpers import Checkpointable as _Base
except ImportError:  # the class still works as a plain callable without submitit
    _Base = object


class ResilientJob(_Base):  # type: ignore[misc, valid-type]
    """A submitit-submittable callable that runs ``fn(*args, **kwargs)`` (which trains with
    ``ResilientRun``) under our signal handling. ``fn``: a picklable function or its import
    path (``"pkg.module:function"``). ``config``: a YAML path, a ``ResilienceConfig``, a dict
    or None; ``overrides`` apply after our signal defaults. ``fn`` gets the resolved config as
    ``config=`` when it takes one. See ``docs/submitit.md``."""

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
        """What submitit pickles for the requeued job: a fresh instance, never live state
        (called by submitit's own handler when its signal lands before ``__call__``)."""
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
            # Under submitit's own controller (no channel) the run's SystemExit must reach
            # __call__, which turns REQUEUE (75) into 144. Our controller reads 81, 42, 75.
            out.append("watchdog.exit_mode=raise")
        return out

    def resolve_config(self) -> ResilienceConfig:
        """The configuration the function runs with (reads the YAML file, if a path)."""
        config = self.config
        if isinstance(config, dict):   # its mistakes are named as the dict's
            config = ResilienceConfig.from_dict(config, "config dict").to_dict()
        elif config is not None and not Path(config).is_file() and not in_submitit_job():
            # Relative paths are read in the job's working directory; only warn here.
            log.warning("config %s is not a file here; the job will look for it in its own "
                        "working directory", config)
            config = None
        return load_config(config, [*self.signal_overrides(), *self.overrides])

    def __call__(self) -> Any:
        local = in_local_task()
        controller = os.getppid()
        if local:
            setup_local_env()
        elif os.environ.get("SLURM_JOB_ID"):   # submitit starts one task per rank with srun
            from kempner_resilience.slurm import setup_torch_env

            setup_torch_env()
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


# ------------------------------------------------------------------------- in the task

# A local task inherits the notebook's environment: inside an allocation these would make the
# run `scontrol requeue` the allocation itself, and a stale RANK would make every task rank 0.
OUTER_JOB_VARS = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_RESTART_COUNT")


def setup_local_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """A local executor's task: the rank variables from ``SUBMITIT_LOCAL_*``, a port from the
    job id, and ``KEMPNER_RESTART_COUNT`` (from our controller's channel, else counted in a
    file: submitit's controller does not say). Returns what was set."""
    from kempner_resilience.slurm.env import master_port
    from kempner_resilience.supervise.rank import restarts_said

    env: Any = os.environ if environ is None else environ
    for key in OUTER_JOB_VARS:
        env.pop(key, None)
    job_id = env.get("SUBMITIT_LOCAL_JOB_ID", "") or str(os.getppid())
    rank = env.get("SUBMITIT_LOCAL_GLOBALID", "0")
    world = env.get("SUBMITIT_LOCAL_NTASKS", "1")
    said = restarts_said(env)
    values = {"RANK": rank, "WORLD_SIZE": world,
              "LOCAL_RANK": env.get("SUBMITIT_LOCAL_LOCALID", rank), "LOCAL_WORLD_SIZE": world,
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port(job_id)),
              "KEMPNER_RESTART_COUNT": str(said if said is not None
                                           else count_start(env, job_id, rank))}
    env.update(values)
    log.debug("local submitit task: %s", values)
    return values


def preempt_when_controller_dies() -> None:
    """Ask for the preemption signal when the local controller dies (submitit's own
    ``job._interrupt()`` kills it): the tasks checkpoint instead of training on unseen."""
    from kempner_resilience.supervise.local.warm import parent_death

    parent = os.getppid()
    ask = parent_death(preempt_signal())
    if ask is not None:
        ask()
        if os.getppid() != parent:       # it died before the request: act now
            os.kill(os.getpid(), preempt_signal())


def _task_file(folder: str, name: str) -> Path:
    """``name`` in the job's submitit ``folder``, else in the temporary directory."""
    return (Path(folder) if folder and Path(folder).is_dir() else Path(tempfile.gettempdir())) / name


def count_start(env: Mapping[str, str], job_id: str, rank: str) -> int:
    """Earlier starts of this task of this local job; records this one."""
    folder = env.get("SUBMITIT_FOLDER", "").replace("%j", job_id)
    path = _task_file(folder, f"{job_id}_{rank}_kr_starts")
    try:
        before = len(path.read_text().splitlines()) if path.exists() else 0
        with open(path, "a") as f:
            f.write(f"{time.time():.3f}\n")
    except OSError as e:   # the count only feeds the restart budget and the ledger
        log.warning("cannot count this task's starts in %s (%s): taken as the first", path, e)
        return 0
    return before


def write_config_file(cfg: ResilienceConfig) -> str:
    """The resolved ``cfg`` in this task's file, for ``$KEMPNER_RESILIENCE_CONFIG``; its path."""
    import yaml

    env = os.environ
    job = env.get("SLURM_JOB_ID") or env.get("SUBMITIT_LOCAL_JOB_ID") or "local"
    rank = env.get("SLURM_PROCID", env.get("RANK", "0"))
    path = _task_file(env.get("SUBMITIT_FOLDER", ""), f"{job}_{rank}_resilience.yaml")
    # Read by this task's own processes and rewritten at every start: whole, not fsynced.
    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False), durable=False)
    return str(path)


def preempt_signal() -> int:
    """submitit's preemption signal (``$SUBMITIT_PREEMPT_SIGNAL``, default ``SIGUSR2``)."""
    return int(getattr(signal, normalize_signal(os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))))


def in_local_task() -> bool:
    """True in a task that submitit's local executor started."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "local" and "SUBMITIT_LOCAL_GLOBALID" in os.environ


def in_submitit_job() -> bool:
    """True in a job process that submitit started, under SLURM or its local executor."""
    return bool(os.environ.get("SUBMITIT_FOLDER")) and (bool(os.environ.get("SLURM_JOB_ID"))
                                                        or in_local_task())


class SignalTakeover:
    """Replaces submitit's handlers for the preemption signal (the run's inside a
    ``ResilientRun``, kept for it to replay before one, ignored after the function returned)
    and SIGTERM (ignored as submitit does; with ``sigterm="stop"`` the default action, or the
    run's STOP inside one)."""

    def __init__(self, preempt_signum: int, sigterm: str = "ignore") -> None:
        self.preempt = preempt_signum
        self.sigterm = sigterm
        self.pending: int | None = None
        self._done = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> "SignalTakeover":
        """Our handlers in place of submitit's; returns self."""
        self._previous[self.preempt] = signal.signal(self.preempt, self._on_preempt)
        if self.preempt != signal.SIGTERM:
            term = self._on_term_ignored if self.sigterm == "ignore" else signal.SIG_DFL
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, term)
        previous = self._previous[self.preempt]
        log.debug("took over %s and SIGTERM from %s", signal.Signals(self.preempt).name,
                  getattr(previous, "__qualname__", previous))
        return self

    def finish(self) -> None:
        """The function returned (or raised). In a submitit job our handlers stay, so a late
        signal cannot make submitit requeue a finished job; elsewhere the old ones come back."""
        self._done.set()
        if not in_submitit_job() and threading.current_thread() is threading.main_thread():
            for s, prev in self._previous.items():
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)

    def _on_preempt(self, signum: int, frame: Any) -> None:
        from kempner_resilience.stop.signals import active_handlers

        if active_handlers():
            return  # chained from ResilientRun's handler: the run handles it
        if self._done.is_set():
            log.warning("%s after the training function returned: ignored (the result is "
                        "being written)", signal.Signals(signum).name)
            return
        if self.pending is not None:
            return
        self.pending = signum
        log.warning("%s before the training entered ResilientRun: it is handled as soon as "
                    "the run starts", signal.Signals(signum).name)
        # The run's ShutdownHandler replays it: the stop comes at the run's first boundary,
        # its deadline counted from now. (A thread re-sending the signal once a run was active
        # woke too late on a loaded machine: several steps ran first.)
        record_early_signal(signum)

    def _on_term_ignored(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM ignored, as submitit does (its preemption signal is %s; "
                    "pass sigterm='stop' to act on SIGTERM)", signal.Signals(self.preempt).name)


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


def check_small(obj: Any, limit: int = MAX_PICKLE_BYTES) -> int:
    """The size of ``obj``'s pickle (cloudpickle's, as submitit's); TypeError if it would hold
    tensors/modules/optimizers, ValueError if it exceeds ``limit`` bytes."""
    try:
        from cloudpickle import Pickler
    except ImportError:  # pragma: no cover
        Pickler = pickle.Pickler  # type: ignore[misc, assignment]
    torch = sys.modules.get("torch")  # no tensor can exist unless the caller imported torch

    class _Scan(Pickler):  # type: ignore[misc, valid-type]
        def reducer_override(self, o: Any) -> Any:
            if torch is not None and isinstance(o, (torch.Tensor, torch.nn.Module,
                                                    torch.optim.Optimizer)):
                raise TypeError(f"a {type(o).__module__}.{type(o).__qualname__} would be "
                                "pickled into the submission; pass paths and config, build "
                                "the model inside the submitted function")
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
    A ``checkpoint.dir`` shared by two jobs is refused before anything is queued."""
    jobs = list(jobs)
    if not jobs:
        raise ValueError("submit_array: no jobs given")
    seen: dict[str, int] = {}
    for i, job in enumerate(jobs):
        if not isinstance(job, ResilientJob):
            raise TypeError(f"submit_array: job {i} is a {type(job).__name__}, not a "
                            "ResilientJob; wrap it: krs.ResilientJob(fn, **kwargs)")
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
    """``executor`` (or one made for ``folder``), adopted into our local or SLURM one."""
    if executor is None:
        if folder is None:
            raise TypeError("submit() needs folder=... (or executor=...)")
        executor = make_executor(folder, **dict(slurm or {}))
    elif slurm:
        executor.update_parameters(**dict(slurm))
    from kempner_resilience.supervise.submitit import local

    if local.is_local_executor(executor):
        return local.ResilientLocalExecutor.adopt(executor)
    from kempner_resilience.supervise.submitit import slurm as on_slurm

    if on_slurm.is_slurm_executor(executor):
        return on_slurm.ResilientSlurmExecutor.adopt(executor)
    return executor


def make_executor(folder: str | os.PathLike[str], *, timeout_min: int = 60,
                  **params: Any) -> Any:
    """A submitit ``AutoExecutor`` for SLURM. ``timeout_min`` > 10: with 10 or less submitit
    calls every interrupt a time-out."""
    import submitit

    if timeout_min <= 10:
        log.warning("timeout_min=%s <= 10: submitit treats every interrupt of such a job as "
                    "a time-out", timeout_min)
    executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
    executor.update_parameters(timeout_min=timeout_min, **params)
    return executor


# ------------------------------------------------------------------------- a submitted job

def is_local_job(job: Any) -> bool:
    """A job of submitit's local executor (its controller is a child process of ours)."""
    try:
        from submitit.local.local import LocalJob
    except ImportError:
        return False
    return isinstance(job, LocalJob)


def interrupt(job: Any) -> None:
    """Send the preemption signal to every task of ``job``, as SLURM does: they checkpoint and
    requeue (submitit's ``_interrupt()`` of a local job kills its controller instead)."""
    if is_local_job(job):
        from kempner_resilience.supervise.submitit.local import interrupt_tasks

        interrupt_tasks(job)
    else:
        job._interrupt()


_TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def wait(job: Any, timeout: float | None = None, poll: float = 0.5) -> Any:
    """``job``, once it has written its result, through any number of requeues. RuntimeError
    (with the log's tail) when it ended without one, TimeoutError after ``timeout`` s."""
    from kempner_resilience.slurm import show_job

    deadline = None if timeout is None else time.monotonic() + timeout
    tasks = _tasks(job)
    local = is_local_job(job)
    ended_since: float | None = None
    last = ""
    while True:
        if all(t.paths.result_pickle.exists() for t in tasks):
            return job
        if local:
            _check_local(job, tasks)
        state = "" if local else (show_job(str(job.job_id), timeout=10.0) or {}).get("JobState", "")
        last = state or last
        if state in _TERMINAL:
            # The tasks may still be writing their pickles: give them a moment.
            ended_since = ended_since or time.monotonic()
            if time.monotonic() - ended_since > 15.0:
                raise RuntimeError(f"job {job.job_id} ended ({state}) without a result:\n"
                                   + _log_tail(job))
        else:
            ended_since = None
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job.job_id} has no result after {timeout} s (state "
                               f"{last or 'unknown'}):\n" + _log_tail(job))
        time.sleep(poll)


def _tasks(job: Any) -> list[Any]:
    return list(getattr(job, "_sub_jobs", []) or []) or [job]


def _check_local(job: Any, tasks: list[Any]) -> None:
    """Raise when a local job's controller (which waits for all its tasks) ended without
    every result."""
    proc = getattr(job, "_process", None)
    code = None if proc is None else proc.poll()
    if proc is not None and code is None:
        return
    if all(t.paths.result_pickle.exists() for t in tasks):   # written just before it ended
        return
    if proc is None:
        why = "its controller is not a child of this process (another session?)"
    elif code < 0:
        why = (f"its controller was killed by {signal.Signals(-code).name} (submitit's "
               "_interrupt() does that; krs.interrupt(job) preempts the tasks instead); its "
               "tasks got the preemption signal and checkpoint on their own")
    else:
        why = "its tasks exited without a result (a task's exit code is in its log)"
    raise RuntimeError(f"local job {job.job_id} ended without a result: {why}; resubmit it to "
                       "resume from its newest checkpoint:\n" + _log_tail(job))


def _log_tail(job: Any, lines: int = 30) -> str:
    out = []
    for t in _tasks(job)[:2]:
        for path in (t.paths.stdout, t.paths.stderr):
            try:
                text = Path(path).read_text(errors="replace").splitlines()
            except OSError:
                continue
            out.append(f"--- {path}\n" + "\n".join(text[-lines:]))
    return "\n".join(out) or "(no log)"
