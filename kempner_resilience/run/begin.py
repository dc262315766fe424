"""How a run begins: the set-up sequence, one step a line, returning the run's parts.

``begin`` is the counterpart of the shutdown sequence (``shutdown/sequence.py``): what
``ResilientRun.__enter__`` does, in order. Each part is built with what it needs (the
checkpoint manager with its busy hook and manifest fields, the run id and lease it belongs to
once its directory is known usable) and returned by its step; ``begin`` makes the frozen
``RunParts`` from those values (``runstate/parts.py``); nothing here sets an attribute on a
part after building it. The one thing noted in the run's progress is the step it resumed at.
Several steps are collectives (every rank runs them in the same order): rank 0 decides (the allocation's end, the run id, the directory lease) and
every rank learns the decision, or the same refusal, through the agreement's store.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

from kempner_resilience.checkpoint import identity
from kempner_resilience.stop import rehearsal
from kempner_resilience.stop.agreement import StopAgreement
from kempner_resilience.exitcodes import Ending, Facts
from kempner_resilience.core.ledger import Ledger, attempt_start
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.core.log import announce, get_logger
from kempner_resilience.run import hparams
from kempner_resilience.runstate import Progress, RunParts, RunState
from kempner_resilience.shutdown import outcome
from kempner_resilience.shutdown.sequence import local_restart_count, record
from kempner_resilience.integrations.trackers import Trackers
from kempner_resilience.slurm.clock import END_TIME_ENV, RunClock, job_end_time
from kempner_resilience.slurm.badnodes import check_allocation
from kempner_resilience.slurm.env import SlurmJob, expand_hostlist
from kempner_resilience.supervise.rank import relaunched, supervisor

if TYPE_CHECKING:
    from kempner_resilience.checkpoint.info import CheckpointInfo
    from kempner_resilience.checkpoint.lease import Lease
    from kempner_resilience.checkpoint.manager import CheckpointManager
    from kempner_resilience.rescue.rescuer import Rescuer

__all__ = ["begin"]

log = get_logger(__name__)


def begin(base: RunParts, progress: Progress, state: Mapping[str, Any] | None,
          run_id: str | None) -> RunParts:
    """Set the run up on the main thread (collective), and return its parts: ``base`` (what
    the run was built with) and what each step built. ``progress`` is the run's: the resume
    notes its step there, and a forced exit during the set-up records with it. On any error the
    watchdog and the signal handlers are taken down again, and the directory's lease given up,
    before it is raised."""
    base.handler.install()
    latest: list[RunParts] = [base]
    try:
        parts = replace(base, agreement=StopAgreement.from_torch())  # rank, world size, store
        latest = _record_forced_exits(parts, progress)          # a repeated SIGTERM/SIGINT
        parts = replace(parts, slurm=SlurmJob.from_env())       # None outside SLURM
        parts = latest[0] = replace(
            parts, clock=_allocation_clock(parts),               # the allocation's end
            trackers=Trackers.from_config(parts.config.integrations))  # imported now
        parts.hang.start()                                      # a load that hangs is a hang
        with parts.hang.busy():               # imports, directory checks and the load are slow
            if state is not None:   # identity, lease, ledger, resume, rescue
                parts = _checkpoints(parts, progress, state, run_id, latest)
                if parts.rank == 0:                 # the supervisor learns which run this is
                    parts = latest[0] = replace(parts, supervisor=supervisor())
                    RunState(parts, progress).tell_supervisor()
            _preflight(parts)
        if parts.run_id is None:                                # no checkpoints
            parts = latest[0] = replace(parts, run_id=_attempt_run_id(parts, run_id))
        parts.hang.last_words(outcome.hang_words(RunState(parts, progress)))  # the backstop's
        latest[0] = parts                     # a forced exit from now on: the run's parts
    except BaseException:
        base.hang.stop()
        base.handler.uninstall(keep_deadline=base.handler.requested())
        if latest[0].ckpt is not None:      # set up, then refused: the directory is free
            try:
                latest[0].ckpt.close()
            except Exception as e:  # noqa: BLE001 - the error being raised is the one to see
                log.debug("cannot close the checkpoint manager after a failed start: %s", e)
        raise
    return parts


def _checkpoints(parts: RunParts, progress: Progress, state: Mapping[str, Any],
                 run_id: str | None, latest: list[RunParts]) -> RunParts:
    """The checkpoint steps, in order: the directory checked, the run's identity and the
    directory's lease, the ledger's start, the resume, then the rescue. ``latest[0]``: the
    parts a forced exit records with, from the ledger on."""
    # Under check-resume, a directory of the script's own is the real run's: refused unwritten.
    rehearsal.refuse_other_dir(RunPaths.from_config(parts.config).root)
    restarts = parts.slurm.restart_count if parts.slurm is not None else local_restart_count()
    ckpt = _manager(parts, state, restarts)
    ckpt.check_dir()                                       # writable, room for a save
    rid, plan = _resolve_run_id(parts, ckpt.paths, run_id)  # run.json, ours
    parts = replace(parts, ckpt=ckpt, run_id=rid)
    held = _hold_directory(parts, ckpt.paths, restarts)
    try:
        ckpt.claim(rid, held, _record_lineage(parts, ckpt.paths, plan))
        parts = replace(parts, attempt_token=_attempt_token(parts, ckpt.paths))
        parts = latest[0] = replace(parts, ledger=_ledger(parts, ckpt.paths, restarts))
        script = hparams.snapshot(state) if parts.rank == 0 else {}  # the script's, pre-load
        info, load_s = _resume(parts, ckpt)
        if info is not None:
            progress.resumed(int(info.step), load_s)
        parts = latest[0] = replace(parts, resumed_from=info,
                                    start_step=0 if info is None else int(info.step),
                                    completed_step=_announce_start(parts, ckpt, info, load_s,
                                                                   script, state))
        parts.clock.set_save_estimate(ckpt.estimate().seconds)
        return replace(parts, rescue=_rescue(parts, ckpt))
    except BaseException:
        # A run that does not start (a refused resume, a state that does not fit) gives the
        # directory up: no shutdown sequence runs for it, and a lease left behind would make
        # the next launch take it over from a run that never ran.
        if held is not None:
            held.release()
        raise


# ------------------------------------------------------------------------------ the steps

def _record_forced_exits(parts: RunParts, progress: Progress) -> list[RunParts]:
    """The signal thread, just before its ``os._exit`` for a second SIGINT/SIGTERM: the other
    ranks are told (the store, a marker), then the ending is recorded as every other one is.
    The signal thread waits for its hooks at most a second, then leaves regardless. Returns
    the one-element list the hook reads the parts from: ``begin`` puts each newer set of
    parts there (during the set-up, what is built so far; then the run's)."""
    agreement = parts.agreement
    parts.handler.add_forced_exit_hook(agreement.announce_forced_exit)
    latest = [parts]

    def forced(code: int) -> None:     # the table's code for FORCED: 128 + the signal
        if progress.outcome is None:
            record(RunState(latest[0], progress),
                   Facts(Ending.FORCED, progress.step, signum=code - 128))

    parts.handler.add_forced_exit_hook(forced)
    return latest


def _allocation_clock(run: RunParts) -> RunClock:
    """The allocation's end, read once: from the environment on every rank, else asked of
    SLURM by rank 0 alone (bounded) and shared, so a big job does not flood slurmctld."""
    cfg = run.config.requeue
    if os.environ.get(END_TIME_ENV):
        end = job_end_time(timeout=cfg.scontrol_timeout_s)
    elif run.slurm is None:
        end = None
    else:
        mine = job_end_time(timeout=cfg.scontrol_timeout_s) if run.rank == 0 else None
        text = run.agreement.share_text("end_time", "" if mine is None else repr(mine),
                                        cfg.scontrol_timeout_s + 30.0)
        end = float(text) if text else None
    clock = RunClock(end, margin_s=cfg.time_limit_margin_s, stop_enabled=cfg.time_limit_stop)
    if end is not None and run.rank == 0:
        log.info("the allocation ends in %.0f s%s", clock.remaining(),
                 "" if cfg.time_limit_stop else " (requeue.time_limit_stop is off)")
    return clock


def _manager(run: RunParts, state: Mapping[str, Any], restarts: int | None
             ) -> CheckpointManager:
    from kempner_resilience.checkpoint import CheckpointManager   # torch: only with state

    # A save waits for the other ranks no longer than any step does (hang_timeout_s) plus
    # what the save itself takes; the hang budget's widening to checkpoint_timeout_s during
    # a save is for this rank's own write, not for waiting on a rank that is gone or paused.
    hang_s = run.config.watchdog.hang_timeout_s
    job = run.slurm
    return CheckpointManager(run.config.checkpoint, state, rank=run.agreement.rank,
                             world_size=run.agreement.world_size,
                             peer_timeout_s=hang_s if hang_s > 0 else None,
                             # saves and loads widen the hang budget: a slow save is no hang
                             busy_hook=run.hang.busy,
                             manifest_extra={"job_id": None if job is None else job.requeue_id,
                                             "restart_count": restarts})


def _resolve_run_id(run: RunParts, paths: RunPaths, explicit: str | None
                    ) -> tuple[str, identity.Plan | None]:
    """Rank 0 reads ``run.json`` (a damaged one recovered from the checkpoints) and checks the
    checkpoints belong to this run; every rank gets the id, or the same refusal. Nothing is
    written here: rank 0's plan (None elsewhere) is written by ``_record_lineage`` once the
    lease is held, so a refused start writes nothing. With ``checkpoint.resume: false`` in a
    directory holding checkpoints, the plan is a new lineage (``identity.plan_lineage``)."""
    from kempner_resilience.checkpoint import layout, quarantine

    cfg = run.config.checkpoint
    text = None
    plan: identity.Plan | None = None
    if run.rank == 0:
        try:
            entries = layout.scan(paths)
            # Without resume, set-aside checkpoints too: a lineage they end is left behind.
            plan = identity.plan(paths, entries if cfg.resume
                                 else entries + quarantine.entries(paths), explicit,
                                 resume=cfg.resume)
            if cfg.resume:
                try:
                    identity.check_same_run(paths, plan.run_id, entries, plan.recorded,
                                            plan.earlier)
                except identity.OtherRunError as e:
                    if not cfg.allow_other_run:
                        raise
                    log.warning("%s; continuing: checkpoint.allow_other_run is true",
                                str(e).split("; refusing")[0])
            text = "ok:" + plan.run_id
        except identity.OtherRunError as e:
            text = "refused:" + str(e)
        except identity.RunFileError as e:
            text = "damaged:" + str(e)
        except OSError as e:      # a new id here would be a new one in every attempt
            text = (f"damaged:cannot read the run's identity in {paths} ({e}); check the "
                    "directory's permissions and its filesystem, then restart")
    text = run.agreement.share_text("run_id", text, 120.0)
    kind, _, value = text.partition(":")
    if kind == "refused":
        raise identity.OtherRunError(value)
    if kind == "damaged":
        raise identity.RunFileError(value)
    return value, plan


def _record_lineage(run: RunParts, paths: RunPaths, plan: identity.Plan | None
                    ) -> frozenset[str | None]:
    """Rank 0, holding the lease: write what ``_resolve_run_id`` planned into ``run.json`` (a
    new lineage, a repair, a first attempt's id); the lineages left behind in ``root`` (rank
    0's: it alone lists for resume and runs retention)."""
    if run.rank != 0 or plan is None:
        return frozenset()
    try:
        identity.record(paths, plan)
    except OSError as e:
        log.warning("cannot record run %s in %s (%s): the next start decides again from the "
                    "checkpoints", run.run_id, paths.run_file, e)
    return plan.earlier


def _hold_directory(run: RunParts, paths: RunPaths, restarts: int | None) -> Lease | None:
    """Rank 0 takes the directory's lease (one live run per ``checkpoint.dir``) before
    anything is written into it; every rank gets the same refusal when another live run
    holds it. Given up at teardown; one left by a killed run is taken over."""
    from kempner_resilience.checkpoint import lease

    held, text = None, "ok"
    if run.rank == 0:
        job = run.slurm
        try:
            held = lease.acquire(paths, job_id=None if job is None else job.requeue_id,
                                 restart_count=restarts, run_id=run.run_id)
        except lease.DirectoryInUseError as e:
            text = "refused:" + str(e)
        except OSError as e:
            log.warning("cannot hold %s with a lease (%s): a second run on this directory "
                        "would not be noticed", paths, e)
    text = run.agreement.share_text("lease", text,
                                    lease.stale_s() + 4 * lease.heartbeat_s() + 60.0)
    kind, _, why = text.partition(":")
    if kind == "refused":
        raise lease.DirectoryInUseError(why)
    return held


def _attempt_token(run: RunParts, paths: RunPaths) -> str | None:
    """This attempt's token, the same on every rank (collective; None in one process): it names
    what ranks write for the others to read, the forced-exit marker (the store dies with rank
    0 when rank 0 is forced out) and the ranks' endings (``supervise/endings.py``). Rank 0,
    holding the lease, first clears both of earlier attempts."""
    if run.agreement.store is None:
        return None
    token = None
    if run.rank == 0:
        token = uuid.uuid4().hex[:12]
        try:
            for old in paths.forced_markers():
                old.unlink(missing_ok=True)
            for old in paths.all_endings():
                shutil.rmtree(old, ignore_errors=True)
        except OSError as e:     # a stale entry has another token: it is never read
            log.debug("cannot clear old forced-exit markers or endings in %s: %s", paths, e)
    token = run.agreement.share_text("attempt_token", token, 120.0)
    run.agreement.use_forced_marker(paths.forced_marker(token))
    return token


def _ledger(run: RunParts, paths: RunPaths, restarts: int | None) -> Ledger:
    """The run ledger, and its ``start`` event. Rank 0 writes it; another rank only a rescue
    it wrote (rank 0 may be the rank that died, and then no one else would record the step
    the rescue kept)."""
    ledger = Ledger(None)
    again = relaunched()          # an in-job restart (the supervisor's channel): its own attempt
    if run.config.checkpoint.ledger:
        ledger = Ledger(paths.ledger, run_id=run.run_id, attempt=restarts or 0,
                        only=None if run.rank == 0 else ("rescue",), relaunch=again.index)
    job = run.slurm
    ledger.event("start", t0=attempt_start(relaunch=again.index, relaunch_t=again.t),
                 job_id=None if job is None else job.requeue_id,
                 restart_count=restarts, world_size=run.agreement.world_size,
                 hosts=(job.nodelist if job is not None and job.nodelist
                        else socket.gethostname()))
    if job is not None and job.nodelist and run.rank == 0:
        # A requeue SLURM did itself (the batch node died: no rank left to exclude the bad
        # nodes) may land on a recorded one: say so, once, with the way out.
        check_allocation(paths, expand_hostlist(job.nodelist))
    return ledger


def _resume(run: RunParts, ckpt: CheckpointManager) -> tuple[CheckpointInfo | None, float]:
    """The newest committed checkpoint loaded into the state (collective): the checkpoint to
    go on from (None: a fresh start), and how long the load took."""
    if not run.config.checkpoint.resume:
        return None, 0.0
    t0 = time.monotonic()
    info = ckpt.resume()
    if info is None:
        return None, 0.0
    load_s = time.monotonic() - t0
    run.ledger.event("resume", step=int(info.step), load_s=round(load_s, 4))
    return info, load_s


def _announce_start(run: RunParts, ckpt: CheckpointManager, info: CheckpointInfo | None,
                    load_s: float, before: dict[str, Any], state: Mapping[str, Any]
                    ) -> int | None:
    """One line per run on rank 0, visible at Python's default log level: which run it
    continues, from where and which step, which of the script's optimizer settings the
    checkpoint's replace, and whether that run already finished its loop; or that it starts
    fresh and why. Returns the total a finished loop of this run reached (rank 0, after a
    resume: read once, so run.steps() says what remains)."""
    if run.rank != 0:
        return None
    done = None
    if info is not None:
        changed = hparams.differences(before, hparams.snapshot(state))
        done = identity.completed_step(ckpt.paths, run.run_id) if run.run_id else None
        if done is None:
            finished = ""
        elif info.step >= done:
            finished = (f"; this run already finished run.steps({done}): a larger total trains "
                        "longer, the same total trains nothing (checkpoint.resume: false starts "
                        "a new run)")
        else:
            finished = (f"; this run already finished run.steps({done}), but its newest "
                        f"checkpoint is step {info.step}: steps {info.step} to {done} run again "
                        "(run.save() after the loop keeps a finished run's last step)")
        announce(log, "run %s resumed from %s (step %d, reason %s) in %.2f s%s%s", run.run_id,
                 info.path, info.step, info.reason, load_s,
                 "" if not changed else "; the checkpoint's optimizer settings replace the "
                 "script's: " + ", ".join(changed), finished)
    elif not run.config.checkpoint.resume:
        announce(log, "run %s starting fresh at step 0: checkpoint.resume is off (%s)",
                 run.run_id, ckpt.paths)
    else:
        announce(log, "run %s starting fresh at step 0: no committed checkpoint in %s",
                 run.run_id, ckpt.paths)
    return done


def _rescue(run: RunParts, ckpt: CheckpointManager) -> Rescuer | None:
    """The just-in-time rescue (``kempner_resilience.rescue``), when every rank holds the
    full state; collective."""
    cfg = run.config.rescue
    if not cfg.enabled or run.agreement.world_size < 2:
        return None
    from kempner_resilience.rescue import Rescuer

    rescuer = Rescuer.start(cfg, ckpt, rank=run.rank, world_size=run.agreement.world_size)
    if rescuer is not None:
        run.hang.reserve_for_on_hang(cfg.budget_s)   # the hang path runs the rescue first
    return rescuer


def _preflight(run: RunParts) -> None:
    """Rank 0 says once what stands between this job and a safe shutdown: a signal that
    never reaches the ranks, or an emergency save that cannot fit in the signal's lead
    (checked once the state and the last save are known: after the resume); outside SLURM,
    a plain torchrun, which reports every intended stop as a failure."""
    from kempner_resilience.slurm import SaveFacts, format_findings, preflight
    from kempner_resilience.slurm.preflight import plain_torchrun

    job, ckpt = run.slurm, run.ckpt
    if run.rank == 0 and run.config.requeue.restart_limit == 0:
        # 0 meant "unlimited" before it took torchrun's meaning: a config written then would
        # silently lose its requeues.
        log.warning("requeue.max_restarts is 0: this job is never requeued or relaunched (0 "
                    "meant unlimited in earlier versions); write `max_restarts: unlimited` "
                    "for no limit")
    hint = plain_torchrun() if run.rank == 0 and job is None else None
    if hint is not None:        # under SLURM, the preflight's findings below say it
        log.warning("%s", hint)
    if job is None or job.procid != 0:
        return
    save = None
    try:
        if ckpt is not None:
            est, last = ckpt.estimate(), ckpt.last_committed
            save = SaveFacts(est.seconds, est.measured, ckpt.state.nbytes(),
                             None if last is None else int(last.nbytes),
                             None if last is None else float(last.save_seconds))
        findings = preflight(run.config, save=save,
                             timeout=run.config.requeue.scontrol_timeout_s)
    except Exception:
        log.exception("preflight checks failed to run")
        return
    problems = [f for f in findings if f.level in ("warn", "error")]
    if problems:
        log.warning("preflight found problems (run `kempner-resilience doctor` inside the "
                    "job for details):\n%s", format_findings(problems))
    for f in findings:
        if f.code in ("save-fits", "time-limit-stop-covers"):
            log.info("%s", f.message)


def _attempt_run_id(run: RunParts, explicit: str | None) -> str:
    """Without checkpoints, an id for this attempt only: rank 0's, shared (collective)."""
    mine = (explicit or identity.new_run_id()) if run.rank == 0 else None
    return run.agreement.share_text("run_id", mine, 120.0)
