"""The `kempner-resilience` command as a user runs it from the README's install."""

import subprocess
import sys
from pathlib import Path

import pytest

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


# Values that passed validation, then crashed a handler or printed a traceback (issue 20).
BAD_NUMBERS = ["signals.grace_s=.nan", "rescue.budget_s=.nan", "checkpoint.every_steps=.nan",
               "checkpoint.keep_last=.inf", "watchdog.hang_timeout_s=.inf",
               "checkpoint.staging_cap_gib=.inf", "checkpoint.io_threads=1000000000000",
               "checkpoint.io_threads=2.5", "signals.grace_s=1" + "0" * 400]


@pytest.mark.parametrize("override", BAD_NUMBERS)
def test_config_rejects_a_non_finite_or_out_of_range_number_with_78_and_no_traceback(override,
                                                                                    tmp_path):
    key, value = override.split("=")
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    for args in (["--set", override], ["--config", str(path)]):
        proc = run("config", *args)
        assert proc.returncode == 78, proc.stderr
        assert f"{key}: " in proc.stderr and "must be" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_torchrun_exits_78_with_the_config_verbs_message_for_an_invalid_config(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the training script must not start')\n")
    bad = ["--set", "signals.grace_s=.nan", "--set", "checkpoint.keep_last=0"]
    torchrun = run("torchrun", *bad, "--nproc-per-node=1", str(script))
    config = run("config", *bad)
    assert torchrun.returncode == config.returncode == 78, torchrun.stderr
    message = config.stderr.removeprefix("kempner-resilience config: ")
    assert "signals.grace_s" in message and "checkpoint.keep_last" in message
    assert torchrun.stderr == "kempner-resilience torchrun: " + message


def test_missing_config_file_is_reported_without_traceback_with_the_config_code(tmp_path):
    proc = run("config", "--config", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 78
    assert "config file not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_defaults_print_the_commented_default_file():
    proc = run("config", "--defaults")
    assert proc.returncode == 0
    assert "hang_timeout_s" in proc.stdout


import shutil

import pytest


@pytest.fixture(scope="module")
def demo_checkpoints(tmp_path_factory):
    """Checkpoints written by the demo's training job (steps 3 and 6, plus a partial one)."""
    root = tmp_path_factory.mktemp("ckpts") / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "kempner_resilience.demo.train", "--steps", "7",
                           "--quiet", "--set", f"checkpoint.dir={root}",
                           "--set", "checkpoint.every_steps=3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    partial = root / "step_000000009"
    shutil.copytree(root / "step_000000006", partial)
    (partial / "MANIFEST.json").unlink()   # as if killed before the commit
    return root


def test_ls_lists_step_time_size_reason_mesh_committed_verified(demo_checkpoints):
    proc = run("ls", str(demo_checkpoints))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["step", "time", "size", "reason", "mesh", "committed",
                                 "verified", "path"]
    assert lines[1].split()[0] == "9" and "no (partial)" in lines[1]
    assert [ln.split()[0] for ln in lines[2:4]] == ["6", "3"]
    assert all("periodic" in ln and "yes" in ln and "sizes ok" in ln for ln in lines[2:4])
    assert lines[4].startswith("(sizes ok:") and "the data was not read" in lines[4]


def test_verify_checks_every_committed_checkpoint(demo_checkpoints):
    proc = run("verify", str(demo_checkpoints))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK ") == 2


def test_verify_fails_on_a_corrupted_shard(demo_checkpoints, tmp_path):
    step = tmp_path / "step_000000006"
    shutil.copytree(demo_checkpoints / "step_000000006", step)
    shard = sorted(step.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = run("verify", str(step))
    assert proc.returncode == 1
    assert "checksum mismatch" in proc.stdout
    assert run("ls", "--checksums", str(tmp_path)).returncode == 1


def test_verify_of_a_missing_directory_is_a_clear_error(tmp_path):
    proc = run("verify", str(tmp_path / "nope"))
    assert proc.returncode != 0
    assert "no such directory" in proc.stderr
    assert "Traceback" not in proc.stderr
