"""`kempner-resilience torchrun` with a spare, without SLURM: what the agents do after a failure.

Real torchrun agents (torch's c10d rendezvous on this machine, ``--max-restarts=1``) start real
demo workers (gloo). Three agents with ``--nnodes=2``: two train, torch keeps the third as a
standby. The multi-node cluster test (tests/test_slurm_spares_torchrun.py) kills a whole node;
here only what the agents decide: a node whose own worker was killed leaves (recorded as a bad
node) and the standby takes its place, the relaunch is an attempt of its own in the ledger, and
a signal ending never relaunches. Each agent names its node through ``$SLURMD_NODENAME``, as
SLURM does on a real node (they all run on this machine).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (env, free_port, kill_node, node_pids, wait_for_file, worker_pids,
                     write_script)
from kempner_resilience.checkpoint import layout
from kempner_resilience.cli import main as cli_main
from kempner_resilience.core.ledger import read_ledger
from kempner_resilience.slurm.badnodes import bad_node_records
from kempner_resilience.demo.compare import compare_weights
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.runpaths import RunPaths

STEPS, EVERY = 100, 40


def _agent(work: Path, i: int, port: int, nnodes: int | str, steps: int, nproc: int = 1,
           hang_timeout_s: float = 1800, rdzv_conf: str = "") -> subprocess.Popen:
    """Agent ``i`` on node ``node{i}``: its workers log their steps to ``progress.i``; the
    agent and its workers read the checkpoint settings from the job's config file."""
    config = work / "resilience.yaml"
    config.write_text(f"checkpoint:\n  dir: {work / 'ckpt'}\n  every_steps: {EVERY}\n"
                      f"watchdog:\n  hang_timeout_s: {hang_timeout_s}\n")
    cmd = [sys.executable, "-m", "kempner_resilience.cli", "torchrun", f"--nnodes={nnodes}",
           f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=spares",
           f"--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=5{rdzv_conf}",
           "--max-restarts=1",
           "--monitor-interval=0.2", "--no-python", sys.executable, "-m",
           "kempner_resilience.demo.train", "--steps", str(steps), "--step-time", "0.05",
           "--out", str(work / "weights.pt"), "--progress", str(work / f"progress.{i}"),
           "--set", f"checkpoint.dir={work / 'ckpt'}", "--set", f"checkpoint.every_steps={EVERY}",
           "--set", f"watchdog.hang_timeout_s={hang_timeout_s}"]
    return subprocess.Popen(cmd, stdout=open(work / f"agent.{i}.out", "w"),
                            stderr=open(work / f"agent.{i}.err", "w"), stdin=subprocess.DEVNULL,
                            cwd=work, start_new_session=True,
                            env=env(KEMPNER_RESILIENCE_FORWARD_SIGNALS="yes",
                                    OMP_NUM_THREADS="1", SLURMD_NODENAME=f"node{i}",
                                    KEMPNER_RESILIENCE_CONFIG=str(config)))


def _listening(port: int, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"no rendezvous store on port {port}")



def _finish(agents: list[subprocess.Popen], timeout: float = 150) -> list[int | None]:
    end = time.monotonic() + timeout
    try:
        for a in agents:
            try:
                a.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [a.poll() for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                kill_node(a.pid)


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    """The uninterrupted run: 2 plain DDP processes, no checkpoints."""
    return reference_run(ranks=2, steps=STEPS)


def _three_agents(work: Path, agents: list[subprocess.Popen],
                  hang_timeout_s: float = 1800, rdzv_conf: str = "") -> tuple[int, int]:
    """Starts three agents into ``agents`` (``--nnodes=2``) and waits until the node that is not
    the rendezvous host has trained 10 steps past the first periodic save; returns (that
    training node, the standby)."""
    work.mkdir()
    port = free_port()
    agents.append(_agent(work, 0, port, 2, STEPS, hang_timeout_s=hang_timeout_s,
                         rdzv_conf=rdzv_conf))
    _listening(port)            # agent 0 hosts the rendezvous store (the first node)
    agents += [_agent(work, i, port, 2, STEPS, hang_timeout_s=hang_timeout_s,
                      rdzv_conf=rdzv_conf) for i in (1, 2)]
    wait_for_file(work / "progress.0", timeout=120, contains="step 5\n")
    # Two agents train; the third waits in torch's redundancy list.
    training = [i for i, a in enumerate(agents) if worker_pids(a.pid)]
    assert len(training) == 2 and 0 in training, training
    [victim] = [i for i in training if i != 0]
    [standby] = {0, 1, 2} - set(training)
    wait_for_file(work / f"progress.{victim}", timeout=60, contains=f"step {EVERY + 10}\n")
    # The line is written between the step's all-reduce and its boundary: a node that dies
    # right then takes the clean fallback (``_resume_point``). Half a step later it computes.
    time.sleep(0.025)
    return victim, standby


def _resume_point(work: Path, said: str) -> tuple[int, bool]:
    """The step the relaunch resumed from, and whether the survivors' rescue wrote it (at most
    the step in flight lost). Else the clean fallback to the periodic save, its reason logged
    (docs/design.md, "Never a checkpoint that mixes steps"): the dead rank had not reached
    the survivors' boundary, so nobody held its RNG and data position there."""
    rescued = [e.step for e in layout.scan(RunPaths(work / "ckpt"))
               if e.committed and e.manifest.get("reason") == "rescue"]
    if rescued:
        return max(rescued), True
    assert "rescue skipped:" in said or "cannot write one" in said, said[-3000:]
    return EVERY, False


def test_a_node_whose_worker_is_killed_leaves_and_the_standby_takes_its_place_bitwise(
        tmp_path, capsys, reference):
    work = tmp_path / "job"
    agents: list[subprocess.Popen] = []
    try:
        victim, standby = _three_agents(work, agents)
        for w in worker_pids(agents[victim].pid):
            os.kill(w, signal.SIGKILL)       # its worker dies (the OOM killer, a GPU fault)
        codes = _finish(agents)
    finally:
        _finish(agents, timeout=0)
    errs = {i: (work / f"agent.{i}.err").read_text() for i in range(3)}
    assert codes == [0, 0, 0], (codes, errs[victim][-3000:])
    assert "this node left the job to a spare" in errs[victim], errs[victim][-3000:]
    # The standby trained from the rescued step on; the run ends bitwise equal.
    step, rescued = _resume_point(work, errs[0])
    assert f"step {STEPS - 1}\n" in (work / f"progress.{standby}").read_text()
    same, total, diff = compare_weights(reference, work / "weights.pt")
    assert not diff, f"{len(diff)} of {total} tensors differ"
    # The run remembers: the node that left is recorded bad (a requeue keeps it off too) ...
    assert set(bad_node_records(RunPaths(work / "ckpt"))) == {f"node{victim}"}, \
        errs[victim][-3000:]
    # ... the in-job restart is in the ledger once, from the rescued step on, naming it ...
    events = read_ledger(work / "ckpt" / "ledger.jsonl")
    restarts = [e for e in events if e["ev"] == "restart"]
    assert len(restarts) == 1, (restarts, errs[0][-3000:])
    [r] = restarts
    assert (r["relaunch"], r["bad_nodes"], r["step"]) == (1, f"node{victim}", step), r
    # ... and the relaunched workers' events are an attempt of their own.
    assert {e.get("relaunch", 0) for e in events if e["ev"] == "start"} == {0, 1}
    assert cli_main(["report", "--json", str(work / "ckpt")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [a["relaunch"] for a in data["attempts"]] == [0, 1], data["attempts"]
    assert all(v is not None for v in data["attempts"][1]["recovery"].values()), data
    assert cli_main(["report", str(work / "ckpt")]) == 0
    out = capsys.readouterr().out
    # (outside SLURM an attempt is named by its index: "1+1", the first in-job restart)
    assert f"1+1: a worker on node{victim} was killed" in out, out
    assert f"kept out: node{victim}; spare: " in out, out
    # The line says where the relaunch resumed, and whether the survivors' rescue wrote it.
    assert f"resumed at step {step}" + (" (the survivors' rescue)" if rescued else "\n") \
        in out, out


def test_a_node_killed_whole_leaves_the_rendezvous_as_soon_as_the_survivor_names_its_rank_bitwise(
        tmp_path, reference):
    # Agent and worker SIGKILLed together (a power loss, a kernel panic). torch alone keeps
    # the dead agent in the finished round until its heartbeat is older than the keep-alive
    # window (5 s x 30 here), and the next round cannot open before; a heartbeat two intervals
    # old (10 s) is the fallback. The survivor's worker saw its peer's rescue link end without
    # a word and named its rank: its agent drops that node at once.
    work = tmp_path / "job"
    agents: list[subprocess.Popen] = []
    try:
        victim, standby = _three_agents(
            work, agents, rdzv_conf=",keep_alive_interval=5,keep_alive_max_attempt=30")
        killed = time.time()
        for pid in node_pids(agents[victim].pid):
            os.kill(pid, signal.SIGKILL)
        codes = _finish([agents[0], agents[standby]])
    finally:
        _finish(agents, timeout=0)
    err = (work / "agent.0.err").read_text()
    assert codes == [0, 0], (codes, err[-3000:])
    assert "the survivors' workers saw its rank(s) 1 die" in err and "not after torch's 150 s" \
        in err, err[-3000:]
    # The new round opened well within one interval of the kill: the dead node's last
    # heartbeat was at most 5 s old then, so the heartbeat rule could not drop it before 5 s.
    [restart] = [e for e in read_ledger(work / "ckpt" / "ledger.jsonl") if e["ev"] == "restart"]
    assert restart["t"] - killed < 5.0, (restart["t"] - killed, err[-3000:])
    _resume_point(work, err)
    assert f"step {STEPS - 1}\n" in (work / f"progress.{standby}").read_text()
    same, total, diff = compare_weights(reference, work / "weights.pt")
    assert not diff, f"{len(diff)} of {total} tensors differ"


def test_a_frozen_node_s_place_goes_to_the_standby_only_after_the_survivors_rescued_bitwise(
        tmp_path, reference):
    # The node stops answering (SIGSTOP: a hung node, a dead NIC): its rendezvous heartbeat
    # expires after ~3 s and the standby waits for its place, but the survivor's worker sees the
    # hang only at its 8 s hang timeout. torch alone restarts the healthy group as soon as a node
    # waits: the survivor's rescue would be lost and the run would resume from the periodic save.
    work = tmp_path / "job"
    agents: list[subprocess.Popen] = []
    frozen: list[int] = []
    try:
        victim, standby = _three_agents(work, agents, hang_timeout_s=8)
        frozen = node_pids(agents[victim].pid)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        codes = _finish([agents[0], agents[standby]])
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGKILL)
        _finish(agents, timeout=0)
    err = (work / "agent.0.err").read_text()
    assert codes == [0, 0], (codes, err[-3000:])
    step, _ = _resume_point(work, err)
    assert "a node waits for a place" in err and "relaunching in place" in err, err[-3000:]
    [restart] = [e for e in read_ledger(work / "ckpt" / "ledger.jsonl") if e["ev"] == "restart"]
    assert restart["step"] == step, restart
    assert f"step {STEPS - 1}\n" in (work / f"progress.{standby}").read_text()
    same, total, diff = compare_weights(reference, work / "weights.pt")
    assert not diff, f"{len(diff)} of {total} tensors differ"


def test_an_elastic_range_takes_in_a_late_node_at_once_as_torch_does(tmp_path):
    # --nnodes=1:2: a node that arrives while another trains is a scale-up, not a dead node's
    # place. torch restarts the group to take it in; the hold for a rescue must not delay it.
    port = free_port()
    agents = [_agent(tmp_path, 0, port, "1:2", 100_000, rdzv_conf=",last_call_timeout=1")]
    try:
        _listening(port)
        wait_for_file(tmp_path / "progress.0", timeout=120, contains="step 3\n")
        agents.append(_agent(tmp_path, 1, port, "1:2", 100_000,
                             rdzv_conf=",last_call_timeout=1"))
        wait_for_file(tmp_path / "progress.1", timeout=90, contains=" step ")
    finally:
        _finish(agents, timeout=0)
    err = (tmp_path / "agent.0.err").read_text()
    assert "a node waits for a place" not in err, err[-3000:]


def test_a_signal_ending_with_restarts_left_exits_with_the_workers_code_and_no_relaunch(
        tmp_path):
    # A time limit or a preemption: save, requeue, exit. torch alone would restart the workers.
    port = free_port()
    agent = _agent(tmp_path, 0, port, 1, 100_000, nproc=2)
    try:
        wait_for_file(tmp_path / "progress.0", timeout=120, contains="step 3\n")
        agent.send_signal(signal.SIGUSR1)
        [code] = _finish([agent], timeout=90)
    finally:
        _finish([agent], timeout=0)
    err = (tmp_path / "agent.0.err").read_text()
    assert code == ExitCode.REQUEUE, err[-3000:]
    assert "no relaunch in place: a signal ending" in err, err[-3000:]


def test_without_a_standby_the_survivor_does_not_wait_for_one_and_exits_with_peer_lost(
        tmp_path):
    # The second death with one spare, or no spare at all: torch alone would restart and wait
    # in the rendezvous for a node that never comes; the fallback is rank 0's requeue (under
    # SLURM) and the workers' code.
    port = free_port()
    agents = [_agent(tmp_path, 0, port, 2, 100_000)]
    _listening(port)
    agents.append(_agent(tmp_path, 1, port, 2, 100_000))
    try:
        wait_for_file(tmp_path / "progress.1", timeout=120, contains="step 5\n")
        victim = agents[1]
        for pid in node_pids(victim.pid):              # the node dies: agent and worker
            os.kill(pid, signal.SIGKILL)
        [code] = _finish(agents[:1], timeout=90)
    finally:
        _finish(agents, timeout=0)
    err = (tmp_path / "agent.0.err").read_text()
    assert code == ExitCode.PEER_LOST, err[-3000:]
    assert "no relaunch in place: no standby node waits" in err, err[-3000:]


def test_under_a_supervisor_the_agent_keeps_its_memory_in_the_run_rank_0_reported(tmp_path):
    # The README's usage: the script sets checkpoint.dir in code, so the agent's own config
    # names ./checkpoints. Rank 0 reported the real directory in the supervisor's channel.
    from kempner_resilience.config import ResilienceConfig
    from kempner_resilience.supervise.torchrun.agent import Agent
    from kempner_resilience.supervise.torchrun.spares import InPlace
    from kempner_resilience.supervise.torchrun.standby import Relaunch
    from kempner_resilience.supervise.channel import Channel, report_now

    settings = Relaunch(endpoint="127.0.0.1:1", run_id="x", restarts_left=1, stale_s=1.0)
    agent = Agent(ResilienceConfig(), forward=True)
    channel = Channel(tmp_path / "channel")
    (tmp_path / "channel").mkdir()
    inplace = InPlace(agent, settings, channel)
    alone = InPlace(agent, settings, None)
    try:
        assert inplace.run_paths().root == Path(agent.config.checkpoint.dir)  # nothing said yet
        report_now(channel, tmp_path / "run", run_id="r", committed=None, code=None, requeue={})
        assert inplace.run_paths().root == (tmp_path / "run").resolve()
        assert alone.run_paths().root == Path(agent.config.checkpoint.dir)
    finally:
        inplace.close()
        alone.close()


def test_under_a_supervisor_relaunches_in_place_without_a_newer_commit_end_the_job_with_77(
        tmp_path):
    # The agent sees the run's commits through the directory rank 0 reported in the channel:
    # a group that failed without committing anything newer than when it started counts
    # toward the run's requeue.max_no_progress, as under srun and the local launcher.
    from kempner_resilience.config import ResilienceConfig
    from kempner_resilience.supervise.torchrun.agent import Agent
    from kempner_resilience.supervise.torchrun.spares import InPlace
    from kempner_resilience.supervise.torchrun.standby import Relaunch
    from kempner_resilience.supervise.channel import Channel, report_now

    run = tmp_path / "run"
    path = layout.create_step_dir(RunPaths(run), 20)
    (path / "__0_0.distcp").write_bytes(b"x")
    layout.write_manifest(path, {"format": layout.FORMAT, "step": 20, "committed_at": 20,
                                 "files": {"__0_0.distcp": {"size": 1, "crc32": 0x8CDC1683}}})
    settings = Relaunch(endpoint="127.0.0.1:1", run_id="x", restarts_left=2, stale_s=1.0)
    agent = Agent(ResilienceConfig(), forward=True)
    (tmp_path / "channel").mkdir()
    channel = Channel(tmp_path / "channel")
    report_now(channel, run, run_id="r", committed=20, code=None,
               requeue={"max_no_progress": 1})
    inplace = InPlace(agent, settings, channel)
    blind = InPlace(agent, settings, None)
    try:
        inplace.group_started()                     # the relaunched group starts at step 20
        again, why = inplace.decide({0: int(ExitCode.PEER_LOST)}, restarts_left=1,
                                    max_restarts=2)
        assert not again and "no progress" in why, why
        assert inplace.final_code == ExitCode.NO_REQUEUE
        # Without a supervisor above the agents, each agent's channel is its own: only rank
        # 0's agent would see the commits, and the agents must decide alike: no guard.
        blind.group_started()
        assert blind.progress() == {}
    finally:
        inplace.close()
        blind.close()


# ------------------------------------------------- the survivors' notice, in one process

@pytest.fixture
def finished_round(tmp_path):
    """A survivor's real rendezvous handler (a ``SpareHandler`` hosting torch's c10d store on
    this machine, keep-alive 5 s x 30: torch drops a dead node after 150 s) whose finished
    round 0 has three participants: this node (group rank 0, global ranks 0-1) and two peers
    whose last heartbeat was 3 s ago (group ranks 1 and 2: ranks 2-3 and 4-5). Each agent
    published its ranks in a real store. Yields (handler, its InPlace, that store, {group
    rank: node})."""
    from datetime import datetime, timedelta, timezone

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    from kempner_resilience.config import ResilienceConfig
    from kempner_resilience.core import torch_private
    from kempner_resilience.supervise.torchrun.agent import Agent
    from kempner_resilience.supervise.torchrun.elastic import spare_handler
    from kempner_resilience.supervise.torchrun.spares import InPlace
    from kempner_resilience.supervise.torchrun.standby import Relaunch

    port = free_port()
    inplace = InPlace(Agent(ResilienceConfig(), forward=True),
                      Relaunch(f"127.0.0.1:{port}", "notice", 1, 155.0))
    handler = spare_handler(RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", "notice", 3, 3, keep_alive_interval=5,
        keep_alive_max_attempt=30), inplace)
    me = torch_private.this_node(handler)
    nodes = {0: me, 1: _NodeDesc("peer1", 101, 0), 2: _NodeDesc("peer2", 102, 0)}
    holder = handler._state_holder
    state = holder.state
    state.complete, state.round = True, 0
    state.participants = {node: g for g, node in nodes.items()}
    beat = datetime.now(timezone.utc) - timedelta(seconds=3)
    state.last_heartbeats = {node: beat for node in nodes.values()}
    holder.mark_dirty()
    holder.sync()                                    # the round, in torch's store
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for g in nodes:
        inplace.publish_ranks(store, g, [2 * g, 2 * g + 1])
    try:
        yield handler, inplace, store, nodes
    finally:
        inplace.close()


def _synced(handler) -> set:
    """The participants after the survivor's next sync of the state (any op it runs)."""
    from kempner_resilience.core import torch_private

    handler._state_holder.mark_dirty()
    handler._state_holder.sync()
    return set(torch_private.rendezvous_state(handler).participants)


def test_a_participant_whose_ranks_the_survivors_saw_die_leaves_the_rendezvous_at_once(
        finished_round, caplog):
    handler, inplace, store, nodes = finished_round
    # The workers' marks: ranks 2-3 (all of peer 1's) and 5 (one of peer 2's); this node's
    # own ranks, named by mistake, never drop it.
    inplace.channel.note_ranks_died(inplace.launch, [0, 1, 2, 3, 5])
    handler.notice_lost_peer(inplace.ranks_died(), inplace.node_ranks(store, 3))
    # Peer 1's heartbeat is 3 s old, under two intervals (10 s): it leaves for its ranks.
    assert _synced(handler) == {nodes[0], nodes[2]}
    assert "saw its rank(s) 2-3 die" in caplog.text, caplog.text


def test_with_no_rank_named_a_participant_leaves_once_its_heartbeat_is_two_intervals_old(
        finished_round):
    from datetime import datetime, timedelta, timezone

    handler, inplace, store, nodes = finished_round
    handler.notice_lost_peer(inplace.ranks_died(), inplace.node_ranks(store, 3))
    assert _synced(handler) == set(nodes.values())       # 3 s old: both stay
    state = handler._state_holder.state
    state.last_heartbeats[nodes[2]] = datetime.now(timezone.utc) - timedelta(seconds=11)
    assert _synced(handler) == {nodes[0], nodes[1]}      # 11 s > 2 x 5 s: it leaves


def test_ranks_named_in_the_finished_round_never_drop_a_participant_of_a_later_one(
        finished_round):
    handler, inplace, store, nodes = finished_round
    inplace.channel.note_ranks_died(inplace.launch, [2, 3])
    handler.notice_lost_peer(inplace.ranks_died(), inplace.node_ranks(store, 3))
    state = handler._state_holder.state
    state.round = 1                 # the next round completed: group rank 1 is another node
    assert _synced(handler) == set(nodes.values())


def _script_agent(work: Path, i: int, port: int, rdzv_id: str, script: Path,
                  arg: Path) -> subprocess.Popen:
    """Agent ``i`` (node ``node{i}``, ``--nnodes=2``, one restart) whose one worker runs
    ``script arg``: a worker that does what the test says instead of training."""
    cmd = [sys.executable, "-m", "kempner_resilience.cli", "torchrun", "--nnodes=2",
           "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           f"--rdzv-id={rdzv_id}", "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3",
           "--max-restarts=1", "--monitor-interval=0.2", "--no-python", sys.executable,
           str(script), str(arg)]
    return subprocess.Popen(cmd, stdout=open(work / f"agent.{i}.out", "w"),
                            stderr=open(work / f"agent.{i}.err", "w"),
                            stdin=subprocess.DEVNULL, cwd=work, start_new_session=True,
                            env=env(OMP_NUM_THREADS="1", SLURMD_NODENAME=f"node{i}"))


# A worker that says what it learnt from its agent's channel (one JSON line per worker group).
# In the first group, once the standby agent waits: node1's worker is killed (its node leaves
# the job to the standby), node0's fails as the survivor of a lost peer does (81); in the
# relaunched group both finish.
_LEARNER = """
import json, os, signal, sys, time
from kempner_resilience.supervise.rank import offered_relaunch
from kempner_resilience.supervise.torchrun.standby import live_standbys
from kempner_resilience.supervise import legacy_env
from kempner_resilience.supervise.channel import Channel, launch_name, relaunched

old = (legacy_env.IN_JOB_RESTART_ENV, legacy_env.RELAUNCH_START_ENV, legacy_env.RENDEZVOUS_ENV)
again, offer = relaunched(), offered_relaunch()
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"node": os.environ["SLURMD_NODENAME"], "relaunch": again.index,
                        "t": again.t, "launch": launch_name(),
                        "endpoint": offer.endpoint if offer else None,
                        "run_id": offer.run_id if offer else None,
                        "supervised": Channel.from_env().supervised,
                        "variables": sorted(k for k in old if k in os.environ)}) + "\\n")
if again.index == 0:
    end = time.monotonic() + 120
    while not live_standbys(offer) and time.monotonic() < end:
        time.sleep(0.2)
    if os.environ["SLURMD_NODENAME"] != "node0":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(81)
"""


def test_a_torchrun_agents_workers_learn_their_relaunch_and_rendezvous_from_its_channel(
        tmp_path):
    # No step loop above the agents: each agent gives its workers a channel of its own. Three
    # agents for two places (--nnodes=2); the standby starts once the first group runs, and
    # takes the place of the node whose worker was killed: rendezvous round 1, a relaunch.
    script = write_script(tmp_path, _LEARNER, "learner.py")
    learnt = tmp_path / "learnt.jsonl"
    port = free_port()
    agents: list[subprocess.Popen] = []

    def agent(i: int) -> subprocess.Popen:
        return _script_agent(tmp_path, i, port, "learn", script, learnt)

    agents.append(agent(0))
    _listening(port)                        # agent 0 hosts the rendezvous store
    agents.append(agent(1))
    end = time.monotonic() + 120
    while (not learnt.exists() or len(learnt.read_text().splitlines()) < 2) \
            and time.monotonic() < end:
        time.sleep(0.2)
    agents.append(agent(2))                 # the standby
    codes = _finish(agents)
    errs = "".join((tmp_path / f"agent.{i}.err").read_text()[-1500:] for i in range(3))
    assert codes == [0, 0, 0], errs
    groups = sorted((json.loads(line) for line in learnt.read_text().splitlines()),
                    key=lambda g: (g["relaunch"], g["node"]))
    assert [(g["node"], g["relaunch"], g["launch"]) for g in groups] == [
        ("node0", 0, "0.0"), ("node1", 0, "0.0"), ("node0", 1, "0.1"), ("node2", 1, "0.1")]
    assert all(g["t"] is not None and g["t"] <= time.time() for g in groups[2:])
    # The rendezvous a relaunch would take, while the agent has a restart left: node0's one
    # restart (--max-restarts=1) is spent in round 1, the standby's is not.
    offered = [(g["endpoint"], g["run_id"]) for g in groups]
    mine = (f"127.0.0.1:{port}", "learn")
    assert offered == [mine, mine, (None, None), mine], groups
    # The agent's own channel is no supervisor above the agents (rank 0 still requeues when
    # no standby waits), and nothing of the contract travels in another variable.
    assert not any(g["supervised"] for g in groups)
    assert all(g["variables"] == [] for g in groups), groups


# What an agent says when torch keeps it out of a round as a standby.
STOOD_BY = "standby (the rendezvous has its nodes)"

# A worker that fails as a survivor of a lost peer does (81) in the first group once the test
# says so (go.<node>), and in a relaunched group runs until the test says the run is done.
_WAITER = """
import os, sys, time
from pathlib import Path
from kempner_resilience.supervise.channel import relaunched

work, node, again = Path(sys.argv[1]), os.environ["SLURMD_NODENAME"], relaunched().index
(work / f"started.{node}.{again}").touch()
flag = work / (f"go.{node}" if again == 0 else "done")
while not flag.exists():
    time.sleep(0.1)
sys.exit(81 if again == 0 else 0)
"""


@pytest.mark.parametrize("store", ["agent", "apart"])
def test_an_agent_that_trained_then_stood_by_exits_0_when_the_run_is_over(tmp_path, store):
    # Three agents for two places (--nnodes=2). Both training nodes fail as survivors do (81,
    # every node alive) and relaunch; node1 is slow to rejoin (frozen a few seconds: a loaded
    # node), so node0 and the standby fill the next round and torch keeps node1 as a standby.
    # Its workers trained once; when the run ends it is a standby like any other: exit 0.
    # The rendezvous store is agent 0's (it goes with that agent: the standby loses its
    # connection) or outlives the agents (the standby sees the rendezvous closed).
    from torch.distributed import TCPStore

    from kempner_resilience.supervise.torchrun.standby import Relaunch, live_standbys

    script = write_script(tmp_path, _WAITER, "waiter.py")
    port = free_port()
    agents: list[subprocess.Popen] = []
    frozen = False
    host = None if store == "agent" else TCPStore("127.0.0.1", port, is_master=True,
                                                  wait_for_workers=False)

    def agent(i: int) -> subprocess.Popen:
        return _script_agent(tmp_path, i, port, "stood-by", script, tmp_path)

    def err(i: int) -> str:
        return (tmp_path / f"agent.{i}.err").read_text()

    def standby_waits() -> None:
        # What the agents ask before a relaunch: a standby in torch's record of the rendezvous
        # (an agent says it stands by before torch has written it there).
        settings = Relaunch(endpoint=f"127.0.0.1:{port}", run_id="stood-by", restarts_left=1,
                            stale_s=4.0)
        end = time.monotonic() + 120
        while not live_standbys(settings):
            assert time.monotonic() < end, "no standby in the rendezvous"
            time.sleep(0.2)

    try:
        agents.append(agent(0))
        _listening(port)                     # agent 0 hosts the rendezvous store, or the test
        agents.append(agent(1))
        wait_for_file(tmp_path / "started.node0.0", timeout=120)
        wait_for_file(tmp_path / "started.node1.0", timeout=120)
        agents.append(agent(2))              # the standby
        standby_waits()
        (tmp_path / "go.node1").touch()
        wait_for_file(tmp_path / "agent.1.err", timeout=120, contains="relaunching in place")
        os.kill(agents[1].pid, signal.SIGSTOP)
        frozen = True
        (tmp_path / "go.node0").touch()
        wait_for_file(tmp_path / "started.node0.1", timeout=120)
        wait_for_file(tmp_path / "started.node2.1", timeout=120)
        os.kill(agents[1].pid, signal.SIGCONT)
        frozen = False
        wait_for_file(tmp_path / "agent.1.err", timeout=120, contains=STOOD_BY)
        standby_waits()                      # node1, in the rendezvous's redundancy list
        (tmp_path / "done").touch()
        codes = _finish(agents)
    finally:
        if frozen:
            os.kill(agents[1].pid, signal.SIGCONT)
        _finish(agents, timeout=0)
        del host
    assert not (tmp_path / "started.node1.1").exists(), err(1)[-3000:]  # node1 stood by
    assert codes == [0, 0, 0], (codes, err(1)[-3000:])
    assert "Traceback" not in err(1), err(1)[-3000:]


def test_an_agent_kept_out_of_a_round_after_training_ends_on_a_signal_as_a_standby_does():
    # Its group was stopped before the rendezvous: those workers' codes are no longer the
    # job's, and a signal (scancel, a time limit) ends it at once with 128+N as it ends a
    # standby that never trained, instead of leaving it waiting in the rendezvous.
    from kempner_resilience.config import ResilienceConfig
    from kempner_resilience.supervise.torchrun.agent import Agent, Interrupted

    agent = Agent(ResilienceConfig(), forward=True)
    worker = subprocess.Popen([sys.executable, "-c", "raise SystemExit(81)"])
    worker.wait()
    agent.add_worker(worker)
    agent.name_ranks({worker.pid: 1})
    assert agent.codes() == {1: 81}
    agent.stand_by()                       # torch put it in the next round's redundancy list
    assert agent.codes() == {}
    previous = signal.signal(signal.SIGUSR1, agent.on_signal)
    try:
        with pytest.raises(Interrupted) as stopped:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(5)                  # the handler runs at the next bytecode
        assert stopped.value.signum == signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, previous)
