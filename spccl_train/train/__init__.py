"""The training plugin: YAML experiment configs, offline data, the DDP trainer and run reports.

Entry point: the ``spccl-train`` command (:mod:`spccl_train.cli`).
"""

from .config import ConfigError, ExperimentConfig, load_config
from .data import DataError

__all__ = ["ConfigError", "DataError", "ExperimentConfig", "load_config"]
