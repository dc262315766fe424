"""srun task for the SLURM tests: record what SlurmJob.from_env and setup_torch_env see.

usage: probe_env.py OUT_DIR   (writes OUT_DIR/rank<PROCID>.json)
"""
import dataclasses
import json
import os
import sys
from pathlib import Path

from kempner_resilience.slurm import SlurmJob, setup_torch_env

job = SlurmJob.from_env()
assert job is not None, "not inside a SLURM job"
env = dict(os.environ)
was_set = setup_torch_env(job, env)
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
record = {"job": dataclasses.asdict(job), "requeue_id": job.requeue_id, "set": was_set,
          "torch_env": {k: env.get(k) for k in keys}, "end_time": job.end_time(),
          "signal_spec": str(job.signal_spec()[1])}
Path(sys.argv[1], f"rank{job.procid}.json").write_text(json.dumps(record))
