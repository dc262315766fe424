"""The one channel between a supervisor and its ranks: a job-scoped directory named in the
environment (``CHANNEL_ENV``), where rank 0 says which run it is and the supervisor keeps its
own memory. Why and where: docs/design.md ("The ranks tell the supervisor").

Every write is an atomic replace, never fsynced: a reader sees a whole file or the one before.
The directory lives as long as the job (a requeue keeps the id).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

from kempner_resilience.checkpoint.layout import newest_committed as newest_commit
from kempner_resilience.config import RequeueConfig
from kempner_resilience.core.fileio import load_json_bounded, write_atomic
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.core.startup import StartupError
from kempner_resilience.supervise.policy import Commits, Decision

__all__ = ["CHANNEL_ENV", "Channel", "ChannelUnwritable", "Progress", "Relaunched", "RunReport",
           "REPORT_NAME", "report_now", "launch_name", "relaunched", "newest_commit"]

_log = get_logger(__name__)
_T = TypeVar("_T")

#: The channel's directory, set by the supervisor in every rank's environment.
CHANNEL_ENV = "KEMPNER_RESILIENCE_SUPERVISOR"
#: Rank 0's report, in the channel.
REPORT_NAME = "run.json"
_JOBS_DIR = ".kempner-resilience"
_HANG_SEEN = "hang-seen"
_DIED = "ranks-died"
_LAUNCH = "launch.json"
_TRAIN_NODES = "train-nodes.json"
_RELAUNCH = "relaunch.json"
_AGENT = "agent.json"
_AGENTS_DIR = "agents"


class ChannelUnwritable(OSError, StartupError):
    """No directory can hold the supervisor's channel: 78 (CONFIG) before any rank starts."""


def tell(path: Path, data: Any, what: str, *, durable: bool = False, mkdir: bool = False
         ) -> bool:
    """Replace ``path`` with ``data`` as JSON, whole; a failure is logged, never raised."""
    try:
        if mkdir:
            path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data), durable=durable)
        return True
    except (OSError, TypeError, ValueError) as e:
        _log.warning("cannot tell %s in %s: %s", what, path.parent, e)
        return False


def hear(path: Path, unreadable: str = "%s unreadable (%s)",
         parse: Callable[[Any], _T] = lambda data: data) -> _T | None:
    """``parse`` of the small JSON file ``path``; None when it is absent, or unreadable or
    refused by ``parse`` (ValueError, TypeError), then logged with ``unreadable``."""
    try:
        return parse(load_json_bounded(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        _log.warning(unreadable, path, e)
        return None


def count(value: Any, low: int | None = 0) -> int | None:
    """``value`` when it is an integer (not a bool) >= ``low`` (None: any), else None."""
    ok = isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)
    return value if ok else None


def _mark(directory: Path, ranks: Iterable[int]) -> None:
    """One empty file per rank in ``directory`` (a mark needs no content); never raises."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for rank in ranks:
            (directory / f"rank-{int(rank)}").touch()
    except (OSError, ValueError):
        pass


def _marked(directory: Path) -> set[int]:
    """The ranks marked in ``directory`` (``_mark``)."""
    try:
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return set()
    return {int(n[5:]) for n in names if n.startswith("rank-") and n[5:].isdigit()}


def _writable_dir(path: Path) -> str | None:
    """Create ``path``; None when it is a writable directory, else why."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    return None if os.access(path, os.W_OK | os.X_OK) else "not writable"


def _local_places(environ: Mapping[str, str]) -> list[Path]:
    """This node's places for a channel, in order: $TMPDIR, /dev/shm, the temporary directory."""
    found = [Path(p) for p in (environ.get("TMPDIR"), "/dev/shm") if p]
    try:
        found.append(Path(tempfile.gettempdir()))
    except (OSError, FileNotFoundError):
        pass
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Relaunched:
    """Which relaunch in place a launch is (0: the job's first) and when it was launched."""

    index: int = 0
    t: float | None = None


@dataclass(frozen=True)
class RunReport:
    """What rank 0 says about its run (``run.json`` in the channel)."""

    run_dir: str                          # the resolved checkpoint.dir
    run_id: str | None = None
    committed: int | None = None          # the newest step this run committed or resumed from
    code: int | None = None               # the exit code, once the attempt has ended
    requeue: Mapping[str, Any] = field(default_factory=dict)   # the run's requeue section
    host: str = ""
    pid: int = 0
    t: float = 0.0                        # time.time() of the report

    @classmethod
    def from_json(cls, data: Any) -> "RunReport":
        """From ``run.json``'s content; ValueError names what is wrong."""
        if not isinstance(data, dict) or not isinstance(data.get("run_dir"), str) \
                or not data["run_dir"]:
            raise ValueError("not a run report: no run_dir")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for key in ("committed", "code"):
            if known.get(key) is not None and not isinstance(known[key], int):
                raise ValueError(f"run report: {key} is {known[key]!r}, not an integer")
        if not isinstance(known.get("requeue", {}), dict):
            raise ValueError("run report: requeue is not a mapping")
        return cls(**known)


@dataclass(frozen=True)
class Channel:
    """One job's channel directory (see the module docstring)."""

    root: Path                  # the job's: rank 0's report, hang marks, the supervisor's memory
    agent: Path | None = None   # a torchrun agent's own directory: its workers' relaunch

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Channel | None":
        """The channel a supervisor gave this process, or None (no supervisor). A torchrun
        agent's channel (``agent.json`` in it) resolves to the job's channel it names."""
        value = (os.environ if environ is None else environ).get(CHANNEL_ENV)
        if not value:
            return None
        path = Path(value)
        data = hear(path / _AGENT, "%s unreadable (%s): taken as the job's channel",
                    lambda d: d if isinstance(d, dict) else {})
        if data is None:
            return cls(path)
        job = data.get("job")
        return cls(Path(job) if isinstance(job, str) and job else path, agent=path)

    @classmethod
    def for_agent(cls, job: "Channel | None", node: str) -> "Channel":
        """A torchrun agent's own channel, ``agents/<node>-<pid>`` in ``job``'s (else private):
        each agent restarts its own workers, so their relaunch cannot be one file of the job's."""
        if job is not None:
            path = job.root / _AGENTS_DIR / f"{node}-{os.getpid()}"
            path.mkdir(parents=True, exist_ok=True)
        else:
            path = Path(tempfile.mkdtemp(prefix="kempner-resilience-agent-"))
        channel = cls(job.root if job is not None else path, agent=path)
        channel.offer_rendezvous(None)
        return channel

    @classmethod
    def private(cls, prefix: str) -> "Channel":
        """A fresh channel of this process's own, for ranks on this node (the local launcher)."""
        tried = []
        for place in [None, *_local_places(os.environ)]:
            try:
                return cls(Path(tempfile.mkdtemp(prefix=prefix, dir=place)))
            except OSError as e:
                tried.append(f"{place or 'the temporary directory'}: {e.strerror or e}")
        raise ChannelUnwritable("no directory can hold the supervisor's channel: "
                                + "; ".join(tried) + ". Set TMPDIR to a writable directory")

    @property
    def supervised(self) -> bool:
        """Whether a supervisor above the ranks decides whether the job runs again: false only
        for a torchrun agent's private channel, where rank 0 still requeues the job itself."""
        return self.agent is None or self.agent != self.root

    @property
    def _own(self) -> Path:        # this launch's own words: the agent's directory, else the job's
        return self.agent if self.agent is not None else self.root

    @classmethod
    def for_job(cls, job_id: str, environ: Mapping[str, str] | None = None,
                cwd: str | os.PathLike[str] | None = None, *, fresh: bool = False) -> "Channel":
        """The channel of job ``job_id`` under ``SLURM_SUBMIT_DIR`` (or ``cwd``), created, else
        on this node. ``fresh``: the job's first attempt, so what is there is a cancelled job's
        with the same id (ids are reused), whose report would name another run: cleared."""
        env = os.environ if environ is None else environ
        name = f"job-{job_id}"
        wanted = (Path(env.get("SLURM_SUBMIT_DIR") or cwd or os.getcwd()) / _JOBS_DIR / name).resolve()
        tried = []
        for root in [wanted] + [(p / f"{_JOBS_DIR}-{os.getuid()}" / name).resolve()
                                for p in _local_places(env)]:
            if fresh and root.is_dir():
                _log.warning("%s: left by an earlier job with the same id; cleared for this one", root)
                shutil.rmtree(root, ignore_errors=True)
            why = _writable_dir(root)
            if why is None:
                if root != wanted:
                    _log.warning("%s cannot hold the supervisor's channel (%s): using %s on this node "
                                 "instead (ranks on other nodes cannot report to it); submit from a "
                                 "writable directory to share it", wanted, tried[0][1], root)
                return cls(root)
            tried.append((root, why))
        raise ChannelUnwritable("no directory can hold the supervisor's channel: "
                                + "; ".join(f"{p}: {why}" for p, why in tried) + ". Submit the job from "
                                "a writable directory (SLURM_SUBMIT_DIR), or set TMPDIR to a writable one")

    @classmethod
    def for_controller(cls, pid: str, folder: str | os.PathLike[str],
                       host: str | None = None) -> "Channel":
        """A local controller's channel, ``job-<pid>.<host>.<token>`` in ``folder``: hosts
        sharing a folder reuse pids, so no controller clears another's."""
        host = (host or socket.gethostname() or "host").replace("/", "_")
        return cls.for_job(f"{pid}.{host}.{secrets.token_hex(4)}", environ={}, cwd=folder)

    def env(self) -> dict[str, str]:
        """The variables that hand this channel to the ranks (the one contract: one)."""
        return {CHANNEL_ENV: str(self._own)}

    # ------------------------------------------------------------------ rank 0's report

    def report(self, report: RunReport) -> None:
        """Replace ``run.json`` with ``report``; never raises (a rank never stops for it)."""
        tell(self.root / REPORT_NAME, {**asdict(report), "requeue": dict(report.requeue)},
             "the supervisor about the run")

    def read(self) -> RunReport | None:
        """Rank 0's latest report; None when there is none yet or it cannot be read (logged)."""
        return hear(self.root / REPORT_NAME, "the ranks' report %s is unreadable (%s): the run is unknown",
                    RunReport.from_json)

    def run_paths(self, default: RunPaths | None = None) -> RunPaths | None:
        """The run's directory as rank 0 reported it, else ``default`` (no report yet)."""
        report = self.read()
        return default if report is None else RunPaths(Path(report.run_dir))

    def requeue(self, default: RequeueConfig) -> RequeueConfig:
        """The run's requeue settings (its restart budget, its no-progress guard) as rank 0
        reported them over ``default``'s: the one reading of them for every supervisor."""
        report = self.read()
        said = {} if report is None else {k: v for k, v in report.requeue.items()
                                          if k in RequeueConfig.__dataclass_fields__}
        try:
            return replace(default, **said) if said else default
        except (TypeError, ValueError) as e:
            _log.warning("the ranks' requeue settings are unusable (%s): using the supervisor's", e)
            return default

    # ------------------------------------------------------------------ the launch

    def begin_launch(self, restarts: int) -> None:
        """Before a launch: this supervisor started the ranks ``restarts`` times before."""
        tell(self.root / _LAUNCH, {"restarts": int(restarts), "t": time.time()},
             "the ranks their restart count")

    def restarts(self) -> int | None:
        """How often the supervisor started the ranks before this launch (None: not said)."""
        data = hear(self.root / _LAUNCH)
        return count(data.get("restarts")) if isinstance(data, dict) else None

    def begin_relaunch(self, index: int, t: float | None = None) -> None:
        """Before a launch: it is relaunch in place ``index``, launched at ``t`` (default now)."""
        tell(self._own / _RELAUNCH, {"index": int(index), "t": time.time() if t is None else float(t)},
             "the ranks their relaunch")

    def relaunched(self) -> Relaunched | None:
        """Which relaunch in place the supervisor said this launch is (None: not said)."""
        data = hear(self._own / _RELAUNCH)
        index = count(data.get("index")) if isinstance(data, dict) else None
        if index is None:
            return None
        t = data.get("t")
        ok = isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1e11
        return Relaunched(index, float(t) if ok else None)

    def offer_rendezvous(self, rendezvous: Mapping[str, Any] | None) -> None:
        """A torchrun agent's channel: the rendezvous it would relaunch its workers in
        (``standby.Relaunch``'s fields) and the job's channel it belongs to."""
        agent = self.agent     # set: only an agent's channel (for_agent) offers one
        tell(agent / _AGENT, {"job": None if agent == self.root else str(self.root),
                              "rendezvous": None if rendezvous is None else dict(rendezvous)},
             "the workers the rendezvous")

    def rendezvous(self) -> dict[str, Any] | None:
        """The rendezvous this process's torchrun agent offers (None: not under one)."""
        data = hear(self.agent / _AGENT) if self.agent is not None else None
        found = data.get("rendezvous") if isinstance(data, dict) else None
        return found if isinstance(found, dict) else None

    def remove_agent(self) -> None:
        """The agent is done: its own directory goes (the whole channel when it was private)."""
        if self.agent is not None:
            shutil.rmtree(self.agent, ignore_errors=True)
            if self.agent.parent.name == _AGENTS_DIR:
                with contextlib.suppress(OSError):   # agents/, when this was its last agent
                    self.agent.parent.rmdir()

    # ------------------------------------------------------------------ the ranks' hang words

    def note_hang_seen(self, launch: str, rank: int) -> None:
        """This rank's hang watchdog ran in Python (it is not hung with the GIL held)."""
        _mark(self.root / _HANG_SEEN / launch, (rank,))

    def hang_seen(self, launch: str) -> set[int]:
        """The ranks of launch ``launch`` whose hang watchdog said so."""
        return _marked(self.root / _HANG_SEEN / launch)

    def note_ranks_died(self, launch: str, ranks: Iterable[int]) -> None:
        """Ranks of launch ``launch`` that this rank saw die without a word."""
        _mark(self.root / _DIED / launch, ranks)

    def ranks_died(self, launch: str) -> set[int]:
        """The ranks of launch ``launch`` that a survivor saw die without a word."""
        return _marked(self.root / _DIED / launch)

    # ------------------------------------------------------------------ the supervisor's memory

    def train_nodes(self) -> int | None:
        """The nodes the training of this job ran on before a requeue (None: not recorded)."""
        return count(hear(self.root / _TRAIN_NODES), 1)

    def record_train_nodes(self, nodes: int) -> None:
        """Remember that this job trains on ``nodes`` nodes (for its requeued self)."""
        tell(self.root / _TRAIN_NODES, int(nodes), "the requeued job its nodes", durable=True)

    def remove(self) -> None:
        """The job is over for good: its channel goes."""
        shutil.rmtree(self.root, ignore_errors=True)
        if self.root.parent.name.startswith(_JOBS_DIR):
            with contextlib.suppress(OSError):   # .kempner-resilience(-<uid>)/, after its last job
                self.root.parent.rmdir()


@dataclass
class Progress:
    """The no-progress guard's evidence over a supervisor's launches, for every backend: the
    newest commit at a launch's start and now. With no run known there is no guard."""

    channel: Channel | None
    fallback: RunPaths | None = None     # the run's directory before rank 0 reports one
    max_no_progress: int = 2             # until the run says its own
    before: int | None = None            # the newest commit when this launch started
    stalled: int = 0                     # the policy's ``Decision.stalled``, carried

    def run_paths(self) -> RunPaths | None:
        """The run's directory: as rank 0 reported it, else ``fallback``."""
        return self.fallback if self.channel is None else self.channel.run_paths(self.fallback)

    def starting(self) -> None:
        """A launch starts: the run's newest commit is the guard's baseline."""
        self.before = newest_commit(self.run_paths())

    def guard(self) -> dict[str, Any]:
        """``Evidence``'s ``commits``, ``stalled`` and ``max_no_progress`` (empty: unknown)."""
        paths = self.run_paths()
        if paths is None or self.channel is None:
            return {}
        return {"commits": Commits(self.before, newest_commit(paths)), "stalled": self.stalled,
                "max_no_progress": self.channel.requeue(RequeueConfig(
                    max_no_progress=self.max_no_progress)).max_no_progress}

    def carry(self, decision: Decision) -> Decision:
        """Carry ``decision``'s count to the next launch; returns it."""
        self.stalled = decision.stalled
        return decision


def relaunched(environ: Mapping[str, str] | None = None) -> Relaunched:
    """Which relaunch in place this process's launch is: as its channel says, else the
    deprecated variables (``legacy_env.py``), else the first launch."""
    from kempner_resilience.supervise.legacy_env import relaunch_by_hand

    channel = Channel.from_env(environ)
    said = channel.relaunched() if channel is not None else None
    by_hand = relaunch_by_hand(environ) if said is None else None
    return said or (Relaunched(*by_hand) if by_hand is not None else Relaunched())


def launch_name(environ: Mapping[str, str] | None = None) -> str:
    """This launch of the ranks within the job: ``<requeues>.<relaunches in place>``."""
    env = os.environ if environ is None else environ
    return f"{env.get('SLURM_RESTART_COUNT') or 0}.{relaunched(environ).index}"


def report_now(channel: Channel, run_dir: str | os.PathLike[str], *, run_id: str | None,
               committed: int | None, code: int | None, requeue: Mapping[str, Any]) -> None:
    """Rank 0's report with this host, process and time (``Channel.report``)."""
    channel.report(RunReport(str(Path(run_dir).resolve()), run_id, committed, code,
                             dict(requeue), os.uname().nodename, os.getpid(), time.time()))
