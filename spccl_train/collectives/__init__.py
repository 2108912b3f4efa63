"""Exact sparse collectives: all-gather, reduce-scatter and all-reduce over Pici, COO or dense.

``all_gather_into_tensor``, ``reduce_scatter_tensor`` and ``all_reduce`` take the arguments of
their ``torch.distributed`` namesakes plus a :class:`CollectiveConfig`; ``all_gather_single`` and
``reduce_scatter_single`` (torch 2.13's new names) are the same two functions. Layers inside:
:mod:`.chunking` (how tensors are cut), :mod:`.exchange` (the one planning exchange),
:mod:`.plan` (format and size of every message), :mod:`.cost` (the model behind ``auto``),
:mod:`.topology` (nodes), :mod:`.context` (what a call on a group runs with: transport, nodes,
cost model), :mod:`.stats` (what a call reports), :mod:`.graphs` (CUDA-graph replay of calls
planned from bounds), :mod:`.hierarchical` (the two-level algorithm) and the ring and direct
executors. Design:
``docs/ARCHITECTURE.md``.
"""

from .api import (
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    last_stats,
    reduce_scatter_single,
    reduce_scatter_tensor,
)
from .choice import Candidate, choose
from .chunking import ChunkLayout, Span
from .config import CollectiveConfig
from .context import learned_corrections, measure_links, release_holds, spans_nodes
from .cost import CodecCost, CostModel, LinkCost
from .encoded import EncodedPieces
from .graphs import cached_graphs, clear_graphs, clearing_graphs
from .plan import Message, Messages, Phase, Plan, Route, Step, plan_all_gather, plan_reduce_scatter
from .stats import CollectiveStats, CollectiveWork
from .thresholds import DEFAULT_THRESHOLDS, ResolvedThresholds, Thresholds
from .topology import Topology

__all__ = [
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "CollectiveConfig",
    "Thresholds",
    "ResolvedThresholds",
    "DEFAULT_THRESHOLDS",
    "CollectiveWork",
    "CollectiveStats",
    "last_stats",
    "measure_links",
    "learned_corrections",
    "release_holds",
    "spans_nodes",
    "clear_graphs",
    "clearing_graphs",
    "cached_graphs",
    "ChunkLayout",
    "EncodedPieces",
    "Candidate",
    "choose",
    "Span",
    "CostModel",
    "LinkCost",
    "CodecCost",
    "Message",
    "Messages",
    "Phase",
    "Plan",
    "Route",
    "Step",
    "plan_all_gather",
    "plan_reduce_scatter",
    "Topology",
]
