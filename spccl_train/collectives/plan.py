"""Plans: the format and exact byte count of every message of a collective, computed from counts.

A collective exchanges the nonzero count of every piece of every chunk on every rank once (see
:mod:`.exchange`); from those counts each rank computes the same :class:`Plan` with the pure
functions below, so message sizes never travel and no step waits on the host.

Format of a message (:func:`choose_format`): dense when the sparsity estimate is at or below the
threshold, or when the sparse payload would not be smaller than dense; else the configured
sparse format. Sparsity estimates:

* a chunk piece as some rank holds it is **measured** (its count is exact);
* in a ring reduce-scatter the piece sent at step ``s`` is the sum of ``s + 1`` ranks'
  contributions; its sparsity is **extrapolated** as ``sigma_s = sigma_{s-1} * sigma_new``
  where ``sigma_new`` is the measured sparsity of the contribution added at that step (the
  paper's ``sigma_next = sigma_prev * sigma_0``, with each rank's own step-0 sparsity
  ``sigma_0``: nonzero positions independent across ranks). The payload is sized for the
  **bound** ``min(n, sum of the contributors' counts)``, which no sum can exceed (a position
  that is zero on every contributor is zero in the sum), and padded to it.
* the all-reduce gather phase is planned either from the same **bound** (the sum of every
  rank's count, capped at n: :func:`bound_reduced_counts`; no second exchange, payloads padded
  to the bound) or after a second count exchange of the reduced chunks, **measured** (exact
  sizes and formats; the paper extrapolates there). ``CollectiveConfig.gather_counts`` or the
  cost model picks.

Thresholds: link-aware in reduction steps (``intra`` or ``inter`` by whether the hop crosses a
node boundary), phase-aware in gather steps (``ag``).

Framing (:data:`~spccl_train.formats.layout.COO_HEADER_BYTES`,
:func:`~spccl_train.formats.layout.message_bytes`, with the rest of the format math): a Pici
payload records its nnz (the last index entry), so it travels bare. A COO payload does not, so
every COO message is a 16-byte header (int64 nnz, int64 n, little-endian) followed by the
payload; the receiver hands the header's nnz to the decoder as a device tensor, with no host
synchronisation. Dense messages are the raw elements.

Sizes: ``Message.nbytes`` is what travels. Ring messages are sent at their exact (or bounded)
size from and into 16-byte aligned slots; direct messages are packed back to back, so each is
rounded up to 16 bytes; the padded all-gather route sends ``Step.slot_bytes`` per rank. A direct
step with several pieces per chunk moves in waves, one exchange per piece index (see
``_direct``); the padded route pads each wave to its largest payload (:attr:`Step.wave_bytes`, :func:`padded_slot`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..formats import COO_HEADER_BYTES, Format, align16, dense_bytes, message_bytes
from ..formats.layout import element_size, pici_metadata_bytes_of
from .chunking import ChunkLayout
from .thresholds import ResolvedThresholds
from .topology import Topology

__all__ = [
    "PADDED_GATHER_SLACK",
    "Phase",
    "Route",
    "Message",
    "Messages",
    "Step",
    "Plan",
    "choose_format",
    "wire_format",
    "sparsity",
    "sparsities",
    "plan_reduce_scatter",
    "plan_all_gather",
    "estimate_reduced_counts",
    "bound_reduced_counts",
    "padded_slot",
]

PADDED_GATHER_SLACK = 1.25
"""The direct all-gather pads every rank's payload to the largest (one ``all_gather``) when that
sends at most this factor more bytes than exact sizes would; otherwise it uses grouped p2p."""


class Phase(str, enum.Enum):
    """The phase a step belongs to."""

    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"


class Route(str, enum.Enum):
    """How the transport moves a step's messages."""

    P2P = "p2p"
    """Batched isend / irecv of each message (ring steps; unpadded direct all-gather)."""
    ALL_TO_ALL = "all_to_all"
    """One ``all_to_all_single`` with the planned split sizes (direct reduce-scatter)."""
    ALL_GATHER = "all_gather"
    """One ``all_gather`` of payloads padded to ``Step.slot_bytes`` (direct all-gather)."""


class Message(NamedTuple):
    """One piece of one chunk going from ``src`` to ``dst``.

    A named tuple rather than a dataclass: plans hold O(world^2 * channels) of them and are
    built on every call's host path.
    """

    src: int
    """Sending group rank."""
    dst: int
    """Receiving group rank."""
    chunk: int
    """The chunk it carries (a slice of the chunked tensor; see :class:`ChunkLayout`)."""
    piece: int
    """Which piece of the chunk."""
    start: int
    """First element of the piece in the chunked tensor."""
    numel: int
    """Elements of the piece."""
    format: Format
    """Wire format."""
    nbytes: int
    """Bytes on the wire, framing and padding included; both sides size their buffers by it."""
    nnz_bound: int
    """Most nonzeros the piece can hold (the count when ``nnz_exact``)."""
    nnz_exact: bool
    """True when ``nnz_bound`` is the measured count rather than a bound."""
    sparsity: float
    """The sparsity estimate the format was chosen from (measured when ``nnz_exact``)."""
    threshold: float
    """The threshold it was compared with."""
    inter_node: bool
    """True when the hop crosses a node boundary."""

    dense_nbytes: int
    """What the same piece costs dense (the baseline for savings)."""

    @property
    def sparse(self) -> bool:
        """True unless the message travels dense."""
        return self.format is not Format.DENSE


WIRE_FORMATS = (Format.DENSE, Format.PICI, Format.COO)
"""Wire formats by their code in :attr:`Messages.columns` ``["format"]``."""
FORMAT_CODE = {fmt: code for code, fmt in enumerate(WIRE_FORMATS)}


class Messages:
    """A step's messages as columns: one numpy array per :class:`Message` field, equally long.

    What a rank plans (:mod:`.rank_plan`) is built as arrays and stays arrays: executors read the
    columns they need as lists (:meth:`lists`), and no :class:`Message` is made unless someone
    iterates (the reference planners, the reference cost model, tests, :meth:`Plan.describe`).
    ``format`` is stored as codes (0 dense, 1 Pici, 2 COO). A sequence of :class:`Message`
    otherwise: ``len``, iteration, indexing, and equality with any sequence of messages.
    """

    __slots__ = ("columns", "_lists", "_rows", "_derived")

    def __init__(self, columns: dict[str, np.ndarray], rows: tuple[Message, ...] | None = None) -> None:
        self.columns = columns
        """``columns[field]``: the field of every message, in message order."""
        self._lists: dict[str, list] = {}
        self._rows = rows
        self._derived: dict[Hashable, object] = {}

    @classmethod
    def of(cls, rows: Sequence[Message]) -> Messages:
        """Columns from messages (the reference planners' output)."""
        rows = tuple(rows)
        fields = list(zip(*rows)) if rows else [()] * len(Message._fields)
        columns = {}
        for name, values in zip(Message._fields, fields):
            if name == "format":
                values = [FORMAT_CODE[f] for f in values]
            kind = bool if name in ("nnz_exact", "inter_node") else float if name in ("sparsity", "threshold") else None
            columns[name] = np.array(values, dtype=kind or np.int64)
        return cls(columns, rows)

    def __len__(self) -> int:
        return len(self.columns["src"])

    def __iter__(self) -> Iterator[Message]:
        return iter(self.rows())

    def __getitem__(self, index):
        return self.rows()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Messages, tuple, list)):
            return self.rows() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.rows())

    def __repr__(self) -> str:
        return f"Messages({len(self)})"

    def rows(self) -> tuple[Message, ...]:
        """Every message as a :class:`Message` (made on first use)."""
        if self._rows is None:
            names = [n for n in Message._fields if n != "format"]
            cols = dict(zip(names, self.lists(*names)))
            cols["format"] = [WIRE_FORMATS[c] for c in self.lists("format")[0]]
            self._rows = tuple(map(Message._make, zip(*(cols[n] for n in Message._fields))))
        return self._rows

    def lists(self, *names: str) -> tuple[list, ...]:
        """The named columns as Python lists (each converted once); ``format`` as codes."""
        out = []
        for name in names:
            values = self._lists.get(name)
            if values is None:
                values = self._lists[name] = self.columns[name].tolist()
            out.append(values)
        return tuple(out)

    def derived(self, key: Hashable, make: Callable[[], object]) -> object:
        """``make()``, made once per ``key``: what an executor derives from the messages (its waves
        and splits), kept with them, so that a reused plan (:mod:`.reuse`) is prepared once."""
        value = self._derived.get(key)
        if value is None:
            value = self._derived[key] = make()
        return value

    def where(self, mask: np.ndarray) -> Messages:
        """The messages where ``mask`` holds, in order."""
        return Messages({name: col[mask] for name, col in self.columns.items()})

    def sent_by(self, rank: int) -> Messages:
        """The messages ``rank`` sends."""
        return self.where(self.columns["src"] == rank)

    def received_by(self, rank: int) -> Messages:
        """The messages ``rank`` receives."""
        return self.where(self.columns["dst"] == rank)


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """Messages that move at once: one ring step, or the single exchange of a direct phase."""

    phase: Phase
    """Reduce-scatter (messages are accumulated) or all-gather (messages overwrite)."""
    index: int
    """Step number within its phase."""
    route: Route
    """How the transport moves the messages."""
    messages: Messages
    """Every message of the step (of every rank, or of the plan's rank), in (src, chunk, piece) order."""
    slot_bytes: int = 0
    """Route ``ALL_GATHER`` only: the bytes each rank sends every other rank, its payload of every
    wave padded to the wave's largest (see :attr:`wave_bytes`)."""
    wave_bytes: tuple[tuple[int, ...], ...] = ()
    """Direct all-gather steps: ``wave_bytes[k][q]``, the bytes of rank ``q``'s payload in wave
    ``k`` (piece ``k`` of its chunk; 0 for an empty piece), what every rank receives from ``q``.
    Wave ``k`` carries piece ``k`` of every chunk."""

    def sent_by(self, rank: int) -> Messages:
        """The messages ``rank`` sends in this step."""
        return self.messages.sent_by(rank)

    def received_by(self, rank: int) -> Messages:
        """The messages ``rank`` receives in this step."""
        return self.messages.received_by(rank)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """Everything a collective sends, step by step, for every rank. Equal on every rank."""

    collective: str
    """``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``."""
    algorithm: str
    """``"ring"`` or ``"direct"``."""
    format: Format
    """The sparse format messages may use (``DENSE``: every message is dense)."""
    dtype: torch.dtype
    """Element type of the data."""
    layout: ChunkLayout
    """The chunks and pieces of the chunked tensor."""
    topology: Topology
    """Which ranks share a node."""
    steps: tuple[Step, ...]
    """The steps in order (an all-reduce lists its reduce-scatter steps, then its gather steps)."""
    rank: int | None = None
    """``None``: every rank's messages (the reference planners here). A rank: only the messages it
    sends or receives (:mod:`.rank_plan`, what a call runs), equal to the reference's."""

    @property
    def world(self) -> int:
        """Ranks in the group."""
        return self.layout.world

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return element_size(self.dtype)

    def messages(self, phase: Phase | None = None) -> Iterator[Message]:
        """Every message (of one phase, if given) in step order."""
        for step in self.steps:
            if phase is None or step.phase is phase:
                yield from step.messages

    def phase_steps(self, phase: Phase) -> tuple[Step, ...]:
        """The steps of one phase."""
        return tuple(s for s in self.steps if s.phase is phase)

    def bytes_sent(self, rank: int | None = None) -> int:
        """Bytes put on the wire by ``rank`` (all ranks when ``None``; a rank's plan: that rank),
        padding included."""
        rank = self._own(rank)
        total = 0
        for step in self.steps:
            if step.route is Route.ALL_GATHER:
                senders = self.world if rank is None else 1
                total += senders * step.slot_bytes * (self.world - 1)
            else:
                total += _column_sum(step.messages, "nbytes", rank)
        return total

    def dense_bytes(self, rank: int | None = None) -> int:
        """Bytes the same steps would send with every message dense (``rank`` as for :meth:`bytes_sent`)."""
        rank = self._own(rank)
        return sum(_column_sum(step.messages, "dense_nbytes", rank) for step in self.steps)

    def _own(self, rank: int | None) -> int | None:
        if self.rank is None or rank in (None, self.rank):
            return self.rank if rank is None else rank
        raise ValueError(f"this plan holds rank {self.rank}'s messages only, not rank {rank}'s")

    def format_counts(self, phase: Phase | None = None) -> Counter[Format]:
        """How many messages travel in each format."""
        counts: Counter[Format] = Counter()
        for step in self.steps:
            if phase is None or step.phase is phase:
                codes = np.bincount(step.messages.columns["format"], minlength=len(WIRE_FORMATS)).tolist()
                counts.update({fmt: n for fmt, n in zip(WIRE_FORMATS, codes) if n})
        return counts

    def then(self, other: Plan) -> Plan:
        """This plan followed by ``other``'s steps (an all-reduce: reduce-scatter, then gather)."""
        return dataclasses.replace(self, steps=self.steps + other.steps)

    def describe(self) -> str:
        """A short table: per step, the formats of the messages sent (by the plan's rank, if it has
        one) and their bytes against dense."""
        head = (
            f"{self.collective} {self.algorithm} {self.format.value} world={self.world} numel={self.layout.numel} "
            f"{self.dtype}: {self.bytes_sent()} of {self.dense_bytes()} dense bytes"
        )
        if self.rank is not None:
            head += f" (rank {self.rank})"
        lines = [head]
        for step in self.steps:
            sent = step.messages if self.rank is None else step.sent_by(self.rank)
            codes = np.bincount(sent.columns["format"], minlength=len(WIRE_FORMATS)).tolist()
            formats = {fmt.value: n for fmt, n in zip(WIRE_FORMATS, codes) if n}
            senders = self.world if self.rank is None else 1
            nbytes = (
                int(sent.columns["nbytes"].sum())
                if step.route is not Route.ALL_GATHER
                else (step.slot_bytes * senders * (self.world - 1))
            )
            dense = int(sent.columns["dense_nbytes"].sum())
            lines.append(
                f"  {step.phase.value}[{step.index}] {step.route.value}: "
                f"{dict(sorted(formats.items()))} {nbytes}/{dense} B"
            )
        return "\n".join(lines)


def _column_sum(messages: Messages, name: str, src: int | None) -> int:
    """The sum of a column over every message (``src``: over those ``src`` sends)."""
    column = messages.columns[name]
    return int(column.sum() if src is None else column[messages.columns["src"] == src].sum())


def sparsity(numel: int, nnz: int) -> float:
    """Fraction of zeros: ``1 - nnz / numel`` (1.0 for an empty range)."""
    return 1.0 - nnz / numel if numel else 1.0


def sparsities(n, counts) -> np.ndarray:
    """:func:`sparsity` elementwise over arrays of pieces (1.0 for empty ones), in the same float steps."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.asarray(n) > 0, 1.0 - counts / np.maximum(n, 1), 1.0)


def wire_format(fmt: Format, n, nnz, sigma, threshold, size: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`choose_format` and :func:`message_bytes` elementwise, over arrays of pieces: whether
    each piece of ``n`` elements, sized for ``nnz`` nonzeros (may be fractional: a mean), travels
    as ``fmt`` (else dense), and its unpadded bytes. ``size``: bytes per element."""
    n = np.asarray(n)
    dense = n * size
    if fmt is Format.DENSE:
        return np.zeros(n.shape, dtype=bool), dense
    nnz = np.asarray(nnz)
    if fmt is Format.PICI:
        payload = pici_metadata_bytes_of(n) + nnz * size
    else:
        whole = np.ceil(nnz).astype(np.int64) if nnz.dtype.kind == "f" else nnz
        payload = COO_HEADER_BYTES + ((4 * whole + 15) & ~15) + nnz * size
    sparse = (n > 0) & (sigma > threshold) & (payload < dense)
    return sparse, np.where(sparse, payload, dense)


def choose_format(
    fmt: Format | str, numel: int, sigma: float, nnz_bound: int, threshold: float, dtype: torch.dtype
) -> Format:
    """``fmt`` if the piece is sparser than ``threshold`` and its sparse payload (sized for
    ``nnz_bound``) is smaller than dense; else dense."""
    fmt = Format(fmt)
    if fmt is Format.DENSE or numel == 0 or sigma <= threshold:
        return Format.DENSE
    if message_bytes(fmt, numel, nnz_bound, dtype) >= dense_bytes(numel, dtype):
        return Format.DENSE
    return fmt


class _Sizes:
    """Message sizes of one planning call, each (format, numel, nnz) computed once.

    Planning runs on every call's host path and builds O(world^2 * channels) messages; most of
    them repeat a size (equal pieces, forwarded payloads), so a per-call memo keeps the format
    math in :mod:`spccl_train.formats` while calling it once per distinct size.
    """

    __slots__ = ("dtype", "_dense", "_sparse")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._dense: dict[int, int] = {}
        self._sparse: dict[tuple[Format, int, int], int] = {}

    def dense(self, numel: int) -> int:
        size = self._dense.get(numel)
        if size is None:
            size = self._dense[numel] = dense_bytes(numel, self.dtype)
        return size

    def sparse(self, fmt: Format, numel: int, nnz: int) -> int:
        key = (fmt, numel, nnz)
        size = self._sparse.get(key)
        if size is None:
            size = self._sparse[key] = message_bytes(fmt, numel, nnz, self.dtype)
        return size


def _message(
    src: int,
    dst: int,
    chunk: int,
    piece: int,
    layout: ChunkLayout,
    requested: Format,
    nnz_bound: int,
    exact: bool,
    sigma: float,
    threshold: float,
    inter: bool,
    sizes: _Sizes,
    packed: bool,
) -> Message:
    start, numel = layout.pieces[chunk][piece]
    # choose_format's rule, with each size computed once
    dense = sizes._dense.get(numel)
    if dense is None:
        dense = sizes.dense(numel)
    fmt, nbytes = Format.DENSE, dense
    if requested is not Format.DENSE and numel and sigma > threshold:
        sparse = sizes._sparse.get((requested, numel, nnz_bound))
        if sparse is None:
            sparse = sizes.sparse(requested, numel, nnz_bound)
        if sparse < dense:
            fmt, nbytes = requested, sparse
    if packed:
        nbytes = align16(nbytes)
    # positional: the field order of Message
    return Message(src, dst, chunk, piece, start, numel, fmt, nbytes, nnz_bound, exact, sigma, threshold, inter, dense)


def _check_counts(counts: Sequence[Sequence[int]], rows: int, cols: int, what: str) -> None:
    if len(counts) != rows or any(len(row) != cols for row in counts):
        shape = (len(counts), len(counts[0]) if len(counts) else 0)
        raise ValueError(f"{what} counts must be {rows} rows of {cols} per-piece counts, got shape {shape}")


def plan_reduce_scatter(
    counts: Sequence[Sequence[int]],
    layout: ChunkLayout,
    dtype: torch.dtype,
    *,
    fmt: Format | str,
    algorithm: str,
    thresholds: ResolvedThresholds,
    topology: Topology,
    collective: str = "reduce_scatter",
) -> Plan:
    """Plan a reduce-scatter (or an all-reduce's first phase) of the chunked tensor.

    Args:
        counts: ``counts[q][c * channels + k]`` is the nnz of rank ``q``'s contribution to
            piece ``k`` of chunk ``c``.
        layout: the chunks (chunk ``c`` ends up summed on rank ``c``).
        dtype: the element type.
        fmt: the sparse format messages may use, or ``"dense"``.
        algorithm: ``"ring"`` (link-aware thresholds, extrapolated fill-in) or ``"direct"``
            (every contribution sent once to its owner, at its measured sparsity).
        thresholds: resolved intra / inter thresholds (``ag`` is not used here).
        topology: which ranks share a node.
        collective: the name recorded in the plan.
    """
    p, ch = layout.world, layout.channels
    _check_counts(counts, p, p * ch, "reduce-scatter")
    fmt = Format(fmt)
    if algorithm == "ring":
        steps = _ring_reduce_scatter_steps(counts, layout, _Sizes(dtype), fmt, thresholds, topology)
    elif algorithm == "direct":
        steps = _direct_reduce_scatter_steps(counts, layout, _Sizes(dtype), fmt, thresholds, topology)
    else:
        raise ValueError(f"algorithm={algorithm!r} must be 'ring' or 'direct' to plan")
    return Plan(collective, algorithm, fmt, dtype, layout, topology, steps)


def _ring_reduce_scatter_steps(counts, layout, sizes, fmt, th, topo) -> tuple[Step, ...]:
    # _ring.ring_chunk's schedule, restated on purpose (this planner is the oracle of the rank
    # planner): step s, rank q sends its running sum of chunk (q - s - 1) % p to q + 1, which
    # adds its own contribution; after p - 1 steps rank c holds the full sum of chunk c. The piece
    # sent at step s carries the contributions of ranks c + 1, ..., c + s + 1 = q.
    p, ch = layout.world, layout.channels
    sigma = [[1.0] * ch for _ in range(p)]
    bound = [[0] * ch for _ in range(p)]
    contributors = [[0] * ch for _ in range(p)]
    steps = []
    for s in range(p - 1):
        messages = []
        for q in range(p):
            c, dst = (q - s - 1) % p, (q + 1) % p
            inter = topo.is_inter(q, dst)
            tau = th.inter if inter else th.intra
            for k, span in enumerate(layout.pieces[c]):
                if not span.numel:
                    continue
                count = counts[q][c * ch + k]
                sigma[c][k] *= sparsity(span.numel, count)
                bound[c][k] = min(span.numel, bound[c][k] + count)
                contributors[c][k] += count > 0
                exact = contributors[c][k] <= 1  # adding all-zero pieces changes nothing
                messages.append(
                    _message(q, dst, c, k, layout, fmt, bound[c][k], exact, sigma[c][k], tau, inter, sizes, False)
                )
        steps.append(Step(Phase.REDUCE_SCATTER, s, Route.P2P, Messages.of(messages)))
    return tuple(steps)


def _direct_reduce_scatter_steps(counts, layout, sizes, fmt, th, topo) -> tuple[Step, ...]:
    p, ch = layout.world, layout.channels
    messages = []
    for q in range(p):
        for c in range(p):
            if c == q:
                continue
            inter = topo.is_inter(q, c)
            tau = th.inter if inter else th.intra
            for k, span in enumerate(layout.pieces[c]):
                if span.numel:
                    count = counts[q][c * ch + k]
                    sigma = sparsity(span.numel, count)
                    messages.append(_message(q, c, c, k, layout, fmt, count, True, sigma, tau, inter, sizes, True))
    if p == 1:
        return ()
    return (Step(Phase.REDUCE_SCATTER, 0, Route.ALL_TO_ALL, Messages.of(messages)),)


def plan_all_gather(
    counts: Sequence[Sequence[int]],
    layout: ChunkLayout,
    dtype: torch.dtype,
    *,
    fmt: Format | str,
    algorithm: str,
    threshold: float,
    topology: Topology,
    collective: str = "all_gather",
    measured: bool = True,
) -> Plan:
    """Plan an all-gather (or an all-reduce's gather phase) of the chunked tensor.

    Args:
        counts: ``counts[c][k]`` is the nnz of piece ``k`` of chunk ``c``, held by rank ``c``.
        layout, dtype, fmt, topology, collective: as for :func:`plan_reduce_scatter`.
        algorithm: ``"ring"`` (each payload is forwarded p - 1 times, unchanged) or ``"direct"``
            (each payload goes to every rank at once).
        threshold: the all-gather threshold (a payload never changes in an all-gather, so one
            format per piece for every hop).
        measured: False when ``counts`` are estimates (the cost model's look-ahead); recorded in
            ``Message.nnz_exact``.
    """
    p, ch = layout.world, layout.channels
    _check_counts(counts, p, ch, "all-gather")
    fmt = Format(fmt)
    sizes = _Sizes(dtype)
    if algorithm == "ring":
        steps = []
        for s in range(p - 1):
            messages = []
            for q in range(p):
                c, dst = (q - s) % p, (q + 1) % p
                inter = topology.is_inter(q, dst)
                for k, span in enumerate(layout.pieces[c]):
                    if span.numel:
                        count = counts[c][k]
                        sigma = sparsity(span.numel, count)
                        messages.append(
                            _message(q, dst, c, k, layout, fmt, count, measured, sigma, threshold, inter, sizes, False)
                        )
            steps.append(Step(Phase.ALL_GATHER, s, Route.P2P, Messages.of(messages)))
        return Plan(collective, algorithm, fmt, dtype, layout, topology, tuple(steps))
    if algorithm != "direct":
        raise ValueError(f"algorithm={algorithm!r} must be 'ring' or 'direct' to plan")
    if p == 1:
        return Plan(collective, algorithm, fmt, dtype, layout, topology, ())
    messages = []
    for c in range(p):
        for d in range(p):
            if d == c:
                continue
            inter = topology.is_inter(c, d)
            for k, span in enumerate(layout.pieces[c]):
                if span.numel:
                    count = counts[c][k]
                    sigma = sparsity(span.numel, count)
                    messages.append(
                        _message(c, d, c, k, layout, fmt, count, measured, sigma, threshold, inter, sizes, True)
                    )
    # rank q sends the same payload to every rank: measured on the messages to its right neighbour
    by_wave = [[0] * p for _ in range(ch)]
    for m in messages:
        if m.dst == (m.src + 1) % p:
            by_wave[m.piece][m.src] += m.nbytes
    waves = tuple(map(tuple, by_wave))
    padded = padded_slot(waves, p)
    route = Route.ALL_GATHER if padded else Route.P2P
    step = Step(Phase.ALL_GATHER, 0, route, Messages.of(messages), slot_bytes=padded, wave_bytes=waves)
    return Plan(collective, algorithm, fmt, dtype, layout, topology, (step,))


def padded_slot(wave_bytes: Sequence[Sequence[int]], world: int) -> int:
    """The bytes per rank of a direct all-gather padded to each wave's largest payload, or 0 when
    that would send more than :data:`PADDED_GATHER_SLACK` times the exact sizes (grouped p2p then)."""
    padded = sum(max(wave) for wave in wave_bytes)
    return padded if padded and world * padded <= PADDED_GATHER_SLACK * sum(map(sum, wave_bytes)) else 0


def estimate_reduced_counts(counts: Sequence[Sequence[int]], layout: ChunkLayout) -> list[list[int]]:
    """Expected nnz of every piece after summing all ranks' contributions (independent positions).

    ``n * (1 - prod(sigma_q))``, capped by ``min(n, sum of counts)``. Used to look ahead at an
    all-reduce's gather phase before its counts are measured.
    """
    p, ch = layout.world, layout.channels
    _check_counts(counts, p, p * ch, "reduce-scatter")
    out = []
    for c in range(p):
        row = []
        for k, span in enumerate(layout.pieces[c]):
            n = span.numel
            sigma, total = 1.0, 0
            for q in range(p):
                sigma *= sparsity(n, counts[q][c * ch + k])
                total += counts[q][c * ch + k]
            row.append(min(n, total, round(n * (1.0 - sigma))))
        out.append(row)
    return out


def bound_reduced_counts(counts: Sequence[Sequence[int]], layout: ChunkLayout) -> list[list[int]]:
    """Most nonzeros every piece can hold after summing all ranks' contributions: ``min(n, sum of counts)``.

    A position that is zero on every rank is zero in the sum, so no reduced piece exceeds it;
    an all-reduce sizes its gather phase from it when it skips the second count exchange.
    """
    p, ch = layout.world, layout.channels
    _check_counts(counts, p, p * ch, "reduce-scatter")
    return [
        [min(span.numel, sum(counts[q][c * ch + k] for q in range(p))) for k, span in enumerate(layout.pieces[c])]
        for c in range(p)
    ]
