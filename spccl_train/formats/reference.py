"""Pure-torch reference codecs for Pici and COO: the oracle for every kernel and collective.

Vectorised torch code that runs on CPU and CUDA tensors alike and produces exactly the bytes of
``docs/FORMATS.md``. It synchronises with the device freely (it needs nnz on the host
to size its slices), so it is the ground truth and the CPU path, not the fast path.

Arguments are assumed to be checked by :mod:`spccl_train.formats.codec`. Payload *contents* are
checked here exactly as the CUDA kernels (``csrc/pici.cu``, ``csrc/coo.cu``) check them: a decoder
returns the kernels' :class:`DecodeStatus` bits and writes what the kernels write, everything for a
good payload and, for a bad one, only the tiles (Pici) or entries (COO) that pass their own checks,
never an element outside the destination range. With ``check=True`` it then raises
:class:`CorruptPayloadError` naming the problem, or saying that the payload is a good one for
another ``n`` when it is. A payload too short for the metadata of ``n`` is a size error: it
raises whatever ``check`` says, before anything is read or written.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from .layout import (
    MAX_ELEMENTS,
    TILE,
    TILE_ROWS,
    coo_layout,
    element_size,
    num_tiles,
    pici_layout,
    pici_max_tiles,
    pici_n_range,
)

__all__ = [
    "STATUS_TEXT",
    "CorruptPayloadError",
    "DecodeStatus",
    "PayloadTooSmallError",
    "check_pici_exact",
    "check_pici_size",
    "coo_compress",
    "coo_decompress",
    "coo_explain",
    "pici_compress",
    "pici_decompress",
    "pici_decompress_patch",
    "pici_explain",
]


class DecodeStatus(enum.IntFlag):
    """Bits of the status a decoder reports (``csrc/spccl.h`` uses the same values)."""

    OK = 0
    BAD_INDEX = 1
    """Pici: the index array does not start at 0 or decreases."""
    BAD_TILE_COUNT = 2
    """Pici: a tile's bitvector popcount disagrees with its index step."""
    BAD_NNZ = 4
    """nnz exceeds n or what the payload can hold (Pici: or an index entry exceeds nnz; COO: or nnz < 0)."""
    PAST_END = 8
    """Nonzeros are marked at positions >= n: the payload does not fit n (or is corrupt)."""
    NOT_ASCENDING = 16
    """COO: positions are not strictly ascending."""


STATUS_TEXT = {
    DecodeStatus.BAD_INDEX: "the index array does not start at 0 or decreases",
    DecodeStatus.BAD_TILE_COUNT: "a tile's bitvector popcount disagrees with its index step",
    DecodeStatus.BAD_NNZ: "nnz exceeds n or what the payload can hold",
    DecodeStatus.PAST_END: "nonzeros are marked past the end of the range",
    DecodeStatus.NOT_ASCENDING: "COO positions are not strictly ascending",
}
"""What each status bit means, for messages."""


def status_names(code: int) -> str:
    """``"BAD_INDEX|PAST_END"``: the names of the bits set in ``code``."""
    return "|".join(bit.name for bit in STATUS_TEXT if code & bit) or "OK"


class CorruptPayloadError(ValueError):
    """A payload's metadata contradicts itself, or the range it claims to encode (it does not fit ``n``)."""


class PayloadTooSmallError(ValueError):
    """An output buffer cannot hold the payload that compression produced."""


def _u32_bytes(values: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 bytes of non-negative int64 values below 2**32."""
    return values.to(torch.int64).contiguous().view(torch.uint8).view(-1, 8)[:, :4].reshape(-1)


def _read_u32(payload: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``count`` little-endian uint32 values at byte ``start``, as int64."""
    raw = payload[start : start + 4 * count].clone()
    return raw.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _read_values(payload: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    return payload[start : start + count * element_size(dtype)].clone().view(dtype)


def _too_small(kind: str, have: int, need: int, n: int, nnz: int) -> PayloadTooSmallError:
    return PayloadTooSmallError(
        f"output buffer of {have} bytes is too small for the {kind} payload of {need} bytes "
        f"(n={n}, nnz={nnz}); allocate capacity_bytes('{kind.lower()}', n, dtype) bytes"
    )


def _result_nnz(nnz: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([nnz], dtype=torch.int64, device=device)


def _accumulate(dst: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """``dst[where] += values`` in fp32 for 16-bit types, rounding once, as the kernels do."""
    if dst.dtype == torch.float32:
        dst[where] = dst[where] + values.to(torch.float32)
    else:
        dst[where] = (dst[where].to(torch.float32) + values.to(torch.float32)).to(dst.dtype)


def pici_compress(src: torch.Tensor, offset: int, n: int, out: torch.Tensor) -> torch.Tensor:
    """Encode ``src[offset:offset+n]`` as Pici into the uint8 buffer ``out``; return nnz.

    Returns a one-element int64 tensor on ``src``'s device. Raises
    :class:`PayloadTooSmallError` (writing nothing) when ``out`` cannot hold the payload.
    """
    layout = pici_layout(n)
    tiles = layout.tiles
    x = src[offset : offset + n]
    padded = torch.zeros(tiles * TILE, dtype=src.dtype, device=src.device)
    padded[:n] = x
    # (tile, column, row): the order of the bitvector words and of the values.
    by_column = padded.view(tiles, TILE_ROWS, TILE_ROWS).transpose(1, 2)
    nonzero = by_column != 0
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int64, device=src.device)
    # Byte k of column word c holds rows 8k..8k+7: the little-endian bytes of the uint64.
    bits = (nonzero.reshape(tiles, TILE_ROWS, 8, 8).to(torch.int64) * weights).sum(-1)
    tile_counts = nonzero.sum(dim=(1, 2))
    index = torch.zeros(tiles + 1, dtype=torch.int64, device=src.device)
    torch.cumsum(tile_counts, 0, out=index[1:])
    values = by_column[nonzero]
    nnz = int(index[-1])
    need = layout.nbytes(nnz, src.dtype)
    if out.numel() < need:
        raise _too_small("Pici", out.numel(), need, n, nnz)
    out[: layout.index_offset] = bits.reshape(-1).to(torch.uint8)
    out[layout.index_offset : layout.values_offset] = 0
    out[layout.index_offset : layout.index_offset + 4 * (tiles + 1)] = _u32_bytes(index)
    out[layout.values_offset : need] = values.contiguous().view(torch.uint8)
    return _result_nnz(nnz, src.device)


def coo_compress(src: torch.Tensor, offset: int, n: int, out: torch.Tensor) -> torch.Tensor:
    """Encode ``src[offset:offset+n]`` as COO into the uint8 buffer ``out``; return nnz."""
    x = src[offset : offset + n]
    positions = torch.nonzero(x != 0).view(-1)
    nnz = positions.numel()
    layout = coo_layout(nnz)
    need = layout.nbytes(src.dtype)
    if out.numel() < need:
        raise _too_small("COO", out.numel(), need, n, nnz)
    out[: layout.values_offset] = 0
    out[: 4 * nnz] = _u32_bytes(positions)
    out[layout.values_offset : need] = x[positions].contiguous().view(torch.uint8)
    return _result_nnz(nnz, src.device)


# ----------------------------------------------------------------------------- sizes


def _tiles(count: int) -> str:
    return f"{count} tile" if count == 1 else f"{count} tiles"


def _made_for(nbytes: int, dtype: torch.dtype, exact: bool) -> str:
    """What a Pici payload's length says about the n it was made for."""
    if exact:
        span = pici_n_range(nbytes, dtype)
        if span is not None:
            lo, hi = span
            fewest, most = num_tiles(lo), num_tiles(hi)
            tiles = _tiles(most) if fewest == most else f"{fewest} to {most} tiles"
            return f"by its length it was made for n from {lo} to {hi} ({tiles})"
    most = pici_max_tiles(nbytes)
    if most < 0:
        return f"{nbytes} bytes are fewer than the 16 of any Pici payload"
    return (
        f"{nbytes} bytes hold the metadata of at most {_tiles(most)}, "
        f"so it was made for n <= {min(TILE * most, MAX_ELEMENTS)}"
    )


def check_pici_size(
    nbytes: int,
    n: int,
    dtype: torch.dtype,
    *,
    what: str = "payload",
    bits_only: bool = False,
    exact: bool = False,
) -> None:
    """Raise :class:`CorruptPayloadError` when ``nbytes`` bytes cannot be a Pici ``what`` for ``n`` elements.

    Checked on the host from sizes alone, before anything is read: the buffer must hold the
    metadata ``n`` needs (with ``bits_only``, just its bitvectors: what a ``prior`` must hold).
    With ``exact`` (a payload exactly as :func:`pici_encode` returned it) it must also be no
    longer than the largest payload of ``n`` elements, and the message says which ``n`` its
    length allows. The message names ``n``, what the length implies, and the fix.
    """
    layout = pici_layout(n)
    tiles = layout.tiles
    need = layout.index_offset if bits_only else layout.metadata_bytes
    if nbytes < need:
        if bits_only:
            most = nbytes // (8 * TILE_ROWS)
            made = (
                f"{nbytes} bytes hold the bitvectors of at most {_tiles(most)}, "
                f"so it was made for n <= {min(TILE * most, MAX_ELEMENTS)}"
            )
            part = f"whose bitvectors alone are {need} bytes"
        else:
            made = _made_for(nbytes, dtype, exact)
            part = f"whose metadata alone is {need} bytes"
        raise CorruptPayloadError(
            f"Pici {what} of {nbytes} bytes does not fit n={n}: n={n} takes {_tiles(tiles)}, {part}, "
            f"but {made}; decode with the n it was encoded with"
        )
    capacity = layout.nbytes(n, dtype)
    if exact and nbytes > capacity:
        if pici_n_range(nbytes, dtype) is None:
            raise CorruptPayloadError(
                f"Pici {what} of {nbytes} bytes is longer than any Pici payload of n={n} {dtype} elements "
                f"({capacity} bytes at most), and no n gives a {dtype} payload exactly {nbytes} bytes long: "
                "pass it exactly as pici_encode returned it, with the n and dtype it was encoded with"
            )
        raise CorruptPayloadError(
            f"Pici {what} of {nbytes} bytes does not fit n={n}: a Pici payload of n={n} {dtype} elements "
            f"({_tiles(tiles)}) has at most {capacity} bytes, but {_made_for(nbytes, dtype, True)}; "
            "decode with the n it was encoded with"
        )


# ----------------------------------------------------------------------------- Pici checks


@dataclasses.dataclass
class _PiciScan:
    """A Pici payload checked as the kernels check it (``check_tile`` in ``csrc/pici.cu``)."""

    status: int
    nnz: int
    room: int
    """Values the payload has room for after its metadata."""
    mask: torch.Tensor | None = None
    """(tile, column, row) marks of ``B``; None when nnz was bad (the kernels then decode nothing)."""
    prior_mask: torch.Tensor | None = None
    index: torch.Tensor | None = None
    """``I`` as int64."""
    good: torch.Tensor | None = None
    """Per tile: it passes its checks (the kernels decode exactly these tiles)."""
    counts: torch.Tensor | None = None
    past: torch.Tensor | None = None
    bad_index: torch.Tensor | None = None
    bad_count: torch.Tensor | None = None
    bad_nnz: torch.Tensor | None = None


def _bit_mask(payload: torch.Tensor, tiles: int) -> torch.Tensor:
    """The (tile, column, row) marks of the ``B`` at the start of ``payload``."""
    raw = payload[: 8 * TILE_ROWS * tiles].view(tiles, TILE_ROWS, 8, 1)
    shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
    # Byte k of column word c holds rows 8k..8k+7.
    return ((raw >> shifts) & 1).bool().view(tiles, TILE_ROWS, TILE_ROWS)


def _by_position(mask: torch.Tensor) -> torch.Tensor:
    """A (tile, column, row) tensor in element order (tile, row, column), flat."""
    return mask.transpose(1, 2).reshape(-1)


def _pici_scan(payload: torch.Tensor, n: int, dtype: torch.dtype, prior: torch.Tensor | None = None) -> _PiciScan:
    layout = pici_layout(n)
    tiles = layout.tiles
    check_pici_size(payload.numel(), n, dtype)
    if prior is not None:
        check_pici_size(prior.numel(), n, dtype, what="prior", bits_only=True)
    index = _read_u32(payload, layout.index_offset, tiles + 1)
    nnz = int(index[-1])
    room = (payload.numel() - layout.values_offset) // element_size(dtype)
    if nnz > n or nnz > room:
        # Every kernel block reads nnz first and returns: nothing is decoded.
        return _PiciScan(int(DecodeStatus.BAD_NNZ), nnz, room)
    device = payload.device
    mask = _bit_mask(payload, tiles)
    prior_mask = _bit_mask(prior, tiles) if prior is not None else None
    counts = mask.sum(dim=(1, 2))
    lo, hi = index[:-1], index[1:]
    past = torch.zeros(tiles, dtype=torch.bool, device=device)
    if tiles:
        # Element (column c, row r) of the last tile is at 64 r + c; those at or past n must be clear.
        beyond = torch.arange(TILE, device=device).view(TILE_ROWS, TILE_ROWS).t() >= n - (tiles - 1) * TILE
        marked = mask[-1] if prior_mask is None else mask[-1] | prior_mask[-1]
        past[-1] = (marked & beyond).any()
    bad_index = hi < lo
    if tiles:
        bad_index[0] = bad_index[0] | (lo[0] != 0)
    bad_count = ~bad_index & (hi - lo != counts)
    bad_nnz = hi > nnz
    status = 0
    for flags, bit in (
        (bad_index, DecodeStatus.BAD_INDEX),
        (bad_count, DecodeStatus.BAD_TILE_COUNT),
        (bad_nnz, DecodeStatus.BAD_NNZ),
        (past, DecodeStatus.PAST_END),
    ):
        if bool(flags.any()):
            status |= int(bit)
    return _PiciScan(
        status,
        nnz,
        room,
        mask=mask,
        prior_mask=prior_mask,
        index=index,
        good=~(past | bad_index | bad_count | bad_nnz),
        counts=counts,
        past=past,
        bad_index=bad_index,
        bad_count=bad_count,
        bad_nnz=bad_nnz,
    )


def _pici_decoded(payload: torch.Tensor, scan: _PiciScan, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``n`` decoded elements in order (zeros where unmarked), from the tiles that pass.

    Tile ``t``'s values are ``A[I[t] : I[t+1]]`` by column, then row, as the kernels read them;
    for a good payload that is the whole of ``A`` in order.
    """
    assert scan.mask is not None and scan.good is not None and scan.index is not None
    tiles = scan.mask.shape[0]
    layout = pici_layout(n)
    values = _read_values(payload, layout.values_offset, scan.nnz, dtype)
    dense = torch.zeros(tiles, TILE_ROWS, TILE_ROWS, dtype=dtype, device=payload.device)
    # masked_scatter_ copies bits; a boolean-index assignment of one value fills from a Python
    # float and would canonicalise a lone NaN.
    if scan.status == 0:
        dense.masked_scatter_(scan.mask, values)
    else:
        take = scan.mask & scan.good.view(-1, 1, 1)
        rank = scan.mask.view(tiles, TILE).cumsum(1) - 1
        source = (scan.index[:-1].view(-1, 1) + rank).view(tiles, TILE_ROWS, TILE_ROWS)[take]
        dense.masked_scatter_(take, values[source])
    return _by_position(dense)[:n]


def _good_elements(scan: _PiciScan, n: int) -> torch.Tensor:
    assert scan.good is not None
    return scan.good.repeat_interleave(TILE)[:n]


def _finish(status: int, check: bool, explain) -> DecodeStatus:
    if status and check:
        raise CorruptPayloadError(explain())
    return DecodeStatus(status)


def pici_decompress(
    payload: torch.Tensor,
    n: int,
    dst: torch.Tensor,
    offset: int,
    *,
    accumulate: bool = False,
    dtype: torch.dtype | None = None,
    check: bool = True,
) -> DecodeStatus:
    """Decode a Pici payload of ``n`` elements into ``dst[offset:offset+n]``; return its status.

    Overwrites the range (zeros included), or with ``accumulate`` adds the decoded nonzeros to
    it. ``dtype`` is the payload's element type (default ``dst.dtype``; a float32 ``dst`` may
    accumulate 16-bit values). A bad payload (nonzero status) is decoded as the kernels decode
    it: tiles that pass their checks are written, the others left alone, and nothing at all
    when nnz is bad; then, with ``check``, :class:`CorruptPayloadError` is raised.
    """
    dtype = dtype or dst.dtype
    scan = _pici_scan(payload, n, dtype)
    if scan.mask is not None:
        target = dst[offset : offset + n]
        decoded = _pici_decoded(payload, scan, n, dtype).to(dst.device)
        if accumulate:
            where = _by_position(scan.mask)[:n].to(dst.device)
            if scan.status:
                where &= _good_elements(scan, n).to(dst.device)
            _accumulate(target, where, decoded[where])
        elif scan.status:
            good = _good_elements(scan, n).to(dst.device)
            target.masked_scatter_(good, decoded[good])
        else:
            target.copy_(decoded)
    return _finish(scan.status, check, lambda: pici_explain(payload, n, dtype))


def pici_decompress_patch(
    payload: torch.Tensor,
    prior: torch.Tensor,
    n: int,
    dst: torch.Tensor,
    offset: int,
    *,
    check: bool = True,
) -> DecodeStatus:
    """Decode a Pici payload into ``dst[offset:offset+n]``, which holds what the Pici payload ``prior`` encodes.

    Writes only the elements either payload marks: the payload's values where it marks them, and
    zeros where only ``prior`` does. The range then equals an overwriting decode (a signed zero left
    unmarked by both keeps its sign). Only ``prior``'s bitvectors are read, as by the kernel: they
    must hold ``512 * tiles`` bytes and mark nothing past ``n``. A bad payload is handled as by
    :func:`pici_decompress`: tiles that fail their checks are left alone.
    """
    scan = _pici_scan(payload, n, dst.dtype, prior)
    if scan.mask is not None:
        assert scan.prior_mask is not None
        decoded = _pici_decoded(payload, scan, n, dst.dtype).to(dst.device)
        where = _by_position(scan.mask)[:n].to(dst.device)
        gone = _by_position(scan.prior_mask)[:n].to(dst.device) & ~where
        if scan.status:
            good = _good_elements(scan, n).to(dst.device)
            where &= good
            gone &= good
        target = dst[offset : offset + n]
        target.masked_fill_(gone, 0)
        target.masked_scatter_(where, decoded[where])
    return _finish(scan.status, check, lambda: pici_explain(payload, n, dst.dtype, prior))


def _last_marked(mask: torch.Tensor) -> int:
    marked = torch.nonzero(_by_position(mask))
    return int(marked[-1]) if marked.numel() else -1


def _u32_at(payload: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The little-endian uint32 at each byte offset in ``starts``, as int64."""
    raw = payload[starts.view(-1, 1) + torch.arange(4, device=payload.device)].to(torch.int64)
    return raw[:, 0] | raw[:, 1] << 8 | raw[:, 2] << 16 | raw[:, 3] << 24


def _pici_refit(payload: torch.Tensor, n: int, dtype: torch.dtype, *, failed: bool) -> str | None:
    """If ``payload`` is a good Pici payload for some other ``n``, say so; else None.

    ``failed``: the payload fails its checks as ``n`` elements; then a larger ``n`` of the same
    tile count is tried too. Other tile counts are tried for an exact payload (no bytes after
    its values), whose length and ``I`` agree only for the tile count it was made for.
    """
    nbytes = payload.numel()
    tiles = num_tiles(n)
    wide = min(tiles * TILE, MAX_ELEMENTS)
    if failed and tiles and wide != n:
        # Same tiles, larger n: only "nnz > n" and "marked past n" depend on n within a tile count.
        scan = _pici_scan(payload, wide, dtype)
        if scan.status == 0:
            assert scan.mask is not None
            last = _last_marked(scan.mask)
            return (
                f"Pici payload does not fit n={n}: it marks a nonzero past the end n={n} (its last at "
                f"position {last}, nnz={scan.nnz}), so it was made for n from {last + 1} to {wide} "
                f"({_tiles(tiles)}); decode with the n it was encoded with"
            )
    # Other tile counts: an exact payload of t tiles has I[0] = 0 and I[t] = its values' count.
    span = pici_n_range(nbytes, dtype)
    if span is None:
        return None
    candidates = torch.arange(num_tiles(span[0]), num_tiles(span[1]) + 1, device=payload.device)
    candidates = candidates[candidates != tiles]
    if not candidates.numel():
        return None
    metadata = 8 * TILE_ROWS * candidates + (4 * (candidates + 1) + 15) // 16 * 16
    starts = 8 * TILE_ROWS * candidates
    fits = (_u32_at(payload, starts) == 0) & (
        _u32_at(payload, starts + 4 * candidates) * element_size(dtype) == nbytes - metadata
    )
    for other in candidates[fits][:4].tolist():
        wide = min(other * TILE, MAX_ELEMENTS)
        scan = _pici_scan(payload, wide, dtype)
        if scan.status == 0:
            assert scan.mask is not None
            lowest = max(_last_marked(scan.mask) + 1, TILE * (other - 1) + 1 if other else 0)
            return (
                f"Pici payload of {nbytes} bytes does not fit n={n} ({_tiles(tiles)}): it is a good payload "
                f"of {_tiles(other)} (nnz={scan.nnz}), made for n from {lowest} to {wide}; "
                "decode with the n it was encoded with"
            )
    return None


def _pici_problems(scan: _PiciScan, n: int) -> str:
    if scan.mask is None:
        return f"Pici payload claims nnz={scan.nnz}, but n={n} and the payload holds at most {scan.room} values"
    assert scan.index is not None and scan.counts is not None
    assert scan.bad_index is not None and scan.bad_count is not None and scan.bad_nnz is not None
    assert scan.past is not None
    lo, hi = scan.index[:-1], scan.index[1:]
    problems = []
    if lo.numel() and int(lo[0]) != 0:
        problems.append(f"Pici index array starts at {int(lo[0])}, not 0")
    decreases = torch.nonzero(hi < lo).view(-1)
    if decreases.numel():
        problems.append(f"Pici index array decreases at tile {int(decreases[0])}")
    miscounted = torch.nonzero(scan.bad_count).view(-1)
    if miscounted.numel():
        t = int(miscounted[0])
        problems.append(f"Pici tile {t} has {int(scan.counts[t])} bits set but its index step is {int(hi[t] - lo[t])}")
    over = torch.nonzero(scan.bad_nnz).view(-1)
    if over.numel():
        t = int(over[0])
        problems.append(f"Pici index entry I[{t + 1}]={int(hi[t])} exceeds nnz={scan.nnz}")
    if bool(scan.past.any()):
        rest = n - (scan.mask.shape[0] - 1) * TILE  # elements of the last tile inside the range
        if bool(_by_position(scan.mask[-1:])[rest:].any()):
            last = _last_marked(scan.mask)
            problems.append(f"Pici bitvector marks nonzeros past the end n={n} (its last at position {last})")
        if scan.prior_mask is not None and bool(_by_position(scan.prior_mask[-1:])[rest:].any()):
            problems.append(f"the prior's bitvector marks nonzeros past the end n={n}")
    return "; ".join(problems)


def pici_explain(payload: torch.Tensor, n: int, dtype: torch.dtype, prior: torch.Tensor | None = None) -> str | None:
    """Why a Pici payload (and ``prior``) fails to decode as ``n`` elements of ``dtype``; None if it does not.

    Reads without writing; runs on the payload's device (a CUDA caller gets the reference's
    message for a status its kernels reported). Raises, like the decoders, for a payload too
    short for ``n``'s metadata.
    """
    scan = _pici_scan(payload, n, dtype, prior)
    if not scan.status:
        return None
    suffix = f"(status {scan.status}: {status_names(scan.status)})"
    problems = _pici_problems(scan, n)
    refit = _pici_refit(payload, n, dtype, failed=True)
    if refit is not None:
        return f"{refit}. Read as n={n}: {problems} {suffix}"
    return (
        f"corrupt Pici payload for n={n}: {problems} {suffix}; a payload encoded with another n "
        "fails like this too: decode with the n it was encoded with"
    )


def check_pici_exact(payload: torch.Tensor, n: int, dtype: torch.dtype) -> None:
    """Raise :class:`CorruptPayloadError` unless ``payload`` is exactly as long as its own nnz makes it.

    For payloads exactly as :func:`pici_encode` returned them, which end with their values: a
    payload with bytes after its values read as ``n`` elements was made for another ``n`` (the
    message says which when it can tell) or has junk appended. Call after a clean decode.
    """
    layout = pici_layout(n)
    nnz = int(_read_u32(payload, layout.index_offset + 4 * layout.tiles, 1)[0])
    expected = layout.nbytes(nnz, dtype) if nnz <= n else None
    nbytes = payload.numel()
    if expected == nbytes:
        return
    reading = f"read as n={n} ({_tiles(layout.tiles)}) its index says nnz={nnz}, a payload of {expected} bytes"
    refit = _pici_refit(payload, n, dtype, failed=False)
    if refit is not None:
        raise CorruptPayloadError(f"{refit}. Read as n={n}: its index says nnz={nnz}, a payload of {expected} bytes")
    raise CorruptPayloadError(
        f"Pici payload of {nbytes} bytes does not end with its values: {reading}, not {nbytes}; pass it "
        "exactly as pici_encode returned it, and decode it with the n it was encoded with"
    )


# ----------------------------------------------------------------------------- COO checks


@dataclasses.dataclass
class _CooScan:
    """A COO payload checked as ``coo_decompress_kernel`` checks it."""

    status: int
    need: int | None = None
    """Bytes the nnz needs (None when nnz is outside [0, n])."""
    positions: torch.Tensor | None = None
    """int64 positions; None when nnz was bad (the kernel then decodes nothing)."""
    past: torch.Tensor | None = None
    descending: torch.Tensor | None = None


def _coo_scan(payload: torch.Tensor, nnz: int, n: int, dtype: torch.dtype) -> _CooScan:
    if not 0 <= nnz <= n:
        return _CooScan(int(DecodeStatus.BAD_NNZ))
    need = coo_layout(nnz).nbytes(dtype)
    if payload.numel() < need:
        return _CooScan(int(DecodeStatus.BAD_NNZ), need)
    positions = _read_u32(payload, 0, nnz)
    past = positions >= n
    # An entry below n that is not above its predecessor (as uint32, whatever the predecessor is).
    descending = torch.zeros_like(past)
    descending[1:] = ~past[1:] & (positions[:-1] >= positions[1:])
    status = 0
    if bool(past.any()):
        status |= int(DecodeStatus.PAST_END)
    if bool(descending.any()):
        status |= int(DecodeStatus.NOT_ASCENDING)
    return _CooScan(status, need, positions, past, descending)


def coo_decompress(
    payload: torch.Tensor,
    nnz: int,
    n: int,
    dst: torch.Tensor,
    offset: int,
    *,
    accumulate: bool = False,
    dtype: torch.dtype | None = None,
    check: bool = True,
) -> DecodeStatus:
    """Decode a COO payload of ``nnz`` nonzeros over ``n`` elements into ``dst[offset:offset+n]``; return its status.

    As the CUDA op does, an overwrite zeroes the range first, whatever the payload holds. A bad
    payload is decoded as the kernel decodes it: nothing more when nnz is bad, else every entry
    but those past ``n`` or not above their predecessor; then, with ``check``,
    :class:`CorruptPayloadError` is raised.
    """
    dtype = dtype or dst.dtype
    scan = _coo_scan(payload, nnz, n, dtype)
    target = dst[offset : offset + n]
    if not accumulate:
        target.zero_()
    if scan.positions is not None:
        values = _read_values(payload, coo_layout(nnz).values_offset, nnz, dtype)
        positions = scan.positions
        if scan.status:
            assert scan.past is not None and scan.descending is not None
            keep = ~(scan.past | scan.descending)
            positions, values = positions[keep], values[keep]
        positions = positions.to(dst.device)
        values = values.to(dst.device)
        if accumulate:
            _accumulate(target, positions, values)
        else:
            target[positions] = values.to(dst.dtype)
    return _finish(scan.status, check, lambda: coo_explain(payload, nnz, n, dtype))


def coo_explain(payload: torch.Tensor, nnz: int, n: int, dtype: torch.dtype) -> str | None:
    """Why a COO payload of ``nnz`` nonzeros fails to decode as ``n`` elements; None if it does not."""
    scan = _coo_scan(payload, nnz, n, dtype)
    if not scan.status:
        return None
    suffix = f"(status {scan.status}: {status_names(scan.status)})"
    if scan.positions is None:
        if nnz < 0:
            problem = f"COO nnz={nnz} is negative"
        elif nnz > n:
            problem = (
                f"COO nnz={nnz} exceeds n={n}: the payload does not fit n={n} (its {nnz} nonzeros need "
                f"n >= {nnz}), or nnz is wrong; decode with the n and nnz it was encoded with"
            )
        else:
            problem = f"COO payload of {payload.numel()} bytes is shorter than the {scan.need} bytes nnz={nnz} needs"
        return f"{problem} {suffix}"
    assert scan.past is not None and scan.descending is not None
    positions = scan.positions
    last = int(positions.max())
    ascending = nnz < 2 or bool((positions[1:] > positions[:-1]).all())
    if scan.status == DecodeStatus.PAST_END and ascending and last < MAX_ELEMENTS:
        return (
            f"COO payload does not fit n={n}: it has a nonzero past the end n={n} (its last at position "
            f"{last}), so it was made for n > {last}; decode with the n it was encoded with {suffix}"
        )
    problems = []
    if bool(scan.past.any()):
        problems.append(f"COO position {last} is past the end n={n}")
    if bool(scan.descending.any()):
        i = int(torch.nonzero(scan.descending)[0])
        problems.append(
            f"COO positions are not strictly ascending (entry {i} is {int(positions[i])} after {int(positions[i - 1])})"
        )
    return f"corrupt COO payload for n={n}, nnz={nnz}: {'; '.join(problems)} {suffix}"
