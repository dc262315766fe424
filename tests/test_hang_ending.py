"""A hang is an ending like the others: the ledger's `exit` event with HANG, the run report,
and `kempner-resilience report` showing the attempt as a hang, not as a crash (killed?).

Two real hangs in a real process with checkpoints: one that holds the GIL (a C call through
ctypes.PyDLL, where no Python thread runs again and only the backstop's monitor process can
act) and one that releases it (the main thread asleep, as in a collective), where the hang
watchdog's thread records the ending itself.
"""

from __future__ import annotations

import json
import sys

import pytest

from helpers import env, run_script, write_script
from kempner_resilience.cli import main as cli_main
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.ledger import read_ledger

HANGS = """
import ctypes, sys, time
import kempner_resilience as kr

class Counter:
    def __init__(self):
        self.n = 0
    def state_dict(self):
        return {"n": self.n}
    def load_state_dict(self, sd):
        self.n = sd["n"]

ckpt, how = sys.argv[1], sys.argv[2]
cfg = kr.load_config(overrides=[f"checkpoint.dir={ckpt}", "checkpoint.every_steps=2",
                                "watchdog.hang_timeout_s=1.5"])
state = Counter()
with kr.ResilientRun(cfg, state={"counter": state}, exit_mode="exit") as run:
    for step in run.steps(10):
        state.n += 1
        if step == 4:
            if how == "gil":    # PyDLL keeps the GIL across the call: no Python runs again
                lib = ctypes.PyDLL(None)
                mutex = ctypes.create_string_buffer(64)
                lib.pthread_mutex_init(mutex, None)
                lib.pthread_mutex_lock(mutex)
                lib.pthread_mutex_lock(mutex)
            time.sleep(600)     # the GIL released, as in a collective whose peer never comes
"""


@pytest.mark.parametrize("how", ["gil", "sleep"])
def test_a_hang_leaves_an_exit_event_with_the_hang_code_and_report_shows_a_hang(
        tmp_path, capsys, how):
    script, ckpt = write_script(tmp_path, HANGS), tmp_path / "ckpt"
    report = tmp_path / "report.json"
    proc = run_script([sys.executable, str(script), str(ckpt), how], capture_output=True,
                          text=True, timeout=120,
                          env=env(KEMPNER_RESILIENCE_REPORT=str(report)))
    assert proc.returncode == ExitCode.HANG, proc.stderr

    exits = [e for e in read_ledger(ckpt / "ledger.jsonl") if e["ev"] == "exit"]
    assert [(e["code"], e["ending"]) for e in exits] == [(int(ExitCode.HANG), "hang")]
    # Held GIL: the backstop's monitor process wrote it; released: the watchdog's thread did.
    assert exits[0].get("by") == ("backstop" if how == "gil" else None)
    ran = json.loads(report.read_text())
    assert ran["exit_code"] == ExitCode.HANG and ran["ending"] == "hang"
    assert ran["saved_step"] == 4                 # the last periodic checkpoint

    assert cli_main(["report", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "42 hang" in out and "killed?" not in out
