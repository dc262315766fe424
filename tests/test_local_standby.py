"""A machine's standby for local launches (supervise/local/standby.py): one process that imported
torch once and outlives the launches; each warm launch forks its ranks from it, unless the
standby imported torch with other values than the ranks would."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import env, wait_for_file, write_script
from kempner_resilience.supervise.local import standby
from kempner_resilience.supervise.local.launcher import LocalLauncher

PARENT = """
import os, sys, time
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"parent.{os.environ['RANK']}")
with open(out, "w") as f:
    f.write(str(os.getppid()))
"""

# Each file appears whole (written aside, then renamed): the test reads it as soon as it exists.
WAITS = """
import os, signal, sys, time
here = os.path.dirname(os.path.abspath(__file__))
def put(name, text):
    with open(os.path.join(here, "." + name), "w") as f:
        f.write(text)
    os.replace(os.path.join(here, "." + name), os.path.join(here, name))
def term(signum, frame):
    put(f"term.{os.environ['RANK']}", "SIGTERM")
    sys.exit(143)
signal.signal(signal.SIGTERM, term)
put(f"pid.{os.environ['RANK']}", f"{os.getpid()} {os.getppid()}")
time.sleep(120)
"""


@pytest.fixture
def node_standby(monkeypatch):
    """A standby of this test's own, named in the environment as the launches see it."""
    name = f"kr-standby-test-{os.getpid()}-{time.monotonic_ns()}"
    proc = standby.start(name, os.environ)
    monkeypatch.setenv(standby.STANDBY_ENV, name)
    monkeypatch.setenv("KEMPNER_RESILIENCE_WARM", "1")
    yield proc
    proc.kill()
    proc.wait()


def _launch(script: Path, tmp_path: Path, **env: str) -> int:
    launcher = LocalLauncher([sys.executable, str(script)], ranks=2, workdir=None,
                             max_launches=1, log_dir=tmp_path, env=env)
    launcher.run()
    return launcher.launches[-1].exit_code


def test_a_warm_launch_forks_every_rank_from_the_machines_standby(node_standby, tmp_path):
    script = write_script(tmp_path, PARENT)
    assert _launch(script, tmp_path) == 0
    assert {(tmp_path / f"parent.{r}").read_text() for r in (0, 1)} == {str(node_standby.pid)}
    assert node_standby.poll() is None          # it outlives the launch, for the next one


def test_a_standby_that_imported_torch_with_another_pythonpath_is_not_used(node_standby,
                                                                           tmp_path):
    script = write_script(tmp_path, PARENT)
    assert _launch(script, tmp_path, PYTHONPATH=str(tmp_path)) == 0
    parents = {(tmp_path / f"parent.{r}").read_text() for r in (0, 1)}
    assert len(parents) == 1 and parents != {str(node_standby.pid)}     # a zygote of its own


def test_a_launch_inside_a_slurm_job_does_not_use_a_standby_outside_that_job(node_standby,
                                                                            tmp_path):
    # Its ranks would live outside the allocation: no --signal, no cgroup, no cleanup by slurmd.
    script = write_script(tmp_path, PARENT)
    assert _launch(script, tmp_path, SLURM_JOB_ID="4242") == 0
    parents = {(tmp_path / f"parent.{r}").read_text() for r in (0, 1)}
    assert len(parents) == 1 and parents != {str(node_standby.pid)}     # a zygote of its own


def test_what_torch_reads_only_when_used_does_not_keep_a_launch_from_the_standby(node_standby,
                                                                                 tmp_path):
    # Lightning sets both in the environment of whoever imports it.
    script = write_script(tmp_path, PARENT)
    assert _launch(script, tmp_path, TORCHINDUCTOR_CACHE_DIR=str(tmp_path),
                   PYTORCH_NVML_BASED_CUDA_CHECK="1") == 0
    assert {(tmp_path / f"parent.{r}").read_text() for r in (0, 1)} == {str(node_standby.pid)}


def test_a_launcher_killed_outright_takes_its_standby_ranks_with_it_by_sigterm(node_standby,
                                                                              tmp_path):
    script = write_script(tmp_path, WAITS)
    code = ("import sys; from kempner_resilience.supervise.local.launcher import LocalLauncher; "
            f"LocalLauncher([sys.executable, {str(script)!r}], ranks=2, workdir=None, "
            f"max_launches=1, log_dir={str(tmp_path)!r}).run()")
    launcher = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        seen = [wait_for_file(tmp_path / f"pid.{r}", timeout=120).split() for r in (0, 1)]
        assert {parent for _, parent in seen} == {str(node_standby.pid)}
        pids = [int(pid) for pid, _ in seen]
        launcher.kill()
        launcher.wait()
        for r in (0, 1):
            assert wait_for_file(tmp_path / f"term.{r}", timeout=30) == "SIGTERM"
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if Path(f"/proc/{p}").exists()]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_a_torchrun_agent_forks_its_workers_from_the_machines_standby(node_standby, tmp_path):
    # The agent imports nothing for its workers: no zygote of its own.
    script = write_script(tmp_path, PARENT)
    agent = subprocess.run(
        [sys.executable, "-m", "kempner_resilience.cli", "torchrun", "--standalone",
         "--nproc-per-node=2", str(script)], cwd=tmp_path, env=env(), capture_output=True,
        text=True, timeout=180)
    assert agent.returncode == 0, agent.stderr[-3000:]
    assert {(tmp_path / f"parent.{r}").read_text() for r in (0, 1)} == {str(node_standby.pid)}
    assert f"forked from the standby {os.environ[standby.STANDBY_ENV]}" in agent.stderr
    assert node_standby.poll() is None


RAY_DRIVER = """
import os, ray
import kempner_resilience.ray as krr
ray.init(num_cpus=1, include_dashboard=False, runtime_env=krr.warm_runtime_env())

@ray.remote
def parent():
    return os.getppid()

print("PARENT", ray.get(parent.remote()), flush=True)
ray.shutdown()
"""


@pytest.mark.ray
def test_a_ray_drivers_workers_fork_from_the_machines_standby(node_standby, tmp_path):
    # The driver starts no zygote of its own: Ray's workers on its node fork from the standby.
    from slurm_fixtures import require_modules

    require_modules("ray")
    script = write_script(tmp_path, RAY_DRIVER)
    e = env()
    e.pop("RANK", None)
    driver = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=e,
                            capture_output=True, text=True, timeout=180)
    assert driver.returncode == 0, driver.stderr[-3000:]
    assert f"PARENT {node_standby.pid}\n" in driver.stdout, driver.stdout[-3000:]
    assert node_standby.poll() is None


# A rank that says which modules were imported before its first line, and what the
# environment holds that a module's import may have set.
IMPORTED = """
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, f"seen.{os.environ['RANK']}"), "w") as f:
    f.write(" ".join([str(os.getppid()), str("wave" in sys.modules),
                      str("kr_probe" in sys.modules), os.environ.get("KR_PROBE_SET", "-")]))
"""


def _seen(tmp_path: Path) -> list[list[str]]:
    return [(tmp_path / f"seen.{r}").read_text().split() for r in (0, 1)]


def test_a_launch_naming_imports_the_standby_lacks_forks_from_a_zygote_that_imported_them(
        node_standby, tmp_path):
    script = write_script(tmp_path, IMPORTED)
    assert _launch(script, tmp_path, KEMPNER_RESILIENCE_WARM_IMPORTS="wave") == 0
    seen = _seen(tmp_path)
    assert {ppid for ppid, *_ in seen} != {str(node_standby.pid)}       # a zygote of its own
    assert [wave for _, wave, _, _ in seen] == ["True", "True"]


def test_what_a_named_import_puts_in_the_environment_is_in_each_warm_rank(node_standby,
                                                                          tmp_path):
    # As a cold rank's own import would have put it there.
    (tmp_path / "kr_probe.py").write_text('import os\nos.environ["KR_PROBE_SET"] = "by-import"\n')
    script = write_script(tmp_path, IMPORTED)
    assert _launch(script, tmp_path, KEMPNER_RESILIENCE_WARM_IMPORTS="kr_probe",
                   PYTHONPATH=str(tmp_path)) == 0
    assert [seen[2:] for seen in _seen(tmp_path)] == [["True", "by-import"]] * 2


def test_a_standby_whose_named_imports_read_other_variables_is_not_used(monkeypatch, tmp_path):
    # It imported ``wave`` with WAVE_* unset: a rank with one set must not inherit that import.
    name = f"kr-standby-test-{os.getpid()}-{time.monotonic_ns()}"
    proc = standby.start(name, {**os.environ, "KEMPNER_RESILIENCE_WARM_IMPORTS": "wave"})
    monkeypatch.setenv(standby.STANDBY_ENV, name)
    monkeypatch.setenv("KEMPNER_RESILIENCE_WARM", "1")
    try:
        script = write_script(tmp_path, IMPORTED)
        assert _launch(script, tmp_path) == 0
        assert {ppid for ppid, *_ in _seen(tmp_path)} == {str(proc.pid)}
        assert _launch(script, tmp_path, WAVE_MODE="other") == 0
        assert {ppid for ppid, *_ in _seen(tmp_path)} != {str(proc.pid)}
    finally:
        proc.kill()
        proc.wait()


def test_a_named_import_that_starts_a_thread_is_never_forked_and_the_ranks_start_cold(
        node_standby, tmp_path, caplog):
    # A fork copies only the forking thread: the module's own thread would be missing in
    # every rank, so the process that imported it refuses to fork. faulthandler's timer is a
    # native thread, which Python's threading module does not count.
    (tmp_path / "kr_probe.py").write_text(
        "import faulthandler\nfaulthandler.dump_traceback_later(600)\n")
    # A forked rank would wait at its exit for the timer thread it lacks: it leaves at once.
    script = write_script(tmp_path, IMPORTED + "os._exit(0)\n")
    with caplog.at_level("WARNING"):
        assert _launch(script, tmp_path, KEMPNER_RESILIENCE_WARM_IMPORTS="kr_probe",
                       PYTHONPATH=str(tmp_path)) == 0
    assert [seen[0] for seen in _seen(tmp_path)] == [str(os.getpid())] * 2   # the launcher's
    assert "starting the ranks cold" in caplog.text and "threads" in caplog.text


def test_a_named_import_that_loads_the_cuda_driver_is_never_forked_and_the_ranks_start_cold(
        node_standby, tmp_path, caplog):
    # torch.cuda.is_available() without NVML loads the CUDA driver without torch's lazy init:
    # a rank forked after it would fail at its first CUDA call. No GPU here: the probe maps a
    # library of that name, which is what the zygote looks for.
    libm = next(line.split()[-1] for line in open("/proc/self/maps") if "/libm.so" in line)
    shutil.copy(libm, tmp_path / "libcuda.so.1")
    (tmp_path / "kr_probe.py").write_text(
        f"import ctypes\nctypes.CDLL({str(tmp_path / 'libcuda.so.1')!r})\n")
    script = write_script(tmp_path, IMPORTED)
    with caplog.at_level("WARNING"):
        assert _launch(script, tmp_path, KEMPNER_RESILIENCE_WARM_IMPORTS="kr_probe",
                       PYTHONPATH=str(tmp_path)) == 0
    assert [seen[0] for seen in _seen(tmp_path)] == [str(os.getpid())] * 2   # the launcher's
    assert "starting the ranks cold" in caplog.text and "CUDA driver" in caplog.text
