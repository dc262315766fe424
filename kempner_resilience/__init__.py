"""kempner_resilience: keep long PyTorch training jobs on SLURM alive without losing work.

The public surface: ``load_config`` and ``ResilienceConfig`` (configuration), ``ResilientRun``
(the object a training script uses), ``ResumableLoader`` (a DataLoader that resumes
mid-epoch; imported on first use, as it needs torch), ``ShutdownHandler`` (signals alone), ``exitcodes``,
``StartupError`` (what ends a script with exit code 78).

Import it first in a training script: the start-up guards below are then in place while torch
and the model load.
"""

import os as _os

# First, before this package or the script imports anything heavy: a --signal warning that
# arrives during the rest of start-up (torch, the model) is recorded instead of killing the rank.
from kempner_resilience.core import startup as _startup

if "SLURM_JOB_ID" in _os.environ:
    _startup.install_early_recorder()
_startup.install_exit_hook()

from kempner_resilience import exitcodes  # noqa: E402
from kempner_resilience.config import (Action, ConfigError, ExitMode, ResilienceConfig,  # noqa: E402
                                       load_config)
from kempner_resilience.exitcodes import ExitCode  # noqa: E402
from kempner_resilience.run.resilient import ResilientRun  # noqa: E402
from kempner_resilience.stop.signals import ShutdownHandler, ShutdownRequest  # noqa: E402
from kempner_resilience.core.startup import StartupError  # noqa: E402

from kempner_resilience.core.version import __version__  # noqa: E402

__all__ = [
    "Action",
    "ConfigError",
    "ExitCode",
    "ExitMode",
    "ResilienceConfig",
    "ResilientRun",
    "ResumableLoader",
    "ShutdownHandler",
    "ShutdownRequest",
    "StartupError",
    "exitcodes",
    "load_config",
    "__version__",
]


def __getattr__(name: str):
    # torch loads in seconds; `import kempner_resilience` stays light until this is used.
    if name == "ResumableLoader":
        from kempner_resilience.checkpoint.data import ResumableLoader

        return ResumableLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
