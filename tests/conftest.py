import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm_fixtures import multinode_cluster, slurm_cluster  # noqa: E402,F401  (real clusters)
