"""The run ledger and the goodput report, on ledgers written by real runs.

Real processes, real signals: a job interrupted twice by SIGUSR1 through the local launcher
(as SLURM's --signal would), a rank 0 killed with SIGKILL while it writes the ledger.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import env, require, run_script, spawn_script, write_script
from kempner_resilience.cli import main as cli_main
from kempner_resilience.demo.launcher import LocalLauncher, train_command
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.goodput import PARTS, analyze_dir
from kempner_resilience.core.ledger import Ledger, read_ledger

STEPS = 30


@pytest.fixture(scope="module")
def twice_interrupted(tmp_path_factory):
    """A 1-rank job stopped by SIGUSR1 at step 8 and at step 18, resumed each time."""
    work = tmp_path_factory.mktemp("twice")
    cmd = train_command(STEPS, step_time=0.03, out=work / "w.pt",
                        overrides=[f"checkpoint.dir={work / 'ckpt'}", "signals.grace_s=60",
                                   "checkpoint.every_steps=5", "watchdog.hang_timeout_s=120"])
    launches = LocalLauncher(cmd, ranks=1, workdir=work, interrupts={8: "SIGUSR1",
                                                                     18: "SIGUSR1"},
                             max_launches=5).run()
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, ExitCode.REQUEUE, 0]
    return work, launches


def test_goodput_parts_add_up_to_the_wall_time_of_a_twice_interrupted_run(twice_interrupted):
    work, launches = twice_interrupted
    g = analyze_dir(work / "ckpt")
    assert len(g.attempts) == 3
    total = sum(g.parts[p] for p in (*PARTS, "queue"))
    assert abs(total - g.wall_s) < 1.0
    assert [a.exit_code for a in g.attempts] == [ExitCode.REQUEUE, ExitCode.REQUEUE, 0]
    assert sum(a.kept_steps for a in g.attempts) == STEPS
    assert [a.start_step for a in g.attempts] == [0] + [l.report["resumed_from"]
                                                       for l in launches[1:]]
    assert 0 < g.goodput < 1 and g.parts["lost"] == 0    # emergency saves lose no step
    assert g.parts["save_blocking"] > 0 and g.parts["load"] > 0 and g.parts["shutdown"] > 0


def test_ledger_records_each_attempt_its_stop_and_its_exit(twice_interrupted):
    work, launches = twice_interrupted
    events = read_ledger(work / "ckpt" / "ledger.jsonl")
    kinds = [e["ev"] for e in events]
    assert kinds.count("start") == 3 and kinds.count("exit") == 3
    assert kinds.count("resume") == 2 and kinds.count("requeue") == 2
    stops = [e for e in events if e["ev"] == "stop"]
    assert [s["signal"] for s in stops] == ["SIGUSR1", "SIGUSR1"]
    assert [s["step"] for s in stops] == [l.report["stop_step"] for l in launches[:2]]
    assert all(s["signal_t"] for s in stops)
    saves = [e for e in events if e["ev"] == "save"]
    assert saves and all(s["bytes"] > 0 and s["blocking_s"] > 0 for s in saves)
    assert [e["restart_count"] for e in events if e["ev"] == "start"] == [0, 1, 2]


def test_each_stopped_attempts_exit_accounts_for_its_shutdown_step_by_step(twice_interrupted):
    work, launches = twice_interrupted
    events = read_ledger(work / "ckpt" / "ledger.jsonl")
    stopped = [e for e in events if e["ev"] == "exit" and e["ending"] == "signal"]
    assert len(stopped) == 2
    for ex, launch in zip(stopped, launches):
        steps = [ex[k] for k in ("agree_s", "save_s", "requeue_s", "teardown_s")]
        # Signal → this event holds every step, and the run report has the same figures.
        assert sum(steps) <= ex["shutdown_s"], ex
        assert ex["signal_t"] < ex["t"] and ex["leave"] == "exit"
        assert launch.report["timings"]["emergency_save_s"] == pytest.approx(ex["save_s"],
                                                                              abs=1e-3)


def test_one_run_id_across_requeues_in_ledger_manifests_and_markers(twice_interrupted):
    work, _ = twice_interrupted
    ckpt = work / "ckpt"
    run_id = json.loads((ckpt / "run.json").read_text())["run_id"]
    assert {e["run_id"] for e in read_ledger(ckpt / "ledger.jsonl")} == {run_id}
    steps = sorted(ckpt.glob("step_*"))
    assert steps
    for d in steps:
        assert json.loads((d / "MANIFEST.json").read_text())["run_id"] == run_id
        assert json.loads((d / "OWNER.json").read_text())["run_id"] == run_id


def test_report_prints_one_row_per_attempt_and_the_goodput(twice_interrupted, capsys):
    work, _ = twice_interrupted
    assert cli_main(["report", str(work / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "3 attempt(s)" in out and "goodput" in out
    assert out.count("SIGUSR1@") == 2
    assert cli_main(["report", "--json", str(work / "ckpt")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["attempts"]) == 3
    assert abs(sum(data["parts_s"].values()) - data["wall_s"]) < 1.0


def test_report_plot_draws_the_attempts_timeline_into_a_png(twice_interrupted, tmp_path,
                                                            capsys):
    require("matplotlib")
    from matplotlib.image import imread

    work, _ = twice_interrupted
    png = tmp_path / "timeline.png"
    assert cli_main(["report", str(work / "ckpt"), "--plot", str(png)]) == 0
    assert "3 attempt(s)" in capsys.readouterr().out       # the report is printed as well
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(png)[..., :3]
    kept = np.array([0x59, 0xA1, 0x4F]) / 255               # the bars of the steps kept
    assert (np.abs(pixels - kept).max(axis=-1) < 0.01).sum() > 1000


def test_report_plot_without_matplotlib_says_how_to_install_it_and_exits_2(twice_interrupted,
                                                                           tmp_path):
    work, _ = twice_interrupted
    shim = tmp_path / "shim"       # first on the path: `import matplotlib` fails as if absent
    shim.mkdir()
    (shim / "matplotlib.py").write_text("raise ImportError('No module named matplotlib')\n")
    png = tmp_path / "timeline.png"
    proc = run_script([sys.executable, "-m", "kempner_resilience.cli", "report",
                           str(work / "ckpt"), "--plot", str(png)], capture_output=True,
                          text=True, timeout=120,
                          env=env(PYTHONPATH=os.pathsep.join([str(shim), *sys.path])))
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'kempner_resilience[plot]'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "" and not png.exists()


def test_the_goodput_page_shows_the_report_and_plot_of_its_committed_ledger(capsys):
    docs = Path(__file__).resolve().parents[1] / "docs"
    assert cli_main(["report", str(docs / "goodput-ledger.jsonl")]) == 0
    out = capsys.readouterr().out.splitlines()
    page = (docs / "goodput.md").read_text()
    # The run line and the goodput breakdown (the table's start times are in local time).
    shown = [out[0]] + out[out.index("", 2) + 1:]
    assert all(line in page for line in shown), shown
    assert "](goodput-timeline.png)" in page and (docs / "goodput-timeline.png").exists()


WRITER = """
import sys
from kempner_resilience.core.ledger import Ledger
ledger = Ledger(sys.argv[1], run_id="r", max_bytes=1 << 40)
blob = "x" * (4 << 20)      # 4 MiB lines: a write the kernel can cut short at a SIGKILL
ledger.event("start", t0=0.0, restart_count=0)
ledger.event("loop", step=0)
print("ready", flush=True)
i = 0
while True:
    i += 1
    ledger.event("save", step=i, reason="periodic", blocking_s=0.01, bytes=1, note=blob)
"""


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


def test_sigkill_of_rank_0_while_it_writes_the_ledger_leaves_a_ledger_report_reads(tmp_path):
    path = tmp_path / "ledger.jsonl"
    script = write_script(tmp_path, WRITER)
    proc = spawn_script([sys.executable, str(script), str(path)], stdout=subprocess.PIPE,
                            text=True, env=env())
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    lines = path.read_bytes().split(b"\n")
    torn = [i for i, line in enumerate(lines) if line and not _parses(line)]
    assert torn in ([], [len(lines) - 1]), "at most the last line may be torn"
    events = read_ledger(path)
    assert [e["ev"] for e in events[:2]] == ["start", "loop"] and len(events) > 2
    assert all(e["ev"] == "save" and len(e["note"]) == 4 << 20 for e in events[2:])
    # The next attempt appends after whatever the kill left, on a line of its own.
    Ledger(path, run_id="r", attempt=1).event("start", t0=time.time(), restart_count=1)
    events = read_ledger(path)
    assert events[-1]["ev"] == "start" and events[-1]["attempt"] == 1
    assert cli_main(["report", str(path)]) == 0
    assert len(analyze_dir(path).attempts) == 2


def test_a_torn_last_line_is_skipped_and_the_next_event_starts_a_fresh_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path, run_id="r")
    ledger.event("start", t0=time.time(), restart_count=0)
    ledger.event("exit", code=0, step=3)
    ledger.close()
    with open(path, "ab") as f:       # what a write cut short by a SIGKILL leaves
        f.write(b'{"ev":"save","t":1,"step"')
    assert [e["ev"] for e in read_ledger(path)] == ["start", "exit"]
    Ledger(path, run_id="r", attempt=1).event("start", t0=time.time(), restart_count=1)
    assert [e["ev"] for e in read_ledger(path)] == ["start", "exit", "start"]


def test_ledger_stays_under_its_size_bound_keeping_old_attempts_saves_as_summaries(tmp_path):
    path = tmp_path / "ledger.jsonl"
    for attempt in range(3):
        ledger = Ledger(path, run_id="r", attempt=attempt, max_bytes=20_000)
        ledger.event("start", t0=time.time(), restart_count=attempt)
        for step in range(200):
            ledger.event("save", step=step, reason="periodic", blocking_s=0.5, bytes=10)
        ledger.event("exit", code=75, step=199)
        ledger.close()
        assert path.stat().st_size <= 20_000
    g = analyze_dir(path)
    assert [a.exit_code for a in g.attempts] == [75, 75, 75]
    assert [a.saves for a in g.attempts] == [200, 200, 200], "saves are folded, not lost"


def test_report_on_a_directory_without_a_ledger_says_so_and_exits_1(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no run ledger here" in err and "Traceback" not in err


@pytest.mark.parametrize("async_", [False, True])
def test_periodic_saves_are_recorded_with_their_blocking_time_and_size(tmp_path, async_):
    import torch.nn as nn

    import kempner_resilience as kr

    cfg = kr.load_config(overrides=(f"checkpoint.dir={tmp_path}", "checkpoint.every_steps=2",
                                    f"checkpoint.async={str(async_).lower()}"))
    with kr.ResilientRun(cfg, state={"model": nn.Linear(64, 64)}, exit_mode="raise") as run:
        for _ in run.steps(6):
            time.sleep(0.05)       # room for a background save to commit before the next one
    saves = [e for e in read_ledger(tmp_path / "ledger.jsonl") if e["ev"] in ("save", "saves")]
    assert saves and {s["step"] for s in saves} <= {2, 4, 6}
    assert all(s["bytes"] > 64 * 64 * 4 and s["blocking_s"] >= 0 for s in saves)
    assert len(saves) >= (1 if async_ else 3)


def test_checkpoint_ledger_false_writes_no_ledger(tmp_path):
    import torch.nn as nn

    import kempner_resilience as kr

    cfg = kr.load_config(overrides=(f"checkpoint.dir={tmp_path}", "checkpoint.every_steps=2",
                                    "checkpoint.ledger=false"))
    with kr.ResilientRun(cfg, state={"model": nn.Linear(4, 4)}, exit_mode="raise") as run:
        for _ in run.steps(4):
            pass
    assert not (tmp_path / "ledger.jsonl").exists() and (tmp_path / "run.json").exists()


def test_a_worker_of_the_torchrun_agent_counts_its_attempt_from_the_agents_start():
    # The agent's imports and rendezvous are the attempt's time: without this, `report` counted
    # them as queue time. A group torch elastic restarts starts with its own processes, and the
    # job's start under SLURM comes first of all.
    from kempner_resilience.core.ledger import AGENT_START_ENV, attempt_start, process_start_time

    own = process_start_time()
    agent = own - 30.0
    assert attempt_start({AGENT_START_ENV: repr(agent)}) == agent
    assert attempt_start({AGENT_START_ENV: repr(agent), "TORCHELASTIC_RESTART_COUNT": "0"}) == agent
    assert abs(attempt_start({AGENT_START_ENV: repr(agent),
                              "TORCHELASTIC_RESTART_COUNT": "1"}) - own) < 1.0
    assert attempt_start({AGENT_START_ENV: repr(agent),
                          "SLURM_JOB_START_TIME": str(int(own - 100))}) == int(own - 100)
    assert abs(attempt_start({AGENT_START_ENV: "soon"}) - own) < 1.0
