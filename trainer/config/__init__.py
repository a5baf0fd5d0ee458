"""The job's configuration, torch-free: its sections (`sections.py`), loading them from defaults, TOML and
the command line (`loading.py`), `--help` (`help_text.py`), and the config-derived facts the pre-flight checks
before any process starts: data files, the pipeline setup, the host-memory floor."""

from .loading import did_you_mean, load_config, parse_value, save_config, to_toml
from .sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)

__all__ = [
    "ActivationCheckpoint", "Checkpoint", "Comm", "Compile", "Job", "JobConfig", "LRScheduler", "Metrics", "Model",
    "Optimizer", "Parallelism", "Profiling", "Training", "Validation",
    "did_you_mean", "load_config", "parse_value", "save_config", "to_toml",
]  # fmt: skip
