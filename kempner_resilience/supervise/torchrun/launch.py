"""torchrun's launch with our agent: torch's ``launch_agent``, building our classes.

``torch.distributed.run.main`` parses torchrun's arguments into a ``LaunchConfig`` and hands it
to ``launcher.api.launch_agent``. ``launch`` does the same with the same public pieces, as
NVIDIA's resiliency launcher (``ft_launcher``) does, but runs ``elastic.ElasticAgent`` and, with
spares, ``elastic.SpareHandler``: nothing of torch's is replaced. Left out: torch's health-check
server (off by default) and the agent thread's name. What a torch release lacks (2.11-2.13) is
passed only where it has it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
import uuid
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from kempner_resilience.core.log import get_logger
from kempner_resilience.supervise.torchrun.agent import AGENT_NAME, TORCH_SIGNALS, Agent
from kempner_resilience.supervise.torchrun.spares import InPlace

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

__all__ = ["launch"]

log = get_logger("kempner_resilience.supervise.torchrun.wrapper")


def launch(argv: Sequence[str] | argparse.Namespace, tracked: Agent, inplace: InPlace | None,
           shutdown_names: dict[str, Any], decides: bool) -> Any:
    """Run torchrun's ``argv`` (or its parsed arguments, from ``accelerate launch``) with our
    agent; the workers' return values (none for a standby). Raises ``ChildFailedError`` after
    torch's own report of it, as torchrun's ``main`` does."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import config_from_args, parse_args, parse_min_max_nnodes

    args = argv if isinstance(argv, argparse.Namespace) else parse_args(list(argv))
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
    return record(_launch_agent)(config, entrypoint, list(cmd_args), tracked, inplace,
                                 shutdown_names, decides)


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
    """``values`` whose keys are in ``names`` (a dataclass's fields, a function's parameters)."""
    known = set(names)
    return {k: v for k, v in values.items() if k in known}


def _launch_agent(config: LaunchConfig, entrypoint: Any, args: list[Any], tracked: Agent,
                  inplace: InPlace | None, shutdown_names: dict[str, Any],
                  decides: bool) -> Any:
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
    spec = WorkerSpec(**_only((f.name for f in dataclasses.fields(WorkerSpec)), dict(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
        args=tuple(args), rdzv_handler=handler, max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval, master_addr=master_addr,
        master_port=master_port, local_addr=config.local_addr, event_log_handler=event_log,
        numa_options=getattr(config, "numa_options", None),
        duplicate_stdout_filters=getattr(config, "duplicate_stdout_filters", None),
        duplicate_stderr_filters=getattr(config, "duplicate_stderr_filters", None),
        virtual_local_rank=getattr(config, "virtual_local_rank", False))))
    torch_init = inspect.signature(ElasticAgent.__mro__[1].__init__).parameters
    agent = ElasticAgent(spec, config.logs_specs, tracked=tracked, inplace=inplace,
                         shutdown_names=shutdown_names, decides=decides, **_only(torch_init, dict(
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
