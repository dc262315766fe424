"""Adapters for launchers other than plain sbatch/srun."""
