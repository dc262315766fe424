"""srun task for the SLURM tests: requeue the own job on the first run only.

usage: probe_requeue.py OUT_DIR [ONLY_ARRAY_TASK]
Writes OUT_DIR/run_<requeue_id>_<restart>.json; on restart 0 (and, for arrays, only in task
ONLY_ARRAY_TASK) calls requeue_job and then waits to be killed by the requeue.
"""
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

from kempner_resilience.config import RequeueConfig
from kempner_resilience.exitcodes import Ending, Facts, Saved, exit_code
from kempner_resilience.slurm import SlurmJob, requeue_job

out = Path(sys.argv[1])
only = sys.argv[2] if len(sys.argv) > 2 else None
job = SlurmJob.from_env()
assert job is not None
tag = f"{job.requeue_id}_{job.restart_count}"
record = {"job": dataclasses.asdict(job), "requeue_id": job.requeue_id}
wants = job.restart_count == 0 and (only is None or job.array_task_id == only)
# `scontrol requeue` SIGTERMs the job's tasks within milliseconds, often before requeue_job has
# returned: note the SIGTERM (as the library's shutdown handler would) so the record is written.
terminated = []
signal.signal(signal.SIGTERM, lambda s, f: terminated.append(s))
if wants:
    res = requeue_job(job, RequeueConfig(scontrol_timeout_s=10, retries=1))
    # The code a run would exit with for this verdict: the one table's.
    code = exit_code(Facts(Ending.SIGNAL, signum=signal.SIGUSR1, saved=Saved.COMMITTED,
                           requeue=res.verdict))
    record["result"] = dataclasses.asdict(res) | {"exit_code": int(code)}
(out / f"run_{tag}.json").write_text(json.dumps(record))
if wants and record["result"]["ok"]:
    deadline = time.monotonic() + 30
    while not terminated and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(143 if terminated else 3)
sys.exit(0 if not wants else int(record["result"]["exit_code"]))
