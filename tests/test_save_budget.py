"""The start-up budget check: does the emergency save fit in what SLURM leaves after its warning?

Unit tests of the verdict (``slurm.budget.save_budget``, no I/O), then the real start-up path: a
run resumes a checkpoint saved for real, in a process inside a SLURM-like environment whose
``scontrol`` (a script on PATH, as in tests/test_slurm_preflight.py) says the job asked for
``--signal=USR1@5`` and the cluster's KillWait is 45 s. The run warns with the numbers and the lead to ask for, and
``kempner-resilience doctor`` in the same environment says the same.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

import kempner_resilience as kr
from helpers import env, run_script, write_script
from kempner_resilience.config import load_config
from kempner_resilience.checkpoint.identity import RUN_ID_ENV
from kempner_resilience.slurm.budget import SaveFacts, save_budget
from kempner_resilience.slurm.scontrol import kill_wait

GIB = 2**30
# 12 GiB written in 40 s by the last save: 50 s estimated for the next one.
BIG = SaveFacts(save_s=50.0, measured=True, state_bytes=12 * GIB, last_bytes=12 * GIB,
                last_s=40.0)


def test_a_save_that_fits_in_the_signal_lead_is_said_to_fit():
    b = save_budget(load_config(), BIG, lead_s=120, kill_wait_s=30)
    assert b.fits and b.level == "info" and b.code == "save-fits"
    assert b.needed_s == 50 + 5 + 20          # save + checkpoint.save_margin_s + requeue/teardown


def test_a_save_longer_than_the_signal_lead_warns_with_the_numbers_and_the_lead_to_ask_for():
    b = save_budget(load_config(), BIG, lead_s=60, kill_wait_s=30)
    assert not b.fits and b.level == "warn" and b.code == "signal-lead-short"
    for number in ("state 12 GiB", "0.3 GiB/s", "estimated emergency save 50.0 s",
                   "--signal=USR1@60", "up to 60 s earlier", "KillWait 30 s", "= 75 s"):
        assert number in b.message, number
    # The lead the sbatch renderer would pick: the grace (100 s) + 20 s, which covers the 75 s.
    assert b.ask_lead_s == 120 and "`#SBATCH --signal=USR1@120`" in b.fix


def test_without_a_signal_the_save_must_fit_between_sigterm_and_sigkill():
    cfg = load_config(overrides=["signals.grace_per_signal_s.SIGTERM=60"])
    b = save_budget(cfg, BIG, lead_s=None, kill_wait_s=30)
    assert b.code == "save-exceeds-killwait" and b.level == "warn"
    assert b.window_s == 30 and "KillWait 30 s" in b.message
    assert "#SBATCH --signal=USR1@120" in b.fix
    small = SaveFacts(save_s=3.0, measured=True, state_bytes=2**20)
    assert save_budget(cfg, small, lead_s=None, kill_wait_s=30).fits


def test_an_unknown_killwait_is_said_and_slurms_default_assumed():
    b = save_budget(load_config(), BIG, lead_s=None, kill_wait_s=None)
    assert b.window_s == 25        # SIGTERM's grace (25 s) is shorter than the assumed 30 s
    assert "KillWait 30 s (assumed: scontrol show config did not say)" in b.message


def test_a_save_longer_than_the_signals_grace_asks_for_more_grace():
    b = save_budget(load_config(), SaveFacts(save_s=300.0), lead_s=600, kill_wait_s=30)
    assert b.code == "save-exceeds-grace" and b.level == "warn"
    assert "signals.grace_s" in b.fix and "325" in b.fix and "--signal=USR1@345" in b.fix


def test_a_short_lead_is_covered_when_the_run_knows_its_end_and_stops_on_its_own():
    b = save_budget(load_config(), BIG, lead_s=60, kill_wait_s=30, end_known=True)
    assert b.level == "info" and b.code == "time-limit-stop-covers" and not b.fits
    off = load_config(overrides=["requeue.time_limit_stop=false"])
    assert save_budget(off, BIG, lead_s=60, kill_wait_s=30, end_known=True).level == "warn"


def test_before_any_measured_save_the_estimate_says_it_is_a_guess():
    guess = SaveFacts(save_s=12.0, measured=False, state_bytes=GIB)
    b = save_budget(load_config(), guess, lead_s=120, kill_wait_s=30)
    assert b.fits and "no save measured yet" in b.message


def fake_scontrol(bindir: Path, answers: dict[str, str]) -> None:
    """``scontrol`` (and a ``squeue`` that knows nothing) answering ``show job``, ``show
    config`` and ``write batch_script`` with fixed text."""
    bindir.mkdir(exist_ok=True)
    cases = "".join(f"  {key}) /bin/cat <<'EOF'\n{text}\nEOF\n  ;;\n"
                    for key, text in answers.items())
    (bindir / "scontrol").write_text(f'#!/bin/bash\ncase "$1 $2" in\n{cases}  *) exit 1 ;;\n'
                                     "esac\n")
    (bindir / "squeue").write_text("#!/bin/bash\nexit 1\n")
    for exe in ("scontrol", "squeue"):
        (bindir / exe).chmod(0o755)


def test_killwait_is_read_from_scontrol_show_config(tmp_path):
    fake_scontrol(tmp_path / "bin", {"'show config'": "ClusterName = c\nKillWait = 45 sec\n"
                                                        "MinJobAge = 300 sec"})
    assert kill_wait(10, environ={"PATH": str(tmp_path / "bin")}) == 45.0
    assert kill_wait(10, environ={"PATH": str(tmp_path / "nothing")}) is None


TRAIN = """
import sys
import torch
import kempner_resilience as kr

cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", "requeue.time_limit_stop=false",
                                "watchdog.hang_timeout_s=0"])
torch.manual_seed(0)
with kr.ResilientRun(cfg, state={"model": torch.nn.Linear(256, 256)}) as run:
    for step in run.steps(int(sys.argv[2])):
        pass
    run.save()
print("done at", run.step, flush=True)
"""


def slurm_like_env(tmp_path: Path) -> dict[str, str]:
    """An srun task of job 5 (USR1@5, KillWait 45 s), with no real SLURM to be reached."""
    script = "#!/bin/bash\n#SBATCH --time=10\n#SBATCH --signal=USR1@5\nsrun python t.py\n"
    fake_scontrol(tmp_path / "bin", {
        "'show -o'": "JobId=5 JobName=t JobState=RUNNING Requeue=1 Restarts=0 "
                     "TimeLimit=00:10:00 EndTime=2030-01-01T00:00:00 Partition=low",
        "'write batch_script'": script,
        "'show config'": "KillWait                = 45 sec"})
    e = {k: v for k, v in env().items() if not k.startswith("SLURM")}
    return e | {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_JOB_ID": "5",
                "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                "SLURM_OPEN_MODE": "a"}


def test_start_up_and_doctor_warn_when_the_measured_save_cannot_fit_in_the_signal_lead(
        tmp_path, monkeypatch):
    script, ckpt = write_script(tmp_path, TRAIN), tmp_path / "ckpt"
    # The first attempt, in this process (outside SLURM), saves a real checkpoint at step 3.
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    cfg = kr.load_config(overrides=[f"checkpoint.dir={ckpt}"])
    with kr.ResilientRun(cfg, state={"model": torch.nn.Linear(256, 256)},
                         exit_mode="raise") as run:
        for _ in run.steps(3):
            pass
        run.save()

    # doctor inside the job, before the next attempt: it reads the checkpoint that attempt
    # resumes from.
    e = slurm_like_env(tmp_path)
    doctor = run_script([sys.executable, "-m", "kempner_resilience.cli", "doctor", "--set",
                             f"checkpoint.dir={ckpt}", "--set",
                             "requeue.time_limit_stop=false"], env=e, capture_output=True,
                            text=True, timeout=120)
    [said] = [line for line in doctor.stdout.splitlines() if "[signal-lead-short]" in line]
    assert "fix: ask for `#SBATCH --signal=USR1@120`" in doctor.stdout

    second = run_script([sys.executable, str(script), str(ckpt), "6"], env=e,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "done at 6" in second.stdout, second.stderr
    [warning] = [line for line in second.stderr.splitlines() if "[signal-lead-short]" in line]
    for number in ("GiB; last save", "GiB/s", "--signal=USR1@5", "KillWait 45 s",
                   "up to 60 s earlier"):
        assert number in warning, number
    assert "fix: ask for `#SBATCH --signal=USR1@120`" in second.stderr

    def estimate(text: str) -> str:
        return re.search(r"estimated emergency save ([\d.]+) s", text).group(1)

    assert estimate(said) == estimate(warning)     # the same verdict from the same save
