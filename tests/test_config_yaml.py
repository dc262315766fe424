"""A config never loses a key without a word, and no YAML document runs away.

A section or key given twice, two spellings of one signal, an exponent without a dot, an alias
bomb, a 25 MB value: each is either read as written or refused with 78 naming where, quickly,
in a message of readable length.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import kempner_resilience as kr
from helpers import env, write_script
from kempner_resilience.config import ConfigError, load_config
from kempner_resilience.exitcodes import ExitCode

LOADS = """
import sys
import kempner_resilience as kr
cfg = kr.load_config(sys.argv[1])
print("loaded", cfg.checkpoint.every_steps, cfg.checkpoint.keep_last, flush=True)
"""


def _load_in_a_script(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    (tmp_path / "cfg.yaml").write_text(text)
    return subprocess.run([sys.executable, str(write_script(tmp_path, LOADS)),
                           str(tmp_path / "cfg.yaml")], capture_output=True, text=True,
                          timeout=120, env=env())


def _load(tmp_path: Path, text: str, *overrides: str):
    (tmp_path / "cfg.yaml").write_text(text)
    return load_config(tmp_path / "cfg.yaml", overrides)


def test_a_section_given_twice_exits_78_naming_both_lines(tmp_path):
    proc = _load_in_a_script(tmp_path, "checkpoint:\n  every_steps: 100\n"
                                       "signals:\n  grace_s: 60\n"
                                       "checkpoint:\n  keep_last: 2\n")
    assert proc.returncode == ExitCode.CONFIG, proc.stderr
    assert "loaded" not in proc.stdout and "Traceback" not in proc.stderr
    assert "checkpoint: section given twice, at line 1 and line 5" in proc.stderr
    assert "merge them into one" in proc.stderr


def test_a_key_given_twice_in_one_section_is_refused_naming_both_lines(tmp_path):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, "checkpoint:\n  every_steps: 100\n  keep_last: 2\n  every_steps: 0\n")
    assert e.value.problems[0][0] == "checkpoint.every_steps"
    assert "given twice, at line 2 and line 4" in e.value.problems[0][1]


def test_sigusr1_and_usr1_in_one_actions_map_exit_78_naming_both_lines(tmp_path):
    proc = _load_in_a_script(tmp_path, "signals:\n  actions:\n    SIGUSR1: requeue\n"
                                       "    USR1: stop\n")
    assert proc.returncode == ExitCode.CONFIG, proc.stderr
    assert ("signals.actions: 'SIGUSR1' (line 3) and 'USR1' (line 4) both name SIGUSR1"
            in proc.stderr)


def test_two_spellings_of_one_signal_in_a_mapping_are_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config({"signals": {"grace_per_signal_s": {"SIGTERM": 20, "term": 40}}})
    assert e.value.problems == [("signals.grace_per_signal_s",
                                 "'SIGTERM' and 'term' both name SIGTERM; keep one of them")]


def test_an_override_in_another_spelling_replaces_the_files_signal_entry(tmp_path):
    cfg = _load(tmp_path, "signals:\n  actions:\n    SIGUSR1: requeue\n",
                "signals.actions.USR1=stop")
    assert cfg.signals.actions["SIGUSR1"] is kr.Action.STOP


def test_an_exponent_without_a_dot_is_a_number(tmp_path):
    cfg = _load(tmp_path, "signals:\n  grace_s: 1e2\nwatchdog:\n  cleanup_timeout_s: 5E-1\n"
                          "checkpoint:\n  staging_cap_gib: 1e-9\n", "signals.grace_s=2e1")
    assert (cfg.signals.grace_s, cfg.watchdog.cleanup_timeout_s) == (20.0, 0.5)
    assert cfg.checkpoint.staging_cap_gib == 1e-9


BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n"
    for i in range(8)) + "checkpoint:\n  dir: *i\n"


def test_a_billion_laughs_alias_bomb_is_refused_at_once(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, BILLION_LAUGHS)
    assert time.monotonic() - t0 < 5
    assert "expands to more than 10,000 values (aliases counted at each use)" in str(e.value)
    assert len(str(e.value)) < 1000


def test_an_alias_that_holds_itself_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="a cycle"):
        _load(tmp_path, "checkpoint: &c\n  dir: [*c]\n")


def test_a_25_mb_value_is_refused_before_validation_in_a_short_message(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, "checkpoint:\n  dir: [" + "x" * 25_000_000 + "]\n")
    assert time.monotonic() - t0 < 5
    assert "longer than 1,048,576 characters" in str(e.value) and len(str(e.value)) < 1000


def test_a_25_mb_value_in_a_mapping_is_refused_in_a_short_message():
    with pytest.raises(ConfigError) as e:
        load_config({"checkpoint": {"every_steps": "x" * 25_000_000}})
    assert "a value of 25,000,000 characters" in str(e.value) and len(str(e.value)) < 1000


def test_a_wrong_value_is_shown_shortened_in_the_message(tmp_path):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, "checkpoint:\n  every_steps: " + "9x" * 2000 + "\n"
                        "  keep_last: [" + ", ".join(["1"] * 3000) + "]\n")
    assert [p for p, _ in e.value.problems] == ["checkpoint.every_steps", "checkpoint.keep_last"]
    assert all(len(m) < 200 for _, m in e.value.problems), e.value.problems
    assert "has the wrong type; expected an integer" in e.value.problems[0][1]


def test_a_problem_line_is_cut_to_a_readable_length():
    err = ConfigError([("checkpoint.dir", "y" * 100_000)])
    assert len(str(err)) < 700 and "characters cut" in str(err)
