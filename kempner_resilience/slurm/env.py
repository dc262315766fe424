"""What SLURM tells a process about its job, and the torch.distributed variables derived from it.

Everything here reads an environment mapping passed in (default ``os.environ``), so it can be
tested from plain dicts; only ``end_time``/``signal_spec``/``first_host`` ask ``scontrol``, each
with a time limit.
"""

from __future__ import annotations

import os
import re
import signal as _signal
import socket
import zlib
from dataclasses import dataclass
from typing import Mapping, MutableMapping

from kempner_resilience.core.log import get_logger
from kempner_resilience.slurm.scontrol import parse_slurm_time, run_scontrol, show_job

__all__ = ["SlurmJob", "SignalSpec", "parse_signal_spec", "expand_hostlist", "first_host",
           "master_port", "tasks_per_node", "setup_torch_env", "node_name", "short_host"]

_log = get_logger(__name__)

# Where MASTER_PORT is taken from: clear of the well-known ports and of Linux's default ephemeral
# range (32768-60999 starts inside it, so stay mostly below; collisions need two jobs on the same
# first node whose ids differ by a multiple of the span).
PORT_BASE = 20000
PORT_SPAN = 12000


def _int(environ: Mapping[str, str], name: str) -> int | None:
    val = environ.get(name, "").strip()
    return int(val) if val.lstrip("-").isdigit() else None


@dataclass(frozen=True)
class SignalSpec:
    """A job's ``--signal=[{R|B}:]SIG[@T]``: which signal, how many seconds early, and to whom.

    ``batch_only`` is the ``B:`` flag: then only the batch shell gets the signal, never the srun
    tasks. ``source`` says where the spec was read from (scontrol, batch_script, env).
    """

    signal: str
    lead_s: int
    batch_only: bool = False
    reservation: bool = False
    source: str = ""

    def __str__(self) -> str:
        flags = ("B" if self.batch_only else "") + ("R" if self.reservation else "")
        return f"{flags + ':' if flags else ''}{self.signal.removeprefix('SIG')}@{self.lead_s}"


_SPEC = re.compile(r"^(?:(?P<flags>[RBrb]+):)?(?P<sig>[A-Za-z0-9+]+)(?:@(?P<t>\d+))?$")


def parse_signal_spec(text: str, source: str = "") -> SignalSpec | None:
    """``"B:USR1@120"`` -> SignalSpec; None when ``text`` is not a valid ``--signal`` value.

    SLURM's default lead time when ``@T`` is omitted is 60 s.
    """
    m = _SPEC.match(text.strip())
    if not m:
        return None
    sig = m.group("sig").upper()
    try:
        name = _signal.Signals(int(sig)).name if sig.isdigit() else (
            sig if sig.startswith("SIG") else "SIG" + sig)
        _signal.Signals[name]
    except (KeyError, ValueError):
        return None
    flags = (m.group("flags") or "").upper()
    return SignalSpec(name, int(m.group("t") or 60), "B" in flags, "R" in flags, source)


# `#SBATCH --signal=X` / `#SBATCH --signal X` in a batch script's leading comment block.
_SBATCH_SIGNAL = re.compile(r"^#SBATCH\s+.*?--signal(?:=|\s+)(\S+)")


def _signal_from_script(script: str) -> tuple[bool, SignalSpec | None]:
    """(script had a #SBATCH block, its last --signal) — later directives win, as in sbatch."""
    found: SignalSpec | None = None
    seen_sbatch = False
    for line in script.splitlines():
        s = line.strip()
        if not s:
            continue
        if not s.startswith("#"):
            break  # sbatch stops reading directives at the first command
        if s.startswith("#SBATCH"):
            seen_sbatch = True
            m = _SBATCH_SIGNAL.match(s)
            if m:
                found = parse_signal_spec(m.group(1).strip("'\""), "batch_script") or found
    return seen_sbatch, found


@dataclass(frozen=True)
class SlurmJob:
    """This process's view of its SLURM job (``from_env`` reads it; None outside SLURM)."""

    job_id: str
    array_job_id: str | None = None
    array_task_id: str | None = None
    restart_count: int = 0
    procid: int | None = None
    ntasks: int | None = None
    localid: int | None = None
    nodeid: int | None = None
    nnodes: int | None = None
    nodelist: str | None = None
    partition: str | None = None
    step_id: str | None = None
    task_pid: int | None = None
    tasks_per_node: str | None = None
    open_mode: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SlurmJob | None":
        """Read the ``SLURM_*`` variables; None when ``SLURM_JOB_ID`` is not set."""
        env = os.environ if environ is None else environ
        job_id = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
        if not job_id:
            return None
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
        return cls(
            job_id=job_id,
            array_job_id=env.get("SLURM_ARRAY_JOB_ID") or None,
            array_task_id=env.get("SLURM_ARRAY_TASK_ID") or None,
            # Unset (not 0) on the first run; incremented by every requeue.
            restart_count=_int(env, "SLURM_RESTART_COUNT") or 0,
            procid=_int(env, "SLURM_PROCID"),
            ntasks=_int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS"),
            localid=_int(env, "SLURM_LOCALID"),
            nodeid=_int(env, "SLURM_NODEID"),
            nnodes=_int(env, "SLURM_STEP_NUM_NODES") or _int(env, "SLURM_JOB_NUM_NODES")
            or _int(env, "SLURM_NNODES"),
            nodelist=env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            or env.get("SLURM_NODELIST") or None,
            partition=env.get("SLURM_JOB_PARTITION") or None,
            step_id=step.strip() if step else None,
            task_pid=_int(env, "SLURM_TASK_PID"),
            tasks_per_node=env.get("SLURM_STEP_TASKS_PER_NODE")
            or env.get("SLURM_TASKS_PER_NODE") or None,
            open_mode=env.get("SLURM_OPEN_MODE") or None,
        )

    @property
    def is_array_task(self) -> bool:
        return self.array_job_id is not None and self.array_task_id is not None

    @property
    def requeue_id(self) -> str:
        """The id ``scontrol requeue`` needs: ``ARRAYJOB_TASK`` for array tasks, else the job id."""
        if self.is_array_task:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @property
    def in_step(self) -> bool:
        """True for a task launched by ``srun`` (a numbered job step), not the batch script."""
        return self.step_id is not None and self.step_id.isdigit()

    def show(self, timeout: float = 10.0,
             environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
        """``scontrol show job`` for this job as a dict, or None (no scontrol, timeout, error).
        ``environ``: the environment scontrol runs with (its PATH finds scontrol)."""
        return show_job(self.requeue_id, timeout, environ=environ)

    def end_time(self, timeout: float = 10.0) -> float | None:
        """When the job's time limit ends, in epoch seconds; None when unknown.

        The time-limit warning signal comes ``lead`` to ``lead + 30`` s before this (SLURM checks
        limits every 30 s); preemption can end the job earlier.
        """
        info = self.show(timeout)
        if info is None or info.get("TimeLimit") in ("UNLIMITED", "Partition_Limit"):
            return None
        return parse_slurm_time(info.get("EndTime"))

    def signal_spec(self, timeout: float = 10.0,
                    environ: Mapping[str, str] | None = None) -> tuple[bool, SignalSpec | None]:
        """The job's ``--signal``, as far as it can be known: ``(known, spec)``.

        ``known`` is False when nothing could be read (then ``spec`` is None too); ``known`` True
        with ``spec`` None means the job has no ``--signal``. Sources, in order: a ``Signal=``
        field of ``scontrol show job`` (newer SLURM), ``SBATCH_SIGNAL`` (sbatch's environment
        input, copied into the job), the stored batch script's ``#SBATCH --signal`` lines
        (``scontrol write batch_script``; an ``sbatch --signal`` command-line option is not
        visible there).
        """
        env = os.environ if environ is None else environ
        info = self.show(timeout, environ)
        if info is not None and info.get("Signal"):
            return True, parse_signal_spec(info["Signal"], "scontrol")
        if env.get("SBATCH_SIGNAL"):
            return True, parse_signal_spec(env["SBATCH_SIGNAL"], "env")
        res = run_scontrol(["write", "batch_script", self.requeue_id, "-"], timeout,
                           environ=environ)
        if res.ok:
            seen, spec = _signal_from_script(res.stdout)
            if seen or spec:
                return True, spec
            return True, None
        _log.debug("cannot read the batch script: %s", res.describe())
        return False, None


# ------------------------------------------------------------------------- host lists

def _split_top(text: str) -> list[str]:
    """Split ``a[1-2],b,c[3,5]`` on commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in (s.strip() for s in parts) if p]


def _expand_one(expr: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", expr)
    if not m:
        return [expr]
    head, tail = expr[:m.start()], expr[m.end():]
    out = []
    for rng in m.group(1).split(","):
        lo, sep, hi = rng.strip().partition("-")
        if sep:
            width = len(lo)  # zero padding is kept: node[01-03] -> node01..node03
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        else:
            values = [lo]
        for v in values:
            out.extend(_expand_one(head + v + tail))  # further brackets, e.g. rack[1-2]-n[1-2]
    return out


def expand_hostlist(nodelist: str) -> list[str]:
    """Pure-Python ``scontrol show hostnames``: ``"gpu[01-03,07],cpu1"`` -> 5 host names."""
    hosts: list[str] = []
    for part in _split_top(nodelist):
        hosts.extend(_expand_one(part))
    return hosts


def first_host(nodelist: str, timeout: float = 10.0) -> str:
    """The first host of a SLURM node list (``scontrol show hostnames``, else the own parser)."""
    res = run_scontrol(["show", "hostnames", nodelist], timeout)
    if res.ok and res.stdout.split():
        return res.stdout.split()[0]
    hosts = expand_hostlist(nodelist)
    if not hosts:
        raise ValueError(f"empty node list {nodelist!r}")
    return hosts[0]


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This node's name as SLURM knows it (``$SLURMD_NODENAME``), else the host name."""
    return (os.environ if environ is None else environ).get("SLURMD_NODENAME") \
        or socket.gethostname()


def short_host(host: str) -> str:
    """A host name as SLURM names nodes: up to its first dot."""
    return host.split(".")[0]


def master_port(job_id: str | int) -> int:
    """A rendezvous port derived from the job id: every rank computes the same one, and
    concurrent jobs sharing a first node get different ones."""
    text = str(job_id)
    # Plain integer ids map linearly (neighbouring jobs never collide); anything else is hashed.
    num = int(text) if text.isdigit() else zlib.crc32(text.encode())
    return PORT_BASE + num % PORT_SPAN


def tasks_per_node(spec: str | None, nodeid: int | None) -> int | None:
    """Tasks on node ``nodeid`` from ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"`` form)."""
    if not spec or nodeid is None:
        return None
    idx = 0
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        count, reps = int(m.group(1)), int(m.group(2) or 1)
        if nodeid < idx + reps:
            return count
        idx += reps
    return None


def setup_torch_env(job: SlurmJob | None = None,
                    environ: MutableMapping[str, str] | None = None,
                    timeout: float = 10.0) -> dict[str, str]:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from SLURM.

    For ranks launched directly by ``srun`` (one task per GPU, no torchrun). Values a launcher
    already set are kept. Returns the variables this call set. Does nothing outside SLURM.
    """
    env = os.environ if environ is None else environ
    if job is None:
        job = SlurmJob.from_env(env)
    if job is None:
        return {}
    if not job.in_step and (job.ntasks or 1) > 1:
        # The batch script (or a child of it) of a multi-task job is not one of the ranks:
        # SLURM_PROCID=0 there would make it a second rank 0.
        _log.warning("not an srun task of a %s-task job: RANK/WORLD_SIZE not set; launch the "
                     "ranks with srun", job.ntasks)
        return {}
    wanted: dict[str, object] = {
        "RANK": job.procid,
        "WORLD_SIZE": job.ntasks,
        "LOCAL_RANK": job.localid,
        "LOCAL_WORLD_SIZE": tasks_per_node(job.tasks_per_node, job.nodeid),
        "MASTER_PORT": master_port(job.job_id),
    }
    set_now: dict[str, str] = {}
    for key, val in wanted.items():
        if val is not None and not env.get(key):
            env[key] = set_now[key] = str(val)
    if not env.get("MASTER_ADDR") and job.nodelist:
        try:
            env["MASTER_ADDR"] = set_now["MASTER_ADDR"] = first_host(job.nodelist, timeout)
        except ValueError as e:
            _log.warning("cannot derive MASTER_ADDR: %s", e)
    if set_now:
        _log.debug("torch env from SLURM: %s", set_now)
    return set_now
