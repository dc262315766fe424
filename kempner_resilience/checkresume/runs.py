"""One run of the user's script for ``check-resume``: N local ranks, a fresh checkpoint directory,
planned stops, relaunched after each as ``kempner-resilience launch`` would, bounded in time.

The script is run as the user would run it (same command, same working directory) under the
local launcher (``supervise/local/launcher.py``). What reaches it is only the package's own
environment: ``$KEMPNER_RESILIENCE_CONFIG`` names a config made for this run (the user's
``--config``/``--set`` with the checkpoint directory replaced by a fresh one, a commit at every
step, nothing deleted), ``$KEMPNER_RESILIENCE_REHEARSAL`` plans the stops
(``stop/rehearsal.py``), ``$KEMPNER_RESILIENCE_REPORT`` brings each launch's report back. A
script that loads its config from a file of its own ignores the first; the directory given
is named again in ``$KEMPNER_RESILIENCE_CHECK_DIR``, and a run whose resolved
``checkpoint.dir`` is another (the script's own: its real run) refuses to start before it
writes anything (exit 78, ``stop/rehearsal.py``).

The whole run gets ``timeout_s``: then the launcher is sent SIGTERM, which it forwards to every
rank (a checkpoint, 143), and ranks still alive after ``stop_timeout_s`` are killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from kempner_resilience.checkpoint import layout
from kempner_resilience.core.fileio import write_atomic
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.supervise.local.launcher import Launch, LocalLauncher, warm_parent
from kempner_resilience.supervise.local.warm import Forker
from kempner_resilience.core.ledger import REPORT_ENV
from kempner_resilience.stop.rehearsal import (CHECK_DIR_ENV, EVENTS_ENV, REHEARSAL_ENV,
                                               PlannedStop, encode)

__all__ = ["LaunchSummary", "RunResult", "run_script", "run_config", "warm_ranks"]

log = get_logger(__name__)

_KEEP_ALL = 1_000_000      # checkpoint.keep_last: every step's checkpoint is compared


@dataclass(frozen=True)
class LaunchSummary:
    """What one launch of the ranks did, from the launcher and rank 0's report."""

    index: int
    exit_codes: tuple[int, ...]
    code: int
    start_step: int | None
    stop_step: int | None
    ending: str | None
    run_dir: str | None          # the directory rank 0 said it uses (None: it said nothing)


@dataclass
class RunResult:
    """One run of the script: its launches, its committed checkpoints by step, its logs."""

    name: str
    root: Path                                   # the checkpoint directory given to the script
    logs: Path
    launches: list[LaunchSummary] = field(default_factory=list)
    committed: dict[int, Path] = field(default_factory=dict)
    timed_out: bool = False
    wall_s: float = 0.0                          # how long its launches took, all together

    @property
    def events_file(self) -> Path:
        """Where rank 0 wrote the epoch ends and milestones it saw (``run/events.py``)."""
        return self.logs.parent / "events.jsonl"

    def log_text(self) -> str:
        """Rank 0's log of the last launch ('' when there is none)."""
        if not self.launches:
            return ""
        try:
            return (self.logs / f"rank0.{self.launches[-1].index}.log").read_text(
                errors="replace")
        except OSError:
            return ""

    def said(self, phrases: Sequence[str]) -> list[str]:
        """Our own lines of this run's logs (every rank, every launch) that contain one of
        ``phrases``, the message only, each once, in order."""
        out: list[str] = []
        for path in sorted(self.logs.glob("rank*.log")):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                if "kempner_resilience" not in line and "[rank " not in line:
                    continue
                message = line.split("] ", 1)[-1].strip()
                if any(p in message for p in phrases) and message not in out:
                    out.append(message)
        return out

    def log_tail(self, lines: int = 12) -> str:
        """The end of rank 0's log of the last launch, indented, for a failure message."""
        return "\n".join(f"    {line}" for line in self.log_text().splitlines()[-lines:])


def run_config(base: Mapping[str, Any], root: Path, every_steps: int = 1) -> dict[str, Any]:
    """The user's resolved config (``ResilienceConfig.to_dict()``) made for one check run: its
    own checkpoint directory, a commit at every step and none deleted (every step is compared),
    saves in the foreground (a commit per step, in step order), SIGTERM a stop (the final one).
    ``every_steps`` 0: only the stops' checkpoints (a killed rank's survivors then write the
    rescue checkpoint of that step, which a commit at every step would leave nothing to do)."""
    cfg = json.loads(json.dumps(base))         # a deep copy of plain data
    ckpt = cfg.setdefault("checkpoint", {})
    ckpt.update({"dir": str(root), "every_steps": every_steps, "every_minutes": 0.0,
                 "keep_last": _KEEP_ALL, "keep_every": 0, "async": False, "resume": True})
    actions = cfg.setdefault("signals", {}).setdefault("actions", {})
    actions["SIGTERM"] = "stop"
    return cfg


def _committed(root: Path) -> dict[int, Path]:
    """The newest committed checkpoint of each step in ``root``."""
    out: dict[int, Path] = {}
    for entry in layout.scan(RunPaths(root)):      # oldest first: the newest of a step wins
        if entry.committed:
            out[entry.step] = entry.path
    return out


class _Deadline:
    """SIGTERM to this process when the run overruns, and a second one ``FORCE_AFTER_S`` later:
    the launcher forwards each to every rank, and a repeated SIGTERM forces a rank out at once
    (a rank stuck inside a step never reaches the boundary where the first one would stop it;
    the launcher kills what is left after its stop timeout). This process's own SIGTERM handler
    is a no-op while the run lasts, so a deadline that fires as the launcher hands its handler
    back cannot end check-resume itself."""

    FORCE_AFTER_S = 2.0

    def __init__(self, timeout_s: float) -> None:
        self.fired = False
        self._lock = threading.Lock()
        self._armed = True
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        with self._lock:
            if not self._armed:
                return
            again = not self.fired
            self.fired = True
            os.kill(os.getpid(), signal.SIGTERM)
            if again:
                self._timer = threading.Timer(self.FORCE_AFTER_S, self._fire)
                self._timer.daemon = True
                self._timer.start()

    def __enter__(self) -> "_Deadline":
        self._previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._armed = False
        self._timer.cancel()
        signal.signal(signal.SIGTERM, self._previous)


@contextlib.contextmanager
def warm_ranks(command: Sequence[str], ranks: int) -> Iterator[Forker | None]:
    """The warm-start process every run of one check forks its ranks from (None: the command
    starts cold, ``supervise/local/warm.py``): torch's import is paid once per check, not
    once per run; ended when the check is."""
    zygote = warm_parent(command, ranks)
    try:
        yield zygote
    finally:
        if zygote is not None:
            zygote.close()


def run_script(command: list[str], *, name: str, work: Path, ranks: int,
               stops: list[PlannedStop], relaunches: int, config: Mapping[str, Any],
               timeout_s: float, stop_timeout_s: float = 20.0,
               relaunch_codes: frozenset[int] = frozenset(), every_steps: int = 1,
               zygote: Forker | None = None) -> RunResult:
    """Run ``command`` on ``ranks`` local ranks in ``work/name`` with the planned ``stops``,
    relaunching at most ``relaunches`` times (after a code in ``relaunch_codes`` or the
    launch-side policy's run-again codes), within ``timeout_s``; warm ranks fork from
    ``zygote`` (``warm_ranks``) when given. Must run on the main thread (the launcher takes
    SIGINT/SIGTERM there)."""
    base = work / name
    root, logs = base / "checkpoints", base / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cfg_path, report = base / "config.yaml", base / "report.json"
    import yaml

    write_atomic(cfg_path, yaml.safe_dump(run_config(config, root, every_steps), sort_keys=False),
                 durable=False)
    env = {"KEMPNER_RESILIENCE_CONFIG": str(cfg_path), REHEARSAL_ENV: encode(stops),
           REPORT_ENV: str(report), CHECK_DIR_ENV: str(root)}
    result = RunResult(name, root, logs)
    env[EVENTS_ENV] = str(result.events_file)
    holder: list[LocalLauncher] = []

    def told(launch: Launch) -> None:
        data: dict[str, Any] = {}
        try:
            data = json.loads(report.read_text())
            report.unlink()
        except (OSError, ValueError):
            pass
        said = holder[0].channel.read() if holder and holder[0].channel else None
        result.launches.append(LaunchSummary(
            launch.index, tuple(launch.exit_codes), launch.exit_code, data.get("start_step"),
            data.get("stop_step"), data.get("ending"), None if said is None else said.run_dir))
        log.info("check-resume: %s run, launch %d: ranks exited %s", name, launch.index + 1,
                 launch.exit_codes)

    from kempner_resilience.supervise.policy import RUN_AGAIN

    again = frozenset(int(c) for c in RUN_AGAIN) | relaunch_codes
    launcher = LocalLauncher(list(command), ranks=ranks, workdir=None,
                             max_launches=relaunches + 1, on_launch=told,
                             relaunch_codes=again, stop_timeout_s=stop_timeout_s,
                             log_dir=logs, env=env, zygote=zygote)
    holder.append(launcher)
    began = time.monotonic()
    with _Deadline(timeout_s) as deadline:
        launcher.run()
    result.wall_s = time.monotonic() - began
    result.timed_out = deadline.fired
    result.committed = _committed(root)
    return result
