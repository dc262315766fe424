"""Relaunch in place: the training as srun steps inside one allocation with spare nodes.

``kempner-resilience srun --spares K`` (N + K nodes) runs srun on N nodes not recorded bad,
ends a failed step without waiting for SLURM to notice a dead node (``SlurmdTimeout``), and
asks the one policy: RELAUNCH on the healthy nodes plus a spare, REQUEUE, or LEAVE. The ranks
leave the requeue after a failure to the loop: rank 0 may be the dead one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from kempner_resilience.config import ResilienceConfig
from kempner_resilience.config.schema import RequeueConfig
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.core.log import get_logger
from kempner_resilience.slurm.badnodes import bad_nodes, record_bad_nodes
from kempner_resilience.slurm.restart_event import last_rescue, ledger_so_far, record_restart
from kempner_resilience.slurm.env import SlurmJob, expand_hostlist, master_port, node_name, tasks_per_node
from kempner_resilience.supervise.local.warm import UNBUFFERED, warm_command
from kempner_resilience.supervise.srun.evidence import LoopState, step_evidence
from kempner_resilience.supervise.srun.standby import Standby
from kempner_resilience.supervise.srun.taskends import StepReport, choose_nodes
from kempner_resilience.supervise.srun.step import (END_STEP_S, FINISHED_GRACE_S, SrunStep,
                                                    StepResult)
from kempner_resilience.supervise.channel import Channel, newest_commit
from kempner_resilience.supervise.policy import (Action, Decision, Evidence, Guard, Kind, RankEnd,
                                                 decide, job_code)

__all__ = ["Relauncher", "StepResult", "run_in_place", "FINISHED_GRACE_S"]

_log = get_logger(__name__)


@dataclass
class Relauncher:
    """The loop; ``run()`` returns the job's exit code."""

    command: Sequence[str]
    spares: int
    config: ResilienceConfig
    in_job_restarts: int = 1
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    srun: Sequence[str] = ("srun",)
    # Each task is a torchrun agent that restarts its own workers: a failure or a dead node
    # is theirs, so the step is never ended for it nor relaunched; a failure that ends it is
    # requeued.
    agents: bool = False
    stopping: bool = False               # a signal came: no relaunch from now on

    def __post_init__(self) -> None:
        env = self.environ
        job = SlurmJob.from_env(env)
        if job is None or not env.get("SLURM_JOB_NODELIST"):
            raise ValueError("not inside a SLURM job (no SLURM_JOB_ID/SLURM_JOB_NODELIST): run "
                             "`kempner-resilience srun` in the batch script of a job")
        self.job = job
        self.nodes = expand_hostlist(env["SLURM_JOB_NODELIST"])
        # A requeued job (same id) finds the report of its earlier attempt there.
        self.channel = Channel.for_job(job.job_id, env, fresh=job.restart_count == 0)
        self.need = len(self.nodes) - int(self.spares)
        recorded = self.channel.train_nodes()
        if self.spares >= 0 and recorded is not None and recorded != self.need \
                and recorded <= len(self.nodes):
            # Requeued with the bad nodes kept out: the training keeps its size (recorded
            # before the requeue); --spares K would have taken K of its nodes away.
            _log.warning("job %s came back with %d node(s) after a requeue that kept bad nodes "
                         "out: training on %d as before, %d spare(s) left", job.job_id,
                         len(self.nodes), recorded, len(self.nodes) - recorded)
            self.need = recorded
        if self.spares < 0 or self.need < 1:
            raise ValueError(f"--spares {self.spares} leaves no node to train on in an "
                             f"allocation of {len(self.nodes)}; ask sbatch for N + spares nodes")
        self.tasks_per_node = tasks_per_node(env.get("SLURM_NTASKS_PER_NODE"), 0) or 1
        base = env.get("MASTER_PORT")
        self.port = int(base) if base and base.isdigit() else master_port(job.job_id)
        self._relaunches = 0                 # in-job restarts so far (the ledger's relaunch)
        self._stalled = 0                    # relaunches in a row without a newer commit
        self._bad_here: set[str] = set()     # nodes this job's failures implicated
        self._unanswered: set[str] = set()   # nodes of a finished step that had not ended
        self.standby: Standby | None = None  # warm ranks ($KEMPNER_RESILIENCE_WARM=1)

    # ------------------------------------------------------------------ the run it supervises

    @property
    def run_paths(self) -> RunPaths:
        """The run's directory as rank 0 reported it, else ``--config``/``--set``'s."""
        return self.channel.run_paths(RunPaths.from_config(self.config))

    def requeue_config(self) -> RequeueConfig:
        """The run's requeue settings as rank 0 reported them, else ``--config``/``--set``'s."""
        return self.channel.requeue(self.config.requeue)

    def _bad(self) -> set[str]:
        """The nodes to keep out: the run's record and this job's failures."""
        return bad_nodes(self.run_paths) | self._bad_here

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """The loop; the job's exit code. The channel goes when the job ends for good."""
        if not self.agents and warm_command(self.command, (UNBUFFERED,)):
            self.standby = Standby.start(self.srun, self.nodes, self.job.job_id,
                                         self.job.restart_count, self.environ)
        try:
            code, requeued = self._loop()
        finally:
            if self.standby is not None:
                self.standby.close()
        if not requeued and code != int(ExitCode.REQUEUE):
            self._release(self._bad_here | self._unanswered)
            self.channel.remove()
        return code

    def _release(self, dead: set[str]) -> None:
        """The job ends for good: give back the nodes that failed or did not answer (``scontrol
        update JobId= NodeList=``; the batch node stays). SLURM otherwise keeps the job
        COMPLETING until it notices a dead node (measured: 300 s, COMPLETED at once after the
        shrink). scontrol writes its resize scripts into its cwd: the channel, removed next."""
        batch = node_name(self.environ)
        gone = ",".join(sorted(dead - {batch}))
        if not gone or batch not in self.nodes:
            return
        keep = [n for n in self.nodes if n not in dead or n == batch]
        cmd = ["scontrol", "update", f"JobId={self.job.job_id}", f"NodeList={','.join(keep)}"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=END_STEP_S,
                                 stdin=subprocess.DEVNULL, cwd=self.channel.root)
        except (OSError, subprocess.TimeoutExpired) as e:
            _log.warning("could not give back node(s) %s (%s): the job may stay COMPLETING "
                         "until SLURM notices them", gone, e)
            return
        if out.returncode:
            _log.warning("could not give back node(s) %s: %s", gone, (out.stderr or out.stdout).strip())
        else:
            _log.info("gave back node(s) %s: the job ends without waiting for SLURM to notice "
                      "them", gone)

    def _loop(self) -> tuple[int, bool]:
        index = 0
        while True:
            bad = self._bad()
            nodes = choose_nodes(self.nodes, bad, self.need)
            if nodes is None and index == 0 and self.job.restart_count > 0:
                # A requeue could not keep this job off its bad nodes (too few others): another
                # would come back here until the no-progress guard. Train on them.
                nodes = choose_nodes(self.nodes, set(), self.need)
                if nodes is not None:
                    _log.warning("the job could not be kept off its recorded bad node(s) %s: "
                                 "training on %s", ",".join(sorted(bad)), ",".join(nodes))
            if nodes is None:
                # No step can start: nothing for the policy to weigh; the scheduler's turn.
                why = (f"only {len(set(self.nodes) - bad)} of the allocation's "
                       f"{len(self.nodes)} nodes are not recorded bad ({','.join(sorted(bad))}); "
                       f"{self.need} needed")
                _log.error("%s: requeueing", why)
                return self._hand_off((RankEnd(int(ExitCode.PEER_LOST)),))
            before = newest_commit(self.run_paths)
            res = self.run_step(nodes, index)
            if self.agents:
                return self._after_agents(res, index)
            if res.finished:
                return 0, False
            ev, decision = self._after_step(res, index, before)
            self._stalled = decision.stalled
            implicated = set(ev.implicated)
            reason, where = self._reason(res.report), ",".join(sorted(implicated)) or "?"
            what = f"{reason} on {where}" if decision.kind is Kind.FAILURE else decision.kind.value
            if decision.kind is Kind.FAILURE and not ev.stopping and implicated:
                self._record_bad(implicated, reason)
            if decision.action is Action.RELAUNCH:
                nxt = choose_nodes(self.nodes, self._bad(), self.need) or []
                spare = sorted(set(nxt) - set(nodes))
                _log.warning("step %d failed (%s): relaunching in place on %s (spare %s): %s",
                             index, what, ",".join(nxt), ",".join(spare) or "-", decision.why)
                self._ledger_restart(res, reason, implicated, spare)
                index += 1
                continue
            if decision.action is Action.REQUEUE:
                _log.warning("step %d ended with %d (%s); no relaunch in place: %s", index,
                             decision.code, what, decision.why)
                return self._requeue(decision)
            log = _log.info if decision.code == 0 else _log.warning
            log("step %d ended with %d (%s): the job ends: %s", index, decision.code, what, decision.why)
            return decision.code, False

    def _after_step(self, res: StepResult, index: int,
                    committed_before: int | None) -> tuple[Evidence, Decision]:
        """The policy's decision on step ``index``'s evidence (``evidence.py``); acts on nothing."""
        cfg = self.requeue_config()
        # A relaunch in place is a restart too: the run's budget (requeue.max_restarts, less
        # what SLURM's requeues used of it) caps the loop's own, so 0 runs the step once.
        limit, restarts = cfg.restart_limit, self.job.restart_count
        in_place = int(self.in_job_restarts) if limit is None else \
            min(int(self.in_job_restarts), max(0, limit - restarts))
        state = LoopState(
            relaunches=index, max_relaunches=in_place,
            requeue_left=bool(cfg.enabled) and (limit is None or restarts < limit),
            committed_before=committed_before, committed_now=newest_commit(self.run_paths),
            stalled=self._stalled, max_no_progress=int(cfg.max_no_progress),
            spares=len(set(self.nodes) - self._bad() - set(res.report.nodes)),
            stopping=self.stopping)
        seen = self.channel.hang_seen(f"{self.job.restart_count}.{index}")
        ev = step_evidence(res.report, state, srun_code=res.code, ended_by_loop=res.ended_by_us,
                           hang_seen=seen, tasks_per_node=self.tasks_per_node)
        return ev, decide(ev)

    def _record_bad(self, nodes: set[str], reason: str) -> None:
        """Keep ``nodes`` out: with the run (bad-nodes.json) and in this job's next steps."""
        self._bad_here |= nodes
        try:
            record_bad_nodes(self.run_paths, nodes, reason=reason, job_id=self.job.job_id)
        except OSError as e:       # the relaunch still avoids them in this job
            _log.error("cannot record bad nodes %s: %s", sorted(nodes), e)

    def _after_agents(self, res: StepResult, index: int) -> tuple[int, bool]:
        """The agents' step ended: by their code alone, a failure worth running again is
        requeued (a dead node was theirs to handle)."""
        code = res.code
        # srun's status as one ending, read by the policy's own rule.
        end = (RankEnd(code, signaled=code > 128),)
        _, kind, _ = job_code(end)
        if res.finished or self.stopping or kind is not Kind.FAILURE:
            return code, False
        why = (f"the agents ended with {code} (their in-place restarts, if any, are spent): "
               "the scheduler runs it again")
        _log.warning("step %d: %s", index, why)
        return self._hand_off(end)

    def _reason(self, report: StepReport) -> str:
        if any(e.node_failure for e in report.ends) or (set(report.nodes) - {e.node for e in report.ends}):
            return "node lost"
        codes = report.codes
        if int(ExitCode.HANG) in codes:
            return "hang"
        if any(c > 128 for c in codes - {int(ExitCode.SIGTERM)}):
            return "rank killed"
        return "peer lost"

    def _requeue(self, decision: Decision) -> tuple[int, bool]:
        """The policy's REQUEUE: after 75 rank 0 requeued the job itself; else the hand-off."""
        if decision.kind is Kind.REQUESTED:
            return decision.code, False
        return self._hand_off((RankEnd(decision.code, signaled=decision.code > 128),))

    def _hand_off(self, ends: tuple[RankEnd, ...]) -> tuple[int, bool]:
        """The job to SLURM after a failure the ranks left to us, decided as for rank 0
        (``requeue_run``), the failed nodes kept out: the failure's code, and whether the job
        was requeued. A signal to the loop requeues nothing."""
        from kempner_resilience.slurm.requeue import requeue_run

        code = job_code(ends)[0]     # the failure's, whatever stops the requeue
        if self.stopping:
            return code, False
        # Before the requeue (it SIGKILLs this batch step at once): the nodes the job trains on.
        decision, result = requeue_run(
            self.job, self.run_paths, self.requeue_config(), newest_commit(self.run_paths), ends=ends,
            exclude=self._bad_here, min_nodes=self.need,
            before=lambda: self.channel.record_train_nodes(self.need))
        if decision.guard is Guard.NOTHING_COMMITTED:
            _log.warning("not requeued: no committed checkpoint to come back to; the job ends "
                         "with %d", code)
        if result is None:
            return code, False
        # A requeue that failed ends the job with 79, as a rank's own does: the batch script
        # (or the user, from the log's fix) may still requeue it.
        return (code, True) if result.ok else (int(ExitCode.REQUEUE_FAILED), False)

    def _ledger_restart(self, res: StepResult, reason: str, bad: set[str], spare: list[str]) -> None:
        """The ``restart`` event (``core.ledger``), its parts back to back so that ``report``
        adds them up: detection (less the rescue, which runs meanwhile), rescue, relaunch."""
        events, ids = ledger_so_far(self.run_paths)
        rescue_s = None if res.first_bad_t is None else last_rescue(events, res.first_bad_t - 120)[1]
        detect_s = relaunch_s = None
        if res.first_bad_t is not None and res.ended_t is not None:
            detect_s = max(0.0, res.ended_t - res.first_bad_t - (rescue_s or 0.0))
            relaunch_s = time.time() - res.ended_t
        record_restart(self.run_paths, relaunch=self._relaunches + 1, reason=reason,
                       bad_nodes=bad, spare=",".join(spare) or None,
                       step=newest_commit(self.run_paths), failure_t=res.first_bad_t,
                       detect_s=detect_s, rescue_s=rescue_s, relaunch_s=relaunch_s, **ids)
        self._relaunches += 1

    # ------------------------------------------------------------------ one step

    def step_command(self, nodes: Sequence[str], index: int) -> list[str]:
        n = len(nodes)
        why = self.standby.gone() if self.standby is not None else None
        if why is not None:
            # Each shim would wait for it before starting its rank cold.
            _log.warning("step %d: the standby step is over (%s): its ranks start cold", index, why)
            self.standby = None
        # --overlap on a relaunch: the old step holds the survivors' CPUs until SLURM notices
        # the dead node (measured: pending past 30 s without it, started at once with it).
        overlap = ["--overlap"] if index else []
        return [*self.srun, "--kill-on-bad-exit=1", *overlap, f"--job-name=kr-step-{index}",
                f"--nodes={n}", f"--ntasks={n * self.tasks_per_node}",
                f"--ntasks-per-node={self.tasks_per_node}", f"--nodelist={','.join(nodes)}",
                *(self.standby.wrap(self.command) if self.standby else self.command)]

    def step_env(self, nodes: Sequence[str], index: int) -> dict[str, str]:
        env = dict(self.environ)
        env["MASTER_ADDR"] = nodes[0]
        # A fresh port for each step: the old rendezvous' port may still be held on a survivor.
        env["MASTER_PORT"] = str(self.port + index)
        env.update(self.channel.env())       # the channel: the loop owns the run-again
        return env

    def run_step(self, nodes: Sequence[str], index: int) -> StepResult:
        """Step ``index`` on ``nodes`` (``supervise/srun/step.py``), until it ends or is ended."""
        cmd = self.step_command(nodes, index)
        _log.info("step %d: %s", index, " ".join(cmd))
        # Before its ranks start: a relaunch is an attempt of its own (core.ledger).
        self.channel.begin_relaunch(index)
        res = SrunStep(cmd, self.step_env(nodes, index), list(nodes), self.tasks_per_node,
                       self.job.job_id, index, self.channel, agents=self.agents,
                       stopping=lambda: self.stopping,
                       launch=f"{self.job.restart_count}.{index}").run()
        if res.finished:
            # srun does not say which nodes had not ended: all but the batch node go back.
            self._unanswered |= set(nodes)
        return res


def run_in_place(command: Sequence[str], spares: int, config: ResilienceConfig,
                 in_job_restarts: int, agents: bool = False,
                 srun_args: Sequence[str] = ()) -> int:
    """``kempner-resilience srun``: the loop here; signals only stop relaunches."""
    loop = Relauncher(command, spares, config, in_job_restarts, agents=agents, srun=("srun", *srun_args))

    def stop(signum: int, frame: object) -> None:
        loop.stopping = True       # only recorded: srun and the ranks get the signal from SLURM

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, stop)
    return loop.run()
