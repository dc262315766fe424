"""The `kempner-resilience` command as a user runs it from the README's install."""

import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).parent / "kempner-resilience")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_the_verbs():
    proc = run("--help")
    assert proc.returncode == 0
    assert "config" in proc.stdout and "exit-codes" in proc.stdout


def test_config_error_is_one_clear_message_without_traceback():
    proc = run("config", "--set", "checkpoint.every_steps=-1")
    assert proc.returncode == 78
    assert "checkpoint.every_steps: -1 is negative" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_config_file_is_reported_without_traceback(tmp_path):
    proc = run("config", "--config", str(tmp_path / "missing.yaml"))
    assert proc.returncode != 0
    assert "config file not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_defaults_print_the_commented_default_file():
    proc = run("config", "--defaults")
    assert proc.returncode == 0
    assert "hang_timeout_s" in proc.stdout
