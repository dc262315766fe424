"""The run's memory of bad nodes (slurm/badnodes.py): the record on disk, the srun exclusion,
and the requeue's ExcNodeList update against a fake scontrol (the real one: test_slurm_badnodes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kempner_resilience.slurm.badnodes import (
    bad_node_records,
    bad_nodes,
    check_allocation,
    exclude_args,
    exclude_for_requeue,
    record_bad_nodes,
)
from kempner_resilience.slurm.scontrol import run_scontrol
from kempner_resilience.core.runpaths import RunPaths


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """Install ``body`` as the only ``scontrol`` on PATH; returns the call log path."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls"

    def install(body: str):
        exe = bindir / "scontrol"
        exe.write_text(f"#!/bin/bash\necho \"$@\" >> {calls}\n{body}\n")
        exe.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
        return calls

    return install


def test_recorded_nodes_are_remembered_with_their_first_reason(tmp_path):
    assert bad_nodes(RunPaths(tmp_path)) == set()
    assert record_bad_nodes(RunPaths(tmp_path), ["n2"], reason="rank 1 died", job_id="7") == {"n2"}
    assert record_bad_nodes(RunPaths(tmp_path), ["n3", "n2"], reason="rank 3 hung",
                            job_id="7") == {"n2", "n3"}
    recs = bad_node_records(RunPaths(tmp_path))
    assert recs["n2"]["reason"] == "rank 1 died" and recs["n2"]["count"] == 2
    assert recs["n3"]["reason"] == "rank 3 hung" and recs["n3"]["job_id"] == "7"
    assert bad_nodes(RunPaths(tmp_path)) == {"n2", "n3"}          # read back from disk


def test_a_malformed_record_reads_as_no_bad_nodes_with_a_warning(tmp_path, caplog):
    RunPaths(tmp_path).bad_nodes.write_text('{"nodes": ["n1"')
    assert bad_nodes(RunPaths(tmp_path)) == set()
    assert "unreadable" in caplog.text and "bad-nodes.json" in caplog.text
    # ... and recording again replaces it with a good one.
    assert record_bad_nodes(RunPaths(tmp_path), ["n1"], reason="x", job_id=None) == {"n1"}
    assert json.loads(RunPaths(tmp_path).bad_nodes.read_text())["nodes"]["n1"]["reason"] == "x"


def test_nodes_recorded_by_concurrent_processes_are_all_kept(tmp_path):
    code = ("import sys; from kempner_resilience.slurm.badnodes import record_bad_nodes\n"
            "from kempner_resilience.core.runpaths import RunPaths\n"
            "for i in range(20): record_bad_nodes(RunPaths(sys.argv[1]), [sys.argv[2] + str(i)], "
            "reason='r', job_id='1')")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), p])
             for p in ("a", "b", "c")]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert bad_nodes(RunPaths(tmp_path)) == {f"{p}{i}" for p in "abc" for i in range(20)}


def test_srun_excludes_bad_nodes_only_when_enough_good_ones_remain(tmp_path, caplog):
    record_bad_nodes(RunPaths(tmp_path), ["n2", "n9"], reason="died", job_id="1")
    assert exclude_args(RunPaths(tmp_path), ["n1", "n2", "n3"], needed=2) == ["--exclude=n2"]
    assert exclude_args(RunPaths(tmp_path), ["n1", "n2", "n3"], needed=3) == []
    assert "runs on them anyway" in caplog.text
    assert exclude_args(RunPaths(tmp_path), ["n1", "n3"], needed=2) == []


def test_an_attempt_on_a_recorded_node_says_so(tmp_path, caplog):
    record_bad_nodes(RunPaths(tmp_path), ["n2"], reason="rank 1 died", job_id="5")
    assert check_allocation(RunPaths(tmp_path), ["n1", "n3"]) == set()
    assert check_allocation(RunPaths(tmp_path), ["n1", "n2"]) == {"n2"}
    assert "node n2, recorded bad (rank 1 died, job 5)" in caplog.text


def test_exclusion_adds_the_bad_nodes_to_the_jobs_own_exclusions(fake_scontrol):
    calls = fake_scontrol('[ "$1" = show ] && echo "JobId=42 JobName=x ExcNodeList=n[7-8] '
                          'NodeList=n1"; exit 0')
    res = exclude_for_requeue("42", {"n2"})
    assert res is not None and res.ok
    assert calls.read_text().splitlines() == ["show -o job 42",
                                              "update JobId=42 ExcNodeList=n2,n7,n8"]


def test_a_refused_exclusion_is_logged_with_the_fix_and_does_not_raise(fake_scontrol, caplog):
    fake_scontrol('[ "$1" = show ] && exit 1; echo "slurm_update error: Access/permission '
                  'denied" >&2; exit 1')
    res = exclude_for_requeue("42", {"n2"})
    assert res is not None and not res.ok
    assert "requeue and the checkpoint stand" in caplog.text
    assert "ExcNodeList" in caplog.text and "--exclude" in caplog.text


def test_an_exclusion_refused_for_a_job_that_lost_a_node_says_why_and_what_still_holds(
        fake_scontrol, caplog):
    fake_scontrol('[ "$1" = show ] && exit 1; echo "Job update not available right now, the DB '
                  'index is being set, try again in a bit for job 42" >&2; exit 1')
    res = exclude_for_requeue("42", {"n2"})
    assert res is not None and not res.ok
    assert "lost a node under --no-kill" in caplog.text
    assert "requeue and the checkpoint stand" in caplog.text


def test_nothing_to_exclude_calls_no_scontrol(fake_scontrol):
    calls = fake_scontrol("exit 0")
    assert exclude_for_requeue("42", set()) is None
    assert not calls.exists()


def test_a_shielded_scontrol_call_survives_the_jobs_sigterm(fake_scontrol, tmp_path):
    # slurmstepd SIGTERMs every process of the job right after our requeue: the update that
    # follows it must still land. Here the fake scontrol gets SIGTERM in the middle of its call.
    done = tmp_path / "done"
    fake_scontrol(f"kill -TERM $$; sleep 0.2; touch {done}; exit 0")
    assert not run_scontrol(["update"], 10.0).ok and not done.exists()  # unshielded: killed
    res = run_scontrol(["update"], 10.0, shield=True)
    assert res.ok and done.exists()


def test_the_shield_leaves_this_threads_signal_mask_as_it_was():
    import signal
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    run_scontrol(["version"], 5.0, shield=True, environ={"PATH": os.defpath})
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before


def test_a_requeue_with_bad_nodes_excludes_them_once_the_job_is_pending(fake_scontrol):
    from kempner_resilience.config import RequeueConfig
    from kempner_resilience.slurm import requeue_job
    calls = fake_scontrol('[ "$1" = show ] && echo "JobId=42 ExcNodeList=(null)"; exit 0')
    res = requeue_job("42", RequeueConfig(), exclude={"n2", "n1"})
    assert res.ok and res.excluded == ("n1", "n2") and res.exclude_error is None
    # The order matters: a running job's exclusions cannot change.
    assert calls.read_text().splitlines() == ["requeue 42", "show -o job 42",
                                              "update JobId=42 ExcNodeList=n1,n2"]


def test_a_failed_exclusion_leaves_the_requeue_standing(fake_scontrol):
    from kempner_resilience.config import RequeueConfig
    from kempner_resilience.slurm import requeue_job
    fake_scontrol('[ "$1" = update ] && { echo "Job is no longer pending execution" >&2; '
                  'exit 1; }; exit 0')
    res = requeue_job("42", RequeueConfig(), exclude={"n2"})
    assert res.ok and res.excluded == () and "no longer pending" in res.exclude_error


def test_an_exclusion_that_would_leave_the_job_no_room_to_run_is_not_made(fake_scontrol, caplog):
    calls = fake_scontrol(
        'case "$1 $3" in\n'
        '  "show job") echo "JobId=42 NumNodes=2 Partition=mn ExcNodeList=n1";;\n'
        '  "show partition") echo "PartitionName=mn Nodes=n[1-3] TotalNodes=3";;\n'
        'esac; exit 0')
    res = exclude_for_requeue("42", {"n2"})
    assert res is not None and not res.ok
    assert "leave 1 of partition mn's 3 nodes for a job of 2" in caplog.text
    assert not any(c.startswith("update") for c in calls.read_text().splitlines())
    # A job of one node has room left on n3: the exclusion is made.
    calls.unlink()
    fake_scontrol(
        'case "$1 $3" in\n'
        '  "show job") echo "JobId=42 NumNodes=1 Partition=mn ExcNodeList=n1";;\n'
        '  "show partition") echo "PartitionName=mn Nodes=n[1-3] TotalNodes=3";;\n'
        'esac; exit 0')
    assert exclude_for_requeue("42", {"n2"}).ok
    assert calls.read_text().splitlines()[-1] == "update JobId=42 ExcNodeList=n1,n2"


def test_a_job_with_spares_asks_for_fewer_nodes_rather_than_never_start(fake_scontrol,
                                                                       caplog):
    # 2 nodes train, 1 is a spare; two of the partition's 4 nodes went bad: 2 are left.
    calls = fake_scontrol(
        'case "$1 $3" in\n'
        '  "show job") echo "JobId=42 NumNodes=3 Partition=mn ExcNodeList=(null)";;\n'
        '  "show partition") echo "PartitionName=mn Nodes=n[1-4] TotalNodes=4";;\n'
        'esac; exit 0')
    assert exclude_for_requeue("42", {"n1", "n2"}, min_nodes=2).ok
    assert calls.read_text().splitlines()[-1] == \
        "update JobId=42 ExcNodeList=n1,n2 NumNodes=2"
    assert "spares given up" in caplog.text
    # Fewer left than the training needs: nothing is excluded.
    assert not exclude_for_requeue("42", {"n1", "n2", "n3"}, min_nodes=2).ok
    assert not calls.read_text().splitlines()[-1].startswith("update JobId=42 ExcNodeList=n1,n2,n3")


def test_the_batch_step_requeues_and_excludes_from_a_step_of_its_own(fake_scontrol, tmp_path):
    # SLURM SIGKILLs the batch step at once on a requeue: neither it nor a child of its own
    # could make the update after it, so the commands run in a one-task srun step. The job is
    # requeued held, so that it cannot start on the node it must leave before the update.
    from kempner_resilience.config import RequeueConfig
    from kempner_resilience.slurm import SlurmJob, requeue_job
    calls = fake_scontrol('[ "$1" = show ] && echo "JobId=42 ExcNodeList=(null)"; exit 0')
    srun = calls.parent / "bin" / "srun"
    srun.write_text(f'#!/bin/bash\necho "srun $@" >> {calls}\n'
                    'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"\n')
    srun.chmod(0o755)
    res = requeue_job(SlurmJob(job_id="42"), RequeueConfig(), exclude={"n2"})
    assert res.ok and res.excluded == ("n2",)
    lines = calls.read_text().splitlines()
    assert lines[0] == "show -o job 42" and lines[1].startswith("srun --overlap --nodes=1")
    assert lines[2:] == ["requeuehold 42", "update JobId=42 ExcNodeList=n2", "release 42"]


def test_a_job_of_tasks_per_node_giving_its_spare_up_asks_for_the_tasks_of_the_nodes_left(
        fake_scontrol):
    # --ntasks-per-node=2 on 3 nodes: NumTasks=6 kept with NumNodes=2 is never runnable.
    calls = fake_scontrol(
        'case "$1 $3" in\n'
        '  "show job") echo "JobId=42 NumNodes=3 NumTasks=6 NtasksPerN:B:S:C=2:0:*:* '
        'Partition=mn ExcNodeList=(null)";;\n'
        '  "show partition") echo "PartitionName=mn Nodes=n[1-4] TotalNodes=4";;\n'
        'esac; exit 0')
    assert exclude_for_requeue("42", {"n1", "n2"}, min_nodes=2).ok
    assert calls.read_text().splitlines()[-1] == \
        "update JobId=42 ExcNodeList=n1,n2 NumNodes=2 NumTasks=4"
