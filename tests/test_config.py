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
    assert "checkpoint.every_minutes: -5.0 is negative; must be >= 0" in str(e.value)


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
    with pytest.raises(ConfigError, match="checkpoint.staging_cap_gib: 0.0 is not allowed; must "
                                          "be > 0 GiB"):
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
