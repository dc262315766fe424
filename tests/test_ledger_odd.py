"""A ledger can hold anything (a torn write, a line someone edited, another run's events, a
FIFO in its place): nothing in it stops a start, and ``report`` never prints a traceback.

Real runs of the demo job in their own processes for the start; ``report`` on a corpus of
mutated ledgers (a fixed seed: the same corpus every run).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import subprocess
from pathlib import Path

import pytest

from helpers import env, require, run_script
from kempner_resilience.cli import main as cli_main
from kempner_resilience.demo.launcher import train_command
from kempner_resilience.core.goodput import analyze
from kempner_resilience.core.ledger import MAX_BYTES, read_ledger

DOCS_LEDGER = Path(__file__).resolve().parents[1] / "docs" / "goodput-ledger.jsonl"
RUN = "20261123-141734-f7d8c087"       # the run id of the docs' ledger


def _demo(ckpt: Path, steps: int = 4) -> subprocess.CompletedProcess:
    cmd = train_command(steps, step_time=0.0, out=ckpt.parent / "w.pt",
                        overrides=[f"checkpoint.dir={ckpt}", "checkpoint.every_steps=2"])
    return run_script(cmd, capture_output=True, text=True, timeout=300, env=env())


def _line(**ev) -> bytes:
    return json.dumps(ev, separators=(",", ":")).encode() + b"\n"


def test_a_5_mib_ledger_with_malformed_lines_never_stops_a_start(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    odd = [_line(ev="save", t=1.0, attempt=0, run_id="r", step=2, blocking_s="abc"),
           _line(ev="save", t=1.0, attempt=[0], run_id="r", step=2, blocking_s=0.1),
           _line(ev="saves", t=1.0, attempt=0, run_id="r", n="many", bytes=1),
           b'{"ev":"save","t":NaN,"attempt":0,"step":4,"bytes":1e400}\n',
           b"[1, 2]\n", b"\xff\xfe not json\n"]
    rng = random.Random(5)
    with open(ckpt / "ledger.jsonl", "wb") as f:
        f.write(_line(ev="start", t=1.0, attempt=0, run_id="r", t0=0.5, restart_count=0))
        while f.tell() < 5 * 2**20:
            f.write(_line(ev="save", t=2.0, attempt=0, run_id="r", step=2, reason="periodic",
                          blocking_s=0.01, bytes=100))
            if rng.random() < 0.01:
                f.write(rng.choice(odd))
    proc = _demo(ckpt)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "skipped" in proc.stderr and "malformed line(s)" in proc.stderr
    # Compacted (the old attempt's saves folded), the new attempt recorded from start to exit.
    assert (ckpt / "ledger.jsonl").stat().st_size < MAX_BYTES
    kinds = [e["ev"] for e in read_ledger(ckpt / "ledger.jsonl")]
    assert kinds[-1] == "exit" and "start" in kinds[1:] and "saves" in kinds


def test_a_ledger_that_is_a_fifo_does_not_block_the_start(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / "ledger.jsonl")
    proc = _demo(ckpt)        # the old code waited in open() for a reader (timeout: a fail)
    assert proc.returncode == 0, proc.stderr
    warning = [ln for ln in proc.stderr.splitlines() if "not a regular file" in ln]
    assert len(warning) == 1 and "WARNING" in warning[0] and "ledger.jsonl" in warning[0]
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000000002", "step_000000004"]


# ----------------------------------------------------------------------------- report

@pytest.fixture(autouse=True)
def _log_to_this_tests_stderr():
    """cli_main's log handler writes to the stderr of the test that made it: one per test."""
    logger = logging.getLogger("kempner_resilience")

    def drop() -> None:
        for h in [h for h in logger.handlers if getattr(h, "_kempner", False)]:
            logger.removeHandler(h)
    drop()
    yield
    drop()


def _report(capsys, ledger: Path, *extra: str) -> tuple[int, str, str]:
    code = cli_main(["report", str(ledger), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_no_traceback(code: int, out: str, err: str) -> None:
    assert code in (0, 1), (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    said = [ln for ln in err.splitlines() if ln.startswith("kempner-resilience report:")]
    assert len(said) == (1 if code else 0), err


ODD_VALUES = ["abc", "", math.nan, math.inf, -math.inf, 1e300, -1e300, 1e20, -1, 2**70, [0],
              {"a": 1}, None, True, False, 0, 1.5, "2026-01-01"]


def _mutate(rng: random.Random, lines: list[bytes]) -> list[bytes]:
    lines = list(lines)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(lines))
        how = rng.randrange(8)
        if how == 0:                                  # a torn line
            lines[i] = lines[i][:rng.randrange(len(lines[i]))]
        elif how == 1:                                # a line lost
            del lines[i]
        elif how == 2:                                # a line repeated elsewhere
            lines.insert(rng.randrange(len(lines) + 1), lines[i])
        elif how == 3:                                # not an event at all
            lines[i] = rng.choice([b"[1,2]", b"17", b'"ev"', b"null", b"{}", b'{"ev":5}',
                                   b"\xff\xfe\x00", b"{" * 5000])
        else:
            try:
                ev = json.loads(lines[i])
            except ValueError:
                continue                              # a line an earlier mutation broke
            if not isinstance(ev, dict):
                continue
            key = rng.choice(sorted(ev) + ["t", "step", "code", "attempt", "run_id"])
            if how == 4:
                ev.pop(key, None)
            elif how == 5 and key != "ev":
                ev[key] = rng.choice(ODD_VALUES)
            elif how == 6:
                ev["ev"] = rng.choice(["start", "exit", "rescue", "save_failed", "saves", "?"])
            else:
                ev["run_id"] = rng.choice([RUN, "other-run", None, 5])
            lines[i] = json.dumps(ev).encode()      # NaN and Infinity as Python writes them
        if not lines:
            lines = [b""]
    return lines


def test_report_never_prints_a_traceback_for_any_ledger(tmp_path, capsys):
    base = DOCS_LEDGER.read_bytes().splitlines()
    rng = random.Random(20)
    ledger = tmp_path / "ledger.jsonl"
    codes = []
    for case in range(400):
        ledger.write_bytes(b"\n".join(_mutate(rng, base)) + b"\n")
        code, out, err = _report(capsys, ledger, *(["--json"] if case % 2 else []))
        _assert_no_traceback(code, out, err)
        codes.append(code)
    assert codes.count(0) > 300            # most odd ledgers still give a report


def test_report_plot_never_prints_a_traceback_for_odd_ledgers(tmp_path, capsys):
    require("matplotlib")
    base = DOCS_LEDGER.read_bytes().splitlines()
    rng = random.Random(21)
    ledger = tmp_path / "ledger.jsonl"
    for case in range(8):
        lines = _mutate(rng, base) if case else \
            [ln.replace(b'"ev":"exit","t":', b'"ev":"exit","was_t":') for ln in base]
        ledger.write_bytes(b"\n".join(lines) + b"\n")
        _assert_no_traceback(*_report(capsys, ledger, "--plot", str(tmp_path / f"{case}.png")))


@pytest.mark.parametrize("odd", [
    {"ev": "save", "t": 1e300}, {"ev": "save", "t": math.nan}, {"ev": "saves", "n": "3"},
    {"ev": "start", "t0": -1e300}, {"ev": "resume", "step": "12"}, {"ev": "exit", "code": "0"}],
    ids=["huge-time", "nan-time", "string-count", "negative-t0", "string-step", "string-code"])
def test_an_odd_but_parseable_line_is_skipped_with_a_warning_and_the_rest_reported(
        tmp_path, capsys, odd):
    lines = DOCS_LEDGER.read_bytes().splitlines()
    event = {"attempt": 0, "run_id": RUN, "t": 1795443456.0, **odd}
    lines.insert(3, json.dumps(event).encode())
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_bytes(b"\n".join(lines) + b"\n")
    code, out, err = _report(capsys, ledger)
    assert code == 0 and "3 attempt(s)" in out and "Traceback" not in err
    assert "skipped 1 malformed line(s) (first: line 4" in err


def test_an_exit_without_a_time_still_ends_its_attempt(tmp_path, capsys):
    events = [json.loads(ln) for ln in DOCS_LEDGER.read_bytes().splitlines()]
    for e in events:
        if e["ev"] == "exit":
            del e["t"]
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(json.dumps(e) + "\n" for e in events))
    code, out, err = _report(capsys, ledger)
    assert code == 0 and "killed?" not in out and "0 completed" in out


def test_report_on_a_ledger_mixing_runs_says_so_and_reports_the_newest(tmp_path, capsys):
    other = [ln.replace(RUN.encode(), b"20261201-000000-0badc0de")
             for ln in DOCS_LEDGER.read_bytes().splitlines()[:6]]
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_bytes(b"\n".join(DOCS_LEDGER.read_bytes().splitlines() + other) + b"\n")
    code, out, _ = _report(capsys, ledger)
    assert code == 0
    assert out.startswith("run 20261201-000000-0badc0de: 1 attempt(s)")
    assert "the ledger mixes 2 runs" in out and f"{RUN} (23 events)" in out
    code, out, _ = _report(capsys, ledger, "--run", RUN)
    assert code == 0 and out.startswith(f"run {RUN}: 3 attempt(s)")
    assert "20261201-000000-0badc0de (6 events)" in out


def test_a_rescue_recorded_by_its_writer_counts_its_step_as_kept(tmp_path, capsys):
    events = [json.loads(ln) for ln in DOCS_LEDGER.read_bytes().splitlines()]
    first = [e for e in events if e["attempt"] == 0 and e["ev"] not in ("stop", "emergency_save",
                                                                        "requeue", "exit")]
    # Rank 0 died at step 22: no exit; rank 1 wrote the rescue and recorded it.
    first.append({"ev": "rescue", "t": first[-1]["t"] + 1, "attempt": 0, "run_id": RUN,
                  "step": 22, "committed": True, "writer": 1, "rank": 1, "reason": "peer lost",
                  "seconds": 0.5})
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(json.dumps(e) + "\n" for e in first))
    g = analyze(read_ledger(ledger))
    assert g.attempts[0].crashed and g.attempts[0].kept_steps == 22
    code, out, _ = _report(capsys, ledger)
    assert code == 0 and "killed? rescue@22 kept" in out


def test_report_shows_failed_periodic_saves_and_why(tmp_path, capsys):
    lines = DOCS_LEDGER.read_bytes().splitlines()
    lines.insert(3, _line(ev="save_failed", t=1795443456.0, attempt=0, run_id=RUN, step=20,
                          failed=1, reason="No space left on device").rstrip())
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_bytes(b"\n".join(lines) + b"\n")
    code, out, _ = _report(capsys, ledger)
    assert code == 0 and "2 (1 failed)" in out
    assert "attempt 0, step 20: No space left on device" in out


def test_report_plot_with_an_unknown_suffix_names_the_formats_and_prints_nothing_else(
        tmp_path, capsys):
    require("matplotlib")
    code = cli_main(["report", str(DOCS_LEDGER), "--plot", str(tmp_path / "out.xyz")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err
    assert "cannot write .xyz files" in err and ".png" in err and ".svg" in err
    assert not (tmp_path / "out.xyz").exists()


def test_report_plot_into_a_directory_or_without_a_suffix_names_the_file_it_wrote(
        tmp_path, capsys):
    require("matplotlib")
    assert cli_main(["report", str(DOCS_LEDGER), "--plot", str(tmp_path)]) == 0
    png = tmp_path / "goodput-timeline.png"
    assert f"wrote the timeline to {png}\n" in capsys.readouterr().err
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert cli_main(["report", str(DOCS_LEDGER), "--plot", str(tmp_path / "tl")]) == 0
    assert f"wrote the timeline to {tmp_path / 'tl.png'}\n" in capsys.readouterr().err
    assert (tmp_path / "tl.png").read_bytes()[:4] == b"\x89PNG"
