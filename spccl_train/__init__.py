"""spccl-train: exact sparse collectives (Pici / COO) and a sparse-gradient training plugin."""

from . import formats

__all__ = ["formats", "__version__"]

__version__ = "0.1.0"
