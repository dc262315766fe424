"""The README's main job: `kempner-resilience demo`, as a user runs it."""

import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).parent / "kempner-resilience")


def demo(tmp_path, *args):
    return subprocess.run([CLI, "demo", "--workdir", str(tmp_path / "work"), *args],
                          capture_output=True, text=True, timeout=900)


def test_demo_interrupted_twice_ends_with_identical_weights_and_says_so(tmp_path):
    proc = demo(tmp_path, "--ranks", "2", "--interrupt-at", "10,25")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("exit REQUEUE (75)") == 2
    assert proc.stdout.count("resumed at step") == 2
    assert "bitwise IDENTICAL to the uninterrupted run" in proc.stdout
    ckpts = tmp_path / "work" / "resilient" / "checkpoints"
    assert any(p.name.startswith("step_") for p in ckpts.iterdir())  # left for ls/verify
    listing = subprocess.run([CLI, "ls", str(ckpts)], capture_output=True, text=True)
    assert listing.returncode == 0 and "sizes ok" in listing.stdout


def test_demo_hang_is_detected_and_the_run_resumes(tmp_path):
    proc = demo(tmp_path, "--ranks", "1", "--steps", "24", "--interrupt-at", "", "--hang-at", "12")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exit HANG (42)" in proc.stdout
    assert "resumed at step 10" in proc.stdout  # the last periodic checkpoint before the hang
    assert "bitwise IDENTICAL" in proc.stdout


def test_a_demo_task_with_spares_names_its_run_after_the_relaunch_its_channel_says(tmp_path,
                                                                                  monkeypatch):
    # Each task of the demo's srun steps is the trainer itself (so a node's standby can fork it
    # warm), and it marks each run in progress.txt as <SLURM's restart count>.<the relaunch in
    # place>; the relaunch comes from the supervisor channel the step loop gave it.
    from kempner_resilience.demo.slurm_demo import write_job
    from kempner_resilience.demo.train import _mark_launch, parse_args
    from kempner_resilience.supervise.channel import Channel

    job = write_job(tmp_path / "job", ranks=2, steps=5, nodes=2, spares=1)
    command = job.sbatch_args[job.sbatch_args.index("--") + 1:]
    assert command[1:4] == ["-u", "-m", "kempner_resilience.demo.train"], command
    assert "--named-launches" in command
    channel = Channel.for_job("5", {}, cwd=tmp_path)
    channel.begin_relaunch(2)
    monkeypatch.delenv("RANK", raising=False)
    for key, value in dict(SLURM_RESTART_COUNT="1", SLURM_PROCID="0",
                           KEMPNER_RESILIENCE_REPORT="", **channel.env()).items():
        monkeypatch.setenv(key, value)
    _mark_launch(parse_args(command[4:]))
    assert (tmp_path / "job" / "progress.txt").read_text() == "# run 1.2\n"
