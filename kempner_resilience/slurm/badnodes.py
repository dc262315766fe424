"""The run's memory of bad nodes: nodes implicated in a failure stay out for the rest of the run.

A node whose rank died or hung is recorded in ``bad-nodes.json`` next to the checkpoints
(``checkpoint.dir``), so the record outlives the job's processes, its in-job relaunches and its
requeues. Who writes: the code that detects the failure (the batch job's relaunch glue, the
survivors' rescue) calls ``record_bad_nodes``. Who reads: the relaunch glue (``srun --exclude``,
``exclude_args``), the requeue path (``exclude_for_requeue``, so that SLURM never starts the job
again on them even once they are IDLE), and a new attempt's start (``check_allocation``: a clear
line when SLURM itself requeued the job onto a recorded node).

The file is small JSON, replaced whole (``fileio.write_atomic``); concurrent writers are
serialised by an advisory lock on a sidecar file, waited on for at most a few seconds (a holder
that hangs costs only the lock, never the record: the write goes ahead unlocked, logged). A
missing file means no bad nodes; a malformed one is logged and read as none: a lost memory costs
at most a relaunch on a bad node, never the checkpoint.

The SLURM mechanism (proved on the test cluster, ``tests/test_slurm_badnodes.py``): a running
job's excluded nodes cannot be changed (``scontrol update JobId=J ExcNodeList=...`` answers
"Job is no longer pending execution"). Right after ``scontrol requeue J`` the job is PENDING
(still completing while any of its processes run, the caller's included, so it cannot start
again before the update lands), and there the update is accepted; the requeued job is then
never placed on those nodes, IDLE or not. ``exclude_for_requeue`` runs that update.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from kempner_resilience.fileio import write_atomic
from kempner_resilience.log import get_logger
from kempner_resilience.slurm.env import expand_hostlist
from kempner_resilience.slurm.scontrol import ScontrolResult, parse_show_job, run_scontrol

__all__ = ["BAD_NODES_NAME", "record_bad_nodes", "bad_nodes", "bad_node_records",
           "exclude_for_requeue", "merged_exclusions", "exclude_args", "check_allocation"]

_log = get_logger(__name__)

BAD_NODES_NAME = "bad-nodes.json"
_LOCK_NAME = ".bad-nodes.lock"
_LOCK_WAIT_S = 5.0

#: ``scontrol`` as ``exclude_for_requeue`` calls it: (args, timeout) -> result.
Scontrol = Callable[[Sequence[str], float], ScontrolResult]


def _path(ckpt_dir: str | os.PathLike[str]) -> Path:
    return Path(ckpt_dir) / BAD_NODES_NAME


def bad_node_records(ckpt_dir: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """node -> {reason, job_id, t (first recorded), last_t, count}; empty when none are
    recorded or the file is unreadable (logged)."""
    p = _path(ckpt_dir)
    try:
        data = json.loads(p.read_text())
        nodes = data["nodes"]
        if not isinstance(nodes, dict) or not all(isinstance(k, str) and k for k in nodes):
            raise ValueError("'nodes' is not a mapping of node names")
        return {k: dict(v) if isinstance(v, dict) else {} for k, v in nodes.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError) as e:
        _log.warning("bad-node record %s unreadable (%s); treating it as empty: nodes that "
                     "failed before may be used again (remove or fix the file to silence this)",
                     p, e)
        return {}


def bad_nodes(ckpt_dir: str | os.PathLike[str]) -> set[str]:
    """Every node recorded so far (empty if none; a malformed file: warned, read as empty)."""
    return set(bad_node_records(ckpt_dir))


@contextlib.contextmanager
def _locked(ckpt_dir: Path) -> Iterator[None]:
    """An advisory lock on the sidecar file, waited on for at most ``_LOCK_WAIT_S``."""
    fd = None
    try:
        fd = os.open(ckpt_dir / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    _log.warning("bad-node record: lock %s not taken (%s); writing unlocked",
                                 ckpt_dir / _LOCK_NAME, e)
                    break
                time.sleep(0.02)
    except OSError as e:  # a read-only or lock-less filesystem: the write itself will tell
        _log.debug("bad-node lock unavailable: %s", e)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)   # releases the lock


def record_bad_nodes(ckpt_dir: str | os.PathLike[str], nodes: Iterable[str], *, reason: str,
                     job_id: str | None) -> set[str]:
    """Add ``nodes`` (with why and when) to the run's record; returns the whole set now
    recorded. Idempotent: a node recorded again keeps its first reason and time, and counts.
    Raises OSError only when the record cannot be written (the caller logs and goes on)."""
    new = {n.strip() for n in nodes if n and n.strip()}
    d = Path(ckpt_dir)
    if not new:
        return bad_nodes(d)
    d.mkdir(parents=True, exist_ok=True)
    now = round(time.time(), 3)
    with _locked(d):
        records = bad_node_records(d)
        for n in sorted(new):
            rec = records.get(n)
            if rec is None:
                records[n] = {"reason": reason, "job_id": job_id, "t": now, "last_t": now,
                              "count": 1}
            else:
                rec["last_t"] = now
                rec["count"] = int(rec.get("count", 1)) + 1
        write_atomic(_path(d), json.dumps({"version": 1, "nodes": records}, indent=1,
                                          sort_keys=True))
    _log.warning("node(s) %s recorded as bad (%s); the run keeps them out from now on "
                 "(%s)", ",".join(sorted(new)), reason, _path(d))
    return set(records)


def merged_exclusions(current: str | None, nodes: Iterable[str]) -> str:
    """The job's ``ExcNodeList`` (``current``, a hostlist, None/``(null)`` when empty) with
    ``nodes`` added: a comma-separated, sorted list (scontrol accepts it as is)."""
    have: set[str] = set()
    if current and current not in ("(null)", "None", "N/A"):
        have = set(expand_hostlist(current))
    return ",".join(sorted(have | set(nodes)))


def _shielded_scontrol(args: Sequence[str], timeout: float) -> ScontrolResult:
    # The requeue we follow makes slurmstepd SIGTERM every process of the job (our scontrol
    # included) a few milliseconds later; the update must not die of it.
    return run_scontrol(list(args), timeout, shield=True)


def exclude_for_requeue(job_id: str, nodes: set[str] | Iterable[str], *,
                        scontrol: Scontrol | None = None, timeout: float = 10.0,
                        current: str | None = None) -> ScontrolResult | None:
    """Make SLURM keep the job off ``nodes`` when it runs again after a requeue.

    Call it right AFTER ``scontrol requeue`` succeeded (while the job is pending; a running
    job's exclusions cannot change). Sets ``ExcNodeList`` to the job's current exclusions
    (``current``, else read with ``scontrol show job``) plus ``nodes``. Returns the update's
    result (None when there is nothing to exclude); never raises: a failure is logged with the
    fix, and the requeue stands without the exclusion."""
    wanted = {n for n in nodes if n}
    if not wanted:
        return None
    call: Scontrol = scontrol or _shielded_scontrol
    if current is None:
        shown = call(["show", "-o", "job", str(job_id)], timeout)
        if shown.ok:
            jobs = parse_show_job(shown.stdout)
            current = jobs[0].get("ExcNodeList") if jobs else None
    value = merged_exclusions(current, wanted)
    res = call(["update", f"JobId={job_id}", f"ExcNodeList={value}"], timeout)
    if res.ok:
        _log.warning("job %s will not run on %s again (ExcNodeList=%s)", job_id,
                     ",".join(sorted(wanted)), value)
    else:
        text = (res.stderr + res.stdout).lower()
        if "not pending" in text or "no longer pending" in text:
            fix = ("the job was not pending: exclusions can only change after `scontrol "
                   "requeue` (a bug if you see this after one)")
        elif "access" in text or "permission" in text or "not authorized" in text:
            fix = ("the site does not let users update their jobs' ExcNodeList; ask the admins "
                   "to drain the node(s), or resubmit with `sbatch --exclude=...`")
        else:
            fix = "resubmit with `sbatch --exclude=...` if the job lands on them again"
        _log.error("could not keep job %s off bad node(s) %s after the requeue: %s. The "
                    "requeue and the checkpoint stand; fix: %s", job_id,
                    ",".join(sorted(wanted)), res.describe(), fix)
    return res


def exclude_args(ckpt_dir: str | os.PathLike[str], allocation: Iterable[str],
                 needed: int) -> list[str]:
    """``srun`` arguments keeping a step off the recorded bad nodes of ``allocation`` when the
    rest still holds ``needed`` nodes (``["--exclude=a,b"]``), else ``[]`` (logged)."""
    nodes = list(allocation)
    bad = sorted(bad_nodes(ckpt_dir) & set(nodes))
    if not bad:
        return []
    if len(nodes) - len(bad) < needed:
        _log.error("the allocation %s holds recorded bad node(s) %s, and only %d good node(s) "
                   "for the %d needed: training runs on them anyway", ",".join(nodes),
                   ",".join(bad), len(nodes) - len(bad), needed)
        return []
    return [f"--exclude={','.join(bad)}"]


def check_allocation(ckpt_dir: str | os.PathLike[str], hosts: Iterable[str]) -> set[str]:
    """The recorded bad nodes among this attempt's ``hosts``, each named in one warning (a
    requeue SLURM did itself, after a node failure, had no rank left to exclude them)."""
    records = bad_node_records(ckpt_dir)
    here = sorted(set(hosts) & set(records))
    for n in here:
        r = records[n]
        _log.warning("this attempt runs on node %s, recorded bad (%s, job %s): SLURM requeued "
                     "the job onto it (a requeue we did would have excluded it); if it fails "
                     "again, ask the admins to drain it or resubmit with --exclude=%s", n,
                     r.get("reason", "?"), r.get("job_id", "?"), n)
    return set(here)
