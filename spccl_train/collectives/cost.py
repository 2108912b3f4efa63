"""The cost model behind ``"auto"``: Hockney alpha-beta terms per hop kind plus codec throughputs.

A plan's time is predicted step by step. In a ring step every rank encodes what it sends
(reduce-scatter steps and the first gather step; forwarded gather payloads are not re-encoded),
puts it on the link (``latency + bytes / bandwidth`` of the intra- or inter-node link) and decodes
what it receives (accumulate in a reduction, overwrite in a gather); the step takes as long as
its slowest rank, and steps add up. A direct step (one all-to-all or all-gather per wave of
pieces) costs each rank its encodes, then the larger of its outgoing and incoming wire time (at
the links' collective bandwidth) plus one latency per wave (its messages start together), then
its decodes; the slowest rank sets the time. The dense baseline (the native
``torch.distributed`` collective) is a ring at the slowest link's collective bandwidth. Every prediction
includes the count passes and planning exchanges (one; two for a sparse all-reduce); the dense
baseline pays one too, since the call counts before it can choose.

It is deliberately simple: pieces are assumed not to overlap (so it over-predicts sparse plans
on GPUs, where compression overlaps transfers), and throughputs do not depend on sparsity. The
defaults lean towards dense for that reason (see :meth:`CostModel.default`): ``auto`` should
only leave dense when the predicted win is clear. Every field is configurable; pass a :class:`CostModel` with figures measured on
your machine in ``CollectiveConfig.cost_model``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..formats import Format
from ..formats.layout import element_size
from .plan import Message, Phase, Plan, Route, Step
from .topology import Topology

__all__ = ["LinkCost", "CodecCost", "CostModel", "NativeCost"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkCost:
    """Hockney terms of one kind of link, as seen by one rank."""

    latency_s: float
    """Start-up time of one message (alpha), seconds."""
    bandwidth: float
    """Bytes per second one rank pushes in one direction (1 / beta), point to point (a ring step)."""
    collective_bandwidth: float | None = None
    """The same through the backend's collectives (the direct algorithm's all-to-all and
    all-gather, and the native call); ``None``: ``bandwidth``. They differ on NCCL's socket
    transport, where collectives spread over more channels than point-to-point calls."""

    def __post_init__(self) -> None:
        _positive(self, "latency_s", allow_zero=True)
        _positive(self, "bandwidth")
        if self.collective_bandwidth is not None:
            _positive(self, "collective_bandwidth")

    @property
    def grouped_bandwidth(self) -> float:
        """Bandwidth through the backend's collectives."""
        return self.collective_bandwidth or self.bandwidth

    def seconds(self, nbytes: int) -> float:
        """``alpha + n * beta``."""
        return self.latency_s + nbytes / self.bandwidth


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NativeCost:
    """The backend's own all-reduce on one group, timed whole.

    NCCL's collectives pick their own algorithm, protocol and channels, and over sockets they
    reach far less than point-to-point transfers do: 4 ranks as 4 emulated nodes on one H200
    (2026-11-26), the probe's ring of sends pushed 4.83 GB/s per rank and NCCL's all-reduce
    0.62 GB/s. Predicted from the links, the native call looked 8x faster than it ran and ``auto``
    fell back to it at 90% sparsity, 3.3x slower than sparse. So the measured model times the
    native call itself, on the group it prices."""

    topology: Topology
    """The group it was timed on: the figures hold for calls on that group only."""
    latency_s: float
    """A tiny all-reduce, seconds."""
    bandwidth: float
    """Bytes one rank pushes per second, counted as a ring's: ``2 (p - 1) / p`` of the tensor per
    all-reduce. An all-gather or reduce-scatter is priced as half an all-reduce (one ring, half the
    start-up)."""

    def __post_init__(self) -> None:
        _positive(self, "latency_s", allow_zero=True)
        _positive(self, "bandwidth")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CodecCost:
    """Throughputs of one sparse format's codec, in dense-equivalent bytes per second."""

    compress: float
    """Dense bytes read per second when encoding."""
    decompress: float
    """Dense bytes written per second when decoding (overwrite)."""
    accumulate: float
    """Dense bytes per second when decoding into a sum (scatter-add)."""
    call_s: float
    """Fixed cost of one encode or decode call (kernel launch or host overhead), seconds."""

    def __post_init__(self) -> None:
        for name in ("compress", "decompress", "accumulate"):
            _positive(self, name)
        _positive(self, "call_s", allow_zero=True)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Link and codec speeds; :meth:`default` gives conservative figures per device type."""

    intra: LinkCost
    """Links between ranks of one node."""
    inter: LinkCost
    """Links between nodes (per rank)."""
    pici: CodecCost
    """Pici codec."""
    coo: CodecCost
    """COO codec."""
    reduce: float
    """Dense element-wise sum, result bytes per second."""
    copy: float
    """Dense copy, bytes per second."""
    count: float
    """The nonzero-count pass before each planning exchange, dense bytes read per second."""
    exchange_s: float
    """One planning exchange: an all-gather of a few counts, a host synchronisation, and the
    host's planning and launching around it."""
    step_s: float = 0.0
    """Fixed cost of each step of a SpCCL plan (a ring step, a direct exchange): the host's
    launches while the device, just synchronised, waits for them. The native collective is one
    call and does not pay it."""
    native: NativeCost | None = None
    """The native all-reduce as measured on one group (:mod:`.links`): it prices native calls on
    groups of its topology (the measured model is the group's own); ``None``, or a call of another
    topology (a hierarchical step's subgroup): predicted as a ring over the links."""

    def __post_init__(self) -> None:
        _positive(self, "reduce")
        _positive(self, "copy")
        _positive(self, "count")
        _positive(self, "exchange_s", allow_zero=True)
        _positive(self, "step_s", allow_zero=True)

    @classmethod
    def default(cls, device: torch.device | str) -> CostModel:
        """Conservative defaults for ``device``'s type.

        Conservative for ``auto`` means never under-rating dense: links at their measured speed
        (slower links would favour sending less), codecs at about half theirs, and planning
        exchanges (which a sparse all-reduce pays twice) at about twice theirs.

        CUDA (H200 measurements in ``GPU.md``, ``bench/results/`` and on 2 H200s): NVLink
        350 GB/s and 20 us per message; network 25 GB/s and 20 us (one 200 Gb/s NIC per GPU);
        Pici encode / decode / accumulate 1.0 / 1.2 / 0.8 TB/s (measured 2.1 / 2.5 / 1.6 TB/s on
        64 MiB fp32), COO 0.8 / 0.6 / 0.6 TB/s; 40 us per codec call and 100 us per plan step
        (fitted to the fixed costs of 64 and 256 MiB calls at 99.9% on 4 H200s, 2026-11-22:
        about +0.45 ms for a direct all-reduce and +0.9 ms for a ring one over the native
        call); dense sums 1 TB/s, copies 2 TB/s; the count pass 1 TB/s (measured 4.4 TB/s with
        the Triton count); 0.5 ms per planning exchange (the native call through SpCCL measured
        0.3-0.5 ms above NCCL's own at 64 MiB).

        CPU (gloo over TCP and the pure-torch reference codec): 1 GB/s and 100 us intra-node,
        0.5 GB/s and 200 us inter-node; Pici 0.05 / 0.1 / 0.1 GB/s, COO 0.25 / 0.5 / 0.5 GB/s,
        150 us per codec call; sums 5 GB/s, copies 10 GB/s, counts 2 GB/s; 1.5 ms per exchange.
        """
        if torch.device(device).type == "cuda":
            return cls(
                intra=LinkCost(latency_s=20e-6, bandwidth=350e9),
                inter=LinkCost(latency_s=20e-6, bandwidth=25e9),
                pici=CodecCost(compress=2.5e12, decompress=2.5e12, accumulate=2.0e12, call_s=40e-6),
                coo=CodecCost(compress=1.5e12, decompress=1.2e12, accumulate=1.2e12, call_s=40e-6),
                reduce=1.0e12,
                copy=2.0e12,
                count=3.0e12,
                exchange_s=0.5e-3,
                step_s=100e-6,
            )
        return cls(
            intra=LinkCost(latency_s=100e-6, bandwidth=1e9),
            inter=LinkCost(latency_s=200e-6, bandwidth=0.5e9),
            pici=CodecCost(compress=0.05e9, decompress=0.1e9, accumulate=0.1e9, call_s=150e-6),
            coo=CodecCost(compress=0.25e9, decompress=0.5e9, accumulate=0.5e9, call_s=150e-6),
            reduce=5e9,
            copy=10e9,
            count=2e9,
            exchange_s=1.5e-3,
        )

    def replayed(self) -> CostModel:
        """This model for calls replayed from a CUDA graph (``CollectiveConfig.cuda_graphs`` with
        bounds): the host launches nothing per codec call or plan step, so those fixed costs
        shrink to the device's gap between graph nodes, taken as 5 us each (at most the eager
        figures). Fitted on 4 H200s (2026-11-22): replayed direct Pici all-reduces of 64 MiB,
        256 MiB and 1 GiB at 99% took 0.195, 0.424 and 1.349 ms, about 0.12 ms fixed, which
        the link latencies alone (20 us per peer and step) already account for."""
        gap = 5e-6
        return dataclasses.replace(
            self,
            pici=dataclasses.replace(self.pici, call_s=min(self.pici.call_s, gap)),
            coo=dataclasses.replace(self.coo, call_s=min(self.coo.call_s, gap)),
            step_s=min(self.step_s, gap),
        )

    def fingerprint(self) -> str:
        """Canonical text of every figure (part of the config check across ranks; made once per
        model, since every call of a config asks for it)."""
        return _fingerprint(self)

    def codec(self, fmt: Format) -> CodecCost:
        """The codec costs of a sparse format."""
        return self.pici if fmt is Format.PICI or fmt == "pici" else self.coo

    def link(self, inter_node: bool) -> LinkCost:
        """The link kind of a hop."""
        return self.inter if inter_node else self.intra

    def planning(self, collective: str, numel: int, dtype: torch.dtype, world: int, exchanges: int = 1) -> float:
        """Seconds of the count passes and exchanges before data moves.

        The first pass counts what this rank holds (the all-gather input: ``numel / world``
        elements; else all ``numel``); an all-reduce's second counts its reduced chunk.
        """
        if exchanges <= 0:
            return 0.0
        size = element_size(dtype)
        held = numel // world if collective == "all_gather" else numel
        counted = held + (exchanges - 1) * (numel // world)
        return exchanges * self.exchange_s + counted * size / self.count

    def predict(self, plan: Plan, exchanges: int = 1) -> float:
        """Predicted seconds for ``plan``, including ``exchanges`` planning exchanges and count passes."""
        total = self.planning(plan.collective, plan.layout.numel, plan.dtype, plan.world, exchanges)
        for step in plan.steps:
            total += self.step_s
            if plan.algorithm == "ring":
                total += self._ring_step(plan, step)
            else:
                total += self._direct_step(plan, step)
        return total

    def predict_native(
        self, collective: str, numel: int, dtype: torch.dtype, topology: Topology, exchanges: int = 1
    ) -> float:
        """Predicted seconds of the dense ``torch.distributed`` collective: from :attr:`native` on
        the group it was timed on, else a ring at the slowest link.

        ``numel`` is the chunked tensor's size: the all-gather output, the reduce-scatter input,
        the all-reduce tensor.
        """
        p = topology.world
        total = self.planning(collective, numel, dtype, p, exchanges)
        if p == 1:
            return total
        chunk = numel * element_size(dtype) / p
        native = self.native
        if native is not None and native.topology == topology:
            phases = 2 if collective == "all_reduce" else 1  # a ring all-reduce is two rings
            return total + (native.latency_s + (p - 1) * chunk * 2 / native.bandwidth) * phases / 2
        link = self.link(topology.ring_crosses_nodes)
        hop = link.latency_s + chunk / link.grouped_bandwidth
        gather = (p - 1) * hop
        scatter = (p - 1) * (hop + chunk / self.reduce)
        if collective == "all_gather":
            return total + gather
        if collective == "reduce_scatter":
            return total + scatter
        return total + scatter + gather

    def least_sparse(
        self, collective: str, numel: int, dtype: torch.dtype, topology: Topology, rounds: int = 1
    ) -> float:
        """A lower bound of every sparse candidate's prediction for this call, whatever its data:
        one count pass and exchange, the fewest steps any algorithm takes (a direct call: one per
        phase), each with its fixed cost and the smallest link latency, and one codec call (a plan
        that sends nothing sparse never wins, and the rank that encodes a sparse message waits for
        it). No bytes are counted, so no plan of any sparsity is predicted below it. ``rounds``:
        host synchronisations of the count exchange (its extra ones priced as exchanges)."""
        total = self.planning(collective, numel, dtype, topology.world) + (rounds - 1) * self.exchange_s
        if topology.world == 1 or numel == 0:
            return total
        kinds = (
            [self.intra]
            if topology.nodes == 1
            else [self.inter]
            if topology.ranks_per_node == 1
            else [self.intra, self.inter]
        )
        steps = 2 if collective == "all_reduce" else 1
        codec = min(self.pici.call_s, self.coo.call_s)
        return total + steps * (self.step_s + min(link.latency_s for link in kinds)) + codec

    def _encode(self, m: Message) -> float:
        if not m.sparse:
            return 0.0
        codec = self.codec(m.format)
        return codec.call_s + m.dense_nbytes / codec.compress

    def _decode(self, m: Message, phase: Phase, copied: bool) -> float:
        if m.sparse:
            codec = self.codec(m.format)
            rate = codec.accumulate if phase is Phase.REDUCE_SCATTER else codec.decompress
            return codec.call_s + m.dense_nbytes / rate
        if phase is Phase.REDUCE_SCATTER:
            return m.dense_nbytes / self.reduce
        return m.dense_nbytes / self.copy if copied else 0.0

    def _ring_step(self, plan: Plan, step: Step) -> float:
        busy = [0.0] * plan.world
        encodes = step.phase is Phase.REDUCE_SCATTER or step.index == 0
        for m in step.messages:
            busy[m.src] += self.link(m.inter_node).seconds(m.nbytes) + (self._encode(m) if encodes else 0.0)
            busy[m.dst] += self._decode(m, step.phase, copied=False)
        return max(busy, default=0.0)

    def _direct_step(self, plan: Plan, step: Step) -> float:
        p = plan.world
        encode, decode = [0.0] * p, [0.0] * p
        out_wire, in_wire = [0.0] * p, [0.0] * p
        peers: set[tuple[int, int, int]] = set()  # (src, dst, wave): each wave is its own exchange
        encoded: set[tuple[int, int, int]] = set()
        for m in step.messages:
            key = (m.src, m.chunk, m.piece)
            if key not in encoded:  # a gathered payload is encoded once for all its receivers
                encoded.add(key)
                encode[m.src] += self._encode(m) if m.sparse else m.dense_nbytes / self.copy
            decode[m.dst] += self._decode(m, step.phase, copied=True)
            if step.route is not Route.ALL_GATHER:
                wire = m.nbytes / self.link(m.inter_node).grouped_bandwidth
                out_wire[m.src] += wire
                in_wire[m.dst] += wire
            peers.add((m.src, m.dst, m.piece))
        if step.route is Route.ALL_GATHER:
            waves = {m.piece for m in step.messages}
            for src in range(p):
                for dst in range(p):
                    if src != dst:
                        wire = step.slot_bytes / self.link(plan.topology.is_inter(src, dst)).grouped_bandwidth
                        out_wire[src] += wire
                        in_wire[dst] += wire
                        peers.update((src, dst, k) for k in waves)
        # One latency per wave: an exchange posts its messages to every peer at once, so their
        # start-up times overlap; the slowest hop kind the rank uses in the wave sets it.
        slowest: dict[tuple[int, int], float] = {}
        for src, dst, wave in peers:
            here = self.link(plan.topology.is_inter(src, dst)).latency_s
            slowest[src, wave] = max(slowest.get((src, wave), 0.0), here)
        latency = [0.0] * p
        for (src, _), seconds in slowest.items():
            latency[src] += seconds
        return max(encode[r] + max(out_wire[r], in_wire[r]) + latency[r] + decode[r] for r in range(p))


def _positive(obj: object, name: str, allow_zero: bool = False) -> None:
    value = getattr(obj, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value >= 0 if allow_zero else value > 0):
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{type(obj).__name__}.{name}={value!r} must be {need}")


@functools.lru_cache(maxsize=64)
def _fingerprint(model: CostModel) -> str:
    return repr(dataclasses.astuple(model))
