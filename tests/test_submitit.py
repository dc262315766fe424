"""The submitit integration: signal takeover, small resubmission pickles, and the whole
preempt -> emergency checkpoint -> requeue -> resume flow against the real local cluster
(plain pytest with 2 tasks over gloo, and the notebook ``docs/submitit.ipynb`` run by nbclient).
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import REPO, env
from kempner_resilience.checkpoint import layout
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.demo.submitit_job import train_demo
from kempner_resilience.supervise.submitit import jobs as krs

submitit = pytest.importorskip("submitit")

NOTEBOOK = REPO / "docs" / "submitit.ipynb"


def _noop_fn(a: int = 0, config=None) -> int:
    return a


# ------------------------------------------------------------------------ no cluster needed

def test_job_pickle_small_and_refuses_model_state():
    torch = pytest.importorskip("torch")
    job = krs.ResilientJob("kempner_resilience.demo.submitit_job:train_demo",
                           overrides=["checkpoint.dir=/tmp/ck"], steps=10, out="/tmp/w.pt")
    assert krs.check_small(job) < 4096
    data = pickle.dumps(job)
    assert b"_rebuild_tensor" not in data
    with pytest.raises(TypeError, match="torch.nn"):
        krs.ResilientJob(_noop_fn, model=torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="Tensor"):
        krs.ResilientJob(_noop_fn, [torch.zeros(3)])
    with pytest.raises(ValueError, match="bytes"):
        krs.ResilientJob(_noop_fn, b"x" * (krs.MAX_PICKLE_BYTES + 1))


def test_an_array_whose_jobs_share_a_checkpoint_dir_is_refused_before_anything_is_queued(
        tmp_path):
    """Two sweep entries in one checkpoint.dir would resume from each other's checkpoints:
    submit_array names both and the fix, and no job is submitted."""
    shared = [krs.ResilientJob(_noop_fn, a=a, overrides=[f"checkpoint.dir={tmp_path / 'ck'}"])
              for a in (1, 2)]
    executor = submitit.AutoExecutor(folder=tmp_path / "logs", cluster="local")
    with pytest.raises(ValueError, match=r"jobs 0 and 1 both have checkpoint.dir=.*its own"):
        krs.submit_array(shared, executor=executor)
    with pytest.raises(TypeError, match="wrap it: krs.ResilientJob"):
        krs.submit_array([_noop_fn], executor=executor)
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").rglob("*.pkl"))


def test_checkpoint_returns_fresh_small_instance():
    job = krs.ResilientJob(_noop_fn, 3, config={"checkpoint": {"every_steps": 5}},
                           overrides=["requeue.max_restarts=4"])
    delayed = job.checkpoint()
    assert isinstance(delayed, submitit.helpers.DelayedSubmission)
    fresh = delayed.function
    assert isinstance(fresh, krs.ResilientJob) and fresh is not job
    assert (fresh.fn, fresh.args, fresh.config, fresh.overrides) == \
        (job.fn, job.args, job.config, job.overrides)
    assert fresh() == 3


def test_config_gets_submitit_signal_actions_user_overrides_win():
    cfg = krs.ResilientJob(_noop_fn).resolve_config()
    assert cfg.signals.actions["SIGUSR2"].value == "requeue"
    assert cfg.signals.actions["SIGTERM"].value == "off"
    cfg = krs.ResilientJob(_noop_fn, sigterm="stop").resolve_config()
    assert cfg.signals.actions["SIGTERM"].value == "stop"
    cfg = krs.ResilientJob(_noop_fn, overrides=["signals.actions.SIGUSR2=stop"]).resolve_config()
    assert cfg.signals.actions["SIGUSR2"].value == "stop"
    with pytest.raises(ValueError, match="sigterm"):
        krs.ResilientJob(_noop_fn, sigterm="later")


def test_resolve_callable_import_paths():
    assert krs.resolve_callable("kempner_resilience.demo.submitit_job:train_demo") is train_demo
    assert krs.resolve_callable("kempner_resilience.demo.submitit_job.train_demo") is train_demo
    with pytest.raises(ValueError):
        krs.resolve_callable("nodots")


_TAKEOVER_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
marker = Path(sys.argv[1]); mode = sys.argv[2]

# What submitit's process_job installs before calling the job: its USR2 handler requeues at once.
def submitit_handler(signum, frame):
    marker.write_text("submitit handler ran")
signal.signal(signal.SIGUSR2, submitit_handler)

import kempner_resilience as kr
from kempner_resilience.supervise.submitit.jobs import ResilientJob

def train(config):
    if mode == "before":   # the signal comes while the function is still building
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.3)
    with kr.ResilientRun(config) as run:
        for step in run.steps(1000):
            if mode == "inside" and step == 3:
                os.kill(os.getpid(), signal.SIGUSR2)
            if mode.startswith("term") and step == 3:  # job._interrupt(): TERM, then USR2
                os.kill(os.getpid(), signal.SIGTERM)
            if mode == "term-ignore" and step == 5:
                os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.02)
            print("step", step, flush=True)
    return "finished"

ResilientJob(train, sigterm="stop" if mode == "term-stop" else "ignore")()
"""


@pytest.mark.parametrize("mode,code", [("inside", 75), ("before", 75), ("term-ignore", 75),
                                       ("term-stop", 143)])
def test_takeover_submitit_handler_never_runs(tmp_path, mode, code):
    """USR2 inside the run, or before it, is handled by ResilientRun (exit REQUEUE=75 outside
    SLURM, where a local launcher relaunches), never by submitit's immediate requeue. SIGTERM is
    ignored by default (so TERM-then-USR2 requeues), or stops the run with sigterm='stop'."""
    script = tmp_path / "takeover.py"
    script.write_text(textwrap.dedent(_TAKEOVER_SCRIPT))
    marker = tmp_path / "marker"
    e = env()
    for k in [k for k in e if k.startswith(("SLURM_", "SUBMITIT_"))]:
        e.pop(k)
    res = subprocess.run([sys.executable, str(script), str(marker), mode], capture_output=True,
                         text=True, timeout=120, env=e)
    assert res.returncode == code, res.stdout[-2000:] + res.stderr[-3000:]
    assert not marker.exists(), "submitit's handler was chained"
    steps = [int(m) for m in re.findall(r"^step (\d+)", res.stdout, re.M)]
    if mode != "before":
        assert steps and max(steps) < 20, res.stdout[-500:]
    else:  # stopped at the run's first boundary, before any step
        assert max(steps, default=0) < 3, res.stdout[-500:]
        assert "handled as soon as the run starts" in res.stderr


# ------------------------------------------------------------------------ local executor
# submitit's local executor (no SLURM): a controller process starts the tasks on this machine.

def _local_executor(folder: Path, tasks: int = 2):
    executor = submitit.AutoExecutor(folder=str(folder), cluster="local")
    executor.update_parameters(timeout_min=30, tasks_per_node=tasks)
    return executor


def test_two_local_tasks_are_ranks_0_and_1_of_one_rendezvous(tmp_path):
    job = krs.submit("os:environ.copy", executor=_local_executor(tmp_path / "logs"))
    krs.wait(job, timeout=120)
    envs = job.results()
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"), ("1", "1", "2")]
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert [e["KEMPNER_RESTART_COUNT"] for e in envs] == ["0", "0"]


def test_a_local_array_runs_each_entry_as_its_own_job_in_its_own_checkpoint_dir(tmp_path):
    """krs.submit_array without SLURM (a notebook's first try): one local job per entry, each
    trained to the end and committed in its own directory, each with its own result."""
    dirs = [tmp_path / f"lr{i}" for i in range(2)]
    jobs = krs.submit_array(
        [krs.ResilientJob(train_demo, overrides=[f"checkpoint.dir={d}", "checkpoint.every_steps=3"],
                          steps=6, quiet=True) for d in dirs],
        executor=_local_executor(tmp_path / "logs", tasks=1))
    assert len({j.job_id for j in jobs}) == 2
    results = [krs.wait(j, timeout=120).result() for j in jobs]
    assert [(r["steps"], r["exit"]) for r in results] == [(6, 0), (6, 0)]
    for d in dirs:
        assert (d / "step_000000006" / "MANIFEST.json").is_file(), sorted(d.rglob("*"))


def test_wait_notices_at_once_that_a_local_job_ended_without_a_result(tmp_path):
    import threading

    job = krs.submit("os:_exit", 75, executor=_local_executor(tmp_path / "logs", tasks=1))
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            krs.wait(job, timeout=600)
        except BaseException as e:      # noqa: BLE001  (the test inspects it)
            outcome.append(e)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    thread.join(120)     # far below wait's own timeout: only a prompt answer gets here
    assert not thread.is_alive(), "wait() still waiting for a local job that has ended"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert "ended without a result" in str(outcome[0])


def test_a_local_job_interrupted_from_the_notebook_checkpoints_requeues_and_resumes_bitwise(
        tmp_path):
    steps, ntasks = 30, 2
    runs = {}
    for name in ("ref", "int"):
        d = tmp_path / name
        (d / "ck").mkdir(parents=True)
        runs[name] = (d, krs.submit(
            train_demo, executor=_local_executor(d / "logs", ntasks),
            overrides=[f"checkpoint.dir={d / 'ck'}"], steps=steps, step_time=0.1,
            out=str(d / "w.pt"), progress=str(d / "progress.txt")))
    d, job = runs["int"]
    _wait_for_steps(d / "progress.txt", ntasks, 5)
    job._interrupt()                  # as a notebook user tries preemption
    results = {}
    for name, (_, j) in runs.items():
        krs.wait(j, timeout=300)
        results[name] = j.results()
    ref, res = results["ref"], results["int"]
    assert [(r["rank"], r["world"]) for r in res] == [(0, 2), (1, 2)]
    assert [r["restart_count"] for r in res] == [1, 1]       # started again once, by the controller
    emergency = [p.name for p in (d / "ck").glob("step_*")
                 if '"reason":"emergency"' in (p / "MANIFEST.json").read_text()]
    assert len(emergency) == 1
    out = (d / "logs" / f"{job.job_id}_0_log.out").read_text()
    assert f"resumed at step {int(emergency[0].removeprefix('step_'))}" in out, out[-2000:]
    assert ref[0]["digest"] and res[0]["digest"] == ref[0]["digest"]


def test_a_local_rank_that_exits_81_is_run_again_and_resumes_from_the_rescue_bitwise(
        tmp_path, monkeypatch):
    """Rank 1 SIGKILLed in step 13 of the first start; rank 0 commits the rescue and exits 81
    (PEER_LOST). submitit's own controller ends such a job without its result; ours asks the
    one policy, starts the tasks again, and they resume from the rescue: the final weights and
    optimizer state equal an uninterrupted run's."""
    from kempner_resilience.demo.compare import compare_weights

    monkeypatch.setenv("PYTHONPATH", f"{REPO / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    steps, kill_step = 24, 13
    runs = {}
    for name, kill_rank in (("ref", -1), ("kill", 1)):
        d = tmp_path / name
        runs[name] = (d, krs.submit(
            "checkpoint_helpers.submitit_kill:train_with_one_death",
            executor=_local_executor(d / "logs"),
            overrides=[f"checkpoint.dir={d / 'ck'}", "checkpoint.every_steps=5"],
            steps=steps, out=str(d / "w.pt"), kill_rank=kill_rank, kill_step=kill_step))
    results = {}
    for name, (_, job) in runs.items():
        krs.wait(job, timeout=400)
        results[name] = job.results()
    d = runs["kill"][0]
    rescues = [e.step for e in layout.scan(RunPaths(d / "ck"))
               if e.committed and e.manifest.get("reason") == "rescue"]
    assert rescues == [kill_step], rescues
    assert [r["start"] for r in results["kill"]] == [1, 1]       # started again, once
    assert [r["resumed"] for r in results["kill"]] == [kill_step, kill_step]
    assert [r["start"] for r in results["ref"]] == [0, 0]
    equal, total, diff = compare_weights(runs["ref"][0] / "w.pt", d / "w.pt")
    assert diff == [] and equal == total > 0
    # Started again warm (the suite sets KEMPNER_RESILIENCE_WARM): both tasks forked from one
    # process that imported torch once, not started by the controller.
    parents = {r["parent"] for r in results["kill"]}
    assert len(parents) == 1 and parents != {int(runs["kill"][1].job_id)}


def test_a_frozen_local_task_is_killed_after_the_grace_and_the_job_runs_again(tmp_path,
                                                                              monkeypatch):
    """Rank 0 exits 42 (HANG), rank 1 froze (SIGSTOP): submitit's controller would wait for it
    until the job's time limit; ours kills it after the grace, counts it as hung, and starts
    the tasks again, which then finish."""
    from kempner_resilience.supervise.submitit.local import ResilientLocalExecutor

    monkeypatch.setenv("PYTHONPATH", f"{REPO / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    executor = ResilientLocalExecutor.adopt(_local_executor(tmp_path / "logs"), grace_s=2.0)
    job = krs.submit("checkpoint_helpers.submitit_kill:end_as_told", ["42", "freeze"],
                     executor=executor)
    krs.wait(job, timeout=300)
    assert job.results() == [1, 1]


# ------------------------------------------------------------------------ real cluster

def _wait_for_steps(progress: Path, ntasks: int, steps: int) -> None:
    """Until every rank has done ``steps`` steps (well before the end): then interrupt."""
    t0 = time.monotonic()
    while True:
        seen = _progress_steps(progress)
        if len(seen) == ntasks and min(seen.values()) >= steps:
            return
        assert time.monotonic() - t0 < 240, f"no progress: {seen}"
        time.sleep(0.1)


def _progress_steps(path: Path) -> dict[int, int]:
    """rank -> highest step written to the demo's --progress file."""
    out: dict[int, int] = {}
    if path.exists():
        for m in re.finditer(r"rank (\d+) step (\d+)", path.read_text()):
            r, s = int(m.group(1)), int(m.group(2))
            out[r] = max(out.get(r, -1), s)
    return out


def _assert_pickle_small(path: Path) -> int:
    data = path.read_bytes()
    assert len(data) < 64 * 1024, f"{path} is {len(data)} bytes"
    assert b"_rebuild_tensor" not in data and b"torch.nn.modules" not in data
    delayed = pickle.loads(data)
    assert isinstance(delayed.function, krs.ResilientJob)
    krs.check_small(delayed)  # raises on any tensor/module/optimizer inside
    return len(data)


@pytest.mark.slurm
@pytest.mark.slow
def test_submitit_two_tasks_preempt_requeue_resume(slurm_cluster, tmp_path):
    """2 tasks over gloo: USR2 (job._interrupt(): TERM, then USR2) mid-training -> all-rank DCP
    emergency checkpoint -> requeue -> resume; the final weights equal an uninterrupted run's."""
    from slurm_fixtures import job_info

    steps, ntasks = 30, 2
    slurm = dict(timeout_min=30, tasks_per_node=ntasks, cpus_per_task=1, name="kr-submitit")
    runs = {}
    for name in ("ref", "int"):
        d = tmp_path / name
        (d / "ck").mkdir(parents=True)
        runs[name] = (d, krs.submit(
            train_demo, folder=d / "logs", slurm=slurm,
            overrides=[f"checkpoint.dir={d / 'ck'}"], steps=steps, step_time=0.25,
            out=str(d / "w.pt"), progress=str(d / "progress.txt")))
    d, job = runs["int"]
    _wait_for_steps(d / "progress.txt", ntasks, 5)
    job._interrupt()
    results = {}
    for name, (_, j) in runs.items():
        krs.wait(j, timeout=300)
        results[name] = j.results()
    ref, res = results["ref"], results["int"]
    assert [r["rank"] for r in res] == [0, 1] and res[0]["world"] == 2
    assert res[0]["restart_count"] >= 1, res  # it ran (at least) twice
    info = job_info(job.job_id)
    if info:
        assert int(info.get("Restarts", "0")) >= 1, info
    # Resumed from a committed emergency checkpoint at step k > 0.
    out = (d / "logs" / f"{job.job_id}_0_log.out").read_text()
    resumed = [int(k) for k in re.findall(r"resumed at step (\d+)", out)]
    assert resumed and resumed[0] > 0, out[-2000:]
    err = (d / "logs" / f"{job.job_id}_0_log.err").read_text()
    assert re.search(r"emergency checkpoint for step \d+ committed", err), err[-3000:]
    assert "requeued job" in err or "DUE TO PREEMPTION" in err, err[-3000:]
    committed = sorted(p.name for p in (d / "ck").glob("step_*") if (p / "MANIFEST.json").exists())
    assert committed, list((d / "ck").iterdir())
    assert f"step_{resumed[0]:09d}" in committed
    # Exact resume: same final weights and optimizer state as the uninterrupted run.
    assert ref[0]["digest"] and res[0]["digest"] == ref[0]["digest"]
    # The resubmission pickle: a few KiB of paths and config, no tensors.
    _assert_pickle_small(d / "logs" / f"{job.job_id}_submitted.pkl")


@pytest.mark.slurm
@pytest.mark.slow
def test_an_array_sweep_gives_each_task_its_own_loop_and_a_preempted_task_resumes_bitwise(
        slurm_cluster, tmp_path):
    """krs.submit_array: one sbatch --array of two identical 2-task runs in their own
    directories. The first is interrupted (USR2): it checkpoints, requeues alone and resumes;
    the second runs straight through; both end with the same weights, and submitit finds
    every result and per-task log under the array's names."""
    steps, ntasks = 30, 2
    slurm = dict(timeout_min=30, tasks_per_node=ntasks, cpus_per_task=1, name="kr-array")
    dirs = [tmp_path / f"lr{i}" for i in range(2)]
    for d in dirs:
        (d / "ck").mkdir(parents=True)
    jobs = krs.submit_array(
        [krs.ResilientJob(train_demo, overrides=[f"checkpoint.dir={d / 'ck'}"], steps=steps,
                          step_time=0.25, out=str(d / "w.pt"), progress=str(d / "progress.txt"))
         for d in dirs], folder=tmp_path / "logs", slurm=slurm)
    array_id = jobs[0].job_id.split("_")[0]
    assert [j.job_id for j in jobs] == [f"{array_id}_0", f"{array_id}_1"]
    _wait_for_steps(dirs[0] / "progress.txt", ntasks, 5)
    jobs[0]._interrupt()
    for j in jobs:
        krs.wait(j, timeout=300)
    (first, *_), (second, *_) = (j.results() for j in jobs)
    assert first["restart_count"] >= 1 and second["restart_count"] == 0, (first, second)
    out = (tmp_path / "logs" / f"{jobs[0].job_id}_0_log.out").read_text()
    resumed = [int(k) for k in re.findall(r"resumed at step (\d+)", out)]
    assert resumed and resumed[0] > 0, out[-2000:]
    err = (tmp_path / "logs" / f"{jobs[0].job_id}_0_log.err").read_text()
    assert "step 0: srun" in err and re.search(r"emergency checkpoint for step \d+ committed",
                                               err), err[-3000:]
    assert "resumed at step" not in (tmp_path / "logs" / f"{jobs[1].job_id}_0_log.out").read_text()
    assert first["digest"] and first["digest"] == second["digest"]


def _inject_parameters(nb, params: dict) -> None:
    """papermill-style: a cell with the values goes right after the cell tagged 'parameters'."""
    import nbformat

    src = "# injected by the test\n" + "\n".join(f"{k} = {v!r}" for k, v in params.items())
    for i, cell in enumerate(nb.cells):
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            nb.cells.insert(i + 1, nbformat.v4.new_code_cell(src))
            return
    raise AssertionError("notebook has no cell tagged 'parameters'")


@pytest.mark.slurm
@pytest.mark.slow
def test_notebook_runs_against_cluster(slurm_cluster, tmp_path):
    """docs/submitit.ipynb, executed by nbclient in a python3 kernel of this interpreter (the
    kernelspec ipykernel ships; jupyter_client starts it with sys.executable)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    _inject_parameters(nb, {"workdir": str(tmp_path / "nb"), "steps": 24, "step_time": 0.25,
                            "wait_timeout_s": 240})
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.monotonic()
    client.execute()
    elapsed = time.monotonic() - t0
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []) if o.get("output_type") == "stream")
    m = re.search(r"resumed at step (\d+)", text)
    assert m and int(m.group(1)) > 0, text[-3000:]
    assert re.search(r"final result: .*'restart_count': [1-9]", text), text[-3000:]
    folder = tmp_path / "nb" / "logs"
    pkls = list(folder.glob("*_submitted.pkl"))
    assert len(pkls) == 1
    _assert_pickle_small(pkls[0])
    print(f"notebook ran in {elapsed:.1f} s")


# ------------------------------------------------------------------------ under the step loop

def test_a_slurm_job_s_batch_script_runs_the_step_loop_around_submitit_s_command(tmp_path):
    """krs.submit's SLURM executor: submitit's script without its srun line, our loop instead,
    which runs srun with submitit's per-task logs (where job.stdout() reads them)."""
    import shutil

    from slurm_fixtures import in_ci
    from kempner_resilience.supervise.submitit.slurm import ResilientSlurmExecutor

    if shutil.which("srun") is None and not in_ci():
        pytest.skip("submitit's SLURM executor needs srun on PATH")
    auto = submitit.AutoExecutor(folder=tmp_path / "%j", cluster="slurm")
    auto.update_parameters(timeout_min=30, tasks_per_node=2)
    ours = ResilientSlurmExecutor.adopt(auto)
    script = ours._make_submission_file_text(ours._submitit_command_str, "u")
    command = script.splitlines()[script.splitlines().index("export SUBMITIT_EXECUTOR=slurm") + 1]
    loop, _, inner = command.partition(" -- ")
    assert "-m kempner_resilience.cli srun" in loop and not loop.startswith("srun")
    assert f"--output {tmp_path}/%j/%j_%t_log.out --error {tmp_path}/%j/%j_%t_log.err" in loop
    assert inner.endswith(f"-u -m submitit.core._submit {tmp_path}/%j")
    assert "#SBATCH --ntasks-per-node=2" in script



HELPERS = Path(__file__).resolve().parent / "checkpoint_helpers"
RESCUE_STEPS, RESCUE_EVERY = 24, 4


def _rescue_args(work: Path, *extra: str) -> tuple[str, ...]:
    return ("--steps", str(RESCUE_STEPS), "--out", str(work / "weights.pt"), "--set",
            f"checkpoint.dir={work / 'ckpt'}", "--set", f"checkpoint.every_steps={RESCUE_EVERY}",
            *extra)


def _submit_rescue(work: Path, *extra: str):
    slurm = dict(timeout_min=30, tasks_per_node=2, cpus_per_task=1, name="kr-submitit-fault")
    return krs.submit("submitit_rescue:main", *_rescue_args(work, *extra), folder=work / "logs",
                      slurm=slurm)


@pytest.mark.slurm
def test_submitit_slurm_rank_exception_leaves_with_1_never_run_again(slurm_cluster, tmp_path,
                                                                    monkeypatch):
    """Rank 1 raises (a bug): the step loop's policy leaves with 1; no requeue, no relaunch."""
    from slurm_fixtures import job_info, wait_job

    monkeypatch.setenv("PYTHONPATH", f"{HELPERS}:{os.environ.get('PYTHONPATH', '')}")
    job = _submit_rescue(tmp_path, "--raise-at", "1:9")
    with pytest.raises(RuntimeError, match="without a result"):
        krs.wait(job, timeout=240)
    info = wait_job(job.job_id, timeout=60) or job_info(job.job_id)
    err = (tmp_path / "logs" / f"{job.job_id}_0_log.err").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", (info, err[-3000:])
    assert info.get("Restarts") == "0", info
    assert err.count("step 0: srun") == 1 and "step 1: srun" not in err, err[-3000:]


@pytest.mark.slurm
def test_submitit_slurm_rank_sigkilled_runs_again_and_resumes_bitwise(slurm_cluster, tmp_path,
                                                                     monkeypatch):
    """Rank 1 SIGKILLed: the step loop runs the job again (a requeue: no spare, no in-job
    restart), it resumes, its result is submitit's, its weights an uninterrupted run's."""
    import torch

    from helpers import assert_bitwise_equal, free_port

    ref = tmp_path / "ref"
    ref.mkdir()
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, str(HELPERS / "rescue_job.py"), *_rescue_args(ref)], cwd=ref,
        env=env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in range(2)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    work = tmp_path / "job"
    monkeypatch.setenv("PYTHONPATH", f"{HELPERS}:{os.environ.get('PYTHONPATH', '')}")
    job = _submit_rescue(work, "--kill-at", "1:9")
    krs.wait(job, timeout=360)
    assert job.results() == [0, 0]
    rank0 = job.task(0)
    assert re.search(r"resumed from \S+ \(step [1-9]", rank0.stderr() or ""), (rank0.stderr() or "")[-3000:]
    assert "Loading pickle" in (rank0.stdout() or "")     # job.stdout() reads the task's log
    assert_bitwise_equal(torch.load(work / "weights.pt", weights_only=True),
                         torch.load(ref / "weights.pt", weights_only=True))


def test_two_local_controllers_with_one_pid_on_two_hosts_never_clear_each_others_channel(
        tmp_path):
    # Two hosts share the jobs' folder, and their controllers happen to have the same pid: the
    # second must neither clear the first's live channel as a leftover nor remove it at its end.
    # Each controller opens its channel as open_channel() does, with its own host's name.
    from kempner_resilience.supervise.channel import Channel, RunReport

    pid = "4242"
    mine = Channel.for_controller(pid, tmp_path, host="host-a")
    mine.report(RunReport(str(tmp_path / "run-a"), "a", 12))
    theirs = Channel.for_controller(pid, tmp_path, host="host-b")
    assert theirs.root != mine.root
    assert theirs.read() is None
    theirs.remove()
    again = Channel.for_controller(pid, tmp_path, host="host-a")   # same host and pid: a
    assert again.root != mine.root and again.read() is None        # new job's own channel
    report = mine.read()
    assert report is not None and (report.run_id, report.committed) == ("a", 12)
