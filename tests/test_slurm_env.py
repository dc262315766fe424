"""SlurmJob.from_env, host lists, signal specs, torch env — from dicts and from a real 2-task job."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kempner_resilience.slurm import (
    SlurmJob,
    expand_hostlist,
    master_port,
    parse_signal_spec,
    setup_torch_env,
)
from kempner_resilience.slurm.env import tasks_per_node
from slurm_fixtures import slurm_cluster, submit, wait_job  # noqa: F401

PROBES = Path(__file__).resolve().parent / "cluster"

ARRAY_ENV = {
    "SLURM_JOB_ID": "1043", "SLURM_ARRAY_JOB_ID": "1040", "SLURM_ARRAY_TASK_ID": "3",
    "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_PARTITION": "kempner", "SLURM_STEP_ID": "0",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_RESTART_COUNT": "2", "SLURM_OPEN_MODE": "a",
}


def test_from_env_is_none_outside_slurm():
    assert SlurmJob.from_env({"PATH": "/usr/bin"}) is None


def test_from_env_reads_array_ids_and_requeue_id_is_arrayjob_task():
    job = SlurmJob.from_env(ARRAY_ENV)
    assert job is not None
    assert (job.job_id, job.array_job_id, job.array_task_id) == ("1043", "1040", "3")
    assert job.requeue_id == "1040_3"
    assert (job.procid, job.ntasks, job.localid, job.nodeid) == (5, 8, 1, 1)
    assert job.restart_count == 2 and job.partition == "kempner" and job.in_step


def test_restart_count_unset_means_zero_and_plain_job_requeues_by_job_id():
    job = SlurmJob.from_env({"SLURM_JOB_ID": "77"})
    assert job is not None
    assert job.restart_count == 0 and job.requeue_id == "77" and not job.in_step


def test_batch_step_is_not_an_srun_task():
    job = SlurmJob.from_env({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "batch"})
    assert job is not None and not job.in_step


@pytest.mark.parametrize("expr,hosts", [
    ("vm", ["vm"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2],b,c[9-10]", ["a1", "a2", "b", "c9", "c10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
])
def test_expand_hostlist_handles_ranges_padding_and_lists(expr, hosts):
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("text,sig,lead,batch", [
    ("USR1@120", "SIGUSR1", 120, False),
    ("B:USR1@90", "SIGUSR1", 90, True),
    ("SIGUSR2", "SIGUSR2", 60, False),
    ("10@30", "SIGUSR1", 30, False),
    ("RB:TERM@5", "SIGTERM", 5, True),
])
def test_parse_signal_spec(text, sig, lead, batch):
    spec = parse_signal_spec(text)
    assert spec is not None and (spec.signal, spec.lead_s, spec.batch_only) == (sig, lead, batch)


def test_parse_signal_spec_rejects_garbage():
    assert parse_signal_spec("NOPE@1") is None and parse_signal_spec("USR1@x") is None


def test_master_port_is_stable_and_in_range():
    assert master_port("1234") == master_port(1234)
    assert master_port("1234") != master_port("1235")
    assert all(20000 <= master_port(i) < 40000 for i in (0, 1, 19999, 10**9, "1040_3"))


def test_tasks_per_node_expands_repeat_counts():
    assert [tasks_per_node("2(x2),1", n) for n in range(4)] == [2, 2, 1, None]


def test_setup_torch_env_sets_rank_vars_without_overwriting_launcher_values():
    env = dict(ARRAY_ENV, MASTER_PORT="29500", PATH="/nonexistent")  # no scontrol: own parser
    was_set = setup_torch_env(SlurmJob.from_env(env), env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "5", "8", "1", "4")
    assert env["MASTER_ADDR"] == "gpu07"
    assert env["MASTER_PORT"] == "29500" and "MASTER_PORT" not in was_set


def test_setup_torch_env_refuses_the_batch_shell_of_a_multi_task_job():
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "PATH": "/x"}
    assert setup_torch_env(None, env) == {} and "RANK" not in env


def test_setup_torch_env_outside_slurm_does_nothing():
    env = {"PATH": "/usr/bin"}
    assert setup_torch_env(None, env) == {} and env == {"PATH": "/usr/bin"}


@pytest.mark.slurm
def test_real_two_task_job_sees_procids_and_same_master_port(slurm_cluster, tmp_path):
    script = f"""#!/bin/bash
#SBATCH -n 2
#SBATCH --time=2
#SBATCH --signal=USR1@45
#SBATCH --output={tmp_path}/job.out
srun {sys.executable} {PROBES / 'probe_env.py'} {tmp_path}
"""
    job_id = submit(script, cwd=tmp_path)
    info = wait_job(job_id, timeout=60)
    assert info["JobState"] == "COMPLETED", (tmp_path / "job.out").read_text()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["job"]["procid"] for r in ranks] == [0, 1]
    assert {r["job"]["job_id"] for r in ranks} == {job_id}
    assert all(r["job"]["restart_count"] == 0 and r["job"]["step_id"] == "0" for r in ranks)
    ports = {r["torch_env"]["MASTER_PORT"] for r in ranks}
    assert ports == {str(master_port(job_id))}
    assert [r["torch_env"]["RANK"] for r in ranks] == ["0", "1"]
    assert {r["torch_env"]["WORLD_SIZE"] for r in ranks} == {"2"}
    assert {r["torch_env"]["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}
    assert {r["torch_env"]["MASTER_ADDR"] for r in ranks} == {info["BatchHost"]}
    # end_time from scontrol: a 2-minute limit ends about 120 s after start.
    assert ranks[0]["end_time"] is not None
    assert ranks[0]["signal_spec"] == "USR1@45"
