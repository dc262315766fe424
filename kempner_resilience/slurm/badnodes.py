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
import dataclasses
import errno
import fcntl
import json
import os
import subprocess
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

from kempner_resilience.core.fileio import load_json_bounded, write_atomic
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.slurm.env import expand_hostlist, node_name
from kempner_resilience.slurm.scontrol import (ScontrolResult, find_scontrol, parse_show_job,
                                               run_scontrol)

__all__ = ["record_bad_nodes", "bad_nodes", "bad_node_records",
           "exclude_for_requeue", "requeue_excluding", "merged_exclusions", "exclude_args",
           "check_allocation"]

_log = get_logger(__name__)

_LOCK_WAIT_S = 5.0

#: ``scontrol`` as ``exclude_for_requeue`` calls it: (args, timeout) -> result.
Scontrol = Callable[[Sequence[str], float], ScontrolResult]


def bad_node_records(paths: RunPaths) -> dict[str, dict[str, Any]]:
    """node -> {reason, job_id, t (first recorded), last_t, count}; empty when none are
    recorded or the file is unreadable (logged)."""
    p = paths.bad_nodes
    try:
        data = load_json_bounded(p)        # bounded: a FIFO or /dev/zero is unreadable
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


def bad_nodes(paths: RunPaths) -> set[str]:
    """Every node recorded so far (empty if none; a malformed file: warned, read as empty)."""
    return set(bad_node_records(paths))


@contextlib.contextmanager
def _locked(paths: RunPaths) -> Iterator[None]:
    """An advisory lock on the sidecar file, waited on for at most ``_LOCK_WAIT_S``."""
    fd = None
    try:
        fd = os.open(paths.bad_nodes_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    _log.warning("bad-node record: lock %s not taken (%s); writing unlocked",
                                 paths.bad_nodes_lock, e)
                    break
                time.sleep(0.02)
    except OSError as e:  # a read-only or lock-less filesystem: the write itself will tell
        _log.debug("bad-node lock unavailable: %s", e)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)   # releases the lock


def record_bad_nodes(paths: RunPaths, nodes: Iterable[str], *, reason: str,
                     job_id: str | None) -> set[str]:
    """Add ``nodes`` (with why and when) to the run's record; returns the whole set now
    recorded. Idempotent: a node recorded again keeps its first reason and time, and counts.
    Raises OSError only when the record cannot be written (the caller logs and goes on)."""
    new = {n.strip() for n in nodes if n and n.strip()}
    if not new:
        return bad_nodes(paths)
    paths.root.mkdir(parents=True, exist_ok=True)
    now = round(time.time(), 3)
    with _locked(paths):
        records = bad_node_records(paths)
        for n in sorted(new):
            rec = records.get(n)
            if rec is None:
                records[n] = {"reason": reason, "job_id": job_id, "t": now, "last_t": now,
                              "count": 1}
            else:
                rec["last_t"] = now
                rec["count"] = int(rec.get("count", 1)) + 1
        write_atomic(paths.bad_nodes, json.dumps({"version": 1, "nodes": records}, indent=1,
                                          sort_keys=True))
    _log.warning("node(s) %s recorded as bad (%s); the run keeps them out from now on "
                 "(%s)", ",".join(sorted(new)), reason, paths.bad_nodes)
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
                        current: str | None = None,
                        min_nodes: int | None = None) -> ScontrolResult | None:
    """Make SLURM keep the job off ``nodes`` when it runs again after a requeue.

    Call it right AFTER ``scontrol requeue`` succeeded (while the job is pending; a running
    job's exclusions cannot change). Sets ``ExcNodeList`` to the job's current exclusions
    (``current``, else read with ``scontrol show job``) plus ``nodes``. When that leaves its
    partition fewer nodes than the job asks for, the job would never start: with ``min_nodes``
    (the nodes the training needs; the rest were spares) and at least that many left, the job
    asks for only the nodes left (``NumNodes``, spares given up), else nothing is excluded.
    Returns the update's result (None when there is nothing to exclude); never raises: a
    failure is logged with the fix, and the requeue stands without the exclusion."""
    wanted = {n for n in nodes if n}
    if not wanted:
        return None
    call: Scontrol = scontrol or _shielded_scontrol
    job = {"ExcNodeList": current} if current is not None else _show(job_id, call, timeout)
    args = _plan(job_id, wanted, call, timeout, job, min_nodes)
    if isinstance(args, ScontrolResult):
        return args
    return _report(job_id, wanted, call(args, timeout))


#: The longest the exclusion's update may take between ``requeuehold`` and ``release``
#: (``requeue_excluding``): under SLURM's shortest sensible KillWait (5 s, the test clusters').
_UPDATE_S = 3.0


def requeue_excluding(job_id: str, nodes: Iterable[str], *, timeout: float = 10.0,
                      min_nodes: int | None = None) -> ScontrolResult | None:
    """``scontrol requeue`` then the exclusion, for a caller in the batch step, which SLURM
    SIGKILLs at once on a requeue (no SIGTERM, no KillWait; measured on 22.05), so it can never
    make a second call, nor can a child of its own. Both run in a one-task srun step on this
    node (``--overlap``): a step's processes get SIGTERM, which they ignore, and SIGKILL only
    ``KillWait`` later. The job's exclusions and partition are read first (a running job's can
    be read). None when there is nothing to exclude or no srun (the caller requeues as usual);
    else the step's result: exit 3 when the requeue failed, else the update's.

    A job SLURM has shrunk (``--no-kill``: a node of it went down, ``ResizeTime`` shown) is
    requeued plainly, never held: slurmctld 22.05 without accounting refuses every update of
    such a job ("the DB index is being set"; measured: until the requeued job has finished
    completing) and the release of a hold could be refused with it, leaving the job held for
    good. Its dead node is DOWN, so the scheduler does not place it there meanwhile; the
    exclusion is still tried after the requeue, and may be refused."""
    wanted = {n for n in nodes if n}
    srun = find_scontrol(name="srun")
    exe = find_scontrol()
    if not wanted or srun is None or exe is None:
        return None
    job = _show(job_id, _shielded_scontrol, timeout)
    args = _plan(job_id, wanted, _shielded_scontrol, timeout, job, min_nodes)
    update = [] if isinstance(args, ScontrolResult) else args
    resized = job.get("ResizeTime", "None") not in ("", "None", "0", "Unknown")
    host = node_name()
    # requeuehold, update, release: a job requeued plainly is pending at once, and the
    # scheduler may start it before the update lands, on the very node it must leave (seen on
    # the test cluster when the dead node came back IDLE within that moment). Held, it waits
    # for the update; the release is tried whatever the update did (exit 4: the job is left
    # held, said with its fix below). A requeuehold that fails (exit 3) leaves the caller's
    # usual path: a plain requeue, then the update.
    # The step is SIGKILLed KillWait after the requeuehold, so the release must come before
    # then whatever the update does: the update gets at most _UPDATE_S, and a refused release
    # is tried again briefly. A resized job is never held (see above): requeue, then the
    # update until it lands or KillWait ends the step.
    script = ('s=$0; j=$1; shift; trap "" TERM INT HUP USR1 USR2; '
              '[ $# = 0 ] && exec "$s" requeue "$j"; '
              + ('"$s" requeue "$j" || exit 3; exec "$s" "$@"' if resized else
              '"$s" requeuehold "$j" || exit 3; '
              f'timeout -s KILL {_UPDATE_S:g} "$s" "$@"; u=$?; '
              '[ $u = 0 ] || echo "kempner-resilience: scontrol update of job $j failed (exit '
              '$u): released without its node exclusion" >&2; '
              'for i in 1 2 3; do "$s" release "$j" && exit $u; sleep 0.3; done; exit 4'))
    if resized:
        _log.warning("job %s lost a node while running (SLURM shrank it); requeueing it without "
                     "a hold, so the exclusion of %s lands only if SLURM accepts it in time",
                     job_id, ",".join(sorted(wanted)))
    cmd = [srun, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
           "--job-name=kr-requeue", "--kill-on-bad-exit=0", "/bin/sh", "-c", script, exe,
           str(job_id), *update]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * 3,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return ScontrolResult(tuple(cmd), None, "", str(e), timed_out=True,
                              seconds=time.monotonic() - t0)
    res = ScontrolResult(("requeue", str(job_id), *update[1:]), proc.returncode, proc.stdout,
                         proc.stderr, seconds=time.monotonic() - t0)
    if proc.returncode == 4:
        _log.error("job %s was requeued but is left held (`scontrol release %s` failed: %s); "
                   "fix: run `scontrol release %s`", job_id, job_id,
                   (proc.stderr or proc.stdout).strip()[-300:], job_id)
        return dataclasses.replace(res, returncode=0)   # requeued, the exclusion made
    if update and proc.returncode != 3:
        _report(job_id, wanted, res)
    return res


def _show(job_id: str, call: Scontrol, timeout: float) -> dict[str, str]:
    """``scontrol show job`` as a dict; {} when it cannot be read."""
    shown = call(["show", "-o", "job", str(job_id)], timeout)
    jobs = parse_show_job(shown.stdout) if shown.ok else []
    return jobs[0] if jobs else {}


def _plan(job_id: str, wanted: set[str], call: Scontrol, timeout: float, job: dict[str, str],
          min_nodes: int | None) -> list[str] | ScontrolResult:
    """The update's arguments (``job``: the job as shown), or the failed result saying why
    none is made."""
    value = merged_exclusions(job.get("ExcNodeList"), wanted)
    args = ["update", f"JobId={job_id}", f"ExcNodeList={value}"]
    room = _room(job, value, call, timeout)
    if room is not None and room[0] < room[1]:
        left, need, why = room
        if min_nodes is None or left < min_nodes:
            _log.error("not keeping job %s off bad node(s) %s: %s, and it would never start "
                       "again. The requeue stands; resubmit on a larger partition, or ask the "
                       "admins to repair the nodes", job_id, ",".join(sorted(wanted)), why)
            return ScontrolResult(tuple(args), 1, stderr=why)
        _log.warning("job %s: %s; it asks for %d node(s) instead (its spares given up, %d "
                     "needed to train)", job_id, why, left, min_nodes)
        args.append(f"NumNodes={left}")
        # A job of --ntasks-per-node asks for that many tasks on each of its nodes
        # (NumTasks = nodes x per node): left as is, SLURM keeps the old count and never
        # starts the job ("BadConstraints", seen on the test cluster).
        per_node = job.get("NtasksPerN:B:S:C", "").split(":")[0]
        if per_node.isdigit() and int(per_node) > 0:
            args.append(f"NumTasks={left * int(per_node)}")
    return args


def _report(job_id: str, wanted: set[str], res: ScontrolResult) -> ScontrolResult:
    """Log what the update did (the fix when it failed); returns ``res``."""
    if res.ok:
        _log.warning("job %s will not run on %s again (%s)", job_id, ",".join(sorted(wanted)),
                     " ".join(a for a in res.args if "=" in a and not a.startswith("JobId")))
    else:
        text = (res.stderr + res.stdout).lower()
        if "not pending" in text or "no longer pending" in text:
            fix = ("the job was not pending: exclusions can only change after `scontrol "
                   "requeue` (a bug if you see this after one)")
        elif "db index" in text:
            fix = ("SLURM refuses updates of a job that lost a node under --no-kill until the "
                   "requeued job has finished completing (22.05 without accounting); the in-job "
                   "relaunches still keep off the node(s), and `sbatch --exclude=...` does on a "
                   "resubmission")
        elif "access" in text or "permission" in text or "not authorized" in text:
            fix = ("the site does not let users update their jobs' ExcNodeList; ask the admins "
                   "to drain the node(s), or resubmit with `sbatch --exclude=...`")
        else:
            fix = "resubmit with `sbatch --exclude=...` if the job lands on them again"
        _log.error("could not keep job %s off bad node(s) %s after the requeue: %s. The "
                    "requeue and the checkpoint stand; fix: %s", job_id,
                    ",".join(sorted(wanted)), res.describe(), fix)
    return res


def _room(job: dict[str, str], excluded: str, call: Scontrol,
          timeout: float) -> tuple[int, int, str] | None:
    """(nodes left in the job's partition once ``excluded`` are out, nodes the job asks for,
    a sentence saying so); None when not known (then the exclusion goes ahead)."""
    need, part = job.get("NumNodes", ""), job.get("Partition", "")
    need = need.split("-")[0]
    if not need.isdigit() or not part or "," in part:
        return None
    res = call(["show", "-o", "partition", part], timeout)
    parts = parse_show_job(res.stdout) if res.ok else []
    nodes = parts[0].get("Nodes", "") if parts else ""
    if not nodes or nodes in ("(null)", "ALL"):
        return None
    members = set(expand_hostlist(nodes))
    left = len(members - set(excluded.split(",")))
    return left, int(need), (f"that would leave {left} of partition {part}'s {len(members)} "
                             f"nodes for a job of {need}")


def exclude_args(paths: RunPaths, allocation: Iterable[str],
                 needed: int) -> list[str]:
    """``srun`` arguments keeping a step off the recorded bad nodes of ``allocation`` when the
    rest still holds ``needed`` nodes (``["--exclude=a,b"]``), else ``[]`` (logged)."""
    nodes = list(allocation)
    bad = sorted(bad_nodes(paths) & set(nodes))
    if not bad:
        return []
    if len(nodes) - len(bad) < needed:
        _log.error("the allocation %s holds recorded bad node(s) %s, and only %d good node(s) "
                   "for the %d needed: training runs on them anyway", ",".join(nodes),
                   ",".join(bad), len(nodes) - len(bad), needed)
        return []
    return [f"--exclude={','.join(bad)}"]


def check_allocation(paths: RunPaths, hosts: Iterable[str]) -> set[str]:
    """The recorded bad nodes among this attempt's ``hosts``, each named in one warning (a
    requeue SLURM did itself, after a node failure, had no rank left to exclude them)."""
    records = bad_node_records(paths)
    here = sorted(set(hosts) & set(records))
    for n in here:
        r = records[n]
        _log.warning("this attempt runs on node %s, recorded bad (%s, job %s): SLURM requeued "
                     "the job onto it (a requeue we did would have excluded it); if it fails "
                     "again, ask the admins to drain it or resubmit with --exclude=%s", n,
                     r.get("reason", "?"), r.get("job_id", "?"), n)
    return set(here)
