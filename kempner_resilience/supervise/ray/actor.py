"""A training actor's side: its torch.distributed group, the driver's stop, Ray's SIGTERM.

The actors of one group are the ranks of one ResilientRun; the driver forms their group and
hands over the config and the stop board (``board.py``). A ResilientRun needs the main thread,
where only sync methods run: no ``max_concurrency``, no concurrency groups.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

from kempner_resilience.config import ResilienceConfig
from kempner_resilience.core.log import get_logger, set_role
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.ray.board import BoardWatcher
from kempner_resilience.supervise.endings import RankEnding
from kempner_resilience.supervise.policy import KILLED, RankEnd

__all__ = ["TrainingActor", "ActorEnding", "stop_context", "init_group", "actor_ends", "actor_died"]

log = get_logger(__name__)


@dataclass
class ActorEnding:
    """How an actor's run ended: ``code`` (0 completed), the ``signum`` that stopped it, and
    whether that came from the driver."""

    code: int = 0
    signum: int | None = None
    from_driver: bool = False

    @property
    def leaves(self) -> bool:
        """Ray's own SIGTERM (an eviction, a drain) stopped the run: the process exits once
        the call has returned."""
        return self.code == 143 and not self.from_driver


def ending_of(outcome: Any) -> Any:
    """A training call's ending: its outcome, or the ``"ending"`` of a ``kr_call`` result."""
    return outcome.get("ending") if isinstance(outcome, dict) else outcome


def actor_ends(outcomes: Sequence[Any], killed: Sequence[int], *, driver_stopping: bool,
               recorded: Mapping[int, RankEnding] | None = None) -> tuple[RankEnd, ...]:
    """Each training call's outcome (an ``ActorEnding``, or its exception) as its rank's
    ending. A dead actor ended as it ``recorded`` (Ray reports the watchdog's 42 with no
    code), else as killed. A SIGTERM the driver did not send (a drain, an eviction) asks to
    run again (75), as a preemption does."""
    ends = []
    for rank, out in enumerate(outcomes):
        ending = ending_of(out)
        if rank in killed:
            ends.append(RankEnd(int(ExitCode.HANG), by_supervisor=True))
        elif isinstance(ending, ActorEnding):
            evicted = (ending.code == int(ExitCode.SIGTERM) and not ending.from_driver
                       and not driver_stopping)
            ends.append(RankEnd(int(ExitCode.REQUEUE) if evicted else ending.code))
        elif actor_died(out):
            ends.append(recorded[rank].end() if recorded and rank in recorded else KILLED)
        else:   # the training raised an error of its own (Ray's RayTaskError): a bug
            ends.append(RankEnd(int(ExitCode.ERROR)))
    return tuple(ends)


def actor_died(error: Any) -> bool:
    """Whether ``error`` (a call's outcome) says that the actor's process is gone."""
    # By name: Ray is imported lazily. ActorDiedError, ActorUnavailableError derive from it.
    return any(c.__name__ == "RayActorError" for c in type(error).__mro__)


def call_error(ref: Any, kinds: tuple[type[BaseException], ...] = (Exception,)
               ) -> BaseException | None:
    """The error of ``kinds`` that call ``ref`` raised, or None; other errors propagate. A call
    not done yet gives Ray's ``GetTimeoutError``."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except kinds as e:
        return e
    return None


def kill_actors(actors: Iterable[Any]) -> None:
    """``ray.kill`` each actor for good; one already gone is skipped."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:   # already gone
            log.debug("ray.kill: %s", e)


def init_group(rank: int, world_size: int, addr: str, port: int, *,
               backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """Join the actors' torch.distributed group as ``rank`` (rank 0 hosts the store at
    ``addr:port``). RANK stays unset: a run in an actor would pick ``exit`` mode."""
    import datetime

    import torch.distributed as dist

    set_role(f"rank {rank}")
    # The rescue's buddy link finds this host's address on the route to it (rescue/link.py);
    # without it that is 127.0.0.1, unreachable from another node.
    os.environ["MASTER_ADDR"] = addr
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


@contextlib.contextmanager
def stop_context(board: Any) -> Iterator[ActorEnding]:
    """Around a training actor's ``with ResilientRun(...)``, on the main thread: the driver's
    stop reaches the run, Ray's SIGTERM handler is out of the way, and the run's
    ``SystemExit`` becomes ``ending``. After Ray's own SIGTERM the process exits once the
    method returns."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("stop_context needs the actor's main thread: a sync actor without "
                           "max_concurrency or concurrency groups")
    ending = ActorEnding()
    previous = signal.getsignal(signal.SIGTERM)
    # Ray's handler raises SystemExit mid-step (no checkpoint); the run's would chain it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Ray's workers block SIGINT in every thread: the driver's Ctrl+C, passed on as SIGINT,
    # would stay pending for good. Unblocked here, on the main thread only, while the run lives.
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    watcher = BoardWatcher(board).start() if board is not None else None
    try:
        yield ending
    except SystemExit as e:
        ending.code = int(e.code) if isinstance(e.code, int) else 1
        ending.signum = watcher.signum if watcher and watcher.delivered else None
        ending.from_driver = ending.signum is not None
        log.warning("the run ended with %d%s", ending.code,
                    " (the driver's stop)" if ending.from_driver else "")
    except Exception as e:
        # A run that lost a peer re-raises the collective's error after its rescue: PEER_LOST,
        # for the supervisor to relaunch. Any other exception is the training's own.
        from kempner_resilience.core.faults import first_line, is_peer_failure

        if not is_peer_failure(e):
            raise
        ending.code = int(ExitCode.PEER_LOST)
        log.warning("the run lost a peer (%s): ending %d", first_line(e), ending.code)
    finally:
        if watcher is not None:
            watcher.stop()
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if ending.leaves:
        # Leave once this method's result is on its way: ``exit_actor`` from a thread would
        # race the return; a short delay, then a plain exit, is bounded.
        def leave() -> None:
            time.sleep(1.0)
            os._exit(ending.code)

        threading.Thread(target=leave, name="kempner-ray-exit", daemon=True).start()


class TrainingActor:
    """Mixin for a Ray training actor class: the driver forms its group and calls its methods
    (``kempner_resilience.ray.TrainingActor`` adds ``resilient_run``). The earlier names
    ``address``, ``init_group`` (deprecated) and ``stop_context`` still work."""

    kr_config: ResilienceConfig | None = None
    kr_board: Any = None
    kr_rank: int = 0
    kr_world_size: int = 1
    kr_ending: ActorEnding | None = None    # how the run of the current call ended

    def kr_address(self) -> tuple[str, int]:
        """This actor's node address and a free port on it: rank 0's, for the group."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), int(s.getsockname()[1])

    def kr_setup(self, rank: int, world_size: int, addr: str, port: int,
                 config: ResilienceConfig | None = None, board: Any = None,
                 backend: str = "gloo", name: str | None = None) -> None:
        """Join the group as ``rank`` and keep the driver's config and stop board; a worker
        group's ``name`` makes the log lines say ``[<name> rank N]``."""
        init_group(rank, world_size, addr, port, backend=backend)
        if name is not None:
            set_role(f"{name} rank {rank}")
        self.kr_config, self.kr_board = config, board
        self.kr_rank, self.kr_world_size = rank, world_size

    def kr_call(self, method: str, args: Sequence[Any] = (),
                kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run ``method`` for the driver: ``{"result": ..., "ending": ActorEnding}``."""
        self.kr_ending = ActorEnding()
        result = getattr(self, method)(*args, **dict(kwargs or {}))
        return {"result": result, "ending": self.kr_ending}

    def address(self) -> tuple[str, int]:
        """Deprecated: the driver forms the group (``RayDriver.run_group``)."""
        warnings.warn("TrainingActor.address is deprecated: RayDriver.run_group forms the "
                      "group", DeprecationWarning, stacklevel=2)
        return self.kr_address()

    def init_group(self, rank: int, world_size: int, addr: str, port: int,
                   backend: str = "gloo") -> None:
        """Deprecated: the driver forms the group (``RayDriver.run_group``)."""
        warnings.warn("TrainingActor.init_group is deprecated: RayDriver.run_group forms the "
                      "group", DeprecationWarning, stacklevel=2)
        self.kr_setup(rank, world_size, addr, port, backend=backend)

    def pid(self) -> int:
        return os.getpid()

    kr_pid = pid    # the name the parking asks a spare by (a Worker has no ``pid``)

    def kr_rebirth(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> int:
        """Become a new actor of this class in this process (``parking.py``): the old
        process group destroyed, the object built again by its ``__init__``."""
        import gc

        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        # Only Ray's own attributes stay: nothing of the last incarnation survives __init__.
        kept = {k: v for k, v in self.__dict__.items() if k.startswith(("_ray", "__ray"))}
        self.__dict__.clear()
        self.__dict__.update(kept)
        # The last incarnation's sockets, pipes and event fds are held by reference cycles
        # (its store, its rescue link): gone now, not at the collector's next pass.
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        type(self).__init__(self, *args, **dict(kwargs or {}))
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this actor runs on (the supervisor's bad-node memory reads it)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    stop_context = staticmethod(stop_context)
