"""Start-up: a run that cannot start exits 78 with the fix; a signal during imports is not fatal.

Every test runs a real script in a real process (real signals by os.kill, real gloo ranks, a real
read-only mount) and checks what a batch job's owner sees: the exit code and stderr.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, env, free_port, start, write_script
from kempner_resilience.exitcodes import ExitCode

# The script a user submits: the configuration is read by load_config or by ResilientRun itself,
# and checkpoint.dir is checked when the run is entered.
TRAIN = """
import sys
import kempner_resilience as kr

path, entry = sys.argv[1], sys.argv[2]
if entry == "load_config":
    cfg = kr.load_config(path)
else:
    import torch
    with kr.ResilientRun(path, state={"model": torch.nn.Linear(2, 2)}) as run:
        for step in run.steps(1):
            pass
print("the run started", flush=True)
"""

# name: (YAML text, entry point, words stderr must hold); {file} stands for an existing file.
BAD_CONFIGS = {
    "malformed YAML": ("checkpoint:\n  every_steps: [4\n", "load_config",
                       ["not valid YAML at line 3"]),
    "malformed YAML read by ResilientRun": ("checkpoint:\n  every_steps: [4\n", "ResilientRun",
                                            ["not valid YAML at line 3"]),
    "unknown key": ("checkpoint:\n  every_step: 4\n", "load_config",
                    ["checkpoint.every_step", "did you mean 'every_steps'"]),
    "wrong type": ("checkpoint:\n  every_steps: four\n", "load_config",
                   ["checkpoint.every_steps", "expected an integer"]),
    "negative cadence": ("checkpoint:\n  every_minutes: -5\n", "load_config",
                         ["checkpoint.every_minutes", "must be >= 0"]),
    "zero keep_last": ("checkpoint:\n  keep_last: 0\n", "load_config",
                       ["checkpoint.keep_last", "must be >= 1"]),
    "zero grace": ("signals:\n  grace_s: 0\n", "ResilientRun", ["signals.grace_s", "must be > 0"]),
    "bad signal action": ("signals:\n  actions:\n    SIGUSR1: reboot\n", "load_config",
                          ["signals.actions.SIGUSR1", "requeue, stop, off"]),
    "unknown signal": ("signals:\n  actions:\n    SIGFOO: stop\n", "load_config",
                       ["signals.actions.SIGFOO", "not a signal name"]),
    # NaN passed validation, then the first SIGUSR1 raised in the handler: exit 43, no checkpoint
    "NaN grace": ("signals:\n  grace_s: .nan\n", "ResilientRun",
                  ["signals.grace_s", "nan is not a finite number", "> 0 and <= 86400 seconds"]),
    "a type error and range errors": ("checkpoint:\n  every_steps: four\n  keep_last: 0\n"
                                      "  io_threads: 1000000000000\n", "load_config",
                                      ["checkpoint.every_steps", "checkpoint.keep_last",
                                       "checkpoint.io_threads", "must be >= 1 and <= 256"]),
    "checkpoint dir is a file": ("checkpoint:\n  dir: {file}\n", "ResilientRun",
                                 ["checkpoint.dir", "is not a directory", "choose another"]),
}


def run_train(tmp_path: Path, config_text: str | None, entry: str) -> subprocess.CompletedProcess:
    (tmp_path / "a_file").write_text("not a directory")
    config = tmp_path / "bad.yaml"
    if config_text is not None:
        config.write_text(config_text.replace("{file}", str(tmp_path / "a_file")))
    return subprocess.run([sys.executable, str(write_script(tmp_path, TRAIN)), str(config), entry],
                          capture_output=True, text=True, timeout=120, env=env(), cwd=tmp_path)


def assert_exits_78_with_the_message(proc: subprocess.CompletedProcess, words: list[str]) -> None:
    assert proc.returncode == ExitCode.CONFIG, proc.stderr
    assert "the run started" not in proc.stdout
    assert "Traceback" not in proc.stderr
    for w in words:
        assert w in proc.stderr
    assert "exiting with 78 (CONFIG)" in proc.stderr
    assert "\n\n" not in proc.stderr.strip()  # one paragraph


@pytest.mark.parametrize("name", BAD_CONFIGS)
def test_a_script_with_a_bad_configuration_exits_78_with_the_fix_and_no_traceback(tmp_path, name):
    text, entry, words = BAD_CONFIGS[name]
    assert_exits_78_with_the_message(run_train(tmp_path, text, entry), words)


def test_a_missing_config_file_exits_78(tmp_path):
    proc = run_train(tmp_path, None, "ResilientRun")
    assert_exits_78_with_the_message(proc, ["config file not found", "bad.yaml"])


def test_an_unwritable_checkpoint_dir_exits_78_when_the_run_is_entered(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({mounted.stderr.strip()})")
    try:
        proc = run_train(tmp_path, f"checkpoint:\n  dir: {ro}\n", "ResilientRun")
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
    assert_exits_78_with_the_message(proc, [f"checkpoint.dir {ro} is not writable",
                                            "choose another checkpoint.dir"])


TWO_RANKS = """
import os, sys
import kempner_resilience as kr
import torch, torch.distributed as dist

rank, port, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
cfg = kr.load_config(overrides=[f"checkpoint.dir={ckpt}", "watchdog.hang_timeout_s=0"])
with kr.ResilientRun(cfg, state={"model": torch.nn.Linear(2, 2)}) as run:
    for step in run.steps(1):
        pass
print("the run started", flush=True)
"""


def test_every_rank_exits_78_when_the_checkpoint_dir_is_a_file(tmp_path):
    script, port, not_a_dir = write_script(tmp_path, TWO_RANKS), str(free_port()), tmp_path / "f"
    not_a_dir.write_text("")
    procs = [start(script, str(rank), port, str(not_a_dir)) for rank in (0, 1)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == ExitCode.CONFIG, err
        assert "Traceback" not in err and "the run started" not in out
        assert "is not a directory" in err


CATCHES = """
import kempner_resilience as kr
from kempner_resilience.checkpoint import CheckpointDirError

try:
    kr.load_config("bad.yaml")
except kr.ConfigError as e:
    print("caught ConfigError:", e.problems[0][0], flush=True)
try:
    with kr.ResilientRun(kr.load_config(overrides=["checkpoint.dir=a_file"]),
                         state={"model": __import__("torch").nn.Linear(2, 2)}):
        pass
except CheckpointDirError as e:
    print("caught CheckpointDirError", isinstance(e, kr.StartupError), flush=True)
print("carried on", flush=True)
"""


def test_a_caller_that_catches_the_start_up_error_gets_the_exception_and_carries_on(tmp_path):
    # What a notebook cell or a `try` around the set-up sees: the exception, no forced exit.
    (tmp_path / "bad.yaml").write_text("checkpoint:\n  keep_last: 0\n")
    (tmp_path / "a_file").write_text("")
    proc = subprocess.run([sys.executable, str(write_script(tmp_path, CATCHES))],
                          capture_output=True, text=True, timeout=120, env=env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["caught ConfigError: checkpoint.keep_last",
                                        "caught CheckpointDirError True", "carried on"]


def test_other_uncaught_errors_keep_their_traceback_and_exit_code(tmp_path):
    script = write_script(tmp_path, "import kempner_resilience\nraise KeyError('user bug')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=env())
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "KeyError: 'user bug'" in proc.stderr


def test_python_dash_i_keeps_the_traceback_for_the_session(tmp_path):
    (tmp_path / "bad.yaml").write_text("checkpoint:\n  keep_last: 0\n")
    script = write_script(tmp_path, "import kempner_resilience as kr\nkr.load_config('bad.yaml')\n")
    proc = subprocess.run([sys.executable, "-i", str(script)], input="", capture_output=True,
                          text=True, timeout=60, env=env(), cwd=tmp_path)
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr
    assert proc.returncode != ExitCode.CONFIG


# ------------------------------------------------------------------- a signal during start-up

# Delivers a real SIGUSR1 to the process at the exact moment `module` begins to import.
SIGNAL_AT_IMPORT = """
import os, signal, sys

class SignalAtImport:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            print("SIGUSR1 sent while importing", name, flush=True)
            os.kill(os.getpid(), signal.SIGUSR1)
        return None

sys.meta_path.insert(0, SignalAtImport())
"""

RUN_WITHOUT_STATE = """
cfg = kr.load_config(overrides=["watchdog.hang_timeout_s=0", "requeue.enabled=false"])
with kr.ResilientRun(cfg) as run:
    for step in run.steps(100):
        print("step", step, flush=True)
"""


def run_under_slurm(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    e = env(SLURM_JOB_ID="999999999")  # as inside a SLURM job (one that does not exist)
    e.pop("SLURM_PROCID", None)
    return subprocess.run([sys.executable, str(write_script(tmp_path, body))],
                          capture_output=True, text=True, timeout=120, env=e)


def assert_stopped_by_the_early_signal(proc: subprocess.CompletedProcess, module: str) -> None:
    assert proc.returncode != -10, "killed by SIGUSR1 during start-up"
    assert f"SIGUSR1 sent while importing {module}" in proc.stdout
    assert "step 0" not in proc.stdout  # stopped at the very first boundary
    assert "before the run started" in proc.stderr
    # requeue.enabled is off (the job id is made up): the run stops without requeueing.
    assert proc.returncode == ExitCode.STOPPED, proc.stderr


def test_a_signal_while_the_package_imports_its_dependencies_is_recorded(tmp_path):
    # kempner_resilience is the first import; the signal lands while it loads PyYAML.
    body = SIGNAL_AT_IMPORT.format(module="yaml") + "import kempner_resilience as kr\n"
    assert_stopped_by_the_early_signal(run_under_slurm(tmp_path, body + RUN_WITHOUT_STATE),
                                       "yaml")


def quickstart_imports() -> str:
    """The import lines that open the quickstart's training script, as written."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    lines = []
    for line in block.splitlines():
        if not line.startswith(("import ", "from ")):
            break
        lines.append(line)
    assert any("import kempner_resilience as kr" in line for line in lines)
    return "\n".join(lines) + "\n"


def test_a_signal_during_import_torch_in_the_quickstart_script_is_handled_as_a_stop(tmp_path):
    # The quickstart's imports (kempner_resilience first), then a run without state; the signal
    # lands in the middle of `import torch`, while torch loads its C extension.
    body = SIGNAL_AT_IMPORT.format(module="torch._C") + quickstart_imports()
    assert_stopped_by_the_early_signal(run_under_slurm(tmp_path, body + RUN_WITHOUT_STATE),
                                       "torch._C")


def import_order_violations(name: str, code: str) -> list[str]:
    """``name`` imports torch at top level before it imports kempner_resilience."""
    first: dict[str, int] = {}
    for i, line in enumerate(code.splitlines()):
        m = re.match(r"(?:import|from)\s+(torch|kempner_resilience)\b", line)
        if m:
            first.setdefault(m.group(1), i)
    if "torch" in first and first.get("kempner_resilience", 1 << 30) > first["torch"]:
        return [name]
    return []


def test_every_example_imports_kempner_resilience_before_torch():
    # A SIGUSR1 that arrives while torch imports kills a process that has not yet imported
    # kempner_resilience (exit -10), so every script users copy puts our import first.
    bad: list[str] = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)):
            if "kempner_resilience" not in block:    # a script before adoption (quickstart)
                continue
            bad += import_order_violations(f"{doc.name} python block {i + 1}", block)
    nb = json.loads((REPO / "docs" / "submitit.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    bad += import_order_violations("submitit.ipynb", "\n".join(cells))
    for py in sorted((REPO / "kempner_resilience" / "demo").glob("*.py")):
        bad += import_order_violations(str(py.relative_to(REPO)), py.read_text())
    assert not bad, f"import kempner_resilience before torch in: {bad}"


def test_importing_the_package_starts_no_process(tmp_path):
    # Every rank imports it, a requeued job's ranks again: a process there (ctypes' find_library
    # runs ldconfig, then gcc) is start-up time paid by each of them. SLURM_JOB_ID set: the
    # early recorder is installed too, as in a batch job.
    script = write_script(tmp_path, """
        import subprocess
        started = []
        _popen = subprocess.Popen.__init__
        def _record(self, args, *a, **kw):
            started.append(args)
            _popen(self, args, *a, **kw)
        subprocess.Popen.__init__ = _record
        import kempner_resilience
        import kempner_resilience.checkpoint.crc, kempner_resilience.stop.ctimer
        print("processes:", started)
        """)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=env(SLURM_JOB_ID="4242"))
    assert proc.returncode == 0, proc.stderr
    assert "processes: []" in proc.stdout, proc.stdout
