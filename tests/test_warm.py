"""Warm ranks (``supervise/local/warm.py``): the local launcher forks each launch's ranks from one
process that imported torch once. A warm rank is the rank a cold start gives (its environment,
arguments, working directory, streams, exit code, signals), a relaunch forked warm ends bitwise
equal to one started cold, and nothing of one incarnation reaches the next: each rank is a fresh
fork of a zygote that never runs a rank's code.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from helpers import assert_bitwise_equal, run_rescue_job, write_script
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.local.warm import Zygote, warm_command

PROBE = """
import os, sys, signal, json
import numpy
print(json.dumps({"rank": os.environ.get("RANK"), "argv": sys.argv, "path0": sys.path[0],
                  "cwd": os.getcwd(), "sigint": str(signal.getsignal(signal.SIGINT)),
                  "sigterm": str(signal.getsignal(signal.SIGTERM)),
                  "numpy": float(numpy.random.rand()),
                  "kr_loaded": "kempner_resilience" in sys.modules}))
sys.exit(int(os.environ.get("RANK", "0")) + 3)
"""


@pytest.fixture
def zygote():
    z = Zygote(dict(os.environ))
    yield z
    z.close()


def _probe(z: Zygote, script: Path, tmp_path: Path, rank: int) -> tuple[int, dict]:
    import json

    out = tmp_path / f"out{rank}"
    p = z.spawn([sys.executable, str(script), "a", "b"], {**os.environ, "RANK": str(rank)},
                str(tmp_path), str(out), str(out))
    code = p.wait(timeout=60)
    return code, json.loads(out.read_text().strip().splitlines()[-1])


def test_a_warm_rank_gets_its_own_environment_arguments_directory_and_exit_code(zygote,
                                                                              tmp_path):
    (tmp_path / "probe").mkdir()
    script = write_script(tmp_path / "probe", PROBE, "p.py")
    code0, seen0 = _probe(zygote, script, tmp_path, 0)
    code1, seen1 = _probe(zygote, script, tmp_path, 1)
    assert (code0, code1) == (3, 4)
    assert seen0["rank"] == "0" and seen1["rank"] == "1"
    assert seen0["argv"] == [str(script), "a", "b"]
    assert seen0["path0"] == str(script.parent) and seen0["cwd"] == str(tmp_path)
    assert "default_int_handler" in seen0["sigint"] and seen0["sigterm"] == str(signal.SIG_DFL)
    assert seen0["numpy"] != seen1["numpy"]          # NumPy's global RNG seeded afresh
    assert not seen0["kr_loaded"]                    # the package's import-time state is the rank's


def test_a_warm_rank_imports_from_the_same_folders_as_a_cold_start_pythonpath_included(
        tmp_path):
    import json
    import subprocess

    script = write_script(tmp_path, "import json, sys; print(json.dumps(sys.path))", "p.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "lib"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cold = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    z = Zygote(env)
    try:
        out = tmp_path / "warm.out"
        assert z.spawn([sys.executable, str(script)], env, str(tmp_path), str(out),
                       str(out)).wait(timeout=60) == 0
    finally:
        z.close()
    warm = json.loads(out.read_text().strip().splitlines()[-1])
    assert warm == json.loads(cold.stdout)
    assert warm[1] == str(tmp_path / "lib")


def test_a_warm_rank_killed_by_a_signal_reports_it_as_popen_does(zygote, tmp_path):
    script = write_script(tmp_path, "import time\ntime.sleep(60)\n")
    p = zygote.spawn([sys.executable, str(script)], dict(os.environ), None, os.devnull,
                     os.devnull)
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL


def test_the_zygote_keeps_no_thread_or_file_of_five_incarnations(zygote, tmp_path):
    script = write_script(tmp_path, "import torch, threading\n"
                          "threading.Thread(target=lambda: None).start()\n"
                          "open(__file__).read()\n")

    def footprint() -> tuple[int, int]:
        pid = zygote.proc.pid
        return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))

    zygote.spawn([sys.executable, str(script)], dict(os.environ), None, os.devnull,
                 os.devnull).wait(timeout=60)
    before = footprint()
    for _ in range(5):
        assert zygote.spawn([sys.executable, str(script)], dict(os.environ), None, os.devnull,
                            os.devnull).wait(timeout=60) == 0
    assert footprint() == before


def test_warm_ranks_of_one_zygote_draw_torch_seeds_of_their_own_as_cold_starts_do(zygote,
                                                                                  tmp_path):
    # An unseeded script then starts each run from other weights, as check-resume's
    # NOT DETERMINISTIC verdict needs: its runs fork from one zygote.
    script = write_script(tmp_path, "import torch\nprint(torch.initial_seed())\n", "s.py")
    seeds = set()
    for rank in range(3):
        out = tmp_path / f"out{rank}"
        assert zygote.spawn([sys.executable, str(script)], dict(os.environ), None, str(out),
                            str(out)).wait(timeout=60) == 0
        seeds.add(int(out.read_text().split()[-1]))
    assert len(seeds) == 3


def test_launchers_given_one_zygote_fork_every_rank_from_it_and_leave_it_running(
        zygote, tmp_path, monkeypatch):
    # check-resume's runs (and the demo's two) share one: torch is imported once, not per run.
    from kempner_resilience.supervise.local.launcher import LocalLauncher

    monkeypatch.setenv("KEMPNER_RESILIENCE_WARM", "1")
    script = write_script(tmp_path, "import os\nprint(os.getppid())\n", "p.py")
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
        [launch] = LocalLauncher([sys.executable, str(script)], ranks=2, workdir=None,
                                 max_launches=1, log_dir=tmp_path / run, zygote=zygote).run()
        assert launch.exit_codes == [0, 0]
    parents = {int((tmp_path / run / f"rank{r}.0.log").read_text())
               for run in ("first", "second") for r in (0, 1)}
    assert parents == {zygote.proc.pid}
    assert zygote.proc.poll() is None            # the caller's to end, not a launcher's


def test_only_this_python_running_a_script_or_a_module_starts_warm(monkeypatch):
    monkeypatch.setenv("KEMPNER_RESILIENCE_WARM", "1")
    assert warm_command([sys.executable, "train.py", "--lr", "1"])
    assert warm_command([sys.executable, "-m", "pkg.train"])
    assert not warm_command([sys.executable, "-u", "train.py"])      # a flag of its own
    assert not warm_command(["bash", "train.sh"])
    monkeypatch.setenv("KEMPNER_RESILIENCE_WARM", "0")
    assert not warm_command([sys.executable, "train.py"])            # opt-in


@pytest.mark.slow
def test_a_rank_killed_and_relaunched_warm_ends_bitwise_equal_to_the_same_job_started_cold(
        tmp_path, monkeypatch):
    ends = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("KEMPNER_RESILIENCE_WARM", mode)
        launches, weights = run_rescue_job(tmp_path / f"warm{mode}", "--kill-at", "1:7",
                                           steps=12, every=4, ranks=2)
        assert [l.exit_codes for l in launches] == [[ExitCode.PEER_LOST, -signal.SIGKILL],
                                                    [0, 0]]
        ends[mode] = weights
    assert_bitwise_equal(ends["0"], ends["1"])


def test_a_warm_rank_runs_torch_with_the_thread_count_its_own_environment_names(tmp_path):
    # A cold start reads OMP_NUM_THREADS at `import torch`; the zygote imported torch with the
    # launch's environment, so the rank's own count must still reach torch.
    import json

    script = write_script(tmp_path, "import json, torch\n"
                                    "print(json.dumps(torch.get_num_threads()))\n", "t.py")
    z = Zygote({**os.environ, "OMP_NUM_THREADS": "2"})
    try:
        out = tmp_path / "out"
        p = z.spawn([sys.executable, str(script)], {**os.environ, "OMP_NUM_THREADS": "1"},
                    str(tmp_path), str(out), str(out))
        assert p.wait(timeout=60) == 0, out.read_text()
        assert json.loads(out.read_text().strip().splitlines()[-1]) == 1
    finally:
        z.close()
