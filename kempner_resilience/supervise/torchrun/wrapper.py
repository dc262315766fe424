"""torchrun under srun: one elastic agent per node whose workers shut down like srun ranks.

Stock torchrun is unsafe as an srun task: a SIGUSR1 kills its agent (SLURM then kills the
workers mid-save), it SIGKILLs the workers 30 s after a SIGTERM, and when one worker exits it
SIGTERMs the others. ``run`` runs torchrun in this process with our agent (stock torchrun,
logged, on a torch without the names of ``core/torch_private.py``). ``launch`` is torch's
``launch_agent`` built from the same public pieces, as NVIDIA's ``ft_launcher`` does, with our
subclasses (``elastic.py``). docs/design.md has the story.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import shutil
import signal
import sys
import tempfile
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from kempner_resilience.config import ResilienceConfig, load_config
from kempner_resilience.supervise.torchrun.agent import (AGENT_NAME, TORCH_SIGNALS, Agent,
                                                         Interrupted)
from kempner_resilience.supervise.torchrun.evidence import agent_exit_code
from kempner_resilience.supervise.torchrun.spares import InPlace, in_place_settings
from kempner_resilience.supervise.channel import Channel
from kempner_resilience.core.fileio import load_json_bounded
from kempner_resilience.core.ledger import AGENT_START_ENV, REPORT_ENV, process_start_time
from kempner_resilience.exitcodes import ExitCode, describe
from kempner_resilience.core.log import get_logger, set_role
from kempner_resilience.slurm.preflight import TORCHRUN_AGENT_ENV

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

__all__ = ["run", "launch", "forward_signals", "agent_exit_code", "what_the_workers_did",
           "RunReport", "FORWARD_ENV"]

log = get_logger(__name__)

#: ``yes``: the agent forwards every signal to its workers; ``no``: never (SLURM delivers them
#: to every process of the step); ``auto`` (default): decided from SLURM's ProctrackType.
FORWARD_ENV = "KEMPNER_RESILIENCE_FORWARD_SIGNALS"
_YES, _NO = ("yes", "1", "true", "always"), ("no", "0", "false", "never")
#: Another launcher's front end (``accelerate launch``): given the function that replaces
#: ``torch.distributed.run.run(args)``, it runs its command line, which calls that function.
Front = Callable[[Callable[[Any], Any]], Any]


def forward_signals(environ: Mapping[str, str] | None = None, timeout_s: float = 10.0
                    ) -> tuple[bool, str]:
    """Whether the agent must forward the signals it gets to its workers, and why: from
    SLURM's ProctrackType (the table in docs/slurm.md), unless ``FORWARD_ENV`` says."""
    env = os.environ if environ is None else environ
    choice = env.get(FORWARD_ENV, "auto").strip().lower() or "auto"
    if choice in _YES or choice in _NO:
        return choice in _YES, f"{FORWARD_ENV}={choice}"
    if choice != "auto":
        raise ValueError(f"{FORWARD_ENV}={choice!r} is not allowed; use yes, no or auto")
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" not in env:
        return True, "not an srun task: only the agent gets the signals"
    from kempner_resilience.slurm.scontrol import run_scontrol

    res = run_scontrol(["show", "config"], timeout_s, environ=env)
    conf = dict(re.findall(r"^(\w+)\s*=\s*(\S*)", res.stdout, re.M)) if res.ok else {}
    proctrack = conf.get("ProctrackType")
    if proctrack is None:
        log.warning("could not read SLURM's ProctrackType (%s): the agent forwards signals to "
                    "its workers; set %s=no if SLURM signals every process of a step",
                    res.describe(), FORWARD_ENV)
        return True, "ProctrackType unknown"
    if proctrack == "proctrack/linuxproc":
        return False, f"{proctrack} signals the task's whole process tree"
    if proctrack == "proctrack/cgroup" and conf.get("SignalChildrenProcesses", "").lower() \
            in ("yes", "1", "true"):
        return False, f"{proctrack} with SignalChildrenProcesses=yes signals every process"
    return True, f"{proctrack} signals only the srun task"


def run(argv: Sequence[str], config: ResilienceConfig | None = None,
        forward: bool | None = None, *, front: Front | None = None) -> int:
    """Run ``torchrun argv`` in this process as a well-behaved srun task; the exit code for
    the batch script (``agent_exit_code``). ``config``: the workers' (their grace bounds the
    agent's wait). ``front``: another launcher's (``argv`` is then unused)."""
    set_role("agent")     # not a rank: its SLURM_PROCID under srun is its node's index
    config = config or load_config()
    config.validate()  # built or changed in Python: held to the file's rules (ConfigError, 78)
    forward, why = forward_signals() if forward is None else (forward, f"forward={forward}")
    agent = Agent(config, forward)
    names = {*config.signals.handled(), *TORCH_SIGNALS}
    previous = {s: signal.getsignal(s)
                for s in sorted(int(getattr(signal, n)) for n in names if hasattr(signal, n))}
    # Before torch loads (seconds): a signal before the workers start then ends the agent with
    # 128+N, as a shell would report it, instead of a USR1's silent default-action death.
    for s in previous:
        signal.signal(s, agent.on_signal)
    report: RunReport | None = None
    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun_main, parse_args

        from kempner_resilience.core import torch_private

        os.environ[TORCHRUN_AGENT_ENV] = str(os.getpid())   # preflight: who started the workers
        # The agent's imports and rendezvous are the job's time, not the queue's (goodput.py).
        os.environ[AGENT_START_ENV] = repr(process_start_time())
        # The workers' own store (worker rank 0's): an agent that dies would take a shared one
        # along, turning a graceful stop into a lost peer.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        report = RunReport()
        log.info("%s: signals %s to the workers (%s)", AGENT_NAME,
                 "are forwarded" if forward else "are not forwarded", why)
        stock = torch_private.elastic("shutdown") is None
        args = None if front is not None else parse_args(list(argv))
        settings = None if args is None else in_place_settings(args)
        inplace = None
        if not stock and settings is not None and torch_private.elastic("restarts") is not None \
                and torch_private.elastic("spares") is not None:
            inplace = InPlace(agent, settings, Channel.from_env())
        ended = ""
        try:
            if stock:
                # Everything rests on knowing the workers: without them, torchrun stays stock.
                _restore(previous)
                if front is not None:
                    from torch.distributed.run import run as torch_run
                    front(torch_run)
                else:
                    torchrun_main(list(argv))
            elif front is not None:
                front(lambda parsed: launch(parsed, agent, None))
            else:
                launch(args, agent, inplace)
        except ChildFailedError as e:
            # Every worker of the last group has ended: all their codes, not only torch's.
            codes = {**agent.codes(),
                     **{int(r): int(f.exitcode) for r, f in sorted(e.failures.items())}}
            if inplace is not None and inplace.left:
                # Not a failed task for srun: the job goes on without this node.
                log.warning("%s: workers exited with %s; this node left the job to a "
                            "spare: exiting with 0", AGENT_NAME, codes)
                return 0
            code = agent_exit_code(codes, agent.killed_ranks())
            if inplace is not None and inplace.final_code is not None:
                code = inplace.final_code      # the policy's guard ended the job (no progress)
            log.warning("%s: workers exited with %s: exiting with %s", AGENT_NAME, codes,
                        what_the_workers_did(code, report.read()))
            return code
        except Exception as e:
            if inplace is None or not inplace.waiting_as_spare():
                raise
            # A spare whose run ended (or whose rendezvous host went): done, not failed.
            ended = f" ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        finally:
            if inplace is not None:
                inplace.close()
        # The policy's code over the last group's workers (a standby has none: 0).
        code = agent_exit_code(agent.codes(), agent.killed_ranks())
        if inplace is not None and inplace.waiting_as_spare():
            log.info("%s: standby node not needed%s; exiting with %d", AGENT_NAME, ended, code)
        return code
    except Interrupted as e:
        log.warning("%s: %s; exiting with %d", AGENT_NAME, e, 128 + e.signum)
        return 128 + e.signum
    finally:
        _restore(previous)
        if report is not None:
            report.close()


def _restore(handlers: Mapping[int, Any]) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


# Codes whose meaning includes "checkpoint committed": from the code alone the agent cannot tell
# (a forced exit, 130/143, committed nothing; a run without state requeues without one).
_COMMIT_CODES = (ExitCode.REQUEUE, ExitCode.STOPPED, ExitCode.REQUEUE_FAILED, ExitCode.SIGINT,
                 ExitCode.SIGTERM)


def what_the_workers_did(code: int, report: Mapping[str, Any] | None) -> str:
    """The agent's account of its workers' exit ``code``: the code, and only what rank 0's run
    ``report`` (None: there is none) says about the checkpoint."""
    text = f"{ExitCode(code).name} ({code})" if code in _COMMIT_CODES else describe(code)
    if report is None:
        text += ("; no run report from rank 0 (forced out, killed, or started by another "
                 "node's agent), so no checkpoint is claimed here: `kempner-resilience ls` "
                 "shows what is on disk")
    elif report.get("saved_step") is not None:
        text += (f"; newest checkpoint this run committed: step {report['saved_step']} "
                 f"({report.get('saved_path')})")
    else:
        resumed = report.get("resumed_from")
        text += "; this run committed no checkpoint" + (
            f" (it resumed from step {resumed})" if resumed is not None else "")
    if code == ExitCode.REQUEUE:
        text += "; torch's 'failed (exitcode: 75)' report above is this requeue, not an error"
    return text


class RunReport:
    """Rank 0's run report, for the agent's last line: at the user's
    ``$KEMPNER_RESILIENCE_REPORT`` (only one written during this run counts), else in a
    directory of the agent's own, set in the environment the workers inherit."""

    def __init__(self) -> None:
        self._own_dir = None
        if not os.environ.get(REPORT_ENV):
            self._own_dir = tempfile.mkdtemp(prefix="kempner-agent-")
            os.environ[REPORT_ENV] = os.path.join(self._own_dir, "report.json")
        self.path = os.environ[REPORT_ENV]
        self._before = self._stamp()

    def _stamp(self) -> int | None:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return None

    def read(self) -> dict[str, Any] | None:
        """The report rank 0 wrote during this run, or None."""
        if self._stamp() in (None, self._before):
            return None
        try:
            report = load_json_bounded(self.path)
        except (OSError, ValueError):
            return None
        return report if isinstance(report, dict) else None

    def close(self) -> None:
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            if os.environ.get(REPORT_ENV) == self.path:
                del os.environ[REPORT_ENV]


# ------------------------------------------------------------------ torch's launch, ours

def launch(args: argparse.Namespace, tracked: Agent, inplace: InPlace | None) -> Any:
    """Run torchrun's parsed arguments (torchrun's or ``accelerate launch``'s) with our agent;
    the workers' return values (none for a standby). Raises ``ChildFailedError`` after
    torch's own report of it, as torchrun's ``main`` does."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import config_from_args, parse_min_max_nnodes

    # torchrun's ``run``: a standalone or single-node static rendezvous is a local c10d one.
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint
                           and args.master_port is None
                           and parse_min_max_nnodes(args.nnodes)[1] == 1):
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
        if args.standalone:
            log.info("standalone rendezvous: --rdzv-backend=%s --rdzv-endpoint=%s --rdzv-id=%s",
                     args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id)
    if args.master_port is None:    # only the static rendezvous reads it
        args.master_port = 29500
    config, entrypoint, cmd_args = config_from_args(args)
    return record(_launch_agent)(config, entrypoint, list(cmd_args), tracked, inplace)


def _entrypoint_name(entrypoint: Any, args: list[Any]) -> str:
    if callable(entrypoint):
        return str(getattr(entrypoint, "__name__", ""))
    if entrypoint == sys.executable:
        return next((a for a in args if not str(a).startswith("-")), "")
    return entrypoint if isinstance(entrypoint, str) else ""


def _static_master(params: Any) -> tuple[str | None, int | None]:
    """The static rendezvous's master address and port (torch's ``_get_addr_and_port``)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if params.backend != "static":
        return None, None
    endpoint = (params.endpoint or "").strip()
    if not endpoint:
        raise ValueError("Endpoint is missing in endpoint. Try to add --master-addr and "
                         "--master-port")
    addr, port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    if port == -1:
        raise ValueError(f"port is missing in endpoint: {endpoint}. Try to specify --master-port")
    return addr, port


def _only(names: Iterable[str], values: dict[str, Any]) -> dict[str, Any]:
    """``values`` whose keys are in ``names``: what this torch release (2.11-2.13) takes."""
    known = set(names)
    return {k: v for k, v in values.items() if k in known}


def _launch_agent(config: LaunchConfig, entrypoint: Any, args: list[Any], tracked: Agent,
                  inplace: InPlace | None) -> Any:
    # torch's launch_agent, less its health-check server (off by default).
    from torch.distributed.elastic import events, metrics
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    from kempner_resilience.supervise.torchrun.elastic import ElasticAgent, spare_handler

    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        log.warning("config has no run_id, generated a random run_id: %s", config.run_id)
    name = _entrypoint_name(entrypoint, args)
    log.info("starting the elastic agent: entrypoint %s, nodes %s:%s, %s per node, run id %s, "
             "rendezvous %s at %s, max restarts %s", name, config.min_nodes, config.max_nodes,
             config.nproc_per_node, config.run_id, config.rdzv_backend, config.rdzv_endpoint,
             config.max_restarts)
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                  run_id=config.run_id, min_nodes=config.min_nodes,
                                  max_nodes=config.max_nodes, local_addr=config.local_addr,
                                  **config.rdzv_configs)
    master_addr, master_port = _static_master(params)
    # Which signals torch's process context handles (ours, swapped in while workers start).
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = getattr(config, "signals_to_handle",
                                                           ",".join(TORCH_SIGNALS))
    handler = spare_handler(params, inplace) if inplace is not None and params.backend == "c10d" \
        else registry.get_rendezvous_handler(params)
    event_log = getattr(config, "event_log_handler", "null")
    newer = {n: getattr(config, n) for n in ("numa_options", "duplicate_stdout_filters",
                                             "duplicate_stderr_filters", "virtual_local_rank")
             if hasattr(config, n)}
    spec = WorkerSpec(**_only((f.name for f in dataclasses.fields(WorkerSpec)), dict(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
        args=tuple(args), rdzv_handler=handler, max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval, master_addr=master_addr,
        master_port=master_port, local_addr=config.local_addr, event_log_handler=event_log,
        **newer)))
    torch_init = inspect.signature(ElasticAgent.__mro__[1].__init__).parameters
    agent = ElasticAgent(spec, config.logs_specs, tracked=tracked, inplace=inplace,
                         **_only(torch_init, dict(
                             start_method=config.start_method,
                             log_line_prefix_template=config.log_line_prefix_template,
                             shutdown_timeout=getattr(config, "shutdown_timeout", 30))))
    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), event_log)
        if result is None:
            # torch's run returns nothing when the rendezvous closed while this agent waited
            # as a standby (its RendezvousGracefulExitError): the run is over, no worker here.
            log.info("%s: the rendezvous closed while this agent stood by", AGENT_NAME)
            return {}
        if result.is_failed():
            # torch's @record copies the first failure's error file into the agent's.
            raise ChildFailedError(name=name, failures=result.failures)
        return result.return_values
    except ChildFailedError:
        raise
    except Exception as e:
        # An agent ended by a signal keeps the rendezvous open (torch's reason: closing it
        # ends this rdzv id for good).
        shutdown_rdzv = not isinstance(e, SignalException)
        events.record(agent.get_event_failed(), event_log)
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
