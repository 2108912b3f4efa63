"""torch's one-tensor dense collectives under whichever name this torch has.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (same semantics) and warns on the old names; torch 2.11 has only the
old ones. Everything in the package (and its benchmarks) calls these two, so neither torch warns.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat"]

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
