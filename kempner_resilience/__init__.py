"""kempner_resilience: keep long PyTorch training jobs on SLURM alive without losing work.

The public surface: ``load_config`` and ``ResilienceConfig`` (configuration), ``ResilientRun``
(the object a training script uses), ``ShutdownHandler`` (signals alone), ``exitcodes``.
"""

from kempner_resilience import exitcodes
from kempner_resilience.config import Action, ConfigError, ResilienceConfig, load_config
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.run import ResilientRun
from kempner_resilience.signals import ShutdownHandler, ShutdownRequest

__version__ = "0.1.0"
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
