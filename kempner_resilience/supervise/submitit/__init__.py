"""The submitit backend: jobs submitted from Python, supervised by our controller (local) or by
the srun step loop (SLURM), each task's ending turned into the policy's evidence."""
