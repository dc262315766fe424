"""The pure part of the relaunch in place (``supervise/srun/taskends.py``): what srun's own messages say
about a failed step and which nodes to keep out, and the ``multi_node`` script that
``kempner-resilience sbatch --spares K`` writes. The real relaunch, with a node killed on the
multi-node cluster, is in tests/test_slurm_spares.py."""

from __future__ import annotations

import shlex
import subprocess
import sys

from kempner_resilience.supervise.srun.taskends import StepReport, choose_nodes, parse_srun_line
from kempner_resilience.core.runpaths import RunPaths


def _report(nodes: list[str], ntasks: int, lines: list[str]) -> StepReport:
    r = StepReport(nodes, ntasks)
    for line in lines:
        end = parse_srun_line(line)
        if end is not None:
            r.add(end)
    return r


def test_a_node_that_stays_silent_while_the_survivors_report_peer_lost_is_the_bad_one():
    r = _report(["n1", "n2"], 4, ["srun: error: n1: tasks 0-1: Exited with exit code 81",
                                  "srun: launch/slurm: _step_signal: Terminating StepId=7.0"])
    assert r.failed and not r.complete
    assert r.implicated() == {"n2"}


def test_a_rank_killed_alone_implicates_its_node_not_the_survivors_it_took_down():
    r = _report(["n1", "n2"], 4, ["srun: error: n2: task 3: Killed",
                                  "srun: error: n1: tasks 0-1: Exited with exit code 143",
                                  "srun: error: n2: task 2: Exited with exit code 81"])
    assert r.failed and r.complete
    assert r.implicated() == {"n2"}


def test_a_hang_on_every_rank_implicates_only_the_first_node_that_reported_it():
    r = _report(["n1", "n2"], 4, ["srun: error: n2: task 2: Exited with exit code 42",
                                  "srun: error: n1: tasks 0-1: Exited with exit code 42",
                                  "srun: error: n2: task 3: Exited with exit code 42"])
    assert r.failed and r.implicated() == {"n2"}


def test_slurm_s_node_failure_message_names_the_dead_node():
    r = _report(["n1", "n2"], 4, ["srun: error: Node failure on n2",
                                  "srun: error: n1: tasks 0-1: Killed"])
    assert r.failed and r.implicated() == {"n2"}


def test_endings_a_relaunch_cannot_help_are_not_failures():
    for code in (1, 75, 78, 143):   # a bug, a requeue under way, a bad config, a stop
        r = _report(["n1"], 2, [f"srun: error: n1: tasks 0-1: Exited with exit code {code}"])
        assert not r.failed, code


def test_the_next_step_takes_the_first_healthy_nodes_in_slurm_s_order_or_none():
    assert choose_nodes(["n1", "n2", "n3"], {"n2"}, 2) == ["n1", "n3"]
    assert choose_nodes(["n1", "n2", "n3"], {"n1", "n2"}, 2) is None


def _sbatch(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "kempner_resilience.cli", "sbatch", *args],
                          capture_output=True, text=True, check=True, timeout=60).stdout


def test_sbatch_spares_asks_for_n_plus_k_nodes_with_no_kill_and_runs_the_step_loop():
    text = _sbatch("--template", "multi_node", "--nodes", "2", "--spares", "1",
                   "--ntasks-per-node", "4", "--set", "checkpoint.dir=/ckpt", "--",
                   "python", "train.py", "--lr", "0.1")
    assert "#SBATCH --nodes=3" in text.splitlines()
    assert "#SBATCH --no-kill" in text.splitlines()
    [launch] = [line for line in text.splitlines() if line.startswith("kempner-resilience srun")]
    argv = shlex.split(launch)
    assert argv[:argv.index("--")] == ["kempner-resilience", "srun", "--spares=1",
                                       "--in-job-restarts=1", "--set=checkpoint.dir=/ckpt"]
    assert argv[argv.index("--") + 1:] == ["python", "train.py", "--lr", "0.1"]
    assert not any(line.startswith("srun ") for line in text.splitlines())



def test_the_step_is_over_once_every_node_heard_from_reported_all_its_tasks():
    r = _report(["n1", "n2", "n3"], 6, ["srun: error: n1: task 0: Exited with exit code 81"])
    assert not r.heard_complete(2)           # n1's task 1 is still rescuing
    r.add(parse_srun_line("srun: error: n1: task 1: Exited with exit code 143"))
    assert r.heard_complete(2) and not r.complete


def test_when_every_rank_ends_with_hang_the_node_of_the_rank_that_never_said_so_is_the_bad_one(
        tmp_path):
    from kempner_resilience.supervise.channel import Channel

    channel = Channel(tmp_path)
    for rank in (0, 1, 3):                    # rank 2 hung with the GIL held: no word from it
        channel.note_hang_seen("0.0", rank)
    channel.note_hang_seen("0.1", 2)          # another launch's word does not count
    seen = channel.hang_seen("0.0")
    assert seen == {0, 1, 3}
    # srun reported the survivors' node first: the order alone would blame n1.
    r = _report(["n1", "n2"], 4, ["srun: error: n1: tasks 0-1: Exited with exit code 42",
                                  "srun: error: n2: task 3: Exited with exit code 42",
                                  "srun: error: n2: task 2: Exited with exit code 42"])
    assert r.implicated(seen, 2) == {"n2"}


def _loop(tmp_path, nodelist: str, job_id: str = "7", restart: int = 0):
    from kempner_resilience.config import load_config
    from kempner_resilience.supervise.srun.relaunch import Relauncher

    cfg = load_config(None, [f"checkpoint.dir={tmp_path}"])
    return Relauncher(["true"], 1, cfg, environ={"SLURM_JOB_ID": job_id,
                                                  "SLURM_JOB_NODELIST": nodelist,
                                                  "SLURM_NTASKS_PER_NODE": "2",
                                                  "SLURM_RESTART_COUNT": str(restart)})


def test_a_job_requeued_with_its_spare_given_up_trains_on_as_many_nodes_as_before(tmp_path,
                                                                                  monkeypatch):
    # Job 7 trained on 2 nodes + 1 spare; its requeue kept 2 dead nodes out and asked for the
    # 2 left. The batch script runs `kempner-resilience srun --spares 1` again on those 2.
    monkeypatch.chdir(tmp_path)
    loop = _loop(tmp_path, "n[1-3]")
    assert loop.need == 2
    loop.channel.record_train_nodes(2)
    assert _loop(tmp_path, "n[1,4]", restart=1).need == 2
    # A new submission (another job id) from the same directory takes its own shape.
    assert _loop(tmp_path, "n[1,4]", job_id="8").need == 1


# ------------------------------------------------------------------------ a step as evidence
# supervise/srun/evidence.py: what srun said, and how the step ended, as each task's ending.

def _ends(nodes, ntasks, lines, *, ended_by_loop=False, srun_code=0, tasks_per_node=1):
    from kempner_resilience.supervise.srun.evidence import task_ends

    return task_ends(_report(nodes, ntasks, lines), srun_code=srun_code,
                     ended_by_loop=ended_by_loop, tasks_per_node=tasks_per_node)


def test_a_task_srun_never_named_exited_0_when_srun_ended_by_itself():
    ends = _ends(["n1", "n2"], 2, ["srun: error: n2: task 1: Exited with exit code 81"],
                 srun_code=81)
    assert [(e.code, e.signaled) for e in ends] == [(0, False), (81, False)]


def test_the_tasks_of_a_node_silent_until_the_loop_ended_the_step_died_with_their_node():
    ends = _ends(["n1", "n2"], 4, ["srun: error: n1: tasks 0-1: Exited with exit code 81"],
                 ended_by_loop=True, tasks_per_node=2)
    assert [e.code for e in ends] == [81, 81, 137, 137]
    assert ends[2].own_death and ends[3].own_death


def test_a_task_that_never_ended_beside_its_node_s_reported_ones_was_ended_by_the_loop():
    ends = _ends(["n1", "n2"], 4, ["srun: error: n1: task 0: Exited with exit code 42",
                                   "srun: error: n2: tasks 2-3: Exited with exit code 42"],
                 ended_by_loop=True, tasks_per_node=2)
    assert ends[1].by_supervisor and not ends[1].own_death
    assert not any(e.by_supervisor for i, e in enumerate(ends) if i != 1)


def test_a_node_slurm_declared_dead_took_its_tasks_with_it():
    ends = _ends(["n1", "n2"], 2, ["srun: error: Node failure on n2",
                                   "srun: error: n1: task 0: Exited with exit code 81"],
                 srun_code=1)
    assert ends[1].own_death and ends[0].code == 81


def test_srun_s_signal_words_are_deaths_by_that_signal_its_exit_codes_are_exits():
    killed, exited = _ends(["n1", "n2"], 2, ["srun: error: n1: task 0: Killed",
                                             "srun: error: n2: task 1: Exited with exit code 137"],
                           srun_code=137)
    assert (killed.code, killed.signaled) == (137, True)
    assert (exited.code, exited.signaled) == (137, False)


def test_a_step_srun_could_not_launch_ends_every_task_with_srun_s_status():
    ends = _ends(["n1", "n2"], 2, ["srun: error: Unable to create step for job 7"], srun_code=1)
    assert [e.code for e in ends] == [1, 1]


def test_the_evidence_carries_the_loop_s_budget_commits_spares_and_slurm_behind_it():
    from kempner_resilience.supervise.srun.evidence import LoopState, step_evidence
    from kempner_resilience.supervise.policy import Commits

    report = _report(["n1", "n2"], 2, ["srun: error: n2: task 1: Exited with exit code 42",
                                       "srun: error: n1: task 0: Exited with exit code 42"])
    state = LoopState(relaunches=1, max_relaunches=2, requeue_left=True, committed_before=10,
                      committed_now=12, stalled=1, max_no_progress=3, spares=1)
    ev = step_evidence(report, state, srun_code=42, ended_by_loop=True, hang_seen={0})
    assert (ev.restarts, ev.max_restarts, ev.scheduler_left) == (1, 2, True)
    assert (ev.commits, ev.stalled, ev.max_no_progress) == (Commits(10, 12), 1, 3)
    assert (ev.spares, ev.implicated, ev.stopping) == (1, frozenset({"n2"}), False)


# ------------------------------------------------------------------------ the loop's decisions
# Relauncher._after_step: the policy on a finished step; the loop acts on its answer.

def _commit(root, step):
    from kempner_resilience.checkpoint import layout

    path = layout.create_step_dir(RunPaths(root), step)
    (path / "__0_0.distcp").write_bytes(b"x")
    layout.write_manifest(path, {"format": layout.FORMAT, "step": step, "committed_at": step,
                                 "files": {"__0_0.distcp": {"size": 1, "crc32": 0x8CDC1683}}})


def _supervising(tmp_path, *, nodelist="n[1-3]", in_job_restarts=1, restart_count=0,
                 requeue=None):
    """A loop on 2 nodes + 1 spare whose rank 0 reported the run in tmp_path/run."""
    from kempner_resilience.config import load_config
    from kempner_resilience.supervise.srun.relaunch import Relauncher
    from kempner_resilience.supervise.channel import RunReport

    loop = Relauncher(["python", "train.py"], 1, load_config(None, []), in_job_restarts,
                      environ={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": nodelist,
                               "SLURM_RESTART_COUNT": str(restart_count),
                               "SLURM_SUBMIT_DIR": str(tmp_path)})
    loop.channel.report(RunReport(str(tmp_path / "run"), "r", None, None, requeue or {}))
    return loop


def _step(lines, *, nodes=("n1", "n2"), code=0, ended_by_loop=False):
    from kempner_resilience.supervise.srun.relaunch import StepResult

    return StepResult(code, _report(list(nodes), len(nodes), lines), ended_by_us=ended_by_loop)


NODE_KILLED = ["srun: error: n1: task 0: Exited with exit code 81"]     # n2 says nothing


def test_the_loop_relaunches_from_scratch_when_nothing_was_ever_committed(tmp_path):
    # Before the policy, the loop refused and the job ended; a fresh start loses nothing.
    from kempner_resilience.supervise.policy import Action

    loop = _supervising(tmp_path)
    ev, d = loop._after_step(_step(NODE_KILLED, ended_by_loop=True), 0, None)
    assert (d.action, d.code, ev.implicated) == (Action.RELAUNCH, 81, frozenset({"n2"}))
    assert "from scratch" in d.why


def test_its_relaunches_in_place_spent_the_loop_hands_the_job_to_slurm_while_it_requeues(
        tmp_path):
    from kempner_resilience.supervise.policy import Action, Guard

    _commit(tmp_path / "run", 20)
    loop = _supervising(tmp_path, restart_count=2, requeue={"max_restarts": 3})
    d = loop._after_step(_step(NODE_KILLED, ended_by_loop=True), 1, 10)[1]
    assert (d.action, d.code, d.guard) == (Action.REQUEUE, 81, Guard.BUDGET)
    spent = _supervising(tmp_path, restart_count=3, requeue={"max_restarts": 3})
    d = spent._after_step(_step(NODE_KILLED, ended_by_loop=True), 1, 10)[1]
    assert (d.action, d.code, d.guard) == (Action.LEAVE, 81, Guard.BUDGET)


def test_relaunches_without_a_newer_commit_over_max_no_progress_end_the_job_with_77(tmp_path):
    from kempner_resilience.supervise.policy import Action, Guard

    _commit(tmp_path / "run", 20)
    loop = _supervising(tmp_path, nodelist="n[1-5]", in_job_restarts=5,
                        requeue={"max_no_progress": 2})
    loop._stalled = 1                       # the relaunch before this one committed nothing
    d = loop._after_step(_step(NODE_KILLED, ended_by_loop=True), 2, 20)[1]
    assert (d.action, d.code, d.guard) == (Action.LEAVE, 77, Guard.NO_PROGRESS)


def _requeues(monkeypatch) -> list:
    from kempner_resilience.slurm import requeue

    calls: list = []

    def requeue_job(job, cfg, *, exclude=(), min_nodes=None):
        calls.append((sorted(exclude), min_nodes))
        return requeue.RequeueResult(True, "1", "job 1 requeued", 1)

    monkeypatch.setattr(requeue, "requeue_job", requeue_job)
    return calls


def test_the_loop_requeues_only_with_a_committed_checkpoint_and_keeps_the_bad_nodes_out(
        tmp_path, monkeypatch):
    from kempner_resilience.supervise.policy import Action, Guard, Kind, Decision

    calls = _requeues(monkeypatch)
    loop = _supervising(tmp_path)
    no_spare = Decision(Action.REQUEUE, 81, Kind.FAILURE, "no spare", guard=Guard.NO_SPARE)
    assert loop._requeue(no_spare) == (81, False) and calls == []    # nothing to come back to
    _commit(tmp_path / "run", 20)
    loop._record_bad({"n2"}, "node lost")
    assert loop._requeue(no_spare) == (81, True)
    assert calls == [(["n2"], 2)]


def test_a_requeue_the_ranks_asked_for_is_theirs(tmp_path, monkeypatch):
    from kempner_resilience.supervise.policy import Action

    calls = _requeues(monkeypatch)
    _commit(tmp_path / "run", 20)
    loop = _supervising(tmp_path)
    d = loop._after_step(_step(["srun: error: n1: tasks 0-1: Exited with exit code 75"],
                               code=75), 0, 20)[1]
    assert (d.action, d.code) == (Action.REQUEUE, 75)
    assert loop._requeue(d) == (75, False) and calls == []       # rank 0 requeued the job


def test_a_node_killed_is_recorded_bad_with_the_run_and_the_next_step_runs_on_the_spare(
        tmp_path, monkeypatch):
    from kempner_resilience.core.ledger import read_ledger
    from kempner_resilience.slurm.badnodes import bad_nodes

    monkeypatch.chdir(tmp_path)
    _commit(tmp_path / "run", 20)
    loop = _supervising(tmp_path)
    steps = {0: _step(NODE_KILLED, ended_by_loop=True), 1: _step([])}
    ran: list = []

    def run_step(nodes, index):
        ran.append(list(nodes))
        return steps[index]

    monkeypatch.setattr(loop, "run_step", run_step)
    assert loop.run() == 0
    assert ran == [["n1", "n2"], ["n1", "n3"]]
    assert bad_nodes(RunPaths(tmp_path / "run")) == {"n2"}
    events = read_ledger(RunPaths(tmp_path / "run").ledger)
    assert [e.get("bad_nodes") for e in events if e.get("ev") == "restart"] == ["n2"]


def test_a_rank_s_own_error_ends_the_job_with_its_code_and_marks_no_node_bad(tmp_path,
                                                                             monkeypatch):
    from kempner_resilience.slurm.badnodes import bad_nodes

    _commit(tmp_path / "run", 20)
    loop = _supervising(tmp_path)
    bug = _step(["srun: error: n1: task 0: Exited with exit code 81",
                 "srun: error: n2: task 1: Exited with exit code 1"], code=81)
    monkeypatch.setattr(loop, "run_step", lambda nodes, index: bug)
    assert loop.run() == 1                  # not srun's status (81): rank 1's own code
    assert bad_nodes(RunPaths(tmp_path / "run")) == set()


def test_a_requeue_that_fails_ends_the_job_with_79_and_the_job_is_not_taken_for_requeued(
        tmp_path, monkeypatch):
    from kempner_resilience.slurm import requeue
    from kempner_resilience.supervise.policy import Action, Guard, Kind, Decision

    monkeypatch.setattr(requeue, "requeue_job", lambda job, cfg, *, exclude=(), min_nodes=None:
                        requeue.RequeueResult(False, "1", "scontrol is not on PATH", 1))
    _commit(tmp_path / "run", 20)
    loop = _supervising(tmp_path)
    no_spare = Decision(Action.REQUEUE, 81, Kind.FAILURE, "no spare", guard=Guard.NO_SPARE)
    from kempner_resilience.exitcodes import ExitCode

    assert loop._requeue(no_spare) == (int(ExitCode.REQUEUE_FAILED), False)


def _dead_node_step(died: list[int]):
    """A step of 2 nodes x 2 tasks whose srun reported node n1's tasks (rescued, exit 81) and
    then waits, as srun does for a dead node SLURM has not noticed yet (a stand-in process
    printing srun's own lines: the real one is in tests/test_slurm_spares.py)."""
    from kempner_resilience.supervise.channel import Channel
    from kempner_resilience.supervise.srun.step import SrunStep

    channel = Channel.private("kr-test-step-")
    channel.note_ranks_died("0.1", died)
    fake_srun = [sys.executable, "-c",
                 "import sys, time; "
                 "sys.stderr.write('srun: error: n1: tasks 0-1: Exited with exit code 81\\n'); "
                 "sys.stderr.flush(); time.sleep(60)"]
    return SrunStep(fake_srun, {"PATH": "/nonexistent"}, ["n1", "n2"], 2, "1", 1, channel,
                    settle_s=60.0, launch="0.1")


def test_a_step_whose_missing_tasks_the_survivors_named_dead_ends_without_the_settle():
    import time

    from kempner_resilience.exitcodes import ExitCode

    began = time.monotonic()
    res = _dead_node_step([2, 3]).run()
    # The settle (60 s here) and SLURM's SETTLE_MAX_S (45 s) never came: the names did.
    assert res.ended_by_us and res.code == int(ExitCode.PEER_LOST)
    assert time.monotonic() - began < 30


def test_a_step_with_a_silent_rank_nobody_named_dead_is_not_over_by_the_names():
    import threading

    step = _dead_node_step([2])          # rank 3 may still be rescuing
    report = _report(["n1", "n2"], 4, ["srun: error: n1: tasks 0-1: Exited with exit code 81"])
    assert not step._only_the_dead_left(report, threading.Lock())
    step.channel.note_ranks_died("0.1", [3])
    assert step._only_the_dead_left(report, threading.Lock())
