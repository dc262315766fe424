"""What a user reads on stderr and stdout: the real programs run, their output captured, and the
lines asserted as the user sees them (issue 31, item 4).

A survivor of a peer's death says what README.md shows; the lines of a launcher or an agent
are not labelled ``[rank 0]``; gloo's C++ text is not embedded in ours; a dead hang monitor is
reported once; ``ls`` into a pipe whose reader left ends quietly; plain torchrun users are
pointed to ``kempner-resilience torchrun``; ``report`` takes a work directory as ``ls`` does.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, RESCUE_JOB, buddy_ring_of_two, env, run_script, write_script
from kempner_resilience.exitcodes import ExitCode

CLI = [sys.executable, "-m", "kempner_resilience.cli"]
# One of our log lines: "HH:MM:SS LEVEL kempner_resilience.module [label] message".
OURS = re.compile(r"^\d\d:\d\d:\d\d (\w+) kempner_resilience\.\S+ \[([^\]]+)\] (.*)$")


def our_lines(text: str, levels: tuple[str, ...] = ("INFO", "WARNING", "ERROR")
              ) -> list[tuple[str, str]]:
    """(label, message) of each of our lines at ``levels``; torch's own output left out."""
    out = []
    for line in text.splitlines():
        m = OURS.match(line)
        if m and m.group(1) in levels:
            out.append((m.group(2), m.group(3)))
    return out


# --------------------------------------------------------------- a survivor of a peer's death

FAIL_AT = 25
# The survivor's lines README.md shows, each as the pattern its message matches.
SURVIVOR_LINES = (
    r"rescue: (rank \d+'s link closed without a goodbye \(the rank is gone\)|a rescue started "
    r"\(passed on by rank \d+\)|this rank: peer lost); offering this rank's step state",
    rf"a peer rank is gone \(gloo: [^()]+\); leaving at step {FAIL_AT}",
    rf"rescue: (rank \d+ )?committed step {FAIL_AT} at \S+(, .*)?",
    r"exiting with PEER_LOST \(81\): .*",
)

# README.md: the writer also says when a snapshot is more than a second late (a loaded machine).
WRITER_WAITS = rf"rescue: waiting up to \d+ s for the state of step {FAIL_AT} from .*"


@pytest.fixture(scope="module")
def survivors(tmp_path_factory) -> tuple[list[int], dict[int, str]]:
    """4 DDP ranks over gloo, rank 3 SIGKILLed in step 25 with the rescue on: the exit codes
    and each survivor's stderr."""
    from kempner_resilience.demo.launcher import LocalLauncher

    work = tmp_path_factory.mktemp("survivors")
    cmd = [sys.executable, str(RESCUE_JOB), "--steps", "30", "--out", str(work / "w.pt"),
           "--set", f"checkpoint.dir={work / 'ckpt'}", "--set", "checkpoint.every_steps=10",
           "--set", "rescue.budget_s=20", "--set", "watchdog.hang_timeout_s=60",
           "--kill-at", f"3:{FAIL_AT}"]
    launch, = LocalLauncher(cmd, ranks=4, workdir=work, max_launches=1,
                            relaunch_codes=set(), stop_timeout_s=90).run()
    return launch.exit_codes, {r: (work / f"rank{r}.0.log").read_text() for r in range(3)}


@pytest.mark.slow
def test_a_survivor_of_a_killed_peer_prints_the_lines_readme_shows_and_no_more(survivors):
    codes, logs = survivors
    assert codes == [ExitCode.PEER_LOST] * 3 + [-signal.SIGKILL]
    for rank, text in logs.items():
        said = [msg for _, msg in our_lines(text, ("WARNING", "ERROR"))
                if not re.fullmatch(WRITER_WAITS, msg)]
        assert len(said) == len(SURVIVOR_LINES), (rank, said)
        for pattern in SURVIVOR_LINES:
            assert sum(bool(re.fullmatch(pattern, m)) for m in said) == 1, (rank, pattern, said)
        assert re.fullmatch(SURVIVOR_LINES[-1], said[-1]), "the exit line comes last"


def test_readme_shows_the_survivors_lines_as_they_are_printed():
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("```\nrescue: "):].split("```")[1].strip().splitlines()
    assert len(block) == len(SURVIVOR_LINES)
    shown = [re.sub(r"step \d+", f"step {FAIL_AT}", line).replace("...", "x") for line in block]
    for line, pattern in zip(shown, SURVIVOR_LINES):
        assert re.fullmatch(pattern, line), (line, pattern)


@pytest.mark.slow
def test_a_survivor_never_says_a_later_rescue_will_lack_its_state_after_a_rescue(survivors):
    _, logs = survivors
    for text in logs.values():
        assert "will lack its per-rank state" not in text


@pytest.mark.slow
def test_gloos_message_is_not_embedded_in_the_lost_peer_line(survivors):
    _, logs = survivors
    for text in logs.values():
        lost = [m for _, m in our_lines(text, ("ERROR",)) if m.startswith("a peer rank is gone")]
        assert len(lost) == 1
        assert ".cc:" not in lost[0] and "GLHF" not in lost[0] and "typically" not in lost[0]


def _link_lost(a, b, caplog) -> None:
    """Rank 1 gone without a goodbye; rank 0 passes the rescue's wake on until its send fails."""
    import time

    caplog.set_level("WARNING", logger="kempner_resilience")
    b.close(clean=False)
    end = time.monotonic() + 30
    while a._out is not None and time.monotonic() < end:   # noqa: SLF001 - the link's state
        a.wake()
        time.sleep(0.01)
    assert a._out is None, "the send to the gone buddy never failed"   # noqa: SLF001


LACKS = "will lack its per-rank state"


def test_a_link_lost_with_its_buddy_says_nothing_while_the_rescue_runs(caplog):
    woken: list[str] = []
    a, b = buddy_ring_of_two(woken)
    try:
        _link_lost(a, b, caplog)
        assert woken, "the gone buddy woke the rescue"
        assert not [r for r in caplog.records if LACKS in r.getMessage()]
    finally:
        a.close(clean=False)


def test_a_rank_that_trains_on_without_its_link_is_told_once(caplog):
    a, b = buddy_ring_of_two([])
    try:
        _link_lost(a, b, caplog)
        for step in range(20):              # the next boundaries' snapshots
            a.send(step, b"s" * 1024)
        assert len([r for r in caplog.records if LACKS in r.getMessage()]) == 1
    finally:
        a.close(clean=False)


# ------------------------------------------------------------------ launchers and agents

def test_the_launchers_lines_are_not_labelled_rank_0_even_with_rank_in_its_environment(
        tmp_path):
    # As under srun or in a batch shell: RANK/SLURM_PROCID set for the launcher itself.
    proc = subprocess.run(
        [*CLI, "launch", "--ranks", "2", "--max-restarts", "1", "--",
         sys.executable, "-c", f"raise SystemExit({int(ExitCode.REQUEUE)})"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env=env(RANK="0", SLURM_PROCID="0"))
    # Its budget spent, the launcher ends the job with the budget's code, not "run it again".
    assert proc.returncode == ExitCode.NO_REQUEUE, proc.stderr
    labels = {label for label, _ in our_lines(proc.stderr)}
    assert labels == {"launcher"}, proc.stderr


# A worker without a process group: it only has to start a run.
WORKER = """
import kempner_resilience as kr
from kempner_resilience.core.log import configure

configure("INFO")
with kr.ResilientRun(kr.load_config(None, ["watchdog.hang_timeout_s=0"])) as run:
    for step in run.steps(3):
        pass
"""
HINT = "kempner-resilience torchrun"


def _torchrun(launcher: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    script = write_script(tmp_path, WORKER)
    return subprocess.run([*launcher, "--standalone", "--nproc-per-node=1", str(script)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=env(SLURM_PROCID="0"), stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def under_our_agent(tmp_path_factory) -> subprocess.CompletedProcess:
    return _torchrun([*CLI, "torchrun"], tmp_path_factory.mktemp("agent"))


@pytest.mark.slow
def test_the_agents_lines_are_labelled_agent_not_rank_0(under_our_agent):
    # The agent ran with SLURM_PROCID=0 in its environment, as srun's first task does.
    proc = under_our_agent
    assert proc.returncode == 0, proc.stderr
    agent = re.findall(r" kempner_resilience\.supervise\.torchrun\S* \[([^\]]+)\]",
                       proc.stderr)
    assert len(agent) >= 2 and set(agent) == {"agent"}, proc.stderr


@pytest.mark.slow
def test_plain_torchrun_users_are_told_once_on_rank_0_to_use_kempner_resilience_torchrun(
        tmp_path):
    proc = _torchrun([sys.executable, "-m", "torch.distributed.run"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    hints = [(label, m) for label, m in our_lines(proc.stderr) if HINT in m]
    assert len(hints) == 1 and hints[0][0] == "rank 0", proc.stderr
    assert "plain torchrun" in hints[0][1] and "ChildFailedError" in hints[0][1]


@pytest.mark.slow
def test_workers_of_kempner_resilience_torchrun_get_no_plain_torchrun_hint(under_our_agent):
    assert under_our_agent.returncode == 0, under_our_agent.stderr
    assert not [m for _, m in our_lines(under_our_agent.stderr) if "plain torchrun" in m]


# ------------------------------------------------------------------------ the hang monitor

KILL_THE_MONITOR = """
import os, signal, sys
from pathlib import Path
import torch
import kempner_resilience as kr
from kempner_resilience.core.log import configure


def monitors():
    # The hang backstop's monitor: our child started as `python -I -S -c ...`.
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().split(b"\\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and argv[1:4] == [b"-I", b"-S", b"-c"]:
            found.append(int(stat.parent.name))
    return found


configure("INFO")
cfg = kr.load_config(None, [f"checkpoint.dir={sys.argv[1]}", "checkpoint.every_steps=1"])
with kr.ResilientRun(cfg, state={"model": torch.nn.Linear(2, 2)}) as run:
    for step in run.steps(20):
        if step == 1:
            pids = monitors()
            assert len(pids) == 1, pids
            os.kill(pids[0], signal.SIGKILL)
"""


def test_a_dead_hang_monitor_is_reported_once_not_after_every_save(tmp_path):
    script = write_script(tmp_path, KILL_THE_MONITOR)
    (tmp_path / "ckpt").mkdir()
    proc = run_script([sys.executable, str(script), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=180, env=env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("checkpoint step") >= 18, "the saves after its death happened"
    said = [m for _, m in our_lines(proc.stderr, ("WARNING", "ERROR")) if "monitor" in m]
    assert len(said) == 1, proc.stderr
    assert "gone" in said[0]


# --------------------------------------------------------------------- ls and report

@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    """A work directory holding one run's checkpoint.dir two levels down (work/run1/ckpt)."""
    work = tmp_path_factory.mktemp("work")
    (work / "run1").mkdir()
    proc = run_script([sys.executable, "-m", "kempner_resilience.demo.train", "--steps", "6",
                           "--quiet", "--set", f"checkpoint.dir={work / 'run1' / 'ckpt'}",
                           "--set", "checkpoint.every_steps=2"],
                          capture_output=True, text=True, timeout=300, env=env())
    assert proc.returncode == 0, proc.stderr
    return work


def test_ls_into_a_pipe_whose_reader_left_ends_with_141_and_no_traceback(work_dir):
    # `kempner-resilience ls DIR | head -1`, with head gone before ls writes (deterministic).
    proc = subprocess.Popen([*CLI, "ls", str(work_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env())
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE
    assert err == ""


def test_report_accepts_the_work_directory_as_ls_does(work_dir):
    def run(target: Path) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, "report", str(target)], capture_output=True, text=True,
                              timeout=120, env=env())

    from_work, from_ckpt = run(work_dir), run(work_dir / "run1" / "ckpt")
    assert from_work.returncode == 0, from_work.stderr
    assert from_work.stdout == from_ckpt.stdout and "1 attempt(s)" in from_work.stdout
    ls = subprocess.run([*CLI, "ls", str(work_dir)], capture_output=True, text=True, timeout=120,
                        env=env())
    assert ls.returncode == 0 and str(work_dir / "run1" / "ckpt") in ls.stdout


def test_report_on_a_work_directory_with_two_runs_names_both_and_exits_2(work_dir, tmp_path):
    import shutil

    for name in ("a", "b"):
        shutil.copytree(work_dir / "run1", tmp_path / name)
    proc = subprocess.run([*CLI, "report", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=env())
    assert proc.returncode == 2
    assert str(tmp_path / "a" / "ckpt") in proc.stderr and str(tmp_path / "b" / "ckpt") \
        in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_survivor_prints_no_cxx_stack_trace_from_the_store_rank_0_took_along(survivors):
    # Rank 0 hosts the store and leaves once its own shutdown is done; a survivor that read the
    # store after that got torch's "recvValue failed" warning with some 20 lines of C++ frames.
    _, logs = survivors
    for rank, text in logs.items():
        assert "TCPStore.cpp" not in text and "frame #" not in text, (rank, text[-2000:])
