"""spccl-train: exact sparse collectives (Pici / COO) and a sparse-gradient training plugin."""

from . import formats
from ._version import __version__
from .collectives import (
    CollectiveConfig,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    reduce_scatter_single,
    reduce_scatter_tensor,
)
from .sparse_config import SparseConfig

__all__ = [
    "formats",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "CollectiveConfig",
    "SparseConfig",
    "__version__",
]
