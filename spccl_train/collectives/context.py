"""What a call on a group runs with: the group's transport, its nodes, its cost model and the
corrections its measured model learned. Every rank resolves these alike (or the planning exchange,
which compares the nodes each rank resolved, raises on every rank)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..transport import P2PTransport
from .config import CollectiveConfig
from .cost import CostModel
from .feedback import Corrections
from .links import Measured, measured_model
from .state import Memo, group_state, state_of
from .topology import Topology

__all__ = [
    "corrections_of",
    "group_ranks_per_node",
    "learned_corrections",
    "measure_links",
    "model_of",
    "nodes_code",
    "ranks_per_node",
    "release_holds",
    "spans_nodes",
    "transport_of",
]


def transport_of(group: dist.ProcessGroup | None) -> P2PTransport:
    """The group's transport, made once per group object (:func:`~.state.group_state`). A group
    kept past ``destroy_process_group`` gets the not-initialised error, not its old state."""
    if group is not None and not dist.is_initialized():
        P2PTransport(group)  # raises the not-initialised error
    return group_state(group).transport


def nodes_code(rpn: int | None) -> str:
    """The nodes as this rank resolves them (``rpn``: :func:`ranks_per_node`, from the environment
    when the config leaves them open), for the config code the planning exchange compares: ranks
    that disagree raise alike."""
    return f"|nodes of {rpn}"


def ranks_per_node(config: CollectiveConfig, transport: P2PTransport) -> int | None:
    """``config.ranks_per_node``, else what the launch says (emulated nodes'
    ``SPCCL_RANKS_PER_NODE``, or torchrun's ``LOCAL_WORLD_SIZE``: global ranks
    ``[k * L, (k + 1) * L)`` share node ``k``), read for this group's members; else one node."""
    if config.ranks_per_node is not None:
        return config.ranks_per_node
    for name in ("SPCCL_RANKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) >= 1:
            launch = int(value)
            known = state_of(transport).nodes
            if launch not in known:  # an O(world) pass over the members, once per group and figure
                known[launch] = group_ranks_per_node(transport.global_ranks, launch)
            return known[launch]
    return None


def spans_nodes(config: CollectiveConfig, group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` spans nodes as its calls of ``config`` see them (:func:`ranks_per_node`):
    some hop crosses a node boundary."""
    transport = transport_of(group)
    return Topology(transport.world, ranks_per_node(config, transport)).nodes > 1


def group_ranks_per_node(global_ranks: Sequence[int], launch_ranks_per_node: int) -> int | None:
    """A group's ranks per node, from its members' global ranks (in group order) on nodes of
    ``launch_ranks_per_node`` consecutive global ranks: the size of its per-node blocks when the
    members of each node are consecutive in the group and every block but the last is equally
    large (a data-parallel group beside tensor parallelism: ``[0, 4, 8, 12]`` on nodes of 8 gives
    2); ``None`` (one node) when all share one node; 1 (every hop across nodes, the cautious
    reading) when they span nodes in blocks that consecutive ranks per node cannot describe."""
    nodes = [g // launch_ranks_per_node for g in global_ranks]
    runs: list[int] = []
    for i, node in enumerate(nodes):
        if i and node == nodes[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    if len(runs) < 2:
        return None  # one node
    size = runs[0]
    together = len(runs) == len(set(nodes))  # each node's members consecutive in the group
    return size if together and all(run == size for run in runs[:-1]) and runs[-1] <= size else 1


def model_of(config: CollectiveConfig, transport: P2PTransport, topology: Topology, device: torch.device) -> Measured:
    """The cost model of this call, with the tag that names it in memoised decisions (and, for
    the measured model, the probe's figures)."""
    if isinstance(config.cost_model, CostModel):
        return Measured(model=config.cost_model, tag="given", links=None)
    if config.cost_model == "measured" and transport.world > 1:
        return measured_model(transport, topology, transport.exchange_device(device))
    found = _default_models.get(device.type)
    if found is None:
        model = CostModel.default(device)
        found = _default_models.put(device.type, Measured(model=model, tag=f"default:{device.type}", links=None))
    return found


_default_models = Memo("default models", 16)


def corrections_of(config: CollectiveConfig, transport: P2PTransport) -> Corrections | None:
    """The group's :class:`~.feedback.Corrections` when its model is the measured one, else ``None``."""
    if config.cost_model != "measured" or transport.world < 2:
        return None
    return state_of(transport).corrections


def learned_corrections(group: dist.ProcessGroup | None = None) -> Corrections:
    """What the collectives of ``group`` learned from their observed times (:mod:`.feedback`):
    the factors their measured model's predictions are multiplied by, by kind of call."""
    return corrections_of(CollectiveConfig(cost_model="measured"), transport_of(group)) or Corrections()


def release_holds(group: dist.ProcessGroup | None = None) -> None:
    """End every native hold of ``group`` (``check_calls="first"``): the next call of each shape
    held native is decided again, and exchanges its counts to see its data unless no data could
    make a sparse candidate win it. A hold otherwise lasts up to 16 calls of its shape
    (:class:`~.state.NativeHolds`), and sees no data meanwhile. Call it where
    the data's sparsity is known to change (pruning that begins after dense steps), on every
    rank of the group between the same two calls: ranks that disagree on a hold hang, one rank
    in the native collective and another in the exchange."""
    state_of(transport_of(group)).holds.release()


def measure_links(
    group: dist.ProcessGroup | None = None,
    config: CollectiveConfig | None = None,
    device: torch.device | None = None,
) -> Measured:
    """The cost model the collectives of ``group`` use under ``config`` (default: measured), and
    the probe's figures: link bandwidth and latency per hop kind, the exchange latency, the codecs.

    Collective: every rank of the group calls it (the first call per group probes; the
    collectives reuse what it measured). ``device`` is the device the collectives will run on
    (default: the current CUDA device under NCCL, else the CPU). For a model that is not
    measured (``config.cost_model`` a :class:`CostModel` or ``"default"``), no probe runs and
    the result names that model with no link figures.
    """
    config = config or CollectiveConfig()
    transport = transport_of(group)
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device()) if transport.backend == "nccl" else torch.device("cpu")
        )
    return model_of(config, transport, Topology(transport.world, ranks_per_node(config, transport)), device)
