"""The torchrun spares glue's memory: the bad-node record and the ledger's ``restart`` event.

No single agent sees the whole failure. The node that leaves records itself bad before it
leaves the rendezvous (``record_left``): the survivors' next round completes only after, so
the record is on disk before the restart event. The new group's rank-0 agent writes the
``restart`` event before its workers start (``record_agent_restart``). Best effort: a record
that cannot be written is logged, never raised into torch.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable

from kempner_resilience.checkpoint.layout import newest_committed
from kempner_resilience.core import torch_private
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.core.log import get_logger
from kempner_resilience.slurm.badnodes import bad_node_records, record_bad_nodes
from kempner_resilience.slurm.env import node_name
from kempner_resilience.slurm.restart_event import last_rescue, ledger_so_far, record_restart

__all__ = ["node_name", "record_left", "record_agent_restart", "rendezvous_round"]

log = get_logger("kempner_resilience.supervise.torchrun.wrapper")


def rendezvous_round(rdzv_handler: Any) -> int | None:
    """The round of torch's dynamic rendezvous this agent has just joined (0 for the first;
    each in-job restart completes the next), or None when this torch does not expose it."""
    state = torch_private.rendezvous_state(rdzv_handler)
    value = getattr(state, "round", None)
    return value if isinstance(value, int) and value >= 0 else None


def record_left(paths: RunPaths, codes: Iterable[int],
                why: str | None = None) -> None:
    """This node leaves the job to a spare (its worker was killed, or hung with the GIL held):
    record it as bad. ``why``: the agent's words for it ("... on this node ...")."""
    node = node_name()
    if not _known_dir(paths, f"node {node} as bad"):
        return
    what = f"a worker on {node} was killed (exit {sorted(set(codes))})" \
        if why is None or "was killed" in why else why.replace("this node", node)
    try:
        record_bad_nodes(paths, [node], reason=f"{what}; it left the job to a spare",
                         job_id=os.environ.get("SLURM_JOB_ID"))
    except OSError as e:     # the relaunch still goes on without it; only the memory is lost
        log.error("cannot record node %s as bad in %s: %s", node, paths, e)


def _known_dir(paths: RunPaths, what: str) -> bool:
    """Whether the run's directory exists (the workers made it). When it does not, the
    agent's config names another ``checkpoint.dir`` than the workers': nothing is written (no
    stray directory), and the log says how to fix it."""
    if paths.root.is_dir():
        return True
    log.warning("not writing %s: no checkpoint directory %s; give the agent the workers' "
                "checkpoint.dir (--config/--set before torchrun's arguments, or "
                "KEMPNER_RESILIENCE_CONFIG)", what, paths)
    return False


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def record_agent_restart(paths: RunPaths, round_: int, *,
                         spare: str | None = None, why: str | None = None
                         ) -> dict[str, Any] | None:
    """Write the ``restart`` event of in-job restart ``round_`` (the rank-0 agent, before it
    starts its workers). ``why``: this agent's own view of the failure, used when no node
    left (a rescued failure with every node alive). Never raises; returns the event."""
    if not _known_dir(paths, f"the restart event of in-job restart {round_}"):
        return None
    try:
        events, ids = ledger_so_far(paths)
        # The failure happened during the previous attempt: since its start.
        starts = [e for e in events if e.get("ev") == "start"]
        since = _num(starts[-1].get("t0")) if starts else None
        since = since if since is not None else 0.0
        fresh = {n: r for n, r in bad_node_records(paths).items()
                 if (_num(r.get("last_t")) or 0.0) >= since}
        rescue_end, rescue_s = last_rescue(events, since)
        rescue_t0 = None if rescue_end is None else rescue_end - (rescue_s or 0.0)
        # When the failure happened, as best known: the leaving node recorded it as soon as
        # its monitor saw its worker dead, or the survivors' rescue began, whichever came first.
        known = [_num(r.get("last_t")) or 0.0 for r in fresh.values()]
        failure_t = min(known + ([rescue_t0] if rescue_t0 is not None else []), default=None)
        now = time.time()
        detect_s = None if failure_t is None or rescue_t0 is None \
            else max(0.0, rescue_t0 - failure_t)
        # Back to back: failure -> detection -> rescue -> relaunch (this agent's launch).
        end = rescue_end if rescue_end is not None else failure_t
        relaunch_s = None if end is None else max(0.0, now - end)
        reason = "; ".join(sorted({str(r.get("reason", "")) for r in fresh.values()} - {""})) \
            or why or "a rescued failure"
        return record_restart(paths, relaunch=round_, reason=reason, bad_nodes=fresh,
                              spare=spare, step=newest_committed(paths),
                              failure_t=failure_t, detect_s=detect_s, rescue_s=rescue_s,
                              relaunch_s=relaunch_s, **ids)
    except Exception as e:   # the restart goes on; only its accounting is lost
        log.error("could not write the restart event of in-job restart %d to %s: %s",
                  round_, paths, e)
        return None
