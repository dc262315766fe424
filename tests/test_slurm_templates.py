"""sbatch templates: one source of truth, rendering, sbatch --test-only, and a real USR1 delivery."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kempner_resilience.config import ResilienceConfig, load_config
from kempner_resilience.slurm import TEMPLATES, master_port, render_sbatch, signal_lead_time
from slurm_fixtures import slurm_cluster, submit, wait_for, wait_job  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
PROBES = ROOT / "tests" / "cluster"
TEMPLATE_DIR = ROOT / "kempner_resilience" / "templates"  # the source; slurm/ is rendered from it
CLI = str(Path(sys.executable).parent / "kempner-resilience")
# Each template's launch line with the default command. multi_node_torchrun runs one
# `kempner-resilience torchrun` agent per node; no template runs a plain torchrun.
LAUNCH = {name: "srun --kill-on-bad-exit=1 python train.py" for name in TEMPLATES}
LAUNCH["multi_node_torchrun"] = ('kempner-resilience srun --agents -- '
                                 '"${TORCHRUN[@]}" python train.py')
LAUNCH["ray"] = "python train.py"     # the Ray driver, in the batch shell's background
PLAIN_TORCHRUN = re.compile(r"(?<!kempner-resilience )\btorchrun\b")
MULTI_NODE = ("multi_node", "multi_node_torchrun", "ray")
# The templates whose ranks are srun tasks (ray's training actors are Ray's workers).
SRUN_RANKS = tuple(name for name in TEMPLATES if name != "ray")
# What the test cluster's 8 CPUs allow for the ray template's one task per node.
RAY_CPUS = {"ray": ["--cpus-per-task=2"]}


def _regen_slurm():
    spec = importlib.util.spec_from_file_location("regen_slurm",
                                                  ROOT / "scripts" / "regen_slurm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", TEMPLATES)
def test_shipped_slurm_file_is_what_the_sbatch_verb_renders(name):
    args = _regen_slurm().SHIPPED_ARGS[name]
    env = {k: v for k, v in os.environ.items() if k != "KEMPNER_RESILIENCE_CONFIG"}
    proc = subprocess.run([CLI, "sbatch", *args], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert (ROOT / "slurm" / f"{name}.sbatch").read_text() == proc.stdout, (
        f"slurm/{name}.sbatch is generated: edit kempner_resilience/templates/{name}.sbatch, "
        "then run: PYTHONPATH=. python scripts/regen_slurm.py")


def test_slurm_dir_holds_exactly_one_rendered_file_per_packaged_template():
    assert sorted(p.stem for p in (ROOT / "slurm").iterdir()) == sorted(TEMPLATES)
    assert sorted(p.stem for p in TEMPLATE_DIR.iterdir()) == sorted(TEMPLATES)


@pytest.mark.parametrize("name", SRUN_RANKS)
def test_templates_signal_srun_tasks_not_the_batch_shell(name):
    text = render_sbatch(template=name, array="0-3" if name == "job_array" else None)
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=USR1@120" in directives  # default signals.grace_s 100 + 20
    assert not any("B:" in d for d in directives)
    assert "#SBATCH --requeue" in directives and "#SBATCH --open-mode=append" in directives
    assert LAUNCH[name] in text
    commands = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not any(PLAIN_TORCHRUN.search(c) for c in commands)
    assert "{{" not in text


def test_ray_template_signals_the_batch_shell_which_starts_ray_and_passes_it_to_the_driver():
    text = render_sbatch(template="ray", nodes=3, ntasks_per_node=8, time="00:30:00",
                         command=["python", "driver.py", "--name", "a b"])
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=B:USR1@120" in directives   # the shell: the driver is no srun task
    assert "#SBATCH --nodes=3" in directives and "#SBATCH --ntasks-per-node=1" in directives
    assert "#SBATCH --requeue" in directives and "#SBATCH --open-mode=append" in directives
    lines = text.splitlines()
    assert "python driver.py --name 'a b' & DRIVER=$!" in lines
    assert "trap 'TRAPPED=1; kill -USR1 $DRIVER 2>/dev/null' USR1" in lines
    assert any(line.startswith("srun ") and "ray start --head" in line for line in lines)
    assert any("ray start --block --address=" in line for line in lines)
    # Ray's processes see no SLURM job: only the driver requeues it.
    assert "NO_JOB=(env -u SLURM_JOB_ID -u SLURM_JOBID -u SLURM_RESTART_COUNT" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_ray_template_exits_with_the_driver_s_code_when_a_signal_comes_as_the_driver_leaves(
        tmp_path):
    # The requeue's SIGTERM reaches the batch shell just as the driver leaves with 75: the trap
    # cuts `wait` short (143), and the driver is gone before the shell looks again.
    driver = ("import os, signal, time; "
              "signal.signal(signal.SIGTERM, lambda *a: os._exit(75)); time.sleep(30)")
    text = render_sbatch(template="ray", command=[sys.executable, "-c", driver])
    block = text[text.index(f"{sys.executable} -c"):]          # the driver, its traps, its wait
    script = tmp_path / "driver_block.sh"
    script.write_text(
        "RAY_STEPS=()\n"
        # The trap's kill returns only once the driver is gone, as a loaded node's can.
        'kill() { builtin kill "$@"; local rc=$?; [ "$1" != -TERM ] || sleep 0.5; return $rc; }\n'
        "(sleep 1; builtin kill -TERM $$) &\n" + block)
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 75, done.stdout + done.stderr
    assert "driver exited with 75" in done.stdout


def test_ray_template_exits_with_the_driver_s_code_when_sigterms_keep_coming_as_it_leaves(tmp_path):
    # A few SIGTERMs, 2 ms apart, while the driver leaves with 75 (the requeue's, scancel's):
    # whenever they reach the shell, it says and exits with the driver's own code.
    driver = ("import os, signal, time; "
              "signal.signal(signal.SIGTERM, lambda *a: os._exit(75)); time.sleep(30)")
    text = render_sbatch(template="ray", command=[sys.executable, "-c", driver])
    script = tmp_path / "driver_block.sh"
    script.write_text("RAY_STEPS=()\n" + text[text.index(f"{sys.executable} -c"):])
    for _ in range(4):
        shell = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        for _ in range(20):
            if shell.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(shell.pid, signal.SIGTERM)
            time.sleep(0.002)
        out = shell.communicate(timeout=10)[0]
        assert shell.returncode == 75 and "driver exited with 75" in out, out


def test_ray_template_takes_no_spares():
    with pytest.raises(ValueError, match="spares"):
        render_sbatch(template="ray", nodes=2, spares=1)


@pytest.mark.parametrize("name", SRUN_RANKS)
def test_raw_templates_are_usable_scripts_with_concrete_defaults(name):
    text = (TEMPLATE_DIR / f"{name}.sbatch").read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash" and "{{" not in text and "#%" not in text
    torchrun = name == "multi_node_torchrun"
    for line in ("#SBATCH --signal=USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --time=04:00:00", "#SBATCH --gpus-per-node=4",
                 "NPROC_PER_NODE=4" if torchrun else "#SBATCH --ntasks-per-node=4",
                 f"{LAUNCH[name]} --config configs/default.yaml"):
        assert line in lines, line
    # Every #SBATCH line sits in the header (sbatch ignores those after the first command).
    first_cmd = next(i for i, l in enumerate(lines[1:], 1) if l.strip() and not l.startswith("#"))
    assert all(i < first_cmd for i, l in enumerate(lines) if l.startswith("#SBATCH"))
    # The explanations users rely on stay in the file.
    for words in ("No `B:` prefix", "kempner-resilience torchrun, not plain torchrun" if torchrun
                  else "srun, not torchrun", "append to the log", "75 = ", "77 = ", "79 = "):
        assert words in text, words
    assert subprocess.run(["bash", "-n", str(TEMPLATE_DIR / f"{name}.sbatch")]).returncode == 0


def test_render_with_the_raw_defaults_reproduces_the_raw_template():
    for name in TEMPLATES:
        raw = (TEMPLATE_DIR / f"{name}.sbatch").read_text()
        text = render_sbatch(template=name, time="04:00:00", ntasks_per_node=4, gpus_per_node=4,
                             nodes=2 if name in MULTI_NODE else 1,
                             array="0-3" if name == "job_array" else None,
                             command="python train.py --config configs/default.yaml")
        assert text == raw, name


def test_torchrun_template_runs_one_agent_per_node_and_ntasks_per_node_workers_on_each():
    text = render_sbatch(template="multi_node_torchrun", nodes=3, ntasks_per_node=8,
                         command=["python", "train.py", "--name", "a b"])
    lines = text.splitlines()
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "NPROC_PER_NODE=8",
                 LAUNCH["multi_node_torchrun"] + " --name 'a b'"):
        assert line in lines, line
    launcher = text.split("TORCHRUN=(", 1)[1].split(")", 1)[0].split()
    assert launcher[:2] == ["kempner-resilience", "torchrun"]
    for arg in ('--nproc-per-node="$NPROC_PER_NODE"',
                "--rdzv-backend=c10d", '--rdzv-endpoint="$RDZV_HOST:$RDZV_PORT"', "--no-python"):
        assert arg in launcher, arg
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    # No spares: every node trains, torchrun never restarts (a requeue does), no --no-kill.
    agent = _torchrun_argv(text, nnodes=3)
    assert "--nnodes=3" in agent and "--max-restarts=0" in agent, agent
    assert "#SBATCH --no-kill" not in lines


def _torchrun_argv(text: str, nnodes: int) -> list[str]:
    """The agent's command line as bash expands it in a job of ``nnodes`` nodes."""
    body = text.split("\nNPROC_PER_NODE=", 1)[1].split("\nkempner-resilience srun ", 1)[0]
    shell = (f"SLURM_NNODES={nnodes} SLURM_JOB_ID=7 SLURM_JOB_NODELIST=n1; NPROC_PER_NODE="
             f"{body}\nprintf '%s\\n' \"${{TORCHRUN[@]}}\"")
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_torchrun_template_with_spares_asks_for_them_with_no_kill_and_trains_on_the_rest():
    text = render_sbatch(template="multi_node_torchrun", nodes=2, spares=1, ntasks_per_node=4)
    lines = text.splitlines()
    assert "#SBATCH --nodes=3" in lines and "#SBATCH --no-kill" in lines
    agent = _torchrun_argv(text, nnodes=3)
    # Two nodes train; the third agent waits as torch's standby; one in-job restart.
    assert "--nnodes=2" in agent and "--max-restarts=1" in agent, agent
    agent = _torchrun_argv(render_sbatch(template="multi_node_torchrun", nodes=2, spares=2,
                                         in_job_restarts=5), nnodes=4)
    assert "--nnodes=2" in agent and "--max-restarts=5" in agent, agent
    with pytest.raises(ValueError, match="multi_node_torchrun"):
        render_sbatch(template="single_node", spares=1)


def test_lead_time_covers_grace_or_measured_save_plus_margin():
    assert signal_lead_time(ResilienceConfig()) == 120  # grace 100 + 20 s before the limit
    cfg = load_config(overrides=["signals.grace_s=60", "checkpoint.save_margin_s=10"])
    assert signal_lead_time(cfg) == 80
    assert signal_lead_time(cfg, save_seconds=20) == 80  # the grace still dominates
    # 95.2 s save + 10 s margin + 20 s requeue/teardown, rounded up
    assert signal_lead_time(cfg, save_seconds=95.2) == 126
    assert signal_lead_time(cfg, lead_time_s=300) == 300
    text = render_sbatch(cfg, save_seconds=95.2)
    assert "#SBATCH --signal=USR1@126" in text.splitlines()
    assert "# USR1 126 s before the time limit" in text
    usr2 = load_config(overrides=["signals.actions.SIGUSR1=off"])
    assert "#SBATCH --signal=USR2@120" in render_sbatch(usr2).splitlines()


def test_render_replaces_in_place_and_drops_optional_lines():
    text = render_sbatch(template="single_node", extra={"time": "00:10:00", "partition": "low"})
    lines = text.splitlines()
    assert [l for l in lines if l.startswith("#SBATCH --time")] == ["#SBATCH --time=00:10:00"]
    assert not any("--gpus-per-node" in l for l in lines if l.startswith("#SBATCH"))
    assert "# export KEMPNER_RESILIENCE_CONFIG=configs/default.yaml" in lines
    assert sum(l.startswith("srun ") for l in lines) == 1
    first_cmd = next(i for i, l in enumerate(lines[1:], 1) if l.strip() and not l.startswith("#"))
    assert lines.index("#SBATCH --partition=low") < first_cmd


def test_render_fills_options_extra_and_quotes_command():
    text = render_sbatch(ResilienceConfig(), template="multi_node", nodes=4, ntasks_per_node=8,
                         gpus_per_node=8, job_name="llm", time="2-00:00:00",
                         command=["python", "train.py", "--name", "a b"],
                         config_path="/cfg/x.yaml", extra={"partition": "kempner_h100",
                                                           "exclusive": None})
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --job-name=llm",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --partition=kempner_h100",
                 "#SBATCH --exclusive", "export KEMPNER_RESILIENCE_CONFIG=/cfg/x.yaml",
                 "srun --kill-on-bad-exit=1 python train.py --name 'a b'"):
        assert line in text.splitlines()


def test_render_rejects_bad_arguments():
    with pytest.raises(ValueError, match="multi_node"):
        render_sbatch(nodes=2)
    with pytest.raises(ValueError, match="array"):
        render_sbatch(template="job_array")
    with pytest.raises(ValueError, match="unknown template"):
        render_sbatch(template="nope")
    with pytest.raises(ValueError, match="one non-empty line"):
        render_sbatch(command="a\nb")
    with pytest.raises(ValueError, match="newline"):
        render_sbatch(job_name="a\nb")


@pytest.mark.slurm
@pytest.mark.parametrize("name", TEMPLATES)
def test_raw_template_passes_sbatch_test_only(slurm_cluster, tmp_path, name):
    # As shipped (GPUs and 4 tasks); only what this CPU test cluster lacks is overridden.
    res = subprocess.run(["sbatch", "--test-only", "--gpus-per-node=0", "--nodes=1",
                          "--ntasks-per-node=2", *RAY_CPUS.get(name, []),
                          str(ROOT / "slurm" / f"{name}.sbatch")],
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "to start at" in res.stderr


@pytest.mark.slurm
@pytest.mark.parametrize("name", TEMPLATES)
def test_rendered_template_passes_sbatch_test_only(slurm_cluster, tmp_path, name):
    script = tmp_path / f"{name}.sbatch"
    script.write_text(render_sbatch(template=name, array="0-1" if name == "job_array" else None,
                                    ntasks_per_node=2, extra={"cpus-per-task": 2}
                                    if name == "ray" else None,
                                    time="00:05:00", output=str(tmp_path / "x.out")))
    res = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    assert "to start at" in res.stderr


@pytest.mark.slurm
def test_rendered_template_delivers_usr1_to_every_srun_task(slurm_cluster, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(
        template="single_node", ntasks_per_node=2, time="00:05:00", job_name="sigtest",
        command=[sys.executable, str(PROBES / "probe_signal.py"), str(tmp_path)],
        output=str(tmp_path / "job.out")))
    job_id = submit(str(script), cwd=tmp_path)
    wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)), timeout=60,
             what="both srun tasks ready")
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True, timeout=30)
    info = wait_job(job_id, timeout=60)
    log = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    got = [json.loads((tmp_path / f"got_{r}.json").read_text()) for r in (0, 1)]
    assert [g["signals"] for g in got] == [["SIGUSR1"], ["SIGUSR1"]]
    # The template's MASTER_PORT and setup_torch_env agree.
    assert {g["master_port"] for g in got} == {str(master_port(job_id))}
    # Launched as the template says, preflight finds nothing wrong with signal or requeue.
    assert got[0]["open_mode"] == "a"
    bad = {"signal-batch-only", "no-signal", "not-srun-task", "no-requeue", "log-truncate",
           "scontrol-missing", "torchrun", "signal-unknown"}
    assert not bad & set(got[0]["findings"]), got[0]["findings"]
    assert "srun exited with 0" in log


@pytest.mark.slurm
def test_preemption_by_high_partition_sends_the_template_signal_to_srun_tasks(
        slurm_cluster, tmp_path):
    # preempt_send_user_signal: a preempted job gets its --signal at once, before GraceTime.
    script = tmp_path / "low.sbatch"
    script.write_text(render_sbatch(
        template="single_node", ntasks_per_node=2, time="00:20:00", extra={"partition": "low"},
        command=[sys.executable, str(PROBES / "probe_signal.py"), str(tmp_path)],
        output=str(tmp_path / "low.out")))
    low = submit(str(script), cwd=tmp_path)
    wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)), timeout=60,
             what="both srun tasks ready")
    high = submit(f"#!/bin/bash\n#SBATCH -p high\n#SBATCH -n 8\n#SBATCH -o {tmp_path}/high.out\n"
                  "true\n", cwd=tmp_path)  # needs the whole node: preempts the low job
    assert wait_job(high, timeout=60)["JobState"] == "COMPLETED"
    got = [json.loads((tmp_path / f"got_{r}.json").read_text()) for r in (0, 1)]
    assert [g["signals"] for g in got] == [["SIGUSR1"], ["SIGUSR1"]]
    wait_job(low, timeout=30)
