"""Typed configuration: dataclass sections (``schema``), YAML loading and dotted overrides
(``load``), plain-data conversion with precise errors (``serial``), generated docs (``render``)."""

from kempner_resilience.config.load import load_config
from kempner_resilience.config.render import render_default_yaml, render_reference_markdown
from kempner_resilience.config.schema import (ENV_CONFIG, Action, CheckpointConfig, ConfigError,
                                              ConfigFileNotFoundError, DirectIOMode, ExitMode,
                                              IntegrationsConfig, RequeueConfig, RescueConfig,
                                              ResilienceConfig, SignalsConfig, StagingMode,
                                              WatchdogConfig, normalize_signal)

__all__ = ["Action", "CheckpointConfig", "ConfigError", "ConfigFileNotFoundError", "DirectIOMode",
           "ExitMode", "IntegrationsConfig", "RequeueConfig", "RescueConfig", "ResilienceConfig",
           "SignalsConfig", "StagingMode", "WatchdogConfig", "ENV_CONFIG",
           "load_config", "normalize_signal", "render_default_yaml", "render_reference_markdown"]
