"""A machine's standby for local launches: one zygote (``warm.py --listen NAME``) that outlives
the launches, named by ``$KEMPNER_RESILIENCE_STANDBY``. A launch that finds one forks its ranks
at once; its own ``warm.Zygote`` would import torch first (2-3 s of CPU each launch).

When a rank's connection drops with the launcher, the standby sends the rank its death signal,
as the death of a launch's own zygote would. A standby that imported torch with other values
than a rank would (``_AT_IMPORT``: PYTHONPATH, TORCH_*, ...) is not used.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Mapping, Sequence

from kempner_resilience.core.log import get_logger
from kempner_resilience.supervise.local import warm
from kempner_resilience.supervise.local.warm import Forker, Zygote

__all__ = ["NodeStandby", "standby_or_zygote", "start", "STANDBY_ENV"]

_log = get_logger(__name__)

#: The standby's abstract socket name.
STANDBY_ENV = "KEMPNER_RESILIENCE_STANDBY"
# What Python or torch may read at start-up or import (a rank of a standby shares its values);
# a standby whose values differ is not used.
_AT_IMPORT = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "NVIDIA", "LD_",
              "GLIBC", "MALLOC")
# Of those, what is read only when used: the thread count (set again in each rank); two that
# Lightning sets in its importer's environment (torch reads them when it checks for CUDA or
# compiles a kernel), so a process that imported Lightning once does not lose its standby;
# torch elastic's settings, which a torchrun agent sets for its workers and torch reads when
# elastic's code runs (a standby never imports it).
_AFTER_IMPORT = frozenset({"OMP_NUM_THREADS", "PYTORCH_NVML_BASED_CUDA_CHECK",
                           "TORCHINDUCTOR_CACHE_DIR", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"})
_AFTER_IMPORT_PREFIXES = ("TORCHELASTIC_",)
# What the frameworks a standby may also import (``warm.IMPORTS_ENV``) read at import; any other
# module is taken to read its own name's variables (``ACCELERATE_*`` for accelerate).
_READ_BY = {"transformers": ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "USE_TORCH",
                             "USE_TF", "USE_FLAX", "USE_JAX"),
            "pytorch_lightning": ("PL_", "LIGHTNING_"), "lightning": ("PL_", "LIGHTNING_")}


class NodeStandby(Forker):
    """A standby that outlives the launches: one zygote a machine keeps for all its launches,
    so a launch pays no import at all; ``close`` leaves it running."""

    @classmethod
    def for_env(cls, env: dict[str, str]) -> "NodeStandby | None":
        """The standby ``$KEMPNER_RESILIENCE_STANDBY`` names, when it answers, runs this
        Python, belongs to the SLURM job of ``env`` (or to none, as ``env``), and imported
        torch with what a rank of ``env`` would import it with (``_AT_IMPORT``); else None
        (the launcher starts its own zygote, and the log says why)."""
        name = os.environ.get(STANDBY_ENV, "").strip()
        if not name:
            return None
        why = _unfit(name, env)
        if why is None:
            return cls(name)
        _log.info("standby %s not used (%s): the ranks fork from a process of their own", name,
                  why)
        return None

    def __str__(self) -> str:
        return f"the standby {self.name}"


def _unfit(name: str, env: Mapping[str, str]) -> str | None:
    """Why the standby ``name`` cannot fork the ranks of ``env``; None when it can."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect("\0" + name)
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                     socket.CMSG_LEN(12))
        pid = int.from_bytes(creds[0:4], sys.byteorder)
        if not os.path.samefile(f"/proc/{pid}/exe", sys.executable):
            return f"it runs another Python than {sys.executable}"
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [e.decode(errors="replace").partition("=") for e in f.read().split(b"\0")
                     if e]
    except OSError as e:
        return f"it does not answer: {e}"
    theirs = {k: v for k, _, v in pairs}
    # Inside a SLURM job, only a standby of that job: the ranks of one outside it would
    # live outside the allocation (no --signal, no cgroup, no cleanup by slurmd).
    if theirs.get("SLURM_JOB_ID") != env.get("SLURM_JOB_ID"):
        return "it is not in this SLURM job"
    imported = warm.warm_imports(theirs)
    missing = [name for name in warm.warm_imports(env) if name not in imported]
    if missing:
        return f"it did not import {', '.join(missing)}"
    tops = [name.partition(".")[0] for name in imported]
    read = tuple(p for top in tops for p in _READ_BY.get(top, (top.upper() + "_",)))
    mine, its = _at_import(env, read), _at_import(theirs, read)
    differ = sorted(k for k in {*mine, *its} if mine.get(k) != its.get(k))
    what = ", ".join(("torch", *imported))
    return f"it imported {what} with other {', '.join(differ)}" if differ else None


def start(name: str, env: Mapping[str, str], *, die_with_caller: bool = False
          ) -> subprocess.Popen[bytes]:
    """A standby behind ``name``, started with ``env`` as a launch's ranks see it (unbuffered
    streams); returns once its socket answers. ``die_with_caller``: SIGKILLed when the calling
    thread ends, even by a signal."""
    return warm.start(name, {**env, "PYTHONUNBUFFERED": "1"},
                      death_signal=signal.SIGKILL if die_with_caller else None)


def standby_or_zygote(env: dict[str, str], *, ignore: Sequence[int] = (),
                      death_signal: int = signal.SIGTERM) -> Forker:
    """The machine's standby when one fits ``env`` (``NodeStandby.for_env``), else a zygote
    of the caller's own started with ``env`` (``ignore``, ``death_signal``: ``Zygote``'s)."""
    return NodeStandby.for_env(env) or Zygote(env, ignore=ignore, death_signal=death_signal)


def _at_import(env: Mapping[str, str], read: tuple[str, ...] = ()) -> dict[str, str]:
    """What of ``env`` torch, Python or the standby's other imports (their variables: ``read``)
    may read before a rank's own code runs."""
    return {k: v for k, v in env.items() if k.startswith(_AT_IMPORT + read)
            and k not in _AFTER_IMPORT and not k.startswith(_AFTER_IMPORT_PREFIXES)}
