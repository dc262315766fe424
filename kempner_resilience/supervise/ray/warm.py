"""Warm Ray workers: through Ray's own ``runtime_env["py_executable"]``, the Python workers Ray
starts on the driver's node fork from one process that imported torch once (the machine's
standby when one fits, ``supervise/local/standby.py``, else a zygote of the driver's own,
``supervise/local/warm.py``). Each actor, and each that replaces a lost one, then skips Python's
start-up, ``import torch``, DCP and the optimizer's ``torch._dynamo`` (2-4 s of CPU).

The ``py_executable`` is the srun standby's shim (``supervise/srun/shim.py``); where no zygote
answers (another node) it becomes the worker itself, a cold start. The zygote imports torch, not
Ray: Ray reads its cluster's authentication token once per process, and a worker forked from a
process that read it before the cluster existed could not connect. docs/ray.md, "The
driver-loop shape (SkyRL's trainer)".
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import sys
from typing import Any, Mapping

from kempner_resilience.core.log import get_logger
from kempner_resilience.supervise.local.standby import standby_or_zygote
from kempner_resilience.supervise.local.warm import warm_on
from kempner_resilience.supervise.srun.shim import WAIT_ENV
from kempner_resilience.supervise.srun.standby import SHIM

__all__ = ["warm_runtime_env"]

log = get_logger(__name__)


def warm_runtime_env(runtime_env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``runtime_env`` for ``ray.init`` with warm Python workers on this node, when
    ``$KEMPNER_RESILIENCE_WARM=1`` (else ``runtime_env`` as it is, as also when it names a
    ``py_executable`` of its own). Call it on the driver's main thread, before ``ray.init``:
    the zygote ends with that thread, or at the driver's exit."""
    env = dict(runtime_env or {})
    if not warm_on() or "py_executable" in env:
        return env
    zygote = standby_or_zygote(dict(os.environ), death_signal=signal.SIGKILL)
    atexit.register(zygote.close)   # after Ray's own exit hook, registered later by ray.init
    # The shim does not wait for a zygote that is not there: on another node it starts cold.
    env["py_executable"] = shlex.join(["env", f"{WAIT_ENV}=0", sys.executable, "-S", SHIM,
                                       zygote.name, sys.executable])
    log.info("Ray workers on this node fork from %s (%s=1)", zygote, "KEMPNER_RESILIENCE_WARM")
    return env
