"""srun task for the SLURM tests: wait for SIGUSR1 and record it, plus the preflight findings.

usage: probe_signal.py OUT_DIR   (writes ready_<rank>, got_<rank>.json)
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

from kempner_resilience.slurm import SlurmJob, preflight, setup_torch_env

out = Path(sys.argv[1])
job = SlurmJob.from_env()
assert job is not None
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(signal.Signals(s).name))
findings = [f.code for f in preflight()]
env = dict(os.environ)
setup_torch_env(job, env)
(out / f"ready_{job.procid}").write_text(str(os.getpid()))
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
(out / f"got_{job.procid}.json").write_text(json.dumps({
    "signals": got, "findings": findings, "master_port": env.get("MASTER_PORT"),
    "open_mode": job.open_mode, "step_id": job.step_id}))
sys.exit(0 if got else 4)
