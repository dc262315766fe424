"""Configuration: typed sections, defaults file in sync, and errors a user can act on."""

from pathlib import Path

import pytest
import yaml

from helpers import REPO
from kempner_resilience import Action, ConfigError, ResilienceConfig, load_config
from kempner_resilience.config import render_default_yaml, render_reference_markdown


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_defaults_file_matches_the_dataclass_defaults():
    assert load_config(REPO / "configs" / "default.yaml") == ResilienceConfig()
    assert (REPO / "configs" / "default.yaml").read_text() == render_default_yaml()


def test_every_default_key_has_a_comment():
    for line in (REPO / "configs" / "default.yaml").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert "  # " in line, f"key without a comment: {line!r}"


def test_config_reference_in_docs_lists_every_key():
    assert render_reference_markdown() in (REPO / "docs" / "config.md").read_text()


def test_no_path_gives_the_defaults():
    cfg = load_config()
    assert cfg.checkpoint.keep_last == 3
    assert cfg.signals.actions["SIGUSR1"] is Action.REQUEUE
    assert cfg.signals.actions["SIGTERM"] is Action.STOP


def test_yaml_values_and_overrides_are_applied(tmp_path):
    path = write(tmp_path, "checkpoint:\n  dir: /scratch/run1\n  every_steps: 50\n")
    cfg = load_config(path, overrides=["signals.grace_s=90", "checkpoint.async=true"])
    assert cfg.checkpoint.dir == "/scratch/run1"
    assert cfg.checkpoint.every_steps == 50
    assert cfg.checkpoint.async_ is True
    assert cfg.signals.grace_s == 90.0


def test_signal_names_are_normalized_and_merged_over_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "signals:\n  actions:\n    usr1: stop\n"))
    assert cfg.signals.actions["SIGUSR1"] is Action.STOP
    # a partial mapping must not drop SIGTERM: a preempted job would die without a checkpoint
    assert cfg.signals.actions["SIGTERM"] is Action.STOP
    assert cfg.signals.grace_for("SIGTERM") == 25.0
    assert cfg.signals.grace_for("SIGUSR1") == 100.0


def test_unknown_key_names_the_path_and_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "checkpoint:\n  evry_steps: 10\n"))
    msg = str(e.value)
    assert "checkpoint.evry_steps" in msg
    assert "did you mean 'every_steps'" in msg
    assert str(tmp_path / "cfg.yaml") in msg


def test_unknown_section_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="checkpoints: unknown key; did you mean 'checkpoint'"):
        load_config(write(tmp_path, "checkpoints:\n  dir: x\n"))


def test_wrong_type_names_key_value_and_expected_type(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "signals:\n  grace_s: soon\n"))
    assert "signals.grace_s: 'soon' has the wrong type; expected a number" in str(e.value)


def test_boolean_is_not_accepted_as_a_number(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.every_steps: True has the wrong type"):
        load_config(write(tmp_path, "checkpoint:\n  every_steps: yes\n"))


def test_negative_interval_is_rejected_with_the_allowed_range(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "checkpoint:\n  every_minutes: -5\n"))
    assert "checkpoint.every_minutes: -5 is negative; must be >= 0 and <= 10080 minutes" in str(e.value)


def test_zero_keep_last_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.keep_last: 0 is not allowed; must be >= 1"):
        load_config(overrides=["checkpoint.keep_last=0"])


def test_zero_max_failed_saves_is_rejected_and_the_default_tolerates_three(tmp_path):
    assert load_config().checkpoint.max_failed_saves == 3
    with pytest.raises(ConfigError, match="checkpoint.max_failed_saves: 0 is not allowed; must "
                       "be >= 1"):
        load_config(overrides=["checkpoint.max_failed_saves=0"])


def test_staging_takes_pinned_pageable_or_off_and_names_them_otherwise(tmp_path):
    from kempner_resilience.config import StagingMode

    assert load_config().checkpoint.staging is StagingMode.PINNED
    # YAML reads a bare `off` as false: it still means staging: off
    assert load_config(write(tmp_path, "checkpoint:\n  staging: off\n")).checkpoint.staging \
        is StagingMode.OFF
    assert load_config(overrides=["checkpoint.staging=pageable"]).checkpoint.staging \
        is StagingMode.PAGEABLE
    with pytest.raises(ConfigError, match="checkpoint.staging: 'gpu' has the wrong type; "
                                          "expected one of pinned, pageable, off"):
        load_config(overrides=["checkpoint.staging=gpu"])


def test_a_staging_cap_of_zero_is_rejected():
    with pytest.raises(ConfigError, match="checkpoint.staging_cap_gib: 0 is not allowed; must "
                                          "be > 0 and <= 1024 GiB"):
        load_config(overrides=["checkpoint.staging_cap_gib=0"])


def test_unknown_signal_name_is_rejected(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "signals:\n  actions:\n    SIGFOO: stop\n"))
    assert "signals.actions.SIGFOO: 'SIGFOO' is not a signal name" in str(e.value)


def test_uncatchable_signal_is_rejected():
    with pytest.raises(ConfigError, match="SIGKILL cannot be used"):
        load_config(overrides=["signals.actions.SIGKILL=stop"])


def test_unknown_action_lists_the_allowed_ones():
    with pytest.raises(ConfigError, match="'explode' has the wrong type; expected one of "
                                          "requeue, stop, off"):
        load_config(overrides=["signals.actions.SIGUSR1=explode"])


def test_all_mistakes_are_reported_in_one_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "checkpoint:\n  keep_last: 0\nwatchdog:\n  hang_timeout_s: "
                                    "-1\n"))
    assert [p for p, _ in e.value.problems] == ["checkpoint.keep_last", "watchdog.hang_timeout_s"]


def test_malformed_yaml_names_the_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "checkpoint:\n  dir: x\n every_steps: [1\n"))
    assert "not valid YAML at line" in str(e.value)


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_malformed_override_shows_the_expected_form():
    with pytest.raises(ConfigError, match="override must look like section.key=value"):
        load_config(overrides=["signals.grace_s"])


def test_empty_file_gives_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == ResilienceConfig()


def test_round_trip_through_plain_data():
    cfg = load_config(overrides=["signals.actions.SIGUSR2=off", "checkpoint.keep_every=100"])
    again = ResilienceConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg
    assert "SIGUSR2" not in again.signals.handled()


def test_exit_code_table_in_docs_matches_the_enum():
    from kempner_resilience.exitcodes import TABLE

    text = (REPO / "docs" / "exit-codes.md").read_text()
    for code, meaning in TABLE.items():
        assert f"| {int(code)} | `{code.name}` | {meaning} |" in text


def test_troubleshooting_explains_every_doctor_finding():
    import re

    source = "".join((REPO / "kempner_resilience" / "slurm" / name).read_text()
                     for name in ("preflight.py", "budget.py"))
    codes = set(re.findall(r'"(?:warn|error|info)", "([a-z-]+)"', source)) - {"error", "warn", "info"}
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    assert codes and all(f"`{c}`" in text for c in codes), codes


def test_a_mapping_works_like_a_file():
    cfg = load_config({"checkpoint": {"dir": "/tmp/x", "every_steps": 5}},
                      overrides=["signals.grace_s=30"])
    assert cfg.checkpoint.every_steps == 5 and cfg.signals.grace_s == 30.0
    with pytest.raises(ConfigError, match="checkpoint.evry_steps: unknown key"):
        load_config({"checkpoint": {"evry_steps": 5}})


# ---------------------------------------------------------------- numbers: finite and bounded

def _numeric_keys():
    """(dotted key, field, Range) for every numeric key of the schema; a dict of numbers (the
    per-signal graces) is checked through one of its entries."""
    import dataclasses
    import typing

    from kempner_resilience.config.serial import yaml_name

    for sec in dataclasses.fields(ResilienceConfig):
        cls = sec.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            args = typing.get_args(tp)
            if tp in (int, float) or (typing.get_origin(tp) is dict and args[1] in (int, float)):
                key = f"{yaml_name(sec)}.{yaml_name(f)}"
                yield (key + ".SIGTERM" if typing.get_origin(tp) is dict else key,
                       f, f.metadata.get("bounds"))


NUMERIC_KEYS = {key: bounds for key, _, bounds in _numeric_keys()}


def test_every_numeric_key_declares_its_allowed_range_and_the_docs_show_it():
    assert NUMERIC_KEYS and all(NUMERIC_KEYS.values()), \
        [k for k, b in NUMERIC_KEYS.items() if b is None]
    docs = (REPO / "docs" / "config.md").read_text()
    defaults = (REPO / "configs" / "default.yaml").read_text()
    for key, bounds in NUMERIC_KEYS.items():
        name = key.removesuffix(".SIGTERM")
        row = next(line for line in docs.splitlines() if line.startswith(f"| `{name}` |"))
        assert bounds.text().replace(">", "&gt;").replace("<", "&lt;") in row
        assert f"allowed: {bounds.text()}" in defaults


def _bad_values(key):
    """NaN, both infinities, and one past each end of the key's range (YAML spelling)."""
    b = NUMERIC_KEYS[key]
    if b is None:  # undeclared: the test below fails for it
        return [".nan", ".inf", "-.inf"]
    above = int(b.hi) + 1 if float(b.hi).is_integer() else b.hi * 2
    below = b.lo if b.lo_open else b.lo - 1
    return [".nan", ".inf", "-.inf", str(above), str(below)]


@pytest.mark.parametrize("key,value", [(k, v) for k in NUMERIC_KEYS for v in _bad_values(k)])
def test_a_non_finite_or_out_of_range_number_is_rejected_naming_the_key_and_range(key, value):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"{key}={value}"])
    assert [p for p, _ in e.value.problems] == [key]
    assert NUMERIC_KEYS[key] is not None and NUMERIC_KEYS[key].text() in str(e.value)


# The values a fault campaign found accepted, or crashing later (issue 20, item 6).
FOUND = [("signals.grace_s", ".nan"), ("rescue.budget_s", ".nan"),
         ("checkpoint.every_steps", ".nan"), ("checkpoint.keep_last", ".inf"),
         ("watchdog.hang_timeout_s", ".inf"), ("checkpoint.staging_cap_gib", ".inf"),
         ("checkpoint.io_threads", "1000000000000"),
         ("signals.grace_per_signal_s.SIGTERM", ".nan"), ("signals.grace_s", "1" + "0" * 400)]


def _yaml(key: str, value: str) -> str:
    *sections, last = key.split(".")
    return "".join("  " * i + s + ":\n" for i, s in enumerate(sections)) + \
        "  " * len(sections) + f"{last}: {value}\n"


@pytest.mark.parametrize("key,value", FOUND)
def test_a_bad_number_in_a_file_or_a_mapping_is_rejected_naming_the_key(tmp_path, key, value):
    path = write(tmp_path, _yaml(key, value))
    for source in (path, yaml.safe_load(path.read_text())):
        with pytest.raises(ConfigError) as e:
            load_config(source)
        assert [p for p, _ in e.value.problems] == [key]


def test_config_objects_built_or_changed_in_python_are_held_to_the_same_rules():
    from kempner_resilience import ResilientRun
    from kempner_resilience.config import CheckpointConfig, RescueConfig, SignalsConfig

    nan = float("nan")
    for build in (lambda: SignalsConfig(grace_s=nan), lambda: RescueConfig(budget_s=nan),
                  lambda: CheckpointConfig(io_threads=10**12),
                  lambda: CheckpointConfig(keep_last=2.5),
                  lambda: CheckpointConfig(every_steps=True)):
        with pytest.raises(ConfigError):
            build()
    cfg = ResilienceConfig()
    cfg.signals.grace_s = nan  # changed after it was validated
    with pytest.raises(ConfigError, match="signals.grace_s: nan is not a finite number"):
        ResilientRun(cfg)


def test_a_type_error_does_not_hide_the_other_mistakes_in_the_file(tmp_path):
    path = write(tmp_path, "checkpoint:\n  every_steps: soon\n  keep_last: 0\n  evry: 1\n"
                           "  io_threads: 1000\nsignals:\n  grace_s: .nan\n  actions: [1]\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert sorted(p for p, _ in e.value.problems) == [
        "checkpoint.every_steps", "checkpoint.evry", "checkpoint.io_threads",
        "checkpoint.keep_last", "signals.actions", "signals.grace_s"]
    assert "keep_last: 0 is not allowed; must be >= 1" in str(e.value)


# ------------------------------------------------------------ the defaults ship with the package

def test_the_shipped_defaults_are_the_repositorys_configs_default_yaml():
    from kempner_resilience.config.load import SHIPPED_DEFAULTS

    assert SHIPPED_DEFAULTS.read_text() == (REPO / "configs" / "default.yaml").read_text()


def test_the_documented_load_config_call_gives_the_defaults_from_any_directory(tmp_path):
    import subprocess
    import sys

    from helpers import env

    code = ("import kempner_resilience as kr\n"
            "cfg = kr.load_config('configs/default.yaml', overrides=['signals.grace_s=90'])\n"
            "assert cfg == kr.load_config(overrides=['signals.grace_s=90']), cfg\n"
            "assert kr.load_config('default.yaml') == kr.ResilienceConfig()\n"
            "print('defaults ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "defaults ok" in proc.stdout


def test_a_config_file_in_the_current_directory_wins_over_the_shipped_one(tmp_path,
                                                                          monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "default.yaml").write_text("checkpoint:\n  keep_last: 7\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/default.yaml").checkpoint.keep_last == 7
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config("configs/other.yaml")


def test_a_wheel_built_from_the_repository_carries_the_defaults(tmp_path):
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "kempner_resilience", src / "kempner_resilience",
                    ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", "-w", str(tmp_path / "out"),
                           str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "out").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = z.read("kempner_resilience/config/default.yaml").decode()
    assert shipped == (REPO / "configs" / "default.yaml").read_text()
