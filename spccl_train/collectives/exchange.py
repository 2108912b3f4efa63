"""The planning exchange: every rank's call and nonzero counts, checked and shared.

Two protocols; every rank picks the same one from the group size alone (:func:`protocol`),
before anything is sent: nothing from a rank's config can decide it, since the configs are only
compared by the exchange itself.

**table** (groups under :data:`SCALABLE_WORLD` ranks): one all-gather, per collective, of one int64 row per rank: a header describing its call
(which collective, numel, dtypes, device, a fingerprint of its config, and any local argument
problems), then the nonzero count of every piece it holds (``world * channels`` slots, so the row
length is equal on every rank whatever the tensors are). One host synchronisation later every
rank holds the same table, checks it with the same code, and so either plans the same collective
or raises the same ``ValueError``: a bad argument on one rank never leaves the others hanging.
Each rank receives ``world * (11 + world * channels)`` int64: O(world^2).

**scalable** (larger groups): up to three rounds, each one host synchronisation
(:func:`exchange_rounds`), O(world x channels) int64 per rank:

1. an all-reduce (max) of every rank's header and its negation: the fields' maxima and minima.
   Where they differ, or a rank has problems, every rank gathers the headers (only then) and
   raises the table protocol's error;
2. the counts: an all-to-all (reduce-scatter and all-reduce: rank ``q`` sends rank ``c`` its
   counts of chunk ``c``, so each rank gets its own chunk's column) or an all-gather of the
   ``channels`` counts of each rank's input (all-gather). A ring (asked for; round 1 checked that
   every rank asked for it) or a graphed call, which need every rank's counts, gathers the table
   here instead and is done: O(world^2) bytes again;
3. reduce-scatter and all-reduce: what the owners alone know, for the cost model and the gather
   phase: an all-reduce (max) of each rank's nonzeros sent and received per hop kind, an
   all-reduce (sum) of the expected nonzeros of every reduced piece index and of every rank's
   nonzeros, and (all-reduce) an all-gather of every reduced piece's bound.

Each rank receives ``2 x world x channels`` int64 (16 bytes per rank and piece) and about 250
bytes of headers, sums and maxima (:func:`exchange_bytes`). The summary ``auto`` weighs is then made
of maxima and means (:meth:`Counts.summary`) rather than of the whole table, and ``auto`` does
not weigh rings, which need the whole table to size their steps.

An all-reduce that measures its gather phase exchanges a second, shorter row (the counts of its
reduced chunk) before it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import zlib

import numpy as np
import torch
import torch.distributed as dist

from ..formats import MAX_ELEMENTS, SUPPORTED_DTYPES
from ..transport import P2PTransport
from .chunking import ChunkLayout, piece_arrays
from .summary import CountSummary
from .topology import Topology

__all__ = [
    "Counts",
    "SCALABLE_WORLD",
    "exchange_rounds",
    "protocol",
    "exchange_scalable",
    "owner_terms",
    "exchange_bytes",
    "Problem",
    "Request",
    "COLLECTIVES",
    "API_NAMES",
    "HEADER_FIELDS",
    "dtype_code",
    "config_code",
    "exchange_counts",
    "exchange_reduced_counts",
    "check_table",
    "check_local",
    "check_bounds",
]

_MAGIC = 0x5350_434C_0002  # "SPCL", protocol 2 (the header carries "observed")
_MAGIC_REDUCED = 0x5350_434C_0101

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
"""Collective names, in the order of their header codes (1, 2, 3)."""
API_NAMES = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
}
"""The public function of each collective (used in error messages)."""

HEADER_FIELDS = (
    "magic",
    "collective",
    "numel",
    "out_numel",
    "dtype",
    "out_dtype",
    "device",
    "config",
    "problems",
    "channels",
    "observed",
)
"""The header of a row, in order; the counts follow. ``observed`` is not part of the call: the
nanoseconds the rank's previous call on the group took, or -1 (:mod:`.feedback`)."""
_OBSERVED = HEADER_FIELDS.index("observed")

_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DEVICE_TYPES = ("cpu", "cuda")


class Problem(enum.IntFlag):
    """Argument problems a rank finds in its own tensors (sent in the header, reported by all)."""

    NONE = 0
    INPUT_NOT_CONTIGUOUS = 1
    OUTPUT_NOT_CONTIGUOUS = 2
    UNSUPPORTED_DTYPE = 4
    DTYPES_DIFFER = 8
    OUTPUT_SIZE = 16
    DEVICE = 32
    DEVICES_DIFFER = 64
    TOO_LARGE = 128
    OVERLAP = 256
    ENCODED = 512


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One rank's call, as its header describes it."""

    collective: str
    """One of :data:`COLLECTIVES`."""
    numel: int
    """Input elements (the tensor's, for all-reduce)."""
    out_numel: int
    """Output elements (equal to ``numel`` for all-reduce)."""
    dtype: torch.dtype
    """Input dtype."""
    out_dtype: torch.dtype
    """Output dtype."""
    device: torch.device
    """The tensors' device."""
    config: int
    """:func:`config_code` of the rank's config."""
    problems: Problem
    """Local argument problems."""
    channels: int
    """Pieces per chunk."""

    def header(self, observed: int = -1) -> list[int]:
        """The header fields, in :data:`HEADER_FIELDS` order, with ``observed`` last."""
        return [
            _MAGIC,
            COLLECTIVES.index(self.collective) + 1,
            self.numel,
            self.out_numel,
            dtype_code(self.dtype),
            dtype_code(self.out_dtype),
            _DEVICE_TYPES.index(self.device.type) + 1 if self.device.type in _DEVICE_TYPES else 0,
            self.config,
            int(self.problems),
            self.channels,
            observed,
        ]


def dtype_code(dtype: torch.dtype) -> int:
    """A small int naming ``dtype`` on the wire (0: one we have no name for)."""
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]) if 1 <= code <= len(_DTYPES) else "an unrecognised dtype"


def config_code(fingerprint: str) -> int:
    """A 32-bit checksum of a config fingerprint (equal configs, equal codes)."""
    return zlib.crc32(fingerprint.encode())


def exchange_counts(
    transport: P2PTransport, request: Request, counts: torch.Tensor | None, width: int, observed: int = -1
) -> tuple[np.ndarray, torch.device, list[int]]:
    """All-gather every rank's header and ``width`` counts; check them; return the counts table.

    Args:
        transport: the group's transport.
        request: this rank's call.
        counts: this rank's per-piece nonzero counts (int64, at most ``width``, on any device), or
            ``None`` when it has problems and counted nothing.
        width: count slots per row (``world * channels``).
        observed: the header's ``observed`` field (:mod:`.feedback`).

    Returns:
        ``(table, device, observed)``: ``table[q]`` is rank ``q``'s ``width`` counts (an int64
        array of ``world`` rows); ``device`` is
        where the exchange ran; ``observed[q]`` is rank ``q``'s ``observed`` field.

    Raises:
        ValueError: the same message on every rank, when any rank's call is invalid or the calls
            disagree.
    """
    device = transport.exchange_device(request.device)
    header = torch.tensor(request.header(observed), dtype=torch.int64)
    row = torch.zeros(len(HEADER_FIELDS) + width, dtype=torch.int64, device=device)
    row[: len(HEADER_FIELDS)].copy_(header, non_blocking=True)
    if counts is not None and counts.numel():
        row[len(HEADER_FIELDS) : len(HEADER_FIELDS) + counts.numel()].copy_(counts, non_blocking=True)
    rows = transport.all_gather_rows(row).cpu().numpy()  # the collective's one host synchronisation
    headers = rows[:, : len(HEADER_FIELDS)].tolist()
    check_table(headers, request.collective, transport.world, transport.backend)
    return rows[:, len(HEADER_FIELDS) :], device, [r[_OBSERVED] for r in headers]


SCALABLE_WORLD = 32
"""Groups of at least this many ranks use the scalable protocol (unless a ring is asked for).
``SPCCL_SCALABLE_EXCHANGE_WORLD`` overrides it (equal on every rank; tests use small values).
From 32 ranks the table (``world^2 x channels`` int64 per rank, 16 KiB at 32 ranks and 2
channels; 16 MiB at 1024) costs more than the two extra synchronisations; below, one round wins."""


def protocol(world: int) -> str:
    """``"table"`` or ``"scalable"``: what every rank of a group of ``world`` ranks uses. From the
    group size alone: anything from a rank's config could differ between ranks before round 1
    has compared them, and ranks in different protocols would post different collectives."""
    threshold = int(os.environ.get("SPCCL_SCALABLE_EXCHANGE_WORLD", SCALABLE_WORLD))
    return "scalable" if world >= max(2, threshold) else "table"


def exchange_rounds(how: str, collective: str, whole_table: bool = False) -> int:
    """Host synchronisations of a count exchange: the table protocol's one; the scalable one's
    header round, then the counts (an all-gather, or the whole table for a ring: done), then for
    a reduce-scatter or all-reduce the owners' sums and bounds."""
    if how == "table":
        return 1
    return 2 if whole_table or collective == "all_gather" else 3


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Counts:
    """What a count exchange (or a caller's bounds) gave one rank: enough to summarise the call for
    ``auto`` and to plan this rank's messages. Arrays are int64."""

    collective: str
    row: np.ndarray
    """``row[c, k]``: this rank's count of piece ``k`` of chunk ``c`` (an all-gather: ``(1, channels)``,
    its input's)."""
    column: np.ndarray | None
    """``column[q, k]``: rank ``q``'s count of piece ``k`` of this rank's chunk (``None``: all-gather)."""
    gathered: np.ndarray | None
    """``gathered[c, k]``: an all-gather's every input count; an all-reduce's every reduced piece's
    bound (``min(n, sum)``); ``None`` for a reduce-scatter."""
    table: np.ndarray | None = None
    """Every rank's row: the table protocol's ``(world, world * channels)``, or what a scalable
    exchange gathered whole for a ring or a graphed call (an all-gather's: each rank's own
    ``channels``); ``None`` under the scalable protocol otherwise."""
    sent_max: np.ndarray | None = None
    """Scalable: per hop kind (intra, inter), the most nonzeros one rank sends of other ranks' chunks."""
    received_max: np.ndarray | None = None
    """Scalable: per hop kind, the most nonzeros one rank receives for its chunk."""
    estimate_sum: np.ndarray | None = None
    """Scalable all-reduce: per piece index, the expected nonzeros of the reduced pieces, summed over chunks."""
    held_sum: int = 0
    """Scalable: every rank's nonzeros, summed."""
    exact: bool = True
    """The counts are measured; ``False``: they are bounds (a caller's, or :mod:`.reuse`'s)."""

    @classmethod
    def from_table(cls, collective: str, table: object, layout: ChunkLayout, rank: int, exact: bool = True) -> Counts:
        """A whole table's counts as this rank sees them (the table protocol, or bounds: not ``exact``)."""
        p, ch = layout.world, layout.channels
        full = np.asarray(table, dtype=np.int64).reshape(p, -1)
        if collective == "all_gather":
            own = full[:, :ch]
            return cls(collective, own[rank : rank + 1], None, own, full, exact=exact)
        cube = full[:, : p * ch].reshape(p, p, ch)
        bound = None
        if collective == "all_reduce":
            bound = np.minimum(piece_arrays(layout)[0], cube.sum(0))
        return cls(collective, cube[rank], cube[:, rank], bound, full, exact=exact)

    def summary(self, layout: ChunkLayout, topology: Topology) -> CountSummary:
        """The summary ``auto`` weighs: the table's (:meth:`CountSummary.of`), or under the scalable
        protocol one of maxima and means: every rank sends and receives as much as the busiest one,
        every reduced piece of an index holds their mean, every rank holds the ranks' mean (the
        hierarchical all-reduce is weighed as for equally dense ranks)."""
        if self.table is not None:
            return CountSummary.of(self.collective, self.table, layout, topology)
        p, ch = layout.world, layout.channels
        if self.collective == "all_gather":
            zero = np.zeros((2, p), dtype=np.int64)
            own = self.gathered
            return CountSummary(
                self.collective, layout, topology, zero, zero, np.zeros(ch, np.int64), own, own, own.sum(1)
            )
        sent = np.repeat(self.sent_max[:, None], p, axis=1)
        received = np.repeat(self.received_max[:, None], p, axis=1)
        if self.collective == "all_reduce":
            bound = self.gathered
            estimate = np.minimum(bound, np.rint(self.estimate_sum / p).astype(np.int64)[None, :])
        else:
            bound = estimate = np.zeros((p, ch), dtype=np.int64)
        held = np.full(p, round(self.held_sum / p), dtype=np.int64)
        return CountSummary(
            self.collective, layout, topology, sent, received, np.zeros(ch, np.int64), bound, estimate, held
        )

    def reduced_bounds(self) -> np.ndarray:
        """An all-reduce's gather phase sized from the first exchange: every reduced piece's bound."""
        assert self.collective == "all_reduce" and self.gathered is not None
        return self.gathered


_CHECKED = ("magic", "collective", "numel", "out_numel", "dtype", "config", "channels")
"""Header fields that must be equal on every rank (what :func:`check_table` compares)."""


def owner_terms(
    row: np.ndarray, column: np.ndarray, layout: ChunkLayout, topology: Topology, rank: int
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """What rank ``rank`` contributes to the scalable protocol's third round, from its ``row`` and
    its chunk's ``column`` (both ``(world, channels)``): O(world x channels).

    Returns ``(maxima, bound, sums)``: its nonzeros sent and received per hop kind (intra, inter;
    maxed over ranks), its reduced pieces' bounds (gathered), and its reduced pieces' expected
    nonzeros followed by its nonzeros (summed over ranks).
    """
    n, n_safe, (first, last) = _owner_geometry(layout, topology, rank)
    to, since = row.sum(1), column.sum(1)  # what it sends to, and receives from, each rank
    sent, received = int(to.sum()), int(since.sum())
    sent_own, received_own = int(to[rank]), int(since[rank])
    sent_node, received_node = int(to[first:last].sum()), int(since[first:last].sum())
    maxima = [sent_node - sent_own, sent - sent_node, received_node - received_own, received - received_node]
    bound = np.minimum(n, column.sum(0))
    # sparsities(): an empty piece has no nonzeros, so 1 - 0 / 1 there
    expected = np.rint(n * (1.0 - np.prod(1.0 - column / n_safe, axis=0))).astype(np.int64)
    return maxima, bound, np.concatenate([np.minimum(bound, expected), [sent]])


@functools.lru_cache(maxsize=64)
def _owner_geometry(layout: ChunkLayout, topology: Topology, rank: int) -> tuple:
    """:func:`owner_terms`'s fixed terms: this rank's pieces' sizes (and at least 1), and where
    its node's ranks start and end."""
    p = layout.world
    n = piece_arrays(layout)[0][rank]
    rpn = topology.ranks_per_node
    local = p if rpn is None else min(rpn, p)
    first = rank // local * local
    return n, np.maximum(n, 1), (first, min(p, first + local))


def exchange_bytes(how: str, collective: str, world: int, channels: int, whole_table: bool = False) -> int:
    """Bytes a count exchange by protocol ``how`` delivers to each rank (what it receives, every
    round): the table's ``world * (11 + world * channels)`` int64, or the scalable protocol's
    ``2 x 11`` header extrema, then ``world x channels`` counts (a ring: the ``world^2 x channels``
    table), and (reductions) the sums and maxima plus, for an all-reduce, ``world x channels`` bounds."""
    if how == "table":
        return 8 * world * (len(HEADER_FIELDS) + world * channels)
    if whole_table:
        return 8 * (2 * len(HEADER_FIELDS) + world * world * channels)
    total = 2 * len(HEADER_FIELDS) + world * channels
    if collective != "all_gather":
        total += 4 + channels + 1 + (world * channels if collective == "all_reduce" else 0)
    return 8 * total


def exchange_scalable(
    transport: P2PTransport,
    request: Request,
    counts: torch.Tensor | None,
    layout: ChunkLayout | None,
    topology: Topology,
    observed: int = -1,
    whole_table: bool = False,
) -> tuple[Counts, torch.device, list[int]]:
    """The scalable protocol (see the module docstring): check every rank's call, then share the counts.

    Args:
        counts: this rank's per-piece nonzero counts (int64, ``world * channels``; an all-gather:
            ``channels``), or ``None`` when it has problems and counted nothing.
        layout: the call's chunks (``None`` with problems: the first round raises on every rank).
        whole_table: gather every rank's counts in round 2 (a ring sizes its steps from them); the
            config asks for it, and round 1 checked that every rank's config is the same.

    Returns:
        ``(counts, device, observed)``: ``observed`` is the lowest and the highest of the ranks'
        ``observed`` fields (what :meth:`.feedback.Corrections.learn` reads).

    Raises:
        ValueError: the table protocol's message, on every rank, when the calls are not one valid call.
    """
    device = transport.exchange_device(request.device)
    header = request.header(observed)
    both = torch.tensor(header + [-v for v in header], dtype=torch.int64).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=transport.group)
    values = both.tolist()  # synchronisation 1
    most, least = values[: len(header)], [-v for v in values[len(header) :]]
    f = {name: i for i, name in enumerate(HEADER_FIELDS)}
    if most[f["problems"]] or any(most[f[name]] != least[f[name]] for name in _CHECKED):
        headers = transport.all_gather_rows(torch.tensor(header, dtype=torch.int64).to(device)).tolist()
        check_table(headers, request.collective, transport.world, transport.backend)
        raise RuntimeError(f"spccl_train: the ranks' calls differ, but not in a way the check names: {headers}")
    assert layout is not None and counts is not None  # no rank has problems
    p, ch, r = layout.world, layout.channels, transport.rank
    times = [least[f["observed"]], most[f["observed"]]]
    if whole_table:  # synchronisation 2: the table protocol's counts, after the checked headers
        table = transport.all_gather_rows(counts.to(device)).cpu().numpy()
        return Counts.from_table(request.collective, table, layout, r), device, times
    if request.collective == "all_gather":
        gathered = transport.all_gather_rows(counts.to(device)).cpu().numpy()  # synchronisation 2
        return Counts(request.collective, gathered[r : r + 1], None, gathered), device, times
    mine = counts.to(device)
    column = torch.empty(p * ch, dtype=torch.int64, device=device)
    dist.all_to_all_single(column, mine, group=transport.group)
    row, col = torch.cat([mine, column]).cpu().numpy().reshape(2, p, ch)  # synchronisation 2 (one copy)
    maxima, bound, sums = owner_terms(row, col, layout, topology, r)
    most_t = torch.tensor(maxima, dtype=torch.int64).to(device)
    sums_t = torch.from_numpy(sums).to(device)
    dist.all_reduce(most_t, op=dist.ReduceOp.MAX, group=transport.group)
    dist.all_reduce(sums_t, op=dist.ReduceOp.SUM, group=transport.group)
    parts = [most_t, sums_t]
    if request.collective == "all_reduce":
        parts.append(transport.all_gather_rows(torch.from_numpy(bound).to(device)).view(-1))
    got = torch.cat(parts).cpu().numpy()  # synchronisation 3 (one copy)
    maxima, sums = got[:4], got[4 : 5 + ch]
    gathered = got[5 + ch :].reshape(p, ch) if request.collective == "all_reduce" else None
    counts = Counts(request.collective, row, col, gathered, None, maxima[:2], maxima[2:], sums[:ch], int(sums[ch]))
    return counts, device, times


def exchange_reduced_counts(transport: P2PTransport, counts: torch.Tensor, device: torch.device) -> list[list[int]]:
    """All-gather each rank's reduced-chunk piece counts (an all-reduce's second exchange)."""
    row = torch.empty(1 + counts.numel(), dtype=torch.int64, device=device)
    row[0] = _MAGIC_REDUCED
    row[1:].copy_(counts, non_blocking=True)
    table = transport.all_gather_rows(row).tolist()
    bad = [q for q, r in enumerate(table) if r[0] != _MAGIC_REDUCED]
    if bad:
        raise RuntimeError(
            f"ranks {bad} sent something else in the all-reduce's second count exchange: collectives on this "
            "group were issued in different orders on different ranks"
        )
    return [r[1:] for r in table]


def check_table(table: list[list[int]], collective: str, world: int, backend: str = "?") -> None:
    """Raise one ``ValueError`` (the same text on every rank) if the gathered calls are not one valid call."""
    api = f"spccl_train.{API_NAMES[collective]}"
    f = {name: i for i, name in enumerate(HEADER_FIELDS)}
    stray = [q for q, r in enumerate(table) if r[f["magic"]] != _MAGIC]
    if stray:
        raise ValueError(
            f"{api}: ranks {stray} are not in a spccl_train collective (or run another version of it); every rank "
            "of the group must make the same collective call in the same order"
        )
    called = [r[f["collective"]] for r in table]
    if len(set(called)) > 1:
        names = ", ".join(f"rank {q}: {API_NAMES[COLLECTIVES[c - 1]]}" for q, c in enumerate(called))
        raise ValueError(f"spccl_train: ranks called different collectives ({names}); call the same one on every rank")
    problems = []
    for q, r in enumerate(table):
        flags = Problem(r[f["problems"]])
        if flags:
            problems.append(f"rank {q}: {_problems_text(r, collective, world, backend)}")
    if problems:
        raise ValueError(f"{api}: invalid arguments on {len(problems)} of {world} ranks. " + " | ".join(problems))
    for field, what in (("numel", "input numel"), ("dtype", "dtype"), ("out_numel", "output numel")):
        values = [r[f[field]] for r in table]
        if len(set(values)) > 1:
            shown = [_dtype_name(v) for v in values] if field == "dtype" else values
            listing = ", ".join(f"rank {q}: {v}" for q, v in enumerate(shown))
            raise ValueError(
                f"{api}: ranks disagree on the {what} ({listing}); every rank must pass tensors of the same numel "
                "and dtype"
            )
    configs = [r[f["config"]] for r in table]
    if len(set(configs)) > 1 or len({r[f["channels"]] for r in table}) > 1:
        groups: dict[int, list[int]] = {}
        for q, c in enumerate(configs):
            groups.setdefault(c, []).append(q)
        listing = "; ".join(f"ranks {ranks}" for ranks in groups.values())
        raise ValueError(
            f"{api}: ranks passed different CollectiveConfigs (alike within: {listing}); every rank plans the "
            "collective on its own, so pass an equal config (format, algorithm, thresholds, ranks_per_node, "
            "channels, cost_model) everywhere"
        )


def check_local(request: Request, world: int, backend: str = "?") -> None:
    """Raise ``ValueError`` on this rank if its own call is invalid (a call with bounds exchanges nothing)."""
    if not request.problems:
        return
    text = _problems_text(request.header(), request.collective, world, backend)
    raise ValueError(
        f"spccl_train.{API_NAMES[request.collective]}: invalid arguments on this rank (a call with bounds makes no "
        f"planning exchange, so the other ranks are not told): {text}"
    )


def check_bounds(bounds: object, layout: ChunkLayout, collective: str) -> list[list[int]]:
    """``bounds`` as a count table (lists of ints), or ``ValueError`` naming what is wrong with it.

    Row ``q`` has ``world * channels`` entries, the bound of each piece as rank ``q`` holds it,
    each in ``[0, piece numel]``; for an all-gather only the first ``channels`` (rank ``q``'s
    input) are read, and they are checked against rank ``q``'s chunk.
    """
    p, ch = layout.world, layout.channels
    api = f"spccl_train.{API_NAMES[collective]}"
    try:
        table = [[int(b) for b in row] for row in bounds]  # type: ignore[union-attr]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{api}: bounds must be a sequence of {p} rows of {p * ch} ints ({exc})") from None
    if len(table) != p or any(len(row) != p * ch for row in table):
        shape = [len(row) for row in table]
        raise ValueError(
            f"{api}: bounds has rows of lengths {shape}; it needs {p} rows (one per rank) of world * channels = "
            f"{p * ch} piece bounds"
        )
    sizes = [piece.numel for chunk in layout.pieces for piece in chunk]
    for q, row in enumerate(table):
        limits = [piece.numel for piece in layout.pieces[q]] if collective == "all_gather" else sizes
        for k, (b, n) in enumerate(zip(row, limits)):
            if not 0 <= b <= n:
                raise ValueError(
                    f"{api}: bounds[{q}][{k}] = {b} is not a nonzero count of a piece of {n} elements; "
                    f"pass a bound in [0, {n}]"
                )
    return table


def _problems_text(row: list[int], collective: str, world: int, backend: str) -> str:
    """Every problem flagged in a header row, described and joined."""
    f = {name: i for i, name in enumerate(HEADER_FIELDS)}
    flags = Problem(row[f["problems"]])
    return "; ".join(_describe(flag, row, f, collective, world, backend) for flag in Problem if flag and flag in flags)


def _describe(flag: Problem, row: list[int], f: dict[str, int], collective: str, world: int, backend: str) -> str:
    numel, out_numel = row[f["numel"]], row[f["out_numel"]]
    dtype, out_dtype = _dtype_name(row[f["dtype"]]), _dtype_name(row[f["out_dtype"]])
    device_code = row[f["device"]]
    device = _DEVICE_TYPES[device_code - 1] if 1 <= device_code <= len(_DEVICE_TYPES) else "another device"
    names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
    if flag is Problem.INPUT_NOT_CONTIGUOUS:
        return "the input is not contiguous; pass input.contiguous()"
    if flag is Problem.OUTPUT_NOT_CONTIGUOUS:
        return "the output is not contiguous; pass a contiguous output (e.g. torch.empty(...))"
    if flag is Problem.UNSUPPORTED_DTYPE:
        return f"dtype {dtype} is not supported; the collectives carry {names}, so cast first"
    if flag is Problem.DTYPES_DIFFER:
        return f"the output dtype {out_dtype} differs from the input dtype {dtype}; allocate the output with the input's dtype"
    if flag is Problem.OUTPUT_SIZE:
        if collective == "all_gather":
            return (
                f"the output has {out_numel} elements but needs world_size * input.numel() = {world} * {numel} = "
                f"{world * numel}"
            )
        return (
            f"the input has {numel} elements but needs world_size * output.numel() = {world} * {out_numel} = "
            f"{world * out_numel}"
        )
    if flag is Problem.DEVICE:
        return f"the tensors are on {device}, which the group's backend ({backend}) does not move; use a group whose backend serves that device"
    if flag is Problem.DEVICES_DIFFER:
        return "the input and output are on different devices; put both on one device"
    if flag is Problem.TOO_LARGE:
        return f"a piece of a chunk would exceed {MAX_ELEMENTS} elements (the formats' limit); raise channels"
    if flag is Problem.ENCODED:
        return (
            "the encoded input does not fit the call (another dtype, device or cut); encode the tensor's dtype on "
            "its device with the call's ChunkLayout.of('all_reduce', tensor.numel(), world_size, config.channels)"
        )
    return (
        "the output overlaps the input; only the in-place forms are supported (all-gather: input is the rank's "
        "slice of the output; reduce-scatter: output is the rank's slice of the input)"
    )
