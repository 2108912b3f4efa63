"""One bucket's sparse reduction, the same for every engine: prune, cap, bound, reduce, count.

The DDP comm hook (:mod:`spccl_train.ddp`) and the Megatron integration
(:mod:`spccl_train.megatron`) hand each gradient bucket to a :class:`BucketReducer`, which

1. prunes it with error feedback (the bucket's own error buffer, made on first use and remade
   when the bucket changes shape or device), to the density of its schedule step; where the
   all-reduce will send Pici payloads as they are, straight into them
   (:meth:`~.pruning.Pruner.prune_to_wire`: one pass, no pruned dense copy; the bucket keeps the
   payloads' buffer, about its own size) and hands them to the all-reduce as its ``encoded`` input.
   That is an all-reduce of ``direct`` or ``auto`` algorithm, no capacity bound, and format
   ``pici``, or ``auto`` on a group within one node where the bucket's previous reduction chose
   direct Pici. Across nodes ``auto`` prunes in place: there it mostly picks COO, whose payloads
   are half as large, and a bucket given Pici payloads tilts ``auto`` to keep them (a COO call
   must decode them first, so COO is seen to take longer than it does, and a candidate left is
   not tried again unless it is priced near). GPT-2 XL on 2 emulated nodes, one H200: pruning
   every bucket to Pici ran 316.5 ms per iteration and sent 4.8% of dense, pruning in place 288.6
   ms and 3.1%, the previous-choice rule 301.9 ms and 3.0% (2026-11-26), and a later run of that
   rule (d09fb38) kept Pici from iteration 21 to the end: 343.8 ms, 4.8%;
2. with a ``capacity_factor``, caps each piece the collective will cut (:func:`~.pruning.piece_caps`)
   and, once an exchange has checked the bucket on every rank, plans the call from those caps
   (no host synchronisation);
3. calls the sparse all-reduce (or reduce-scatter into a shard), its CUDA graph tagged by engine,
   reducer and bucket;
4. adds what the call did to its totals: :meth:`BucketReducer.summary` is every engine's summary
   (:class:`ReductionSummary`; the engines count their dense warm-up reductions in it too).

What differs between engines stays with them: when a bucket is dense (warm-up), averaging, and
where the call runs (the DDP hook's side streams and planning group are arguments here). What
both take is one :class:`~spccl_train.sparse_config.SparseConfig`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools

import torch
import torch.distributed as dist

from ._timing import Span
from .collectives import (
    ChunkLayout,
    CollectiveConfig,
    CollectiveStats,
    CollectiveWork,
    EncodedPieces,
    all_reduce,
    reduce_scatter_tensor,
    spans_nodes,
)
from .formats import Format
from .pruning import Pruner, PruneResult, piece_caps
from .sparse_config import SparseConfig

__all__ = ["BucketState", "BucketReducer", "CallRecord", "ReductionSummary"]

_scopes = itertools.count()
"""Numbers the reducers, to tag their buckets' CUDA graphs apart."""

PENDING_TIMERS = 1024
"""Timers kept unread; past this the older half is read (long finished, so reading waits for nothing)."""


@dataclasses.dataclass(slots=True)
class BucketState:
    """What a reducer keeps for one bucket."""

    index: int
    """The bucket's number, equal on every rank (it seeds the threshold sampling and tags its graph)."""
    reductions: int = 0
    """Reductions so far, dense warm-up included (the engine counts them)."""
    error: torch.Tensor | None = None
    """Error-feedback buffer (the bucket's shape, ``pruning.error_dtype``); made at the first pruning."""
    last_prune: PruneResult | None = None
    """The latest pruning pass (threshold, kept count; tensors on the device)."""
    validated: tuple[int, str] | None = None
    """``capacity_factor``: ``(numel, collective)`` of the bucket's reduction once it was planned
    with the exchange (every rank's bucket agreed); later ones are planned from the caps."""
    encoded: EncodedPieces | None = None
    """The payloads pruning writes for the all-reduce (:meth:`BucketReducer.reduce`), reused every step."""
    last_choice: tuple[str, Format] | None = None
    """``(algorithm, format)`` the bucket's latest reduction ran (equal on every rank)."""


@dataclasses.dataclass(frozen=True, slots=True)
class CallRecord:
    """One sparse reduction, as :attr:`SparseConfig.record_calls <spccl_train.sparse_config.SparseConfig.record_calls>`
    keeps it: what ``auto`` chose for a bucket, what it expected and what the call took here."""

    bucket: int
    """The bucket's number (equal on every rank)."""
    collective: str
    """``"all_reduce"`` or ``"reduce_scatter"``."""
    elements: int
    """The bucket's elements."""
    candidate: str
    """The candidate that ran, named as ``auto`` weighs it (``"direct/coo"``, ``"native/dense"``)."""
    trial: bool
    """``auto`` ran it to try it (:attr:`~spccl_train.collectives.CollectiveStats.trial`)."""
    encoded: bool
    """Its input came as Pici payloads (pruned to the wire)."""
    predicted_s: float
    """The cost model's prediction for it, corrections included."""
    seconds: float
    """From issue to completion on this rank (device time on CUDA): overlapped calls share the
    device with the backward pass and with each other."""
    bytes_sent: int
    """Bytes this rank put on the wire."""
    dense_bytes: int
    """Bytes a dense ring would have sent."""
    exchanges: int
    """Planning exchanges (host synchronisations)."""
    candidates: dict[str, float]
    """Every candidate ``auto`` weighed and its corrected prediction (empty where none was weighed)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReductionSummary:
    """What an engine's gradient reductions did since its state was made (or its stats reset):
    the DDP hooks' and the Megatron integration's ``summary()``."""

    dense_reductions: int
    """Bucket reductions done by the dense collective (the warm-up; every one for the dense hook)."""
    sparse_reductions: int
    """Bucket reductions done by SpCCL (all-reduces and reduce-scatters)."""
    elements: int
    """Gradient elements that went through SpCCL."""
    kept: int
    """Elements kept by pruning (all elements when pruning is off)."""
    bytes_sent: int
    """Bytes this rank sent."""
    dense_bytes: int
    """Bytes a dense ring would have sent for the same calls."""
    prune_seconds: float
    """Time in pruning (device time on CUDA); a bucket pruned to the wire counts its encoding here,
    which the reduction then does not."""
    reduce_seconds: float
    """Time from issuing each reduction to its completion."""
    deferred: int
    """Elements pruning kept that the capacity bound left in the error buffers for later."""
    exchanges: int
    """Planning exchanges (host synchronisations)."""
    decode_failures: int = 0
    """Reductions whose decoders reported a bad payload (0 unless something is wrong; with
    ``capacity_factor`` the bounds hold by construction, so anything else is a bug to report)."""
    choices: dict[str, int] = dataclasses.field(default_factory=dict)
    """SpCCL reductions by the candidate that ran (``"direct/coo"``, ``"native/dense"``, ...):
    what ``auto`` chose, trials included."""
    calls: tuple[CallRecord, ...] = ()
    """Every sparse reduction in order, where ``SparseConfig.record_calls`` asks for them; else empty."""

    @property
    def density(self) -> float:
        """Achieved density: kept / elements."""
        return self.kept / self.elements if self.elements else 0.0

    @property
    def bytes_ratio(self) -> float:
        """Bytes sent over dense bytes (below 1 saves traffic)."""
        return self.bytes_sent / self.dense_bytes if self.dense_bytes else 0.0


class BucketReducer:
    """Prunes and reduces buckets, and keeps their totals (see the module docstring).

    Args:
        settings: the :class:`~spccl_train.sparse_config.SparseConfig` (pruning, collective,
            ``capacity_factor``, ``prune_to_wire``; ``dense_iterations`` is the engine's business).
        engine: names the engine in the buckets' CUDA graph tags (``"ddp"``, ``"megatron"``).

    ``prune``, ``config`` (the collective's), ``capacity_factor`` and ``prune_to_wire`` read
    ``settings``; ``pruner`` is made from its pruning section.
    """

    __slots__ = (
        "settings",
        "pruner",
        "engine",
        "scope",
        "_reductions",
        "_dense_reductions",
        "_elements",
        "_kept",
        "_deferred",
        "_exchanges",
        "_bytes_sent",
        "_dense_bytes",
        "_prune_seconds",
        "_reduce_seconds",
        "_decode_failures",
        "_choices",
        "_prune_spans",
        "_stats",
        "_calls",
    )

    def __init__(self, settings: SparseConfig, engine: str) -> None:
        self.settings = settings
        self.pruner = Pruner(settings.pruning)
        self.engine = engine
        self.scope = next(_scopes)  # equal on every rank that makes its reducers in one order
        self.reset_stats()

    @property
    def prune(self) -> bool:
        return self.settings.prune

    @property
    def config(self) -> CollectiveConfig:
        """The collective's config."""
        return self.settings.collective

    @property
    def capacity_factor(self) -> float | None:
        return self.settings.capacity_factor

    @property
    def prune_to_wire(self) -> bool:
        return self.settings.prune_to_wire

    def __getstate__(self) -> dict:
        skip = ("scope", "_prune_spans", "_stats", "_calls")
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in skip}

    def __setstate__(self, state: dict) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)
        self.scope = next(_scopes)  # a copy must not replay the original's graphs
        self._prune_spans, self._stats, self._calls = [], [], []  # device timers stay with the original

    def reset_stats(self) -> None:
        """Zero the totals (not the buckets' error buffers)."""
        self._reductions = self._dense_reductions = self._elements = self._exchanges = 0
        self._bytes_sent = self._dense_bytes = 0
        self._kept: torch.Tensor | int = 0
        self._deferred: torch.Tensor | int = 0
        self._prune_seconds = self._reduce_seconds = 0.0
        self._decode_failures: torch.Tensor | int = 0
        self._choices: collections.Counter[str] = collections.Counter()
        self._prune_spans: list[Span] = []
        self._stats: list[CollectiveStats] = []
        self._calls: list[tuple[int, int, bool, CollectiveStats]] = []  # record_calls: (bucket, numel, encoded, stats)

    def count_dense(self) -> None:
        """Count a bucket reduction the engine did with the dense collective (its warm-up)."""
        self._dense_reductions += 1

    def summary(self) -> ReductionSummary:
        """The totals so far. Reads device timers and counters: call it off the hot path."""
        self._fold(keep=0)
        return ReductionSummary(
            dense_reductions=self._dense_reductions,
            sparse_reductions=self._reductions,
            elements=self._elements,
            kept=int(self._kept),
            bytes_sent=self._bytes_sent,
            dense_bytes=self._dense_bytes,
            prune_seconds=self._prune_seconds,
            reduce_seconds=self._reduce_seconds,
            deferred=int(self._deferred),
            exchanges=self._exchanges,
            decode_failures=int(self._decode_failures),
            choices=dict(self._choices),
            calls=tuple(_record(*call) for call in self._calls),
        )

    def _fold(self, keep: int) -> None:
        """Read all but the newest ``keep`` timers and statuses of each kind into the totals."""
        old = max(len(self._prune_spans) - keep, 0)
        self._prune_seconds += sum(span.seconds() for span in self._prune_spans[:old])
        del self._prune_spans[:old]
        old = max(len(self._stats) - keep, 0)
        failed = [flag for flag in (stats.decode_failed for stats in self._stats[:old]) if flag is not None]
        if failed:  # counted on the device: folding in the hot path must not synchronise
            self._decode_failures = self._decode_failures + torch.stack(failed).sum()
        self._reduce_seconds += sum(stats.elapsed_s for stats in self._stats[:old])
        del self._stats[:old]

    def bounded(self, bucket: BucketState, numel: int, collective: str = "all_reduce") -> bool:
        """Whether the bucket's next reduction is planned from its caps (no host synchronisation)."""
        return self.capacity_factor is not None and bucket.validated == (numel, collective)

    def sends_encoded(
        self, bucket: BucketState, group: dist.ProcessGroup | None, world: int, capped: bool, all_reduce: bool
    ) -> bool:
        """Whether a pruned bucket goes to the all-reduce as Pici payloads (:meth:`Pruner.prune_to_wire`):
        the all-reduce will send them (see the module docstring). Equal on every rank."""
        cfg = self.config
        if not (
            self.prune_to_wire
            and self.prune
            and all_reduce
            and not capped
            and world > 1
            and cfg.algorithm in ("auto", "direct")
        ):
            return False
        if cfg.format == "pici":
            return True
        return cfg.format == "auto" and bucket.last_choice == ("direct", Format.PICI) and not spans_nodes(cfg, group)

    def error_buffer(self, bucket: BucketState, tensor: torch.Tensor) -> torch.Tensor:
        """The bucket's error buffer (made, or remade if the bucket changed shape or device)."""
        error = bucket.error
        if error is None or error.shape != tensor.shape or error.device != tensor.device:
            error = bucket.error = self.pruner.new_error_buffer(tensor)
        return error

    def reduce(
        self,
        bucket: BucketState,
        tensor: torch.Tensor,
        *,
        group: dist.ProcessGroup | None,
        world: int,
        step: int,
        schedule_step: int,
        shard: torch.Tensor | None = None,
        planning_group: dist.ProcessGroup | None = None,
        planning_stream: torch.cuda.Stream | None = None,
    ) -> CollectiveWork:
        """Prune ``tensor`` (the bucket's gradients: in place, or into the bucket's payloads, leaving
        ``tensor`` to be overwritten by the sum) and sum it over ``group``.

        All-reduce in place when ``shard`` is ``None``, else reduce-scatter into ``shard`` (this
        rank's slice of ``tensor``). ``step`` seeds the sampling; ``schedule_step`` picks the
        density (the warm-up counts from the first sparse reduction). ``planning_group`` and
        ``planning_stream``: where the pruning and the planning exchange run (an all-reduce
        only; a bounded reduction has nothing to plan and runs on the current stream).
        Returns the asynchronous work.
        """
        collective = "all_reduce" if shard is None else "reduce_scatter"
        numel = tensor.numel()
        bounded = self.bounded(bucket, numel, collective)
        if bounded:  # nothing to plan ahead: prune, cap and reduce on the current stream
            planning_group = planning_stream = None
        capped = encoded = None
        with torch.cuda.stream(planning_stream) if planning_stream is not None else contextlib.nullcontext():
            if self.prune:
                span = Span(tensor.device)
                error = self.error_buffer(bucket, tensor)
                if self.capacity_factor is not None:
                    density = self.pruner.config.density_at(schedule_step)
                    channels = self.config.channels
                    capped = piece_caps(numel, world, channels, density, self.capacity_factor, collective)
                if self.sends_encoded(bucket, group, world, capped is not None, shard is None):
                    layout = ChunkLayout.of("all_reduce", numel, world, self.config.channels)
                    result, encoded = self.pruner.prune_to_wire(
                        tensor, error, layout, step=step, buffer=bucket.index, schedule_step=schedule_step,
                        into=bucket.encoded,
                    )  # fmt: skip
                    bucket.encoded = encoded
                else:
                    result = self.pruner.prune(
                        tensor, error, step=step, buffer=bucket.index, schedule_step=schedule_step, caps=capped
                    )
                if result.deferred is not None:
                    self._deferred = self._deferred + result.deferred
                span.stop()
                self._prune_spans.append(span)
                bucket.last_prune = result
                self._kept = self._kept + result.kept.to(torch.int64)  # int32 per call; totals run longer
            else:
                self._kept = self._kept + numel
        bounds = [list(capped[1])] * world if bounded else None
        tag = (self.engine, self.scope, bucket.index)  # the bucket's CUDA graph (config.cuda_graphs)
        if shard is None:
            work = all_reduce(
                tensor,
                group=group,
                async_op=True,
                config=self.config,
                planning_group=planning_group,
                planning_stream=planning_stream,
                bounds=bounds,
                graph_tag=tag,
                encoded=encoded,
            )
        else:
            work = reduce_scatter_tensor(
                shard, tensor, group=group, async_op=True, config=self.config, bounds=bounds, graph_tag=tag
            )
        if capped is not None:
            bucket.validated = (numel, collective)  # every rank's bucket agreed in the exchange
        stats = work.stats
        bucket.last_choice = (stats.algorithm, stats.format)
        self._choices[stats.candidate] += 1
        self._reductions += 1
        self._exchanges += stats.exchanges
        self._elements += numel
        self._bytes_sent += stats.bytes_sent
        self._dense_bytes += stats.dense_bytes
        self._stats.append(stats)
        if self.settings.record_calls:
            self._calls.append((bucket.index, numel, encoded is not None, stats))
        if len(self._stats) > PENDING_TIMERS:
            self._fold(keep=PENDING_TIMERS // 2)
        return work


def _record(bucket: int, numel: int, encoded: bool, stats: CollectiveStats) -> CallRecord:
    """A call's record; reads its device timer (off the hot path)."""
    return CallRecord(
        bucket=bucket,
        collective=stats.collective,
        elements=numel,
        candidate=stats.candidate,
        trial=stats.trial,
        encoded=encoded,
        predicted_s=stats.predicted_s,
        seconds=stats.elapsed_s,
        bytes_sent=stats.bytes_sent,
        dense_bytes=stats.dense_bytes,
        exchanges=stats.exchanges,
        candidates=dict(stats.candidates),
    )
