"""The CUDA kernels (``torch.ops.spccl.*``) against the reference codec, byte for byte.

Skipped unless a GPU and the compiled kernels are present; on the GPU machine run
``python -m pytest tests/test_kernels_cuda.py -q`` (collecting it compiles the kernels on
first use, about a minute). Every test draws fresh random inputs; a failure names the seed, and
``SPCCL_TEST_SEED=<seed>`` replays it.

What is checked, for float32 / bfloat16 / float16:
- compression: the kernels' Pici and COO payloads equal the reference's bytes and nnz, over
  whole tensors and sub-ranges at odd offsets, for special values too (-0.0, NaN payloads,
  +-Inf, subnormals);
- decompression: overwrite and accumulate (also float32 ``dst`` with a 16-bit payload) equal
  the reference bit for bit (both round once from fp32), with nothing written outside the
  destination range;
- corrupt payloads: a nonzero status with ``check=False``, :class:`CorruptPayloadError` with
  ``check=True``, and never a write outside the destination range;
- output buffers: one exactly as large as the payload works, a smaller one raises
  :class:`PayloadTooSmallError`, and no byte past ``out`` is ever written;
- many pieces in one launch (``pici_compress_pieces``): each piece's payload and count equal the
  reference's for that piece alone, for 1 to over 1024 pieces (empty, unaligned, overlapping,
  exactly sized and too small payloads), and no byte between or after the payloads is written;
- ``torch.library.opcheck`` on each of the eight codec operators (the ninth,
  ``pici_prune_compress_pieces``, in ``test_pruning_wire.py``).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable

import pytest
import torch

from spccl_train import formats
from spccl_train._ext import kernels_available
from spccl_train.formats import (
    CorruptPayloadError,
    PayloadTooSmallError,
    capacity_bytes,
    coo_layout,
    payload_bytes,
    pici_layout,
    reference,
)

__all__: list[str] = []

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels_available()),
    reason="needs a GPU and the compiled spccl CUDA kernels (torch.ops.spccl)",
)

DEVICE = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LENGTHS = [0, 1, 63, 64, 4095, 4096, 4097, 3 * 4096 + 5, (1 << 22) + 3]
# 0.88: 16-bit tiles of both kinds in one payload (about 492 nonzeros of 4096 a tile: at most 512
# are zeroed and scattered, more go through shared memory by columns; csrc/pici.cu, kScatterMax).
SPARSITIES = [0.0, 0.5, 0.88, 0.97, 0.99, 0.9999, 1.0]
FORMATS = ["pici", "coo"]
# (payload dtype, dst dtype) pairs that decompress-accumulate supports.
ACCUMULATE_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),
]
MEDIUM = 3 * 4096 + 5
"""Four tiles, the last one partial: big enough for every corruption, small enough for opcheck."""
GUARD = 67
"""Elements of sentinel after every destination range (and before it, at a nonzero offset)."""

_BITS_DTYPE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# A NaN bit pattern per dtype that no codec produces by itself: unwritten elements stand out.
_POISON = {torch.float32: 0x7FA5A5A5, torch.bfloat16: 0x7FA5, torch.float16: 0x7DA5}
_POISON_BYTE = 0xA5
# Bit patterns of -0.0, NaNs (quiet, negative, signalling, all-ones payload), +-Inf,
# subnormals (smallest, largest negative, middle), largest finite, smallest normal.
# fmt: off
_SPECIAL_BITS = {
    torch.float32: [
        0x80000000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0x7F800000, 0xFF800000,
        0x00000001, 0x807FFFFF, 0x00400000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00800000,
    ],
    torch.bfloat16: [
        0x8000, 0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0x7F80, 0xFF80,
        0x0001, 0x807F, 0x0040, 0x7F7F, 0xFF7F, 0x0080,
    ],
    torch.float16: [
        0x8000, 0x7E00, 0xFE00, 0x7C01, 0x7FFF, 0x7C00, 0xFC00,
        0x0001, 0x83FF, 0x0200, 0x7BFF, 0xFBFF, 0x0400,
    ],
}
# fmt: on
# Status bits of the kernels (spccl_train.formats.codec documents their meaning).
_BAD_INDEX, _BAD_TILE_COUNT, _BAD_NNZ, _PAST_END, _NOT_ASCENDING = 1, 2, 4, 8, 16


# ---------------------------------------------------------------------------------------
# Inputs


def _seed() -> int:
    """A fresh seed per test, or the one ``SPCCL_TEST_SEED`` names to replay a failure."""
    return int(os.environ.get("SPCCL_TEST_SEED") or int.from_bytes(os.urandom(6), "little"))


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(seed)
    return gen


def _sparse(n: int, dtype: torch.dtype, sparsity: float, gen: torch.Generator) -> torch.Tensor:
    """``randn`` values with each element zeroed (to +0.0) with probability ``sparsity``."""
    x = torch.randn(n, generator=gen, device=DEVICE).to(dtype)
    drop = torch.rand(n, generator=gen, device=DEVICE) < sparsity
    return x.masked_fill_(drop, 0)


def _int_bits(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Unsigned bit patterns as the signed integers of ``dtype``'s width."""
    width = 8 * torch.empty((), dtype=dtype).element_size()
    signed = [v - (1 << width) if v >= 1 << (width - 1) else v for v in values]
    return torch.tensor(signed, dtype=_BITS_DTYPE[dtype], device=DEVICE)


def _with_specials(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A quarter special values, a quarter zeros (+0.0 and -0.0), the rest ``randn``.

    Built on the integer bit patterns, so that no float operation can quieten a signalling
    NaN or flush a subnormal on the way.
    """
    bits = torch.randn(n, generator=gen, device=DEVICE).to(dtype).view(_BITS_DTYPE[dtype])
    specials = _int_bits(_SPECIAL_BITS[dtype], dtype)
    pick = torch.randint(0, specials.numel(), (n,), generator=gen, device=DEVICE)
    kind = torch.rand(n, generator=gen, device=DEVICE)
    bits = torch.where(kind < 0.25, specials[pick], bits)
    bits = torch.where((kind >= 0.25) & (kind < 0.5), torch.zeros_like(bits), bits)
    return bits.view(dtype)


def _poisoned(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((n,), _POISON[dtype], dtype=_BITS_DTYPE[dtype], device=DEVICE).view(dtype)


def _poisoned_bytes(n: int) -> torch.Tensor:
    return torch.full((n,), _POISON_BYTE, dtype=torch.uint8, device=DEVICE)


def _guarded(values: torch.Tensor, offset: int, guard: int = GUARD) -> torch.Tensor:
    """``values`` placed at ``offset`` in a poisoned tensor with ``guard`` more elements after."""
    dst = _poisoned(offset + values.numel() + guard, values.dtype)
    dst[offset : offset + values.numel()] = values
    return dst


def _canonical_zeros(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a decoder returns it: -0.0 becomes +0.0 (it is zero), everything else as is."""
    bits = x.view(_BITS_DTYPE[x.dtype])
    return torch.where(x == 0, torch.zeros_like(bits), bits).view(x.dtype)


# ---------------------------------------------------------------------------------------
# Codec calls


def _kernel_compress(fmt: str, src: torch.Tensor, offset: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = _poisoned_bytes(capacity_bytes(fmt, n, src.dtype))
    nnz = formats.compress_into(fmt, src, out, offset=offset, n=n)
    return out, nnz


def _reference_compress(fmt: str, src: torch.Tensor, offset: int, n: int) -> tuple[torch.Tensor, int]:
    out = _poisoned_bytes(capacity_bytes(fmt, n, src.dtype))
    encode = reference.pici_compress if fmt == "pici" else reference.coo_compress
    return out, int(encode(src, offset, n, out).item())


def _reference_decompress(
    fmt: str,
    payload: torch.Tensor,
    dst: torch.Tensor,
    offset: int,
    n: int,
    nnz: int,
    *,
    accumulate: bool = False,
    dtype: torch.dtype | None = None,
) -> None:
    if fmt == "pici":
        reference.pici_decompress(payload, n, dst, offset, accumulate=accumulate, dtype=dtype)
    else:
        reference.coo_decompress(payload, nnz, n, dst, offset, accumulate=accumulate, dtype=dtype)


# ---------------------------------------------------------------------------------------
# Comparisons that say where things differ


def _payload_part(fmt: str, n: int, nnz: int, dtype: torch.dtype, at: int) -> str:
    size = torch.empty((), dtype=dtype).element_size()
    if fmt == "pici":
        layout = pici_layout(n)
        if at < layout.index_offset:
            word = at // 8
            return f"B word {word} (tile {word // 64}, column {word % 64})"
        if at < layout.index_offset + 4 * (layout.tiles + 1):
            return f"I[{(at - layout.index_offset) // 4}]"
        if at < layout.values_offset:
            return "padding after I"
        return f"A value {(at - layout.values_offset) // size}"
    layout = coo_layout(nnz)
    if at < 4 * nnz:
        return f"position {at // 4}"
    if at < layout.values_offset:
        return "padding after the positions"
    return f"value {(at - layout.values_offset) // size}"


def _assert_same_payload(
    fmt: str, got: torch.Tensor, want: torch.Tensor, n: int, nnz: int, dtype: torch.dtype, context: str
) -> None:
    size = payload_bytes(fmt, n, nnz, dtype)
    diff = torch.nonzero(got[:size] != want[:size]).view(-1)
    if diff.numel():
        at = int(diff[0])
        pytest.fail(
            f"{context}: {diff.numel()} of {size} payload bytes differ from the reference, first at byte "
            f"{at} ({_payload_part(fmt, n, nnz, dtype, at)}): kernel {int(got[at]):#04x}, "
            f"reference {int(want[at]):#04x}"
        )


def _hex(bits: int, dtype: torch.dtype) -> str:
    width = 8 * torch.empty((), dtype=dtype).element_size()
    return f"{bits & ((1 << width) - 1):#0{width // 4 + 2}x}"


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, context: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, context
    g, w = got.view(_BITS_DTYPE[got.dtype]), want.view(_BITS_DTYPE[want.dtype])
    diff = torch.nonzero(g != w).view(-1)
    if diff.numel():
        at = int(diff[0])
        pytest.fail(
            f"{context}: {diff.numel()} of {got.numel()} elements differ, first at {at}: got "
            f"{got[at].item()!r} ({_hex(int(g[at]), got.dtype)}), want {want[at].item()!r} "
            f"({_hex(int(w[at]), want.dtype)})"
        )


def _assert_same_nan_aware(got: torch.Tensor, want: torch.Tensor, context: str) -> None:
    """Bitwise equal, except that a NaN's payload may differ (fp32 arithmetic on a NaN picks one)."""
    nan_got, nan_want = got.isnan(), want.isnan()
    diff = torch.nonzero(nan_got != nan_want).view(-1)
    if diff.numel():
        at = int(diff[0])
        pytest.fail(
            f"{context}: NaN at different places, first at {at}: got {got[at].item()!r}, want {want[at].item()!r}"
        )
    _assert_same_bits(got.masked_fill(nan_got, 0), want.masked_fill(nan_want, 0), context)


def _assert_guards_intact(dst: torch.Tensor, offset: int, n: int, context: str) -> None:
    """Everything of ``dst`` outside ``[offset, offset + n)`` still holds the poison pattern."""
    bits = dst.view(_BITS_DTYPE[dst.dtype])
    outside = torch.cat([bits[:offset], bits[offset + n :]])
    written = torch.nonzero(outside != _int_bits([_POISON[dst.dtype]], dst.dtype)).view(-1)
    if written.numel():
        at = int(written[0])
        at = at if at < offset else at + n
        pytest.fail(f"{context}: element {at} outside the range [{offset}, {offset + n}) was written")


def _assert_tail_intact(buffer: torch.Tensor, end: int, context: str) -> None:
    written = torch.nonzero(buffer[end:] != _POISON_BYTE).view(-1)
    if written.numel():
        pytest.fail(
            f"{context}: {written.numel()} bytes past the end of out ({end} bytes) were written, "
            f"first at byte {end + int(written[0])}"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------
# Compression


@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_compress_matches_reference(fmt: str, dtype: torch.dtype, n: int, sparsity: float) -> None:
    seed = _seed()
    x = _sparse(n, dtype, sparsity, _generator(seed))
    context = f"{fmt} compress, {_name(dtype)}, n={n}, sparsity={sparsity}, seed={seed}"
    got, nnz = _kernel_compress(fmt, x, 0, n)
    want, want_nnz = _reference_compress(fmt, x, 0, n)
    assert nnz.dtype == torch.int64 and nnz.shape == (1,) and nnz.device == x.device, context
    assert int(nnz.item()) == want_nnz, context
    _assert_same_payload(fmt, got, want, n, want_nnz, dtype, context)


@pytest.mark.parametrize("n", [1, 63, 4097, MEDIUM, (1 << 20) + 3])
@pytest.mark.parametrize("offset", [1, 3, 7, 4099])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_compress_subrange_matches_reference(fmt: str, dtype: torch.dtype, offset: int, n: int) -> None:
    """A range at an odd offset of a larger tensor encodes as if it started at 0.

    The elements around the range are nonzero, so a kernel that reads past either end
    changes the payload.
    """
    seed = _seed()
    gen = _generator(seed)
    big = torch.randn(offset + n + 13, generator=gen, device=DEVICE).to(dtype)
    big[offset : offset + n] = _sparse(n, dtype, 0.5, gen)
    context = f"{fmt} compress of [{offset}, {offset + n}), {_name(dtype)}, seed={seed}"
    got, nnz = _kernel_compress(fmt, big, offset, n)
    want, want_nnz = _reference_compress(fmt, big, offset, n)
    assert int(nnz.item()) == want_nnz, context
    _assert_same_payload(fmt, got, want, n, want_nnz, dtype, context)
    # The same range copied out to a tensor of its own gives the same bytes.
    alone, _ = _kernel_compress(fmt, big[offset : offset + n].clone(), 0, n)
    _assert_same_payload(fmt, alone, want, n, want_nnz, dtype, context + " (copied out)")


@pytest.mark.parametrize("n", [4097, MEDIUM, (1 << 16) + 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_special_values_round_trip(fmt: str, dtype: torch.dtype, n: int) -> None:
    """-0.0 is zero (decodes as +0.0); NaNs, infinities and subnormals travel bit for bit."""
    seed = _seed()
    x = _with_specials(n, dtype, _generator(seed))
    context = f"{fmt} special values, {_name(dtype)}, n={n}, seed={seed}"
    got, nnz = _kernel_compress(fmt, x, 0, n)
    want, want_nnz = _reference_compress(fmt, x, 0, n)
    assert int(nnz.item()) == want_nnz, context
    _assert_same_payload(fmt, got, want, n, want_nnz, dtype, context)
    dst = _poisoned(n + GUARD, dtype)
    formats.decompress_into(fmt, want, dst, n=n, nnz=want_nnz)
    _assert_same_bits(dst[:n], _canonical_zeros(x), context + " (decoded)")
    _assert_guards_intact(dst, 0, n, context + " (decoded)")


# ---------------------------------------------------------------------------------------
# Decompression


@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_decompress_matches_reference(fmt: str, dtype: torch.dtype, n: int, sparsity: float) -> None:
    """Overwrite decoding writes the whole range (zeros included) and nothing else."""
    seed = _seed()
    x = _sparse(n, dtype, sparsity, _generator(seed))
    payload, nnz = _reference_compress(fmt, x, 0, n)
    for offset in (0, 5):
        context = f"{fmt} decompress, {_name(dtype)}, n={n}, sparsity={sparsity}, offset={offset}, seed={seed}"
        got = _poisoned(offset + n + GUARD, dtype)
        want = got.clone()
        status = formats.decompress_into(fmt, payload, got, offset=offset, n=n, nnz=nnz, check=False)
        _reference_decompress(fmt, payload, want, offset, n, nnz)
        assert status is not None and int(status.item()) == 0, f"{context}: status {status}"
        _assert_same_bits(got, want, context)
        _assert_same_bits(got[offset : offset + n], _canonical_zeros(x), context + " (against the input)")


@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_decompress_patch_matches_reference(dtype: torch.dtype, n: int, sparsity: float) -> None:
    """Patching a range that holds the prior payload's data gives the overwrite's bits, writing only
    elements either payload marks (the prior's data keeps its -0.0s elsewhere) and nothing outside."""
    seed = _seed()
    gen = _generator(seed)
    x = _sparse(n, dtype, sparsity, gen)
    old = _with_specials(n, dtype, gen)  # -0.0 where unmarked: must survive untouched
    payload, _ = _reference_compress("pici", x, 0, n)
    prior, _ = _reference_compress("pici", old, 0, n)
    for offset in (0, 5):
        context = f"pici decompress-patch, {_name(dtype)}, n={n}, sparsity={sparsity}, offset={offset}, seed={seed}"
        got = _guarded(old, offset)
        want = got.clone()
        status = formats.decompress_into("pici", payload, got, offset=offset, n=n, prior=prior, check=False)
        reference.pici_decompress_patch(payload, prior, n, want, offset)
        assert status is not None and int(status.item()) == 0, f"{context}: status {status}"
        _assert_same_bits(got, want, context)
        _assert_guards_intact(got, offset, n, context)
        marked = (x != 0) | (old != 0)
        _assert_same_bits(got[offset : offset + n][marked], _canonical_zeros(x)[marked], context + " (against x)")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_decompress_patch_prior_past_the_end_is_reported(dtype: torch.dtype) -> None:
    """A prior marking an element at or past n is reported and never written there."""
    n = 4097
    x = _sparse(n, dtype, 0.5, _generator(_seed()))
    payload, _ = _reference_compress("pici", x, 0, n)
    prior, _ = _reference_compress("pici", torch.zeros(n, dtype=dtype, device=DEVICE), 0, n)
    words = prior[: 512 * 2].view(torch.int64)
    words[64 + 1] |= 1 << 0  # tile 1, column 1, row 0: element 4096 + 1 = n
    got = _guarded(torch.zeros(n, dtype=dtype, device=DEVICE), 0)
    status = formats.decompress_into("pici", payload, got, n=n, prior=prior, check=False)
    assert int(status.item()) & _PAST_END, f"status {int(status.item())}"
    _assert_guards_intact(got, 0, n, f"{_name(dtype)} prior past the end")


@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("dtype", "dst_dtype"), ACCUMULATE_DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_decompress_accumulate_matches_reference(
    fmt: str, dtype: torch.dtype, dst_dtype: torch.dtype, n: int, sparsity: float
) -> None:
    """``dst += decoded`` in fp32, rounded once to ``dst``'s type: bitwise equal to the reference."""
    seed = _seed()
    gen = _generator(seed)
    x = _sparse(n, dtype, sparsity, gen)
    payload, nnz = _reference_compress(fmt, x, 0, n)
    for offset in (0, 3):
        context = (
            f"{fmt} decompress-accumulate of {_name(dtype)} into {_name(dst_dtype)}, n={n}, "
            f"sparsity={sparsity}, offset={offset}, seed={seed}"
        )
        got = _guarded(torch.randn(n, generator=gen, device=DEVICE).to(dst_dtype), offset)
        want = got.clone()
        status = formats.decompress_into(
            fmt, payload, got, offset=offset, n=n, nnz=nnz, accumulate=True, dtype=dtype, check=False
        )
        _reference_decompress(fmt, payload, want, offset, n, nnz, accumulate=True, dtype=dtype)
        assert status is not None and int(status.item()) == 0, f"{context}: status {status}"
        _assert_same_bits(got, want, context)


@pytest.mark.parametrize(("dtype", "dst_dtype"), ACCUMULATE_DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_decompress_accumulate_special_values(fmt: str, dtype: torch.dtype, dst_dtype: torch.dtype) -> None:
    """Special values on both sides of ``dst += decoded``, as the reference computes it.

    Subnormal sums must not be flushed to zero. Positions the payload holds no value for are
    left untouched, as the reference's scatter-add leaves them (a -0.0 in ``dst`` stays -0.0).
    A NaN result may carry any NaN payload.
    """
    seed = _seed()
    gen = _generator(seed)
    n = MEDIUM
    x = _with_specials(n, dtype, gen)
    payload, nnz = _reference_compress(fmt, x, 0, n)
    context = f"{fmt} decompress-accumulate of special {_name(dtype)} into {_name(dst_dtype)}, seed={seed}"
    got = _guarded(_with_specials(n, dst_dtype, gen), 0)
    want = got.clone()
    status = formats.decompress_into(fmt, payload, got, n=n, nnz=nnz, accumulate=True, dtype=dtype, check=False)
    _reference_decompress(fmt, payload, want, 0, n, nnz, accumulate=True, dtype=dtype)
    assert status is not None and int(status.item()) == 0, f"{context}: status {status}"
    _assert_same_nan_aware(got, want, context)
    _assert_guards_intact(got, 0, n, context)


# ---------------------------------------------------------------------------------------
# Corrupt payloads


@dataclasses.dataclass(frozen=True, slots=True)
class _Corruption:
    """A damaged payload and the arguments to decode it with."""

    payload: torch.Tensor
    nnz: int
    n: int
    expected_bit: int
    """A status bit the kernels must set, or 0 where any nonzero status will do."""


def _pici_index(payload: torch.Tensor, n: int) -> torch.Tensor:
    """``I`` as a writable int32 view into ``payload``."""
    layout = pici_layout(n)
    return payload[layout.index_offset : layout.index_offset + 4 * (layout.tiles + 1)].view(torch.int32)


def _set_pici_bit(payload: torch.Tensor, position: int) -> None:
    """Mark element ``position`` nonzero in ``B`` (tile t, row r, column c -> word 64t+c, bit r)."""
    tile, local = divmod(position, 4096)
    row, column = divmod(local, 64)
    byte = 8 * (64 * tile + column) + row // 8
    payload[byte] |= 1 << (row % 8)


def _index_decreases(payload, x, n, nnz):
    index = _pici_index(payload, n)
    index[2] = index[1] - 1
    return _Corruption(payload, nnz, n, _BAD_INDEX)


def _index_starts_nonzero(payload, x, n, nnz):
    _pici_index(payload, n)[0] = 1
    return _Corruption(payload, nnz, n, _BAD_INDEX)


def _pici_nnz_exceeds_n(payload, x, n, nnz):
    _pici_index(payload, n)[-1] = n + 1
    return _Corruption(payload, nnz, n, _BAD_NNZ)


def _pici_nnz_exceeds_payload(payload, x, n, nnz):
    """The payload ends 16 bytes before the values its index promises."""
    size = payload_bytes("pici", n, nnz, x.dtype)
    return _Corruption(payload[: size - 16], nnz, n, _BAD_NNZ)


def _tile_count_disagrees(payload, x, n, nnz):
    """``I[1]`` moves up by one: tile 0 claims one value more, tile 1 one fewer, than their bits."""
    _pici_index(payload, n)[1] += 1
    return _Corruption(payload, nnz, n, _BAD_TILE_COUNT)


def _extra_bit_in_tile(payload, x, n, nnz):
    """A zero element of tile 1 marked nonzero, ``I`` left alone."""
    position = 4096 + int(torch.nonzero(x[4096:8192] == 0)[0])
    _set_pici_bit(payload, position)
    return _Corruption(payload, nnz, n, _BAD_TILE_COUNT)


def _bit_past_end(payload, x, n, nnz):
    """Element ``n`` (past the range, inside the last tile) marked, with ``I`` kept consistent."""
    _set_pici_bit(payload, n)
    _pici_index(payload, n)[-1] += 1
    return _Corruption(payload, nnz + 1, n, _PAST_END)


def _decoded_with_more_tiles(payload, x, n, nnz):
    """Decoded with an ``n`` two tiles longer: ``I`` is read from where the values are."""
    return _Corruption(payload, nnz, n + 2 * 4096, 0)


def _coo_positions(payload: torch.Tensor, nnz: int) -> torch.Tensor:
    return payload[: 4 * nnz].view(torch.int32)


def _positions_swapped(payload, x, n, nnz):
    positions = _coo_positions(payload, nnz)
    positions[:2] = positions[:2].flip(0).clone()
    return _Corruption(payload, nnz, n, _NOT_ASCENDING)


def _position_repeated(payload, x, n, nnz):
    positions = _coo_positions(payload, nnz)
    positions[1] = positions[0]
    return _Corruption(payload, nnz, n, _NOT_ASCENDING)


def _position_at_n(payload, x, n, nnz):
    _coo_positions(payload, nnz)[-1] = n
    return _Corruption(payload, nnz, n, 0)


def _position_2_32_minus_1(payload, x, n, nnz):
    """0xFFFFFFFF: past the end as uint32, -1 to a kernel that reads positions as signed."""
    _coo_positions(payload, nnz)[-1] = -1
    return _Corruption(payload, nnz, n, 0)


def _coo_nnz_exceeds_n(payload, x, n, nnz):
    return _Corruption(payload, n + 1, n, _BAD_NNZ)


def _coo_nnz_exceeds_payload(payload, x, n, nnz):
    """One nonzero more than the (exactly sized) payload holds."""
    return _Corruption(payload[: payload_bytes("coo", n, nnz, x.dtype)], nnz + 1, n, _BAD_NNZ)


def _coo_nnz_negative(payload, x, n, nnz):
    return _Corruption(payload, -1, n, 0)


_CORRUPTIONS: dict[str, list[Callable[..., _Corruption]]] = {
    "pici": [
        _index_decreases,
        _index_starts_nonzero,
        _pici_nnz_exceeds_n,
        _pici_nnz_exceeds_payload,
        _tile_count_disagrees,
        _extra_bit_in_tile,
        _bit_past_end,
        _decoded_with_more_tiles,
    ],
    "coo": [
        _positions_swapped,
        _position_repeated,
        _position_at_n,
        _position_2_32_minus_1,
        _coo_nnz_exceeds_n,
        _coo_nnz_exceeds_payload,
        _coo_nnz_negative,
    ],
}


@pytest.mark.parametrize("sparsity", [0.5, 0.99])  # the 16-bit decoders of dense and of sparse payloads
@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize(
    ("fmt", "corrupt"),
    [(fmt, corrupt) for fmt, corruptions in _CORRUPTIONS.items() for corrupt in corruptions],
    ids=lambda v: v if isinstance(v, str) else v.__name__.strip("_"),
)
def test_corrupt_payload_is_reported(
    fmt: str, corrupt: Callable[..., _Corruption], dtype: torch.dtype, accumulate: bool, sparsity: float
) -> None:
    """A nonzero status (``check=False``) or :class:`CorruptPayloadError` (``check=True``).

    Whatever a kernel writes inside the destination range, it writes nothing outside it.
    """
    seed = _seed()
    n = MEDIUM
    x = _sparse(n, dtype, sparsity, _generator(seed))
    clean, nnz = _reference_compress(fmt, x, 0, n)
    bad = corrupt(clean, x, n, nnz)
    what = f"{fmt} {corrupt.__name__.strip('_')}, {_name(dtype)}"
    context = f"{what}, accumulate={accumulate}, sparsity={sparsity}, seed={seed}"

    # The reference rejects it too, so the damage is real.
    with pytest.raises(CorruptPayloadError):
        _reference_decompress(fmt, bad.payload, _poisoned(bad.n, dtype), 0, bad.n, bad.nnz, accumulate=accumulate)

    nnz_arg = torch.tensor([bad.nnz], dtype=torch.int64, device=DEVICE)
    offset = 9
    dst = _guarded(torch.randn(bad.n, device=DEVICE).to(dtype), offset)
    status = formats.decompress_into(
        fmt, bad.payload, dst, offset=offset, n=bad.n, nnz=nnz_arg, accumulate=accumulate, check=False
    )
    assert status is not None, context
    code = int(status.item())
    assert code != 0, f"{context}: the kernel reported status 0 for a corrupt payload"
    if bad.expected_bit:
        assert code & bad.expected_bit, f"{context}: status {code} lacks bit {bad.expected_bit}"
    _assert_guards_intact(dst, offset, bad.n, context + " (check=False)")

    dst = _guarded(torch.randn(bad.n, device=DEVICE).to(dtype), offset)
    with pytest.raises(CorruptPayloadError):
        formats.decompress_into(
            fmt, bad.payload, dst, offset=offset, n=bad.n, nnz=nnz_arg, accumulate=accumulate, check=True
        )
    _assert_guards_intact(dst, offset, bad.n, context + " (check=True)")


# ---------------------------------------------------------------------------------------
# Output buffers smaller than the worst case


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.99])
@pytest.mark.parametrize("n", [MEDIUM, (1 << 20) + 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_exactly_sized_out_works(fmt: str, dtype: torch.dtype, n: int, sparsity: float) -> None:
    """A buffer of exactly the payload's size (often not a multiple of 16) is enough."""
    seed = _seed()
    x = _sparse(n, dtype, sparsity, _generator(seed))
    want, nnz = _reference_compress(fmt, x, 0, n)
    size = payload_bytes(fmt, n, nnz, dtype)
    context = f"{fmt} into {size} bytes, {_name(dtype)}, n={n}, sparsity={sparsity}, seed={seed}"
    buffer = _poisoned_bytes(capacity_bytes(fmt, n, dtype) + 256)
    got = formats.compress_into(fmt, x, buffer[:size], check=True)
    assert int(got.item()) == nnz, context
    _assert_same_payload(fmt, buffer, want, n, nnz, dtype, context)
    _assert_tail_intact(buffer, size, context)


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.99])
@pytest.mark.parametrize("n", [MEDIUM, (1 << 20) + 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_too_small_out_raises_and_writes_nothing_past_it(fmt: str, dtype: torch.dtype, n: int, sparsity: float) -> None:
    """Too small: ``PayloadTooSmallError`` when checked, the true nnz when not; never a byte past ``out``."""
    seed = _seed()
    x = _sparse(n, dtype, sparsity, _generator(seed))
    _, nnz = _reference_compress(fmt, x, 0, n)
    size = payload_bytes(fmt, n, nnz, dtype)
    metadata = payload_bytes(fmt, n, 0, dtype)
    for short in sorted({size - 1, size - 16, (size + metadata) // 2, metadata}):
        if not metadata <= short < size:
            continue
        context = f"{fmt} into {short} of {size} bytes, {_name(dtype)}, n={n}, sparsity={sparsity}, seed={seed}"
        buffer = _poisoned_bytes(size + 256)
        got = formats.compress_into(fmt, x, buffer[:short], check=False)
        assert int(got.item()) == nnz, f"{context}: unchecked compression must still report the true nnz"
        _assert_tail_intact(buffer, short, context + " (check=False)")
        buffer = _poisoned_bytes(size + 256)
        with pytest.raises(PayloadTooSmallError):
            formats.compress_into(fmt, x, buffer[:short], check=True)
        _assert_tail_intact(buffer, short, context + " (check=True)")


# ---------------------------------------------------------------------------------------
# Many pieces in one launch


def _random_pieces(n: int, count: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """``count`` ranges of ``n`` elements: empty, short, a few tiles or long, anywhere (overlaps too)."""
    starts, numels = [], []
    for _ in range(count):
        numel = min(n, rng.choice([0, rng.randrange(1, 4097), rng.randrange(4096, 3 * 4096 + 7), rng.randrange(n + 1)]))
        starts.append(rng.randrange(n - numel + 1))
        numels.append(numel)
    return starts, numels


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("count", [1, 2, 31, 33, 1100])
def test_compress_pieces_matches_reference_piece_by_piece(dtype: torch.dtype, count: int) -> None:
    """One launch over ``count`` pieces: piece ``i``'s payload is the reference's for that range
    alone, with room for any density, exactly its size (rounded up to 16 bytes) or too little
    (then only its count is compared); the last payload is the too small one where it can be,
    and nothing past it is written."""
    seed = _seed()
    rng, gen = random.Random(seed), _generator(seed)
    n = rng.choice([1, 4096 * 5 + 3, rng.randrange(1, 1 << 20)])
    x = _sparse(n, dtype, rng.choice([0.0, 0.5, 0.99, 1.0]), gen)
    starts, numels = _random_pieces(n, count, rng)
    expected = [_reference_compress("pici", x, start, numel) for start, numel in zip(starts, numels)]
    offsets, sizes = [0], []
    for i, (numel, (_, nnz)) in enumerate(zip(numels, expected)):
        size = payload_bytes("pici", numel, nnz, dtype)
        short = max(payload_bytes("pici", numel, 0, dtype), (size - rng.randrange(1, 64)) & ~15)
        kind = 2 if i == count - 1 else rng.randrange(3)
        room = (formats.align16(capacity_bytes("pici", numel, dtype)), formats.align16(size), short)[kind]
        offsets.append(offsets[-1] + room)
        sizes.append(size)
    buffer = _poisoned_bytes(offsets[-1] + 256)
    nnz = torch.full((count,), -1, dtype=torch.int64, device=DEVICE)
    formats.compress_pieces_into(x, buffer, tuple(starts), tuple(numels), tuple(offsets), nnz)
    context = f"{_name(dtype)} n={n} pieces={count} seed={seed}"
    got = nnz.tolist()
    for i, ((want, want_nnz), numel) in enumerate(zip(expected, numels)):
        assert got[i] == want_nnz, f"{context}: piece {i} ({starts[i]}, {numel}) counted {got[i]}, not {want_nnz}"
        room = offsets[i + 1] - offsets[i]
        if sizes[i] <= room:  # the whole payload, and nothing after it in its room
            payload = buffer[offsets[i] : offsets[i] + sizes[i]]
            _assert_same_payload("pici", payload, want, numel, want_nnz, dtype, f"{context} piece {i}")
            _assert_tail_intact(buffer[: offsets[i + 1]], offsets[i] + sizes[i], f"{context} piece {i}")
        else:  # too small: its bitvectors and index whole all the same
            metadata = payload_bytes("pici", numel, 0, dtype)
            assert torch.equal(buffer[offsets[i] : offsets[i] + metadata], want[:metadata]), f"{context} piece {i}"
    _assert_tail_intact(buffer, offsets[-1], context)


def test_compress_pieces_needs_an_aligned_out() -> None:
    x = torch.ones(100, device=DEVICE)
    out = torch.empty(4096, dtype=torch.uint8, device=DEVICE)
    nnz = torch.empty(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="need out to start at a 16-byte aligned address"):
        formats.compress_pieces_into(x, out[1:], (0,), (100,), (0, 1024), nnz)
    with pytest.raises(ValueError, match="nnz must be a contiguous 1-D int64 tensor"):
        formats.compress_pieces_into(x, out, (0,), (100,), (0, 1024), nnz.view(1, 1))


# ---------------------------------------------------------------------------------------
# Operator registration


def _opcheck(op: torch._ops.OpOverload, args: tuple) -> None:
    # The default test_utils (schema, autograd registration, fake tensor, aot dispatch with
    # dynamic shapes) all apply: the ops mutate only their (a!) argument and return a new
    # one-element tensor that aliases nothing.
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck_compress(fmt: str, dtype: torch.dtype) -> None:
    x = _sparse(MEDIUM + 8, dtype, 0.5, _generator(_seed()))
    out = torch.empty(capacity_bytes(fmt, MEDIUM, dtype), dtype=torch.uint8, device=DEVICE)
    _opcheck(getattr(torch.ops.spccl, f"{fmt}_compress").default, (x, 5, MEDIUM, out))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_opcheck_compress_pieces(dtype: torch.dtype) -> None:
    x = _sparse(MEDIUM + 8, dtype, 0.5, _generator(_seed()))
    room = formats.align16(capacity_bytes("pici", MEDIUM, dtype))
    out = torch.empty(3 * room, dtype=torch.uint8, device=DEVICE)
    nnz = torch.empty(3, dtype=torch.int64, device=DEVICE)
    args = (x, [5, 0, 8], [MEDIUM, 0, MEDIUM], out, [0, room, 2 * room, 3 * room], nnz)
    torch.library.opcheck(torch.ops.spccl.pici_compress_pieces.default, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck_decompress(fmt: str, dtype: torch.dtype) -> None:
    x = _sparse(MEDIUM, dtype, 0.5, _generator(_seed()))
    payload, nnz = _reference_compress(fmt, x, 0, MEDIUM)
    dst = torch.randn(MEDIUM + 8, device=DEVICE).to(dtype)
    if fmt == "pici":
        _opcheck(torch.ops.spccl.pici_decompress.default, (payload, MEDIUM, dst, 5))
    else:
        nnz_t = torch.tensor([nnz], dtype=torch.int64, device=DEVICE)
        _opcheck(torch.ops.spccl.coo_decompress.default, (payload, nnz_t, MEDIUM, dst, 5))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_opcheck_decompress_patch(dtype: torch.dtype) -> None:
    gen = _generator(_seed())
    old = _sparse(MEDIUM, dtype, 0.5, gen)
    payload, _ = _reference_compress("pici", _sparse(MEDIUM, dtype, 0.5, gen), 0, MEDIUM)
    prior, _ = _reference_compress("pici", old, 0, MEDIUM)
    dst = _guarded(old, 5, 3)
    _opcheck(torch.ops.spccl.pici_decompress_patch.default, (payload, MEDIUM, prior, dst, 5))


@pytest.mark.parametrize(("dtype", "dst_dtype"), ACCUMULATE_DTYPES, ids=_name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck_decompress_accumulate(fmt: str, dtype: torch.dtype, dst_dtype: torch.dtype) -> None:
    x = _sparse(MEDIUM, dtype, 0.5, _generator(_seed()))
    payload, nnz = _reference_compress(fmt, x, 0, MEDIUM)
    dst = torch.randn(MEDIUM + 8, device=DEVICE).to(dst_dtype)
    if fmt == "pici":
        _opcheck(torch.ops.spccl.pici_decompress_accumulate.default, (payload, MEDIUM, dtype, dst, 5))
    else:
        nnz_t = torch.tensor([nnz], dtype=torch.int64, device=DEVICE)
        _opcheck(torch.ops.spccl.coo_decompress_accumulate.default, (payload, nnz_t, MEDIUM, dtype, dst, 5))
