"""What a caller can tune on a sparse collective: :class:`CollectiveConfig` and :class:`Thresholds`.

Every rank must pass an equal config: the plan of a collective is computed independently on
every rank from the exchanged nonzero counts and this config, so a config that differs between
ranks is detected in the planning exchange and raises the same ``ValueError`` on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from .cost import CostModel
from .thresholds import DEFAULT_THRESHOLDS, ResolvedThresholds, Thresholds

__all__ = ["CollectiveConfig", "Thresholds", "ResolvedThresholds", "DEFAULT_THRESHOLDS", "MAX_CHANNELS"]

MAX_CHANNELS = 64
"""Most pieces a chunk may be cut into (the count exchange grows with ``world * channels``)."""

_FORMATS = ("auto", "pici", "coo", "dense")
_ALGORITHMS = ("auto", "ring", "direct", "hierarchical")
_GATHER_COUNTS = ("auto", "bound", "measured")
_COST_MODELS = ("measured", "default")
_CHECK_CALLS = ("every", "first")


@dataclasses.dataclass(kw_only=True, slots=True)
class CollectiveConfig:
    """How a sparse collective runs. Pass an equal config on every rank.

    Example::

        >>> cfg = CollectiveConfig(format="pici", algorithm="ring", ranks_per_node=4)
        >>> spccl_train.all_reduce(grad, config=cfg)
    """

    format: str = "auto"
    """Wire format: ``"pici"`` (bitvector, ~3% overhead: good from ~50% sparsity up), ``"coo"``
    (index + value: good above ~95%), ``"dense"`` (no compression), or ``"auto"`` (the cost
    model picks Pici, COO or plain dense per call). With a sparse format each message still
    travels dense when its sparsity is at or below the thresholds."""
    algorithm: str = "auto"
    """``"ring"`` (the paper: p-1 steps per phase, formats adapt per step to fill-in),
    ``"direct"`` (reduce-scatter as one all-to-all of compressed chunks, all-gather as one
    exchange of compressed chunks: no fill-in in transit), ``"auto"`` (the cost model picks one of
    those or the native call; for all-reduces on groups spanning nodes also the hierarchical one;
    at two ranks it leaves the ring out, which sends the direct algorithm's messages slower),
    or ``"hierarchical"`` (groups spanning nodes: an all-reduce reduce-scatters inside each node,
    all-reduces the node sums across nodes and all-gathers inside each node; an all-gather and a
    reduce-scatter take their two steps; each step a flat call with ``auto``; :mod:`.hierarchical`)."""
    thresholds: Thresholds = dataclasses.field(default_factory=Thresholds)
    """Sparsity thresholds (intra-node, inter-node, all-gather); unset ones take the chosen
    format's defaults. A mapping with keys ``intra``, ``inter``, ``ag`` is accepted too."""
    gather_counts: str = "auto"
    """How an all-reduce sizes the messages of its gather phase. ``"bound"``: from the first
    exchange alone, each reduced piece sized for ``min(n, sum of every rank's count)``, which no
    sum can exceed (one host synchronisation per call; payloads are padded when supports
    overlap). ``"measured"``: count the reduced chunks and exchange again (a second
    synchronisation; exact sizes and formats). ``"auto"``: the cost model picks per call."""
    ranks_per_node: int | None = None
    """Topology: ranks ``[k * ranks_per_node, (k + 1) * ranks_per_node)`` of the group share node
    ``k``. ``None`` reads the launch's nodes from ``SPCCL_RANKS_PER_NODE`` (which emulated nodes
    set, :mod:`spccl_train.emulation`) or else torchrun's ``LOCAL_WORLD_SIZE`` (``L`` consecutive
    global ranks per node) and finds the group's own from its members' global ranks (a
    data-parallel group ``[0, 4, 8, 12]`` on nodes of 8 has 2 per node; groups that span nodes in
    other shapes get 1, every hop across nodes), and otherwise puts all ranks on one node;
    ``SPCCL_RANKS_PER_NODE``, when set, decides alone. The variables must be equal on every rank
    (the planning exchange checks the result, except for calls with caller ``bounds``). Tests set it to
    simulate several nodes on one machine. It picks the intra- or inter-node threshold per hop
    and the link terms of the cost model."""
    channels: int = 1
    """Pieces each chunk is cut into (1 to 64). Each piece is its own message, so on a GPU the
    compression of piece k+1 overlaps the transfer of piece k (the direct algorithm moves the
    pieces in waves, one exchange per piece index); more pieces also make the per-message format
    decisions finer; a direct all-reduce sized from bounds also posts each wave's gather as soon as
    the wave is summed. Measured on 4 H200s (bounds and CUDA graphs, 99% sparse fp32): 2 pieces
    made 1 GiB all-reduces 14% faster than 1, all-gathers 5% and reduce-scatters 9%; at 256 MiB
    all-reduces 2% and reduce-scatters 6% faster, all-gathers 12% slower; 4 pieces (before the
    interleaving) were slower at both sizes. Must be equal on every rank: it sizes the count
    exchange."""
    cuda_graphs: bool = False
    """CUDA only: run the second call of a kind (same sizes, dtype, group, config, bounds and
    ``graph_tag``) as a captured CUDA graph and replay it from then on (:mod:`.graphs`), so a call
    costs ~0.1 ms of host time instead of the eager path's ~1.3 ms of Python. Calls with
    ``bounds=`` make no host synchronisation at all. Calls without them still exchange counts (one
    synchronisation), then plan from bounds derived from the counts (``graphs.BOUND_HEADROOM``: about
    6% and four standard deviations above them, kept while later counts fit), so that calls of similar sparsity replay one graph; an all-reduce
    with ``gather_counts="measured"`` runs eagerly. A replayed call must pass the tensors and
    stream it was captured with (else it raises): give calls on different tensors different
    ``graph_tag`` values. Each cached graph keeps its scratch memory; call
    :func:`~.graphs.clear_graphs` on every rank before ``destroy_process_group``. Other calls
    run as usual. Capturing is collective for NCCL, and ``auto`` prices replayed calls without
    host launch costs (:meth:`~.cost.CostModel.replayed`), so it must be equal on every rank."""
    check_calls: str = "every"
    """``"every"``: each call's count exchange compares the ranks' calls, so a bad call (a size,
    dtype or config that differs, a bad tensor on one rank) raises the same ``ValueError`` on every
    rank. ``"first"``: a call shape (collective, sizes, dtypes, config) is compared once, on its
    first call; after that a call of that shape that ``auto`` can tell from its sizes alone will go
    native (no sparse candidate could win even with no nonzeros: small calls, fast links) runs the
    native collective with no exchange at all, and so does one whose last exchanged call chose
    native, for 1, 2, 4, ... up to 16 calls before an exchange checks again
    (``state.NativeHolds``: a shape NCCL wins, on NVLink, then costs NCCL's call, not an exchange
    and NCCL's call). The price: ranks whose later calls diverge (one
    rank passing another size, or a bad tensor, in a shape checked before) are no longer told and
    hang in the native collective, as ``torch.distributed``'s own calls do. A shape's held calls
    keep the launch's environment as its first held call read it (``SPCCL_RANKS_PER_NODE``,
    ``LOCAL_WORLD_SIZE``, ``SPCCL_SCALABLE_EXCHANGE_WORLD``): change it only between process
    groups. For callers whose call shapes are fixed by construction (a DDP hook's buckets)."""
    cost_model: CostModel | str | None = "measured"
    """Link and codec speeds for ``"auto"``. ``"measured"``: measured on the group's first call
    (:mod:`.links`: link latency and bandwidth per hop kind, the exchange's latency, codec
    throughputs cached per device), equal on every rank. ``"default"``: the fixed figures of
    :meth:`CostModel.default` for the tensor's device (``None`` means the same, as it did before
    measuring existed). A :class:`CostModel`: your own figures, used as given (this is how to
    override a measurement)."""

    def holds_native(self) -> bool:
        """Whether calls of this config may run native without an exchange (``check_calls="first"``,
        and ``auto`` may choose native: ``format`` auto or dense, ``algorithm`` auto), so that
        ``auto`` prices the native candidate at what such a call takes (:mod:`.held`)."""
        return self.check_calls == "first" and self.algorithm == "auto" and self.format in ("auto", "dense")

    def __post_init__(self) -> None:
        if isinstance(self.thresholds, Mapping):
            unknown = set(self.thresholds) - {"intra", "inter", "ag"}
            if unknown:
                raise ValueError(f"thresholds has unknown keys {sorted(unknown)}; use 'intra', 'inter' and 'ag'")
            self.thresholds = Thresholds(**self.thresholds)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field and the fix (also run before every call)."""
        if self.format not in _FORMATS:
            raise ValueError(f"format={self.format!r} is not one of {', '.join(map(repr, _FORMATS))}; pick one of them")
        if self.algorithm not in _ALGORITHMS:
            raise ValueError(
                f"algorithm={self.algorithm!r} is not one of {', '.join(map(repr, _ALGORITHMS))}; pick one of them"
            )
        if not isinstance(self.thresholds, Thresholds):
            raise ValueError(
                f"thresholds={self.thresholds!r} must be a Thresholds (or a mapping with keys intra, inter, ag)"
            )
        if self.gather_counts not in _GATHER_COUNTS:
            raise ValueError(
                f"gather_counts={self.gather_counts!r} is not one of {', '.join(map(repr, _GATHER_COUNTS))}; pick one of them"
            )
        rpn = self.ranks_per_node
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
            raise ValueError(
                f"ranks_per_node={rpn!r} must be a positive int (ranks per node, e.g. LOCAL_WORLD_SIZE) "
                "or None for a single node"
            )
        ch = self.channels
        if isinstance(ch, bool) or not isinstance(ch, int) or not 1 <= ch <= MAX_CHANNELS:
            raise ValueError(f"channels={ch!r} must be an int from 1 to {MAX_CHANNELS}; 1 disables piece pipelining")
        if self.check_calls not in _CHECK_CALLS:
            raise ValueError(
                f"check_calls={self.check_calls!r} is not one of {', '.join(map(repr, _CHECK_CALLS))}; pick one of them"
            )
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs={self.cuda_graphs!r} must be True or False")
        if not isinstance(self.cost_model, CostModel) and self.cost_model not in (*_COST_MODELS, None):
            raise ValueError(
                f"cost_model={self.cost_model!r} must be a CostModel or one of {', '.join(map(repr, _COST_MODELS))} "
                "(None: 'default')"
            )

    def key(self) -> tuple:
        """Every field in one hashable tuple: equal for two configs that plan alike (thresholds of
        equal value plan alike whatever their number type), and cheaper than :meth:`fingerprint`
        (a memo key for this process, not a text to compare across ranks)."""
        return (
            self.format,
            self.algorithm,
            self.gather_counts,
            self.thresholds,
            self.ranks_per_node,
            self.channels,
            self.cuda_graphs,
            self.check_calls,
            self.cost_model,
        )

    def fingerprint(self) -> str:
        """A canonical text of every field, equal on two ranks iff their configs plan alike."""
        th = self.thresholds
        cost = self.cost_model.fingerprint() if isinstance(self.cost_model, CostModel) else self.cost_model or "default"
        parts = [
            self.format,
            self.algorithm,
            self.gather_counts,
            *(_canon(v) for v in (th.intra, th.inter, th.ag)),
            _canon(self.ranks_per_node),
            str(self.channels),
            "graphs" if self.cuda_graphs else "eager",
            f"check {self.check_calls}",
            cost,
        ]
        return "|".join(parts)


def _canon(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isfinite(value):
        return value.hex()
    return repr(value)
