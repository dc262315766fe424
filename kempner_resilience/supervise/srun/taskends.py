"""What one srun step did, read from srun's own messages on its stderr (pure).

A node that died says nothing: its slurmd died with it, and SLURM notices only after
``SlurmdTimeout``. So a node silent while the others report is the dead one; the survivors'
codes say what kind of ending it was.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.policy import NOT_IN_PLACE, RESCUED_CODES

__all__ = ["TaskEnd", "StepReport", "parse_srun_line", "choose_nodes", "FAILURE_CODES"]

FAILURE_CODES = RESCUED_CODES       # the policy's rescued codes, by their older name
# What the survivors of someone else's failure end with; any other bad ending points at the
# task's own node (HANG: the hung rank's kernel timer; a signal: the rank was killed).
_SURVIVOR_CODES = frozenset({int(ExitCode.PEER_LOST), int(ExitCode.SIGTERM), 0})

_TASKS = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.*)$")
_NODE_FAIL = re.compile(r"^srun: error: Node failure on (\S+)")
_EXITED = re.compile(r"Exited with exit code (\d+)")
_SIGNAL_WORDS = {"Killed": signal.SIGKILL, "Terminated": signal.SIGTERM,
                 "Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT,
                 "Bus error": signal.SIGBUS, "Interrupt": signal.SIGINT}


@dataclass(frozen=True)
class TaskEnd:
    """srun's report of tasks on one node that ended badly (``node_failure``: the whole node)."""

    node: str
    tasks: tuple[int, ...] = ()
    code: int | None = None              # the exit code, 128 + N for a signal
    node_failure: bool = False
    signaled: bool = False               # killed by that signal (srun: "Killed"), not an exit


def _task_ids(text: str) -> tuple[int, ...]:
    spans = [part.partition("-") for part in text.split(",")]
    return tuple(t for lo, _, hi in spans if lo.isdigit() for t in range(int(lo), int(hi or lo) + 1))


def parse_srun_line(line: str) -> TaskEnd | None:
    """One line of srun's stderr -> what it reports about a task's end, or None."""
    line = line.strip()
    if m := _NODE_FAIL.match(line):
        return TaskEnd(m.group(1), node_failure=True)
    if not (m := _TASKS.match(line)):
        return None
    node, tasks, what = m.group(1), _task_ids(m.group(2)), m.group(3)
    if e := _EXITED.search(what):
        return TaskEnd(node, tasks, int(e.group(1)))
    sig = next((s for word, s in _SIGNAL_WORDS.items() if what.startswith(word)), None)
    return None if sig is None else TaskEnd(node, tasks, 128 + int(sig), signaled=True)


@dataclass
class StepReport:
    """Everything srun said about one step's task ends, in order."""

    nodes: Sequence[str]                 # the step's nodes
    ntasks: int                          # the step's tasks
    ends: list[TaskEnd] = field(default_factory=list)

    def add(self, end: TaskEnd) -> None:
        self.ends.append(end)

    def node_of(self, task: int, tasks_per_node: int) -> str | None:
        """The node of ``task``: srun lays tasks out in blocks, task r on nodes[r // per node]."""
        i = task // max(tasks_per_node, 1)
        return self.nodes[i] if i < len(self.nodes) else None

    @property
    def reported_tasks(self) -> set[int]:
        return {t for e in self.ends for t in e.tasks}

    @property
    def complete(self) -> bool:
        """Every task's end was reported (nothing more to wait for)."""
        return len(self.reported_tasks) >= self.ntasks

    def heard_complete(self, tasks_per_node: int) -> bool:
        """Every node that reported a task's end has reported all of its tasks' ends: what is
        missing is whole nodes, the silent (dead) ones."""
        per: dict[str, set[int]] = {}
        for e in self.ends:
            if not e.node_failure:
                per.setdefault(e.node, set()).update(e.tasks)
        return bool(per) and all(len(t) >= tasks_per_node for t in per.values())

    @property
    def codes(self) -> set[int]:
        return {e.code for e in self.ends if e.code is not None}

    @property
    def failed(self) -> bool:
        """srun reported a failure ending (a rank lost or hung, killed by a signal other than
        SIGTERM/SIGINT, or a node declared dead) and nothing that ends the job as it is (a
        bug, a requeue under way): the loop then ends the step."""
        if self.codes & NOT_IN_PLACE:
            return False
        killed = {c for c in self.codes if c > 128} - {int(ExitCode.SIGTERM), int(ExitCode.SIGINT)}
        return bool(self.codes & FAILURE_CODES or killed or any(e.node_failure for e in self.ends))

    def implicated(self, hang_seen: set[int] | None = None, tasks_per_node: int = 1) -> set[str]:
        """The nodes to keep out: those declared dead or silent, else those whose own tasks
        failed (not the survivors' PEER_LOST/SIGTERM). When every node looks guilty, the nodes
        of the ranks missing from ``hang_seen``: a rank hung with the GIL held cannot say its
        watchdog ran, and its backstop ends it about a second after the others', so srun's
        order does not tell. Without that word: the first bad report's node, a guess."""
        heard = {e.node for e in self.ends}
        silent = {e.node for e in self.ends if e.node_failure} | (set(self.nodes) - heard
                                                                  if self.ends else set())
        if silent:
            return silent
        own = [e.node for e in self.ends if e.code is not None and e.code not in _SURVIVOR_CODES]
        if own and set(own) >= set(self.nodes) and len(self.nodes) > 1:
            # Every rank ended with HANG.
            if hang_seen:
                quiet = {self.node_of(r, tasks_per_node) for r in range(self.ntasks)
                         if r not in hang_seen} - {None}
                if quiet and quiet != set(self.nodes):
                    return quiet
            return {own[0]}
        return set(own)


def choose_nodes(nodes: Iterable[str], bad: Iterable[str], n: int) -> list[str] | None:
    """The first ``n`` of the allocation's ``nodes`` (SLURM's order: rank 0 lands on the first)
    that are not ``bad``; None when fewer than ``n`` are left."""
    bad_set = set(bad)
    good = [h for h in nodes if h not in bad_set]
    return good[:n] if len(good) >= n else None
