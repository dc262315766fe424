"""What an exception that ended the training loop says about the job: a lost peer, or a bug.

A rank whose peer died (a killed process, a dead node, a cut link) learns it only through its
own collectives: gloo raises ``Connection closed by peer``/``reset by peer``, NCCL an aborted
communicator or a watchdog timeout, the TCPStore a broken connection. That is not a bug in the
training script and deserves its own exit code (``PEER_LOST``) and one log line, not a traceback:
the job resumes from its last committed checkpoint. Anything else is the user's error and keeps
Python's traceback and exit code 1.

A peer that is alive but does not answer (paused with SIGSTOP, a frozen node) ends a gloo wait
with its per-operation timeout: ``Timed out waiting 8000ms for recv operation to complete``,
after which every later operation on that group fails at once with ``Application timeout caused
pair closure`` (gloo's texts, provoked with torch 2.13). Both are lost peers too. The package's
own wrappers of such failures (a save that lost a peer) say so with a true ``peer_failure``
attribute, which needs no import here.
"""

from __future__ import annotations

import re
import sys

__all__ = ["is_peer_failure", "first_line"]

# Seen from gloo, NCCL and c10d's store when the other side of a collective is gone.
_PEER_TEXT = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket timeout",
    "timed out",
    "nccl communicator was aborted",
    "ncclremoteerror",
    "ncclsystemerror",
    "remote process exited",
    "peer",                      # gloo's enforce messages name the peer in various words
)
# gloo's timeout texts, which name neither gloo nor the peer (see the module docstring).
_GLOO_TIMEOUT_TEXT = (
    "caused pair closure",
    "for recv operation to complete",
    "for send operation to complete",
)


# Where torch's C++ raised it: gloo's "[/path/gloo/transport/tcp/pair.cc:553] ", NCCL's
# "NCCL error in: /path/ProcessGroupNCCL.cpp:1234, ", c10d's "[c10d] ".
_CPP_WHERE = re.compile(r"^(?:\[[^\]\s]*(?:\.(?:cc|cpp|cu|h|hpp)(?::\d+)?|c10d)\]\s*"
                        r"|NCCL error in: \S+\.(?:cc|cpp|cu)(?::\d+)?,\s*)")
# The end of the first sentence: a period, then a capital (an address's dots are not).
_SENTENCE_END = re.compile(r"(?<=\.)\s+(?=[A-Z])")


def _dist_error_types() -> tuple[type[BaseException], ...]:
    dist = sys.modules.get("torch.distributed")
    if dist is None:                   # torch.distributed never imported: no collective ran
        return ()
    return tuple(t for t in (getattr(dist, n, None) for n in
                             ("DistBackendError", "DistNetworkError", "DistStoreError"))
                 if isinstance(t, type))


def is_peer_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a collective or store failure
    caused by another rank being gone, rather than a bug in the training code."""
    seen = 0
    types = _dist_error_types()
    while exc is not None and seen < 8:
        if types and isinstance(exc, types):
            return True
        if getattr(exc, "peer_failure", False) is True:
            return True
        if isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)):
            text = str(exc).lower()
            if any(t in text for t in _GLOO_TIMEOUT_TEXT):
                return True
            if any(t in text for t in _PEER_TEXT) and ("gloo" in text or "nccl" in text
                                                       or "c10d" in text or "peer" in text
                                                       or "store" in text):
                return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, for one-line logs. A message from torch's C++
    (gloo, NCCL, c10d) loses its source location and the advice gloo appends ("This is
    typically caused by a remote worker crashing. ... GLHF!"): ``gloo: Connection closed by
    peer [127.0.0.1]:50585``. Our line says what it means; theirs is not ours to print."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text, who = lines[0], type(exc).__name__
    where = _CPP_WHERE.match(text)
    if where is not None:
        for lib in ("gloo", "nccl", "c10d"):
            if lib in where.group(0).lower():
                who = "NCCL" if lib == "nccl" else lib
                break
        text = _SENTENCE_END.split(text[where.end():], 1)[0].rstrip(".") or text
    return f"{who}: {text[:300]}"
