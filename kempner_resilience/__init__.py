"""kempner_resilience: keep long PyTorch training jobs on SLURM alive without losing work.

The public surface: ``load_config`` and ``ResilienceConfig`` (configuration), ``ResilientRun``
(the object a training script uses), ``ShutdownHandler`` (signals alone), ``exitcodes``.
"""

import os as _os

from kempner_resilience import exitcodes
from kempner_resilience.config import Action, ConfigError, ResilienceConfig, load_config
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.run import ResilientRun
from kempner_resilience.signals import ShutdownHandler, ShutdownRequest

__version__ = "0.1.0"

if "SLURM_JOB_ID" in _os.environ:
    # A --signal warning during start-up (imports, model build) must not kill the rank.
    from kempner_resilience.signals import install_early_recorder as _early

    _early()
__all__ = [
    "Action",
    "ConfigError",
    "ExitCode",
    "ResilienceConfig",
    "ResilientRun",
    "ShutdownHandler",
    "ShutdownRequest",
    "exitcodes",
    "load_config",
    "__version__",
]
