"""Hierarchical collectives: inside each node, across nodes, inside each node again.

For a group of ``N`` nodes of ``L`` consecutive ranks (``ranks_per_node``), node ``k``'s local
rank ``l`` being group rank ``k * L + l``:

1. **Reduce-scatter inside the node** (over NVLink on a real cluster): local rank ``l`` gets the
   node's sum of slice ``l`` (of ``L`` equal slices; the tensor is padded to a multiple of ``L``
   in a copy when its length is not one).
2. **All-reduce across nodes** of that slice, among the ``N`` ranks of local rank ``l`` (one per
   node): only these bytes cross the network, ``1 / L`` of the tensor, each reduced over its
   node already. This is where fill-in matters: the node sums are denser than the ranks' inputs,
   and the sub-call's own ``auto`` (with the link-aware ``inter`` threshold, every hop being
   inter-node) decides how sparse to send them.
3. **All-gather inside the node** of the reduced slices.

The all-gather and the reduce-scatter take the two steps of their kind, with a transpose of
blocks (one copy) to keep the group's rank order (node-major): an all-gather first across nodes
(``1 / L`` of the flat algorithms' network bytes), then inside the node; a reduce-scatter first
inside the node, then across nodes.

Each step is one of the library's flat collectives on a subgroup (made once per group and
``ranks_per_node``, with ``torch.distributed.new_group``: every rank takes part in making its own
two), with the caller's format, thresholds and channels, and ``auto`` choosing algorithm (ring,
direct or native) per step from that step's counts. Exact, and bit-identical on every rank: step
2's result is bit-identical on the ranks of each slice's group, and step 3 copies bits.

Where the flat algorithms send ``~2 x size x min(1, p x density)`` bytes per rank over the network
once fill-in saturates, this sends ``~2 x size / L x min(1, p x density)``: L times fewer.

``auto`` weighs the all-reduce against the flat algorithms and the native call for every call
planned from counts on a group of several nodes of several ranks (:func:`predict`).
``CollectiveConfig(algorithm="hierarchical")`` asks for it outright, for all three collectives.
Either way the call first makes the flat call's count exchange, which checks every rank's
arguments against the others' (a bad call raises on every rank before any step), and then its
steps' own (:func:`run`, given the API's entry point to call each step with;
:func:`check_request` holds the argument errors every rank finds before the exchange). On one
node, or with one rank per node, it is the flat call.

Not yet: groups other than the default one (making subgroups of a subgroup needs every rank of
the default group, which a call on a subgroup cannot ask for), caller bounds, CUDA graphs (a
hierarchical call runs eagerly), ``planning_group`` (the steps plan on the subgroups, on the
current stream: in the DDP hook's ``overlap="stream"`` each step's exchange waits behind the
previous bucket's transfers), and ``auto`` weighing the all-gather and reduce-scatter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .._timing import Span
from ..transport import P2PTransport
from .chunking import ChunkLayout, piece_arrays
from .config import CollectiveConfig
from .cost import CostModel
from .exchange import exchange_rounds, protocol
from .state import Memo, state_of
from .stats import CollectiveStats, dense_ring_bytes
from .summary import CountSummary, count_levels, round_count
from .topology import Topology

__all__ = [
    "applies",
    "check_hierarchy",
    "check_request",
    "hierarchical_all_gather",
    "hierarchical_all_reduce",
    "hierarchical_reduce_scatter",
    "is_world",
    "predict",
    "run",
    "subgroups",
]


def check_hierarchy(world: int, ranks_per_node: int | None) -> None:
    """Raise ``ValueError`` (naming the values and the fix) where several nodes are not equal
    blocks of ranks (one node, or one rank per node, is the flat call)."""
    if ranks_per_node is not None and 1 < ranks_per_node < world and world % ranks_per_node:
        raise ValueError(
            f"algorithm='hierarchical' needs nodes of equal size: {world} ranks are not a multiple of "
            f"ranks_per_node={ranks_per_node}; set CollectiveConfig.ranks_per_node to the ranks per node"
        )


def applies(topology: Topology) -> bool:
    """Whether the group has two levels: several nodes, of several ranks each, all equal."""
    rpn = topology.ranks_per_node
    return rpn is not None and 1 < rpn < topology.world and topology.world % rpn == 0


def predict(
    config: CollectiveConfig,
    summary: CountSummary,
    dtype: torch.dtype,
    model: CostModel,
    weigh_batch: Callable[..., list],
) -> tuple[float, bool]:
    """The model's time for the hierarchical all-reduce of a flat call's count summary (each rank's
    nonzeros): each step weighed as the flat call it is, with every rank of the step equally dense:

    1. the reduce-scatter inside the densest node (nodes run at once; the densest ends last), at
       its ranks' mean density ``d``;
    2. the all-reduce across nodes of one slice, at that node sum's density ``1 - (1 - d)^L``
       (fill-in as for independent supports, ``L`` ranks per node);
    3. the all-gather inside a node of the slices at the whole sum's density, ``1 - (1 - m)^p``
       for the ranks' mean density ``m``.

    A step's density is rounded to the decision grid (:data:`.summary.DENSITY_STEPS_PER_OCTAVE`)
    and its weighing looked up in the step's curve (:func:`_curve`): made once per step shape,
    config and model, so a new sparsity profile costs three look-ups, O(world) work in all.

    Each step's prediction includes its own planning exchange. Under ``auto`` a step is weighed as
    the direct algorithm or the native call, not as a ring: weighing rings took four fifths of
    this function's time (8 ranks per node: 0.5 of 0.7 ms per new profile), and the step's own
    ``auto`` still picks a ring where it is faster, so the prediction is at most that much above
    the step's (on 4 ranks the ring ran up to 7% faster than the direct call, on NVLink and at two
    ranks slower; ``bench/results/2026-11-26_native/``). Returns the time and whether any step
    would send sparsely (if none does, it is NCCL's work done slower: it never wins).
    The summary's topology must satisfy :func:`applies`.
    """
    layout, topology = summary.layout, summary.topology
    p, local = topology.world, topology.ranks_per_node
    nodes = p // local
    padded = -(-layout.numel // local) * local
    held = summary.held.reshape(nodes, local).sum(1)  # per node: integers, exact
    densest = int(held.argmax())
    node = min(1.0, int(held[densest]) / (local * max(1, layout.numel)))  # its ranks' mean density
    mean = min(1.0, int(held.sum()) / (p * max(1, layout.numel)))
    within, across, gathered = _step_curves(config, padded, local, nodes, layout.channels, dtype, model, weigh_batch)
    per_node = padded // local  # what each rank holds of the steps across nodes and of the gather
    steps = [
        within[round_count(round(node * padded), padded)],
        across[round_count(round((1 - _power(1 - node, local)) * per_node), per_node)],
        gathered[round_count(round((1 - _power(1 - mean, p)) * per_node), per_node)],
    ]
    return sum(t for t, _ in steps), any(sparse for _, sparse in steps)


def _power(x: float, k: int) -> float:
    """``x ** k`` by squaring, each product rounded as IEEE arithmetic rounds it: the same bits on
    every rank (a library ``pow`` may differ in the last bit between machines)."""
    out = 1.0
    while k:
        if k & 1:
            out *= x
        x *= x
        k >>= 1
    return out


def _step_curves(
    config: CollectiveConfig,
    padded: int,
    local: int,
    nodes: int,
    channels: int,
    dtype: torch.dtype,
    model: CostModel,
    weigh_batch: Callable[..., list],
) -> tuple[dict[int, tuple[float, bool]], ...]:
    """The curves (:func:`_curve`) of the three steps of a hierarchical all-reduce of ``padded``
    elements on ``nodes`` nodes of ``local`` ranks: the reduce-scatter inside a node, the
    all-reduce across nodes, the all-gather inside a node. Made once per shape, config and model
    (memoised; ranks make the same curves from the same inputs)."""
    key = (config.fingerprint(), padded, local, nodes, channels, dtype, model, weigh_batch)
    hit = _curves.get(key)
    if hit is None:
        within, across = _within(config), _across(config)
        hit = _curves.put(
            key,
            (
                _curve("reduce_scatter", within, None, padded, local, channels, dtype, model, weigh_batch),
                _curve("all_reduce", across, 1, padded // local, nodes, channels, dtype, model, weigh_batch),
                _curve("all_gather", within, None, padded, local, channels, dtype, model, weigh_batch),
            ),
        )
    return hit


def _curve(
    collective: str,
    cfg: CollectiveConfig,
    rpn: int | None,
    numel: int,
    world: int,
    channels: int,
    dtype: torch.dtype,
    model: CostModel,
    weigh_batch: Callable[..., list],
) -> dict[int, tuple[float, bool]]:
    """A step's weighing, as ``cfg`` on ``world`` ranks (``rpn``: none within a node, one per node
    across), at every count of nonzeros its ranks' density can round to
    (:func:`.summary.count_levels`, about 16 per octave: 450 for 2**28 elements), every rank of the
    step holding that many: ``{count: (seconds, sends sparse)}``. One batch of array work per
    :data:`_BATCH` table elements (a few milliseconds per curve at 8 ranks per node)."""
    sub = ChunkLayout.of(collective, numel, world, channels)
    topology = Topology(world, rpn)
    sizes = piece_arrays(sub)[0].ravel().astype(np.float64)  # [c * channels + k]: a table row's order
    if collective == "all_gather":  # a row's first pieces are its input's
        sizes[channels:] = 0
    held = numel // world if collective == "all_gather" else numel
    counts = count_levels(held)
    rounds = exchange_rounds(protocol(world), collective)  # each step exchanges as its subgroup's size says
    out = {}
    block = max(1, _BATCH // (world * sizes.size))
    for start in range(0, len(counts), block):
        part = counts[start : start + block]
        rows = np.rint(np.multiply.outer(np.array(part) / max(1, held), sizes)).astype(np.int64)  # [b, world * ch]
        table = np.broadcast_to(rows[:, None, :], (len(part), world, sizes.size))
        weighed = weigh_batch(
            CountSummary.of(collective, table, sub, topology, batch=True), cfg, dtype, model, rounds=rounds, rings=False
        )
        for count, (chosen, _) in zip(part, weighed):
            out[count] = (chosen.predicted_s, chosen.algorithm != "native")
    return out


_BATCH = 1 << 21
""":func:`_curve`'s table elements per batch (16 MiB of int64)."""

_curves = Memo("hierarchical curves", 64)
""":func:`_step_curves` by their inputs."""


def is_world(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is the default group (the only parent the subgroups can be made from)."""
    return group is None or group == dist.group.WORLD


def subgroups(transport, ranks_per_node: int) -> tuple:
    """``(intra, inter)`` of this rank: its node, and the ranks of its local rank on every node.

    Made on first use and kept while the group lives. The parent is the default group (checked by
    the caller), and every rank makes every subgroup, all intra-node ones then all inter-node
    ones, in one order: ``torch.distributed.new_group`` is collective over the default group (its
    names come from a counter every rank advances alike, and with a bound NCCL device each is a
    split every rank joins), so all ranks must reach this together, as they do: every rank of the
    group makes the same decision. Subgroup rank ``i`` is node ``i`` (inter) or local rank ``i``
    (intra), as the block transposes of the all-gather and reduce-scatter assume.
    """
    made = state_of(transport).subgroups
    if ranks_per_node not in made:
        world, rank = transport.world, transport.rank
        nodes = world // ranks_per_node
        intra = [dist.new_group(list(range(k * ranks_per_node, (k + 1) * ranks_per_node))) for k in range(nodes)]
        inter = [dist.new_group(list(range(i, world, ranks_per_node))) for i in range(ranks_per_node)]
        node, local = divmod(rank, ranks_per_node)
        made[ranks_per_node] = (intra[node], inter[local])
    return made[ranks_per_node]


def hierarchical_all_reduce(
    tensor: torch.Tensor,
    intra: dist.ProcessGroup,
    inter: dist.ProcessGroup,
    config: CollectiveConfig,
    local_world: int,
    call: Callable[..., object],
) -> list:
    """Sum ``tensor`` over the group in the three steps above; returns the steps' stats.

    ``call(collective, output, input, group, config)`` runs one flat collective synchronously on
    the current stream and returns its stats (the API's own entry point). The flat exchange
    before it made the current stream wait for any planning stream.
    """
    flat = tensor.view(-1)
    n = flat.numel()
    padded = -(-n // local_world) * local_world
    work = flat
    if padded != n:  # equal slices: pad a copy with zeros (they stay zero, sent as nothing)
        work = torch.zeros(padded, dtype=flat.dtype, device=flat.device)
        work[:n].copy_(flat)
    piece = torch.empty(padded // local_world, dtype=flat.dtype, device=flat.device)
    within, across = _within(config), _across(config)
    stats = [call("reduce_scatter", piece, work, intra, within)]
    stats.append(call("all_reduce", piece, piece, inter, across))
    stats.append(call("all_gather", work, piece, intra, within))
    if work is not flat:
        flat.copy_(work[:n])
    return stats


def hierarchical_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    intra: dist.ProcessGroup,
    inter: dist.ProcessGroup,
    config: CollectiveConfig,
    local_world: int,
    call: Callable[..., object],
) -> list:
    """Gather every rank's ``input`` into ``output`` (group rank order): across nodes among the
    ranks of this local rank, then inside the node, then the blocks back to rank order."""
    m = input.numel()
    nodes = output.numel() // (m * local_world)
    across = torch.empty(nodes * m, dtype=input.dtype, device=input.device)  # [node][m], this local rank's
    stats = [call("all_gather", across, input.reshape(-1), inter, _across(config))]
    gathered = torch.empty(output.numel(), dtype=input.dtype, device=input.device)  # [local rank][node][m]
    stats.append(call("all_gather", gathered, across, intra, _within(config)))
    output.view(nodes, local_world, m).copy_(gathered.view(local_world, nodes, m).transpose(0, 1))
    return stats


def hierarchical_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    intra: dist.ProcessGroup,
    inter: dist.ProcessGroup,
    config: CollectiveConfig,
    local_world: int,
    call: Callable[..., object],
) -> list:
    """Sum ``input`` over the group, leaving this rank's chunk in ``output``: the chunks reordered
    by local rank (a copy: ``input`` is never modified), reduced inside the node (local rank ``l``
    gets its node's sums of the chunks of local rank ``l`` on every node), then across nodes."""
    m = output.numel()
    nodes = input.numel() // (m * local_world)
    ordered = input.reshape(nodes, local_world, m).transpose(0, 1).contiguous().view(-1)  # [local rank][node][m]
    node_sums = torch.empty(nodes * m, dtype=input.dtype, device=input.device)
    stats = [call("reduce_scatter", node_sums, ordered, intra, _within(config))]
    stats.append(call("reduce_scatter", output.view(-1), node_sums, inter, _across(config)))
    return stats


def _within(config: CollectiveConfig) -> CollectiveConfig:
    """A step inside one node: the flat algorithms and native, no nodes."""
    return dataclasses.replace(config, algorithm="auto", ranks_per_node=None, cuda_graphs=False)


def _across(config: CollectiveConfig) -> CollectiveConfig:
    """A step among one rank per node: every hop inter-node."""
    return dataclasses.replace(config, algorithm="auto", ranks_per_node=1, cuda_graphs=False)


def check_request(transport: P2PTransport, config: CollectiveConfig, bounds: Sequence[Sequence[int]] | None) -> None:
    """``algorithm="hierarchical"``'s own argument errors, from what every rank shares (the config
    and the group), so every rank raises alike before any exchange. (Unequal nodes are found after
    the exchange, which compares every rank's ``ranks_per_node``.)"""
    if bounds is not None:
        raise ValueError(
            "bounds= is not supported with algorithm='hierarchical' (its steps plan from their own counts); "
            "drop the bounds or use algorithm='auto'"
        )
    if not is_world(transport.group) and transport.world > 1:
        raise ValueError(
            "algorithm='hierarchical' runs on the default group only (its node subgroups are made from it); "
            "call it with group=None, or use algorithm='auto' on this group"
        )


def _run_steps(
    collective: str,
    transport: P2PTransport,
    config: CollectiveConfig,
    ranks_per_node: int,
    inp: torch.Tensor,
    out: torch.Tensor,
    call: Callable[..., CollectiveStats],
) -> list[CollectiveStats]:
    """Run a hierarchical call's flat steps on the node subgroups; their stats. ``call`` as for
    :func:`hierarchical_all_reduce`."""
    intra, inter = subgroups(transport, ranks_per_node)
    if collective == "all_reduce":
        return hierarchical_all_reduce(inp, intra, inter, config, ranks_per_node, call)
    if collective == "all_gather":
        return hierarchical_all_gather(out, inp, intra, inter, config, ranks_per_node, call)
    return hierarchical_reduce_scatter(out, inp, intra, inter, config, ranks_per_node, call)


def run(
    call: Callable[..., CollectiveStats],
    collective: str,
    transport: P2PTransport,
    config: CollectiveConfig,
    topology: Topology,
    inp: torch.Tensor,
    out: torch.Tensor,
    timer: Span,
    flat_s: float,
    chosen: tuple[float, dict[str, float]] | None,
    how: str,
    received: int,
    learn: Callable[[Span], None] | None = None,
) -> tuple[CollectiveStats, torch.cuda.Event | None]:
    """Run a hierarchical call's steps after its flat exchange (by protocol ``how``, which
    delivered ``received`` bytes); their stats, summed. ``call(collective, output, input, group,
    config)`` runs one flat step synchronously and returns its stats (the API's own entry point).
    ``chosen``: what ``auto`` predicted (and weighed) when it chose it; ``None`` when it was asked
    for (the steps' predictions plus ``flat_s``, the flat exchange's). ``learn(timer)`` runs once
    the call is timed."""
    parts = _run_steps(collective, transport, config, topology.ranks_per_node, inp, out, call)
    event = timer.stop()
    if learn is not None:
        learn(timer)
    if chosen is None:
        predicted = sum(part.predicted_s for part in parts) + flat_s
        chosen = (predicted, {"hierarchical": predicted})
    chunk = (out.numel() if collective == "all_gather" else inp.numel()) // transport.world  # the layout's
    stats = _summed(collective, transport, chunk, inp.element_size(), parts, timer, *chosen, how, received)
    return stats, event


def _summed(
    collective: str,
    transport: P2PTransport,
    chunk: int,
    element_size: int,
    parts: list[CollectiveStats],
    timer: Span,
    predicted: float,
    candidates: dict[str, float],
    how: str,
    received: int,
) -> CollectiveStats:
    """One call's stats from its steps' (after the flat exchange, by protocol ``how``, which
    delivered ``received`` bytes: one more). ``chunk``: elements per rank's chunk, for the dense
    ring's bytes."""
    p = transport.world
    statuses = [part._statuses for part in parts if part._statuses is not None]
    return CollectiveStats(
        collective=collective,
        algorithm="hierarchical",
        format=parts[0 if collective == "all_gather" else 1].format,  # the step that crosses the network
        plan=None,
        predicted_s=predicted,
        candidates=candidates,
        exchanges=1 + sum(part.exchanges for part in parts),
        gather_counts="",
        bytes_sent=sum(part.bytes_sent for part in parts),
        dense_bytes=dense_ring_bytes(collective, p * chunk, p, element_size),
        graph="",
        _statuses=torch.cat(statuses) if statuses else None,
        _timer=timer,
        steps=tuple(parts),
        exchange=how,
        exchange_bytes=received + sum(part.exchange_bytes for part in parts),
    )
