"""The pure part of the relaunch in place (``slurm/steps.py``): what srun's own messages say
about a failed step and which nodes to keep out, and the ``multi_node`` script that
``kempner-resilience sbatch --spares K`` writes. The real relaunch, with a node killed on the
multi-node cluster, is in tests/test_slurm_spares.py."""

from __future__ import annotations

import shlex
import subprocess
import sys

from kempner_resilience.slurm.steps import StepReport, choose_nodes, parse_srun_line


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


def _loop(tmp_path, nodelist: str, job_id: str = "7"):
    from kempner_resilience.config import load_config
    from kempner_resilience.slurm.relaunch import Relauncher

    cfg = load_config(None, [f"checkpoint.dir={tmp_path}"])
    return Relauncher(["true"], 1, cfg, environ={"SLURM_JOB_ID": job_id,
                                                  "SLURM_JOB_NODELIST": nodelist,
                                                  "SLURM_NTASKS_PER_NODE": "2"})


def test_a_job_requeued_with_its_spare_given_up_trains_on_as_many_nodes_as_before(tmp_path,
                                                                                  monkeypatch):
    # Job 7 trained on 2 nodes + 1 spare; its requeue kept 2 dead nodes out and asked for the
    # 2 left. The batch script runs `kempner-resilience srun --spares 1` again on those 2.
    monkeypatch.chdir(tmp_path)
    loop = _loop(tmp_path, "n[1-3]")
    assert loop.need == 2
    loop.channel.record_train_nodes(2)
    assert _loop(tmp_path, "n[1,4]").need == 2
    # A new submission (another job id) from the same directory takes its own shape.
    assert _loop(tmp_path, "n[1,4]", job_id="8").need == 1
