"""Property tests of the Pici and COO codecs on CPU (the reference path), through the public API.

The byte layout is checked against FORMATS.md three ways: hand-worked payloads written out byte
by byte, an independent numpy encoder below (``_spec_pici`` / ``_spec_coo``), and round trips.
Inputs are drawn fresh each run by hypothesis; tensors come from a drawn seed so a failure
replays from hypothesis' report.
"""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
import torch
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st

from spccl_train import formats as F
from spccl_train.formats import CorruptPayloadError, PayloadTooSmallError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF_DTYPES = [torch.bfloat16, torch.float16]
FORMATS = ["pici", "coo"]
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
NP_UINT_OF = {torch.float32: np.uint32, torch.bfloat16: np.uint16, torch.float16: np.uint16}
EDGE_LENGTHS = [0, 1, 63, 64, 4095, 4096, 4097, 3 * 4096 + 5]
EDGE_DENSITIES = [1.0, 0.5, 0.01, 0.0001, 0.0]  # sparsity 0, 50, 99, 99.99, 100 %

# Nonzero specials as raw bit patterns (NaNs with payloads, signalling NaNs, infinities,
# subnormals down to the smallest), so they can be checked bit for bit.
# fmt: off
SPECIAL_BITS = {
    torch.float32: [
        0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800001, 0xFFA00001,  # NaNs
        0x7F800000, 0xFF800000,  # +-Inf
        0x00000001, 0x80000001, 0x00200000, 0x007FFFFF,  # subnormals (0x00200000 is tiny / 4)
        0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  # tiny, +-max
    ],
    torch.bfloat16: [
        0x7FC0, 0xFFC0, 0x7FC5, 0x7F81, 0xFFA1,
        0x7F80, 0xFF80,
        0x0001, 0x8001, 0x0020, 0x007F,
        0x0080, 0x7F7F, 0xFF7F,
    ],
    torch.float16: [
        0x7E00, 0xFE00, 0x7E15, 0x7C01, 0xFD01,
        0x7C00, 0xFC00,
        0x0001, 0x8001, 0x0100, 0x03FF,
        0x0400, 0x7BFF, 0xFBFF,
    ],
}
# fmt: on
NEG_ZERO_BITS = {torch.float32: 0x80000000, torch.bfloat16: 0x8000, torch.float16: 0x8000}


# ----------------------------------------------------------------------------- helpers


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor (NaN != NaN, but its bits compare)."""
    return t.contiguous().view(INT_OF[t.dtype])


def _from_bits(patterns: list[int], dtype: torch.dtype) -> torch.Tensor:
    width = 32 if dtype == torch.float32 else 16
    signed = [p - (1 << width) if p >= 1 << (width - 1) else p for p in patterns]
    return torch.tensor(signed, dtype=INT_OF[dtype]).view(dtype)


def _decoded_bits(x: torch.Tensor) -> torch.Tensor:
    """What decoding must give for ``x``: the same bits, except that every zero is +0.0."""
    b = _bits(x).clone()
    b[x == 0] = 0
    return b


def _assert_bits_equal(actual: torch.Tensor, expected_bits: torch.Tensor) -> None:
    got = _bits(actual)
    if not torch.equal(got, expected_bits):
        bad = torch.nonzero(got != expected_bits).view(-1)
        raise AssertionError(
            f"{bad.numel()} elements differ, first at {bad[:8].tolist()}: "
            f"got bits {got[bad[:8]].tolist()}, expected {expected_bits[bad[:8]].tolist()}"
        )


def _same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((_bits(a) == _bits(b)) | (torch.isnan(a) & torch.isnan(b))).all())


def _make_tensor(n: int, dtype: torch.dtype, density: float, seed: int, specials: int) -> torch.Tensor:
    """A length-``n`` tensor with about ``density * n`` nonzeros, -0.0 among its zeros and
    ``specials`` special values (NaN, Inf, subnormal or -0.0) at random positions."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, (n,), generator=g).to(torch.float32))
    values = (torch.randn(n, generator=g) * scale).to(dtype)
    values[values == 0] = 1  # underflow must not make a drawn nonzero a zero
    keep = torch.rand(n, generator=g) < density
    negative_zero = torch.rand(n, generator=g) < 0.5
    x = torch.zeros(n, dtype=dtype)
    x[keep] = values[keep]
    x[~keep & negative_zero] = -0.0
    if n and specials:
        table = _from_bits(SPECIAL_BITS[dtype] + [NEG_ZERO_BITS[dtype]], dtype)
        where = torch.randperm(n, generator=g)[: min(n, specials)]
        pick = torch.randint(0, table.numel(), (where.numel(),), generator=g)
        x[where] = table[pick]
    return x


@st.composite
def sparse_tensors(draw, lengths=None, dtypes=DTYPES, specials=True):
    """A random 1-D tensor: edge or random length, edge or random sparsity, maybe specials."""
    if lengths is None:
        lengths = st.sampled_from(EDGE_LENGTHS) | st.integers(0, 3 * 4096 + 5)
    n = draw(lengths, label="n")
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    density = draw(st.sampled_from(EDGE_DENSITIES) | st.floats(0, 1), label="density")
    seed = draw(st.integers(0, 2**63 - 1), label="seed")
    count = draw(st.sampled_from([0, 0, 1, 5, 40]) if specials else st.just(0), label="specials")
    x = _make_tensor(n, dtype, density, seed, count)
    note(f"n={n} dtype={dtype} density={density} seed={seed} specials={count} nnz={int((x != 0).sum())}")
    return x


def _payload_bytes(payload: torch.Tensor) -> bytes:
    return payload.numpy().tobytes()


def _spec_pici(x: torch.Tensor) -> bytes:
    """FORMATS.md's Pici payload of ``x``, built with numpy independently of the library."""
    n = x.numel()
    raw = _bits(x).numpy().view(NP_UINT_OF[x.dtype])
    tiles = -(-n // 4096)
    mask = np.zeros(tiles * 4096, dtype=bool)
    mask[:n] = (x != 0).numpy()
    mask = mask.reshape(tiles, 64, 64)  # tile, row, column
    vals = np.zeros(tiles * 4096, dtype=raw.dtype)
    vals[:n] = raw
    vals = vals.reshape(tiles, 64, 64)
    words = np.zeros((tiles, 64), dtype=np.uint64)  # tile, column
    for r in range(64):
        words |= mask[:, r, :].astype(np.uint64) << np.uint64(r)
    index = np.concatenate([[0], np.cumsum(mask.sum(axis=(1, 2)))]).astype("<u4").tobytes()
    # Boolean indexing of the (tile, column, row) view yields tile, then column, then row.
    values = vals.transpose(0, 2, 1)[mask.transpose(0, 2, 1)]
    return (
        words.astype("<u8").tobytes()
        + index
        + bytes(-len(index) % 16)
        + values.astype(values.dtype.newbyteorder("<")).tobytes()
    )


def _spec_coo(x: torch.Tensor) -> bytes:
    """FORMATS.md's COO payload of ``x``, built with numpy independently of the library."""
    raw = _bits(x).numpy().view(NP_UINT_OF[x.dtype])
    nonzero = (x != 0).numpy()
    positions = np.nonzero(nonzero)[0].astype("<u4").tobytes()
    return positions + bytes(-len(positions) % 16) + raw[nonzero].astype(raw.dtype.newbyteorder("<")).tobytes()


SPEC = {"pici": _spec_pici, "coo": _spec_coo}
ENCODE = {"pici": F.pici_encode, "coo": F.coo_encode}
DECODE = {"pici": F.pici_decode, "coo": F.coo_decode}


def _size(fmt: str, n: int, nnz: int, dtype: torch.dtype) -> int:
    return F.pici_bytes(n, nnz, dtype) if fmt == "pici" else F.coo_bytes(n, nnz, dtype)


def _u8(data: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone() if data else torch.empty(0, dtype=torch.uint8)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMATS)
@settings(deadline=None, max_examples=150)
@given(x=sparse_tensors())
def test_encode_decode_round_trip(fmt, x):
    n, nnz = x.numel(), int((x != 0).sum())
    payload = ENCODE[fmt](x)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == _size(fmt, n, nnz, x.dtype)
    assert _payload_bytes(payload) == SPEC[fmt](x)
    y = DECODE[fmt](payload, n, x.dtype)
    assert y.dtype == x.dtype and y.shape == (n,)
    _assert_bits_equal(y, _decoded_bits(x))


@pytest.mark.parametrize("fmt", FORMATS)
@settings(deadline=None, max_examples=150)
@given(x=sparse_tensors(), junk=st.integers(0, 255), slack=st.integers(0, 64))
def test_compress_into_decompress_into_round_trip(fmt, x, junk, slack):
    n, nnz = x.numel(), int((x != 0).sum())
    # Stale bytes in the buffer must not leak into the payload (the padding is written as zeros).
    out = torch.full((F.capacity_bytes(fmt, n, x.dtype) + slack,), junk, dtype=torch.uint8)
    got = F.compress_into(fmt, x, out)
    assert got.dtype == torch.int64 and got.shape == (1,)
    assert int(got) == nnz
    size = _size(fmt, n, nnz, x.dtype)
    assert _payload_bytes(out[:size]) == SPEC[fmt](x)
    dst = torch.full((n,), 5.0, dtype=x.dtype)
    extra = {"nnz": got} if fmt == "coo" else {}
    # Decoding from the whole buffer (trailing bytes included) and from the exact payload.
    assert F.decompress_into(fmt, out, dst, **extra) is None
    _assert_bits_equal(dst, _decoded_bits(x))
    dst.fill_(-3.0)
    F.decompress_into(fmt, out[:size].clone(), dst, **({"nnz": nnz} if fmt == "coo" else {}))
    _assert_bits_equal(dst, _decoded_bits(x))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", EDGE_LENGTHS)
@pytest.mark.parametrize("density", EDGE_DENSITIES)
@settings(deadline=None, max_examples=3)
@given(seed=st.integers(0, 2**63 - 1))
def test_round_trip_edge_grid(fmt, dtype, n, density, seed):
    x = _make_tensor(n, dtype, density, seed, specials=0)
    nnz = int((x != 0).sum())
    if density == 1.0:
        assert nnz == n
    if density == 0.0:
        assert nnz == 0
    payload = ENCODE[fmt](x)
    assert payload.numel() == _size(fmt, n, nnz, dtype)
    assert _payload_bytes(payload) == SPEC[fmt](x)
    _assert_bits_equal(DECODE[fmt](payload, n, dtype), _decoded_bits(x))


@pytest.mark.parametrize("fmt", FORMATS)
@settings(deadline=None, max_examples=2)
@given(x=sparse_tensors(lengths=st.just((1 << 20) + 7), specials=True))
def test_round_trip_large(fmt, x):
    n, nnz = x.numel(), int((x != 0).sum())
    out = torch.empty(F.capacity_bytes(fmt, n, x.dtype), dtype=torch.uint8)
    got = F.compress_into(fmt, x, out)
    assert int(got) == nnz
    size = _size(fmt, n, nnz, x.dtype)
    assert _payload_bytes(out[:size]) == SPEC[fmt](x)
    dst = torch.empty(n, dtype=x.dtype)
    F.decompress_into(fmt, out[:size], dst, **({"nnz": got} if fmt == "coo" else {}))
    _assert_bits_equal(dst, _decoded_bits(x))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_multidimensional_input_is_encoded_flat(fmt, dtype):
    x = _make_tensor(3 * 5 * 300, dtype, 0.2, seed=7, specials=3)
    assert _payload_bytes(ENCODE[fmt](x.view(3, 5, 300))) == _payload_bytes(ENCODE[fmt](x))


# ----------------------------------------------------------------------------- special values


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_zero_is_zero_and_decodes_as_positive_zero(fmt, dtype):
    x = torch.zeros(100, dtype=dtype)
    x[::3] = -0.0
    x[50] = 1.5
    payload = ENCODE[fmt](x)
    assert payload.numel() == _size(fmt, 100, 1, dtype)
    out = torch.empty(F.capacity_bytes(fmt, 100, dtype), dtype=torch.uint8)
    assert int(F.compress_into(fmt, x, out)) == 1
    y = DECODE[fmt](payload, 100, dtype)
    expected = torch.zeros(100, dtype=INT_OF[dtype])
    expected[50] = _bits(torch.tensor([1.5], dtype=dtype))[0]
    _assert_bits_equal(y, expected)
    assert not torch.signbit(y[::3]).any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_are_nonzero_and_survive_bit_for_bit(fmt, dtype):
    specials = _from_bits(SPECIAL_BITS[dtype], dtype)
    n = 4096 + 200
    x = torch.zeros(n, dtype=dtype)
    # Spread over both tiles, including the last row and column of tile 0.
    x[1 : 1 + 2 * specials.numel() : 2] = specials
    x[4095] = specials[0]
    x[n - 1] = specials[-1]
    x[4096 + 5 :: 7][: specials.numel()] = specials
    nnz = int((_bits(x) != 0).sum())
    payload = ENCODE[fmt](x)
    assert payload.numel() == _size(fmt, n, nnz, dtype)
    assert _payload_bytes(payload) == SPEC[fmt](x)
    _assert_bits_equal(DECODE[fmt](payload, n, dtype), _bits(x))


def test_float32_tiny_over_four_is_a_surviving_subnormal():
    value = torch.tensor([torch.finfo(torch.float32).tiny / 4], dtype=torch.float32)
    assert _bits(value).item() == 0x00200000
    x = torch.zeros(10)
    x[3] = value
    for fmt in FORMATS:
        y = DECODE[fmt](ENCODE[fmt](x), 10, torch.float32)
        _assert_bits_equal(y, _bits(x))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_smallest_half_subnormal_survives(dtype):
    smallest = _from_bits([0x0001], dtype)
    assert 0 < float(smallest) < torch.finfo(dtype).tiny
    x = torch.zeros(64, dtype=dtype)
    x[63] = smallest
    x[0] = -smallest
    for fmt in FORMATS:
        payload = ENCODE[fmt](x)
        assert payload.numel() == _size(fmt, 64, 2, dtype)
        _assert_bits_equal(DECODE[fmt](payload, 64, dtype), _bits(x))


@pytest.mark.parametrize(
    "dtype, pattern", [(torch.float32, 0x7F800001), (torch.bfloat16, 0x7FC5), (torch.float16, 0x7C15)]
)
def test_pici_decode_keeps_lone_nan_bits(dtype, pattern):
    x = torch.zeros(10, dtype=dtype)
    x[3] = _from_bits([pattern], dtype)[0]
    payload = F.pici_encode(x)
    assert _payload_bytes(payload) == _spec_pici(x)
    _assert_bits_equal(F.pici_decode(payload, 10, dtype), _bits(x))


def test_pici_decode_keeps_nan_bits_when_not_alone():
    for dtype, pattern in [(torch.float32, 0x7F800001), (torch.bfloat16, 0x7FC5), (torch.float16, 0x7C15)]:
        x = torch.zeros(10, dtype=dtype)
        x[3] = _from_bits([pattern], dtype)[0]
        x[7] = 1.0
        _assert_bits_equal(F.pici_decode(F.pici_encode(x), 10, dtype), _bits(x))


# ----------------------------------------------------------------------------- hand-worked bytes


def _words(**set_words: int) -> bytes:
    words = [0] * 64
    for name, value in set_words.items():
        words[int(name[1:])] = value
    return struct.pack("<64Q", *words)


def test_pici_bytes_by_hand_float32():
    x = torch.zeros(70, dtype=torch.float32)
    x[0], x[1], x[64], x[69] = 1.0, 2.0, 3.0, -4.0
    x[2] = -0.0
    # Element 64 r + c is row r, column c: 0 -> (0, 0), 1 -> (0, 1), 64 -> (1, 0), 69 -> (1, 5).
    bitvector = _words(c0=0b11, c1=0b01, c5=0b10)
    index = struct.pack("<2I", 0, 4) + bytes(8)
    values = struct.pack("<4f", 1.0, 3.0, 2.0, -4.0)  # column 0 (rows 0, 1), column 1, column 5
    expected = bitvector + index + values
    assert len(expected) == 544
    payload = F.pici_encode(x)
    assert torch.equal(payload, _u8(expected))
    _assert_bits_equal(F.pici_decode(_u8(expected), 70, torch.float32), _decoded_bits(x))


def test_coo_bytes_by_hand_float32():
    x = torch.zeros(70, dtype=torch.float32)
    x[0], x[1], x[64], x[69] = 1.0, 2.0, 3.0, -4.0
    x[2] = -0.0
    expected = struct.pack("<4I", 0, 1, 64, 69) + struct.pack("<4f", 1.0, 2.0, 3.0, -4.0)
    assert len(expected) == 32
    assert torch.equal(F.coo_encode(x), _u8(expected))
    out = torch.empty(64, dtype=torch.uint8)
    assert int(F.compress_into("coo", x, out)) == 4
    y = F.coo_decode(_u8(expected), 70, torch.float32)
    _assert_bits_equal(y, _decoded_bits(x))


def test_coo_index_padding_by_hand():
    x = torch.zeros(9, dtype=torch.float16)
    x[8] = 1.0  # fp16 1.0 = 0x3C00
    expected = struct.pack("<I", 8) + bytes(12) + struct.pack("<H", 0x3C00)
    assert torch.equal(F.coo_encode(x), _u8(expected))


def test_pici_two_tiles_by_hand_bfloat16():
    n = 4096 + 3
    x = torch.zeros(n, dtype=torch.bfloat16)
    x[130] = 0.25  # tile 0, row 2, column 2     bf16 0x3E80
    x[4095] = 1.0  # tile 0, row 63, column 63  bf16 0x3F80
    x[4096] = -2.0  # tile 1, row 0, column 0   bf16 0xC000
    x[4098] = 0.5  # tile 1, row 0, column 2    bf16 0x3F00
    x[5] = -0.0
    bitvector = _words(c2=1 << 2, c63=1 << 63) + _words(c0=1, c2=1)
    index = struct.pack("<3I", 0, 2, 4) + bytes(4)
    values = struct.pack("<4H", 0x3E80, 0x3F80, 0xC000, 0x3F00)
    expected = bitvector + index + values
    assert len(expected) == 1048
    assert torch.equal(F.pici_encode(x), _u8(expected))
    _assert_bits_equal(F.pici_decode(_u8(expected), n, torch.bfloat16), _decoded_bits(x))
    coo = struct.pack("<4I", 130, 4095, 4096, 4098) + struct.pack("<4H", 0x3E80, 0x3F80, 0xC000, 0x3F00)
    assert torch.equal(F.coo_encode(x), _u8(coo))


def test_empty_payloads_by_hand():
    for dtype in DTYPES:
        x = torch.empty(0, dtype=dtype)
        assert torch.equal(F.pici_encode(x), _u8(bytes(16)))  # I = [0], padded
        assert F.coo_encode(x).numel() == 0
        assert F.pici_decode(_u8(bytes(16)), 0, dtype).numel() == 0
        assert F.coo_decode(torch.empty(0, dtype=torch.uint8), 0, dtype).numel() == 0
        # An all-zero range of 5 elements: one tile of empty words, I = [0, 0].
        assert torch.equal(F.pici_encode(torch.zeros(5, dtype=dtype)), _u8(bytes(512 + 16)))


# ----------------------------------------------------------------------------- sub-ranges


@st.composite
def ranges(draw, dtypes=DTYPES):
    src = draw(sparse_tensors(lengths=st.integers(0, 2 * 4096 + 300), dtypes=dtypes))
    total = src.numel()
    odd = st.sampled_from([1, 3, 63, 65, 4095, 4097, 8191]).filter(lambda o: o <= total)
    offset = draw(st.integers(0, total) | odd, label="offset")
    n = draw(st.integers(0, total - offset), label="n")
    return src, offset, n


@pytest.mark.parametrize("fmt", FORMATS)
@settings(deadline=None, max_examples=100)
@given(case=ranges())
def test_compress_sub_range_equals_encoding_the_slice(fmt, case):
    src, offset, n = case
    alone = src[offset : offset + n].clone()
    out = torch.full((F.capacity_bytes(fmt, n, src.dtype),), 0xA5, dtype=torch.uint8)
    got = F.compress_into(fmt, src, out, offset=offset, n=n)
    nnz = int((alone != 0).sum())
    assert int(got) == nnz
    size = _size(fmt, n, nnz, src.dtype)
    assert _payload_bytes(out[:size]) == _payload_bytes(ENCODE[fmt](alone)) == SPEC[fmt](alone)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(deadline=None, max_examples=40)
@given(case=ranges())
def test_compress_default_n_runs_to_the_end(fmt, case):
    src, offset, _ = case
    out = torch.empty(F.capacity_bytes(fmt, src.numel() - offset, src.dtype), dtype=torch.uint8)
    got = F.compress_into(fmt, src, out, offset=offset)
    tail = src[offset:].clone()
    assert _payload_bytes(out[: _size(fmt, tail.numel(), int(got), src.dtype)]) == SPEC[fmt](tail)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(deadline=None, max_examples=100)
@given(case=ranges(), sentinel=st.sampled_from([7.0, float("nan"), -0.0, float("inf")]), seed=st.integers(0, 2**63 - 1))
def test_decompress_sub_range_writes_only_that_range(fmt, case, sentinel, seed):
    dst, offset, n = case
    dst = dst.clone()  # random contents around the range, specials included
    dst[offset : offset + n] = sentinel  # inside: must be overwritten, zeros included
    x = _make_tensor(n, dst.dtype, 0.3, seed, specials=4)
    payload = ENCODE[fmt](x)
    before = _bits(dst).clone()
    extra = {"nnz": int((x != 0).sum())} if fmt == "coo" else {}
    F.decompress_into(fmt, payload, dst, offset=offset, n=n, **extra)
    after = _bits(dst)
    assert torch.equal(after[:offset], before[:offset])
    assert torch.equal(after[offset + n :], before[offset + n :])
    _assert_bits_equal(dst[offset : offset + n], _decoded_bits(x))


# ----------------------------------------------------------------------------- patch


@settings(deadline=None, max_examples=100)
@given(case=ranges(), old_seed=st.integers(0, 2**63 - 1), density=st.sampled_from(EDGE_DENSITIES) | st.floats(0, 1))
def test_decompress_patch_equals_overwrite_and_touches_only_marked(case, old_seed, density):
    """With ``prior`` (a payload of what the range holds), the result is the overwrite's, and only
    elements that either payload marks change: elsewhere even a -0.0 keeps its bits."""
    x_full, offset, n = case
    x = x_full[offset : offset + n].clone()
    old = _make_tensor(n, x.dtype, density, old_seed, specials=3)
    dst = x_full.clone()  # random contents around the range
    dst[offset : offset + n] = old
    before = _bits(dst).clone()
    F.decompress_into("pici", F.pici_encode(x), dst, offset=offset, n=n, prior=F.pici_encode(old))
    after = _bits(dst)
    assert torch.equal(after[:offset], before[:offset])
    assert torch.equal(after[offset + n :], before[offset + n :])
    marked = (x != 0) | (old != 0)
    inside = after[offset : offset + n]
    assert torch.equal(inside[~marked], before[offset : offset + n][~marked])
    assert torch.equal(inside[marked], _decoded_bits(x)[marked])


def test_decompress_patch_arguments_are_checked():
    x = torch.zeros(100)
    payload = F.pici_encode(x)
    with pytest.raises(ValueError, match="prior= serves overwriting Pici decodes only"):
        F.decompress_into("pici", payload, x, prior=payload, accumulate=True)
    with pytest.raises(ValueError, match="prior= serves overwriting Pici decodes only"):
        F.decompress_into("coo", F.coo_encode(x), x, nnz=0, prior=payload)
    with pytest.raises(TypeError, match="prior must be a torch.uint8"):
        F.decompress_into("pici", payload, x, prior=x)
    with pytest.raises(CorruptPayloadError, match="Pici prior of 10 bytes does not fit n=100"):
        F.decompress_into("pici", payload, x, prior=payload[:10])


# ----------------------------------------------------------------------------- accumulate


def _expected_accumulate(dst: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dst`` plus ``x`` at the nonzeros of ``x`` only, computed in fp32 and rounded once."""
    where = x != 0
    out = dst.clone()
    out[where] = (dst[where].float() + x[where].float()).to(dst.dtype)
    return out


def _check_accumulated(dst: torch.Tensor, before: torch.Tensor, x: torch.Tensor) -> None:
    where = x != 0
    # Untouched positions keep their exact bits (-0.0 + 0.0 would have made them +0.0).
    assert torch.equal(_bits(dst)[~where], _bits(before)[~where])
    expected = _expected_accumulate(before, x)
    assert _same_or_both_nan(dst[where], expected[where])


@pytest.mark.parametrize("fmt", FORMATS)
@settings(deadline=None, max_examples=100)
@given(case=ranges(), dst_seed=st.integers(0, 2**63 - 1))
def test_decompress_accumulate_adds_at_nonzeros_only(fmt, case, dst_seed):
    x_full, offset, n = case
    x = x_full[offset : offset + n].clone()
    dst = _make_tensor(x_full.numel(), x.dtype, 0.7, dst_seed, specials=6)
    payload = ENCODE[fmt](x)
    before = dst.clone()
    extra = {"nnz": int((x != 0).sum())} if fmt == "coo" else {}
    F.decompress_into(fmt, payload, dst, offset=offset, n=n, accumulate=True, **extra)
    assert torch.equal(_bits(dst)[:offset], _bits(before)[:offset])
    assert torch.equal(_bits(dst)[offset + n :], _bits(before)[offset + n :])
    _check_accumulated(dst[offset : offset + n], before[offset : offset + n], x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_accumulate_rounds_once_from_fp32(fmt, dtype):
    # The sums 1 + 0.75 eps and 1 + 0.25 eps are exact in fp32 and fall between two 16-bit
    # values: rounding that sum once gives 1 + eps and 1 respectively.
    n = 256
    dst = torch.ones(n, dtype=dtype)
    eps = torch.finfo(dtype).eps
    x = torch.zeros(n, dtype=dtype)
    x[::2] = eps * 0.75  # exactly representable; 1 + 0.75 eps rounds to 1 + eps
    x[1::4] = eps * 0.25  # 1 + 0.25 eps rounds back to 1
    before = dst.clone()
    extra = {"nnz": int((x != 0).sum())} if fmt == "coo" else {}
    F.decompress_into(fmt, ENCODE[fmt](x), dst, accumulate=True, **extra)
    _check_accumulated(dst, before, x)
    assert torch.equal(dst[::2], torch.full((n // 2,), 1 + float(eps), dtype=dtype))
    assert torch.equal(dst[1::4], torch.ones(n // 4, dtype=dtype))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("payload_dtype", HALF_DTYPES)
@settings(deadline=None, max_examples=40)
@given(data=st.data())
def test_float32_dst_accumulates_half_payload(fmt, payload_dtype, data):
    x_full, offset, n = data.draw(ranges(dtypes=[payload_dtype]), label="range")
    x = x_full[offset : offset + n].clone()
    dst = _make_tensor(x_full.numel(), torch.float32, 0.8, data.draw(st.integers(0, 2**63 - 1)), specials=4)
    before = dst.clone()
    extra = {"nnz": int((x != 0).sum())} if fmt == "coo" else {}
    F.decompress_into(fmt, ENCODE[fmt](x), dst, offset=offset, n=n, accumulate=True, dtype=payload_dtype, **extra)
    assert torch.equal(_bits(dst)[:offset], _bits(before)[:offset])
    assert torch.equal(_bits(dst)[offset + n :], _bits(before)[offset + n :])
    _check_accumulated(dst[offset : offset + n], before[offset : offset + n], x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_accumulate_keeps_negative_zero_and_nan_where_payload_is_zero(fmt):
    dst = _from_bits([0x80000000, 0x7FC00001, 0x80000000, 0x3F800000], torch.float32)
    x = torch.tensor([0.0, 0.0, 2.0, -0.0])
    before = dst.clone()
    F.decompress_into(fmt, ENCODE[fmt](x), dst, accumulate=True, **({"nnz": 1} if fmt == "coo" else {}))
    assert _bits(dst).tolist() == [_bits(before)[0].item(), _bits(before)[1].item(), 0x40000000, 0x3F800000]


# ----------------------------------------------------------------------------- corrupt payloads
#
# What a bad payload gets is specified by the CUDA kernels (csrc/pici.cu, csrc/coo.cu), and the
# CPU path must agree: the same DecodeStatus bits, and the same destination range afterwards.
# The models below restate the kernels' checks with numpy, tile by tile / entry by entry,
# independently of the reference; every decode of a damaged payload is compared with them, with
# check=False (a status, never an exception) and with check=True (CorruptPayloadError).

STATUS = F.DecodeStatus


def _size_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align16(k: int) -> int:
    return -(-k // 16) * 16


def _from_raw(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=dtype).clone() if raw else torch.empty(0, dtype=dtype)


def _model_pici(raw: bytes, n: int, dtype, before: torch.Tensor, mode: str, prior: bytes | None = None):
    """(status, range after) of a Pici decode of ``raw`` into a range holding ``before``.

    Kernel rules: nnz = I[NT] above n or above the values the payload holds stops every block
    (BAD_NNZ, nothing written). Otherwise each tile is checked alone (marks at or past n, its
    prior's too: PAST_END; I[t+1] < I[t] or I[0] != 0: BAD_INDEX; else a popcount that is not
    its step: BAD_TILE_COUNT; I[t+1] > nnz: BAD_NNZ) and decoded only if it passes, from
    A[I[t]:I[t+1]] by column then row.
    """
    size = _size_of(dtype)
    tiles = -(-n // 4096)
    metadata = 512 * tiles + _align16(4 * (tiles + 1))
    assert len(raw) >= metadata, "a size error, not a status"
    index = list(struct.unpack_from(f"<{tiles + 1}I", raw, 512 * tiles))
    nnz = index[-1]
    after = before.clone()
    if nnz > n or nnz > (len(raw) - metadata) // size:
        return int(STATUS.BAD_NNZ), after
    words = np.frombuffer(raw, dtype="<u8", count=64 * tiles).reshape(tiles, 64)
    prior_words = (
        np.frombuffer(prior, dtype="<u8", count=64 * tiles).reshape(tiles, 64) if prior is not None else 0 * words
    )
    values = _from_raw(raw[metadata : metadata + nnz * size], dtype)
    rows = np.arange(64, dtype=np.uint64)
    status = 0
    for t in range(tiles):
        marks = ((words[t][:, None] >> rows) & 1).astype(bool)  # [column, row]
        prior_marks = ((prior_words[t][:, None] >> rows) & 1).astype(bool)
        position = t * 4096 + 64 * np.arange(64)[None, :] + np.arange(64)[:, None]  # [column, row]
        lo, hi = index[t], index[t + 1]
        bad = 0
        if ((marks | prior_marks) & (position >= n)).any():
            bad |= STATUS.PAST_END
        if hi < lo or (t == 0 and lo != 0):
            bad |= STATUS.BAD_INDEX
        elif hi - lo != int(marks.sum()):
            bad |= STATUS.BAD_TILE_COUNT
        if hi > nnz:
            bad |= STATUS.BAD_NNZ
        status |= int(bad)
        if bad:
            continue
        marked = torch.from_numpy(position[marks])  # C order of [column, row]: the order of A
        mine = values[lo:hi]
        if mode == "overwrite":
            after[torch.from_numpy(position[position < n])] = 0
            after[marked] = mine
        elif mode == "accumulate":
            after[marked] = (after[marked].float() + mine.float()).to(after.dtype)
        else:  # patch: zeros where only the prior marks, then the values
            after[torch.from_numpy(position[prior_marks & ~marks & (position < n)])] = 0
            after[marked] = mine
    return status, after


def _model_coo(raw: bytes, nnz: int, n: int, dtype, before: torch.Tensor, accumulate: bool):
    """(status, range after, positions named twice) of a COO decode of ``raw``.

    Kernel rules: an overwrite zeroes the range first (the op does, before the kernel), whatever
    follows. nnz < 0, above n, or above what the payload holds: BAD_NNZ, nothing (more) written.
    Otherwise entry i is skipped if its position is >= n (PAST_END) or, being below n, not above
    entry i - 1's (NOT_ASCENDING); every other entry is decoded. A position decoded twice may
    hold either value (the kernel's threads race), so those are returned, not compared.
    """
    size = _size_of(dtype)
    after = before.clone() if accumulate else torch.zeros_like(before)
    if not 0 <= nnz <= n or len(raw) < _align16(4 * nnz) + nnz * size:
        return int(STATUS.BAD_NNZ), after, set()
    positions = struct.unpack_from(f"<{nnz}I", raw, 0)
    values = _from_raw(raw[_align16(4 * nnz) : _align16(4 * nnz) + nnz * size], dtype)
    status, seen, twice = 0, set(), set()
    for i, p in enumerate(positions):
        if p >= n:
            status |= STATUS.PAST_END
            continue
        if i and positions[i - 1] >= p:
            status |= STATUS.NOT_ASCENDING
            continue
        (twice if p in seen else seen).add(p)
        if accumulate:
            after[p] = (after[p].float() + values[i].float()).to(after.dtype)
        else:
            after[p] = values[i]
    return int(status), after, twice


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, skip=(), what: str = "") -> None:
    """Bit for bit, but any NaN matches any NaN (accumulation may produce either operand's)."""
    keep = torch.ones(actual.numel(), dtype=torch.bool)
    keep[list(skip)] = False
    same = (_bits(actual) == _bits(expected)) | (torch.isnan(actual) & torch.isnan(expected))
    bad = torch.nonzero(~same & keep).view(-1)
    assert not bad.numel(), (
        f"{what}: {bad.numel()} elements differ from the kernels' rules, first at {bad[:8].tolist()}: "
        f"got {actual[bad[:8]].tolist()}, expected {expected[bad[:8]].tolist()}"
    )


def _decode_both_ways(
    fmt: str,
    raw: bytes,
    n: int,
    dtype,
    *,
    nnz: int | None = None,
    mode: str = "overwrite",
    prior: bytes | None = None,
    dst_dtype=None,
    seed: int = 0,
) -> tuple[int, str | None]:
    """Decode ``raw`` into the middle of a random ``dst`` with check=False, then with check=True.

    check=False must return a one-element int32 status equal to the model's and never raise;
    check=True must raise CorruptPayloadError exactly when that status is nonzero (else return
    None). Both must leave the range as the model says and everything around it untouched.
    Returns the status and the exception's message (None when the payload was good).
    """
    dst_dtype = dst_dtype or dtype
    pad = 7
    start = _make_tensor(n + 2 * pad, dst_dtype, 0.7, seed, specials=3)
    inside = start[pad : pad + n]
    if fmt == "pici":
        expected_status, expected = _model_pici(raw, n, dtype, inside, mode, prior)
        twice = set()
    else:
        expected_status, expected, twice = _model_coo(raw, nnz, n, dtype, inside, mode == "accumulate")
    kwargs = {"offset": pad, "n": n, "accumulate": mode == "accumulate", "dtype": dtype}
    if nnz is not None:
        kwargs["nnz"] = nnz
    if prior is not None:
        kwargs["prior"] = _u8(prior)
    results = []
    for check in (False, True):
        dst = start.clone()
        if not check:
            status = F.decompress_into(fmt, _u8(raw), dst, check=False, **kwargs)
            assert status.dtype == torch.int32 and status.shape == (1,)
            assert int(status) == expected_status, (
                f"status {int(status)} ({STATUS(int(status))!r}), kernels' rules give "
                f"{expected_status} ({STATUS(expected_status)!r})"
            )
            message = None
        elif expected_status:
            with pytest.raises(CorruptPayloadError) as info:
                F.decompress_into(fmt, _u8(raw), dst, check=True, **kwargs)
            message = str(info.value)
        else:
            assert F.decompress_into(fmt, _u8(raw), dst, check=True, **kwargs) is None
            message = None
        what = f"{fmt} {mode} check={check}"
        assert torch.equal(_bits(dst)[:pad], _bits(start)[:pad]), f"{what}: wrote before the range"
        assert torch.equal(_bits(dst)[pad + n :], _bits(start)[pad + n :]), f"{what}: wrote after the range"
        _assert_same(dst[pad : pad + n], expected, twice, what)
        results.append(message)
    return expected_status, results[1]


def _pici_parts(raw: bytes, n: int) -> tuple[list[int], list[int], int]:
    """B's words, I, and the values' offset of a Pici payload of ``n`` elements."""
    tiles = -(-n // 4096)
    words = list(struct.unpack_from(f"<{64 * tiles}Q", raw, 0))
    index = list(struct.unpack_from(f"<{tiles + 1}I", raw, 512 * tiles))
    return words, index, F.pici_layout(n).values_offset


def _pici_join(words: list[int], index: list[int], values: bytes) -> bytes:
    raw = struct.pack(f"<{len(words)}Q", *words) + struct.pack(f"<{len(index)}I", *index)
    return raw + bytes(-len(raw) % 16) + values


def _mark(words: list[int], position: int) -> None:
    """Set element ``position``'s bit: tile t, row r, column c is bit r of word 64 t + c."""
    tile, local = divmod(position, 4096)
    row, column = divmod(local, 64)
    words[64 * tile + column] |= 1 << row


def _unmark(words: list[int], position: int) -> None:
    tile, local = divmod(position, 4096)
    row, column = divmod(local, 64)
    words[64 * tile + column] &= ~(1 << row)


MODES = ["overwrite", "accumulate", "patch"]
PICI_CORRUPTIONS = [
    "index starts above 0",
    "index decreases",
    "bit set, index kept",
    "bit cleared, index kept",
    "nnz above n",
    "values cut short",
    "bit past the end",
    "prior bit past the end",
]


def _corrupt_pici(kind: str, x: torch.Tensor, data) -> tuple[bytes, bytes | None, int, str]:
    """A damaged payload of ``x``: (payload, prior, the status bit it must raise, message regex)."""
    n, size = x.numel(), _size_of(x.dtype)
    raw = _payload_bytes(F.pici_encode(x))
    words, index, values_offset = _pici_parts(raw, n)
    values = raw[values_offset:]
    tiles = len(index) - 1
    prior = None
    if kind == "index starts above 0":
        index[0] = data.draw(st.integers(1, 2**32 - 1), label="I[0]")
        return _pici_join(words, index, values), prior, STATUS.BAD_INDEX, f"starts at {index[0]}, not 0"
    if kind == "index decreases":
        t = data.draw(st.integers(1, tiles - 1), label="tile")
        index[t] = index[t + 1] + data.draw(st.integers(1, 1000), label="by")
        return _pici_join(words, index, values), prior, STATUS.BAD_INDEX, f"decreases at tile {t}"
    if kind in ("bit set, index kept", "bit cleared, index kept"):
        marked = x != 0
        want = ~marked if kind.startswith("bit set") else marked
        where = torch.nonzero(want).view(-1)
        position = int(where[data.draw(st.integers(0, where.numel() - 1), label="which")])
        (_mark if kind.startswith("bit set") else _unmark)(words, position)
        t = position // 4096
        return _pici_join(words, index, values), prior, STATUS.BAD_TILE_COUNT, f"tile {t} has .* bits set"
    if kind == "nnz above n":
        index[-1] = n + data.draw(st.integers(1, 2**32 - 1 - n), label="by")
        return _pici_join(words, index, values), prior, STATUS.BAD_NNZ, f"claims nnz={index[-1]}, but n={n}"
    if kind == "values cut short":
        nnz = index[-1]
        cut = data.draw(st.integers(1, nnz * size), label="cut")
        keep = nnz - -(-cut // size)
        return raw[:-cut], prior, STATUS.BAD_NNZ, f"claims nnz={nnz}, but n={n} and the payload holds at most {keep}"
    if kind == "bit past the end":
        position = data.draw(st.integers(n, 4096 * tiles - 1), label="position")
        _mark(words, position)
        index[-1] += 1  # the last tile's step keeps up with its popcount; one more value
        values += bytes(size)
        return _pici_join(words, index, values), prior, STATUS.PAST_END, f"past the end n={n} .*position {position}"
    assert kind == "prior bit past the end"
    prior_words = list(words)
    position = data.draw(st.integers(n, 4096 * tiles - 1), label="position")
    _mark(prior_words, position)
    prior = _pici_join(prior_words, index, values)
    return raw, prior, STATUS.PAST_END, "the prior's bitvector marks nonzeros past the end"


@pytest.mark.parametrize(
    "kind, mode",
    [(kind, mode) for kind in PICI_CORRUPTIONS for mode in MODES if mode == "patch" or not kind.startswith("prior")],
)
@settings(deadline=None, max_examples=12)
@given(data=st.data())
def test_pici_corruption_is_a_status_unchecked_and_an_error_checked(kind, mode, data):
    """Every kind of damage: check=False returns its status bit (never raises), check=True raises
    CorruptPayloadError naming it, and both leave the range as the CUDA kernels do."""
    need_tiles = 2 if kind == "index decreases" else 1
    lengths = st.integers(4096 * (need_tiles - 1) + 1, 3 * 4096 + 5)
    if kind in ("bit past the end", "prior bit past the end"):
        lengths = lengths.filter(lambda k: k % 4096)  # room past n in the last tile
    x = data.draw(sparse_tensors(lengths=lengths, specials=False), label="x")
    nonzeros = int((x != 0).sum())
    assume(not (kind == "bit set, index kept" and nonzeros == x.numel()))
    assume(not (kind in ("bit cleared, index kept", "values cut short") and nonzeros == 0))
    # nnz + 1 > n: the kernels stop at BAD_NNZ before they look at tiles.
    assume(not (kind == "bit past the end" and nonzeros == x.numel()))
    raw, prior, bit, message = _corrupt_pici(kind, x, data)
    if mode == "patch" and prior is None:
        prior = _payload_bytes(F.pici_encode(_make_tensor(x.numel(), x.dtype, 0.3, seed=11, specials=0)))
    dst_dtype = torch.float32 if mode == "accumulate" and data.draw(st.booleans(), label="fp32 dst") else x.dtype
    status, got = _decode_both_ways(
        "pici", raw, x.numel(), x.dtype, mode=mode, prior=prior, dst_dtype=dst_dtype, seed=data.draw(st.integers(0, 99))
    )
    assert status & bit, f"status {STATUS(status)!r} lacks {STATUS(bit)!r}"
    assert re.search(message, got), got
    assert f"n={x.numel()}" in got
    assert f"status {status}" in got


COO_CORRUPTIONS = [
    "positions swapped",
    "position repeated",
    "position past the end",
    "nnz above n",
    "nnz above the payload",
    "payload cut short",
    "negative nnz",
]


def _corrupt_coo(kind: str, x: torch.Tensor, data) -> tuple[bytes, int, int, str]:
    """A damaged COO payload of ``x`` with the nnz to decode it with, its status bit, a message regex."""
    n = x.numel()
    raw = bytearray(_payload_bytes(F.coo_encode(x)))
    nnz = int((x != 0).sum())
    if kind in ("positions swapped", "position repeated"):
        i = data.draw(st.integers(1, nnz - 1), label="entry")
        a, b = struct.unpack_from("<2I", raw, 4 * (i - 1))
        struct.pack_into("<2I", raw, 4 * (i - 1), *((b, a) if kind == "positions swapped" else (a, a)))
        return bytes(raw), nnz, STATUS.NOT_ASCENDING, "not strictly ascending"
    if kind == "position past the end":
        i = data.draw(st.integers(0, nnz - 1), label="entry")
        position = data.draw(st.integers(n, 2**32 - 1), label="position")
        struct.pack_into("<I", raw, 4 * i, position)
        return bytes(raw), nnz, STATUS.PAST_END, f"{position}.* past the end n={n}|past the end n={n}.*{position}"
    if kind == "nnz above n":
        more = n + data.draw(st.integers(1, 10**6), label="by")
        return bytes(raw), more, STATUS.BAD_NNZ, f"nnz={more} exceeds n={n}"
    if kind == "nnz above the payload":
        return bytes(raw), nnz + 1, STATUS.BAD_NNZ, f"shorter than the .* bytes nnz={nnz + 1} needs"
    if kind == "payload cut short":
        cut = data.draw(st.integers(1, len(raw)), label="cut")
        return bytes(raw[:-cut]), nnz, STATUS.BAD_NNZ, f"COO payload of {len(raw) - cut} bytes is shorter"
    assert kind == "negative nnz"
    negative = -data.draw(st.integers(1, 2**40), label="nnz")
    return bytes(raw), negative, STATUS.BAD_NNZ, f"nnz={negative} is negative"


@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
@pytest.mark.parametrize("kind", COO_CORRUPTIONS)
@settings(deadline=None, max_examples=12)
@given(data=st.data())
def test_coo_corruption_is_a_status_unchecked_and_an_error_checked(kind, accumulate, data):
    x = data.draw(sparse_tensors(lengths=st.integers(1, 3000), specials=False), label="x")
    nonzeros = int((x != 0).sum())
    assume(nonzeros >= (2 if kind in ("positions swapped", "position repeated") else 1))
    assume(not (kind == "nnz above the payload" and nonzeros == x.numel()))
    raw, nnz, bit, message = _corrupt_coo(kind, x, data)
    mode = "accumulate" if accumulate else "overwrite"
    status, got = _decode_both_ways(
        "coo", raw, x.numel(), x.dtype, nnz=nnz, mode=mode, seed=data.draw(st.integers(0, 99))
    )
    assert status & bit, f"status {STATUS(status)!r} lacks {STATUS(bit)!r}"
    assert re.search(message, got), got
    assert f"status {status}" in got


@settings(deadline=None, max_examples=250)
@given(x=sparse_tensors(lengths=st.integers(0, 2 * 4096 + 100)), data=st.data())
def test_pici_random_damage_matches_the_kernels(x, data):
    """Random bytes overwritten, the payload cut or extended: whatever the result, check=False
    gives the kernels' status without raising and check=True raises iff it is nonzero, and the
    range holds what the kernels leave (untouched outside it)."""
    n = x.numel()
    raw = bytearray(_payload_bytes(F.pici_encode(x)))
    metadata = F.pici_layout(n).values_offset
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        where = data.draw(st.integers(0, len(raw) - 1) | st.integers(512 * (-(-n // 4096)), metadata - 1), label="byte")
        raw[min(where, len(raw) - 1)] = data.draw(st.integers(0, 255), label="value")
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(metadata, len(raw)), label="length")]
    raw += bytes(data.draw(st.integers(0, 40), label="extend"))
    mode = data.draw(st.sampled_from(MODES), label="mode")
    prior = None
    if mode == "patch":
        prior = _payload_bytes(
            F.pici_encode(_make_tensor(n, x.dtype, 0.2, seed=data.draw(st.integers(0, 99)), specials=0))
        )
        if data.draw(st.booleans(), label="damage prior") and n % 4096:
            prior = bytearray(prior)
            prior[data.draw(st.integers(0, 512 * (-(-n // 4096)) - 1), label="prior byte")] = 0xFF
            prior = bytes(prior)
    status, message = _decode_both_ways("pici", bytes(raw), n, x.dtype, mode=mode, prior=prior, seed=n % 100)
    if status:
        assert "n=" in message and f"status {status}" in message


@settings(deadline=None, max_examples=250)
@given(x=sparse_tensors(lengths=st.integers(0, 3000)), data=st.data())
def test_coo_random_damage_matches_the_kernels(x, data):
    n = x.numel()
    raw = bytearray(_payload_bytes(F.coo_encode(x)))
    true_nnz = int((x != 0).sum())
    nnz = data.draw(st.sampled_from([true_nnz]) | st.integers(-2, n + 2), label="nnz")
    for _ in range(data.draw(st.integers(0, 4), label="flips")):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1), label="byte")] = data.draw(st.integers(0, 255), label="value")
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw)), label="length")]
    accumulate = data.draw(st.booleans(), label="accumulate")
    status, message = _decode_both_ways(
        "coo", bytes(raw), n, x.dtype, nnz=nnz, mode="accumulate" if accumulate else "overwrite", seed=n % 100
    )
    if status:
        assert f"status {status}" in message


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep", [0, 1, 15, 512, 4 * 512 - 1])
def test_pici_payload_shorter_than_its_metadata_is_a_size_error(dtype, keep, check):
    """Too short for n's metadata: it does not fit n. Raised from sizes alone, whatever check
    says, before anything is read or written."""
    n = 3 * 4096 + 5  # metadata: 4 tiles of words + 20 bytes of I padded to 32 = 2080
    payload = F.pici_encode(_make_tensor(n, dtype, 0.1, seed=1, specials=0))[:keep].clone()
    dst = torch.full((n + 4,), 9.0, dtype=dtype)
    most = F.layout.pici_max_tiles(keep)
    with pytest.raises(CorruptPayloadError, match=f"Pici payload of {keep} bytes does not fit n={n}") as info:
        F.decompress_into("pici", payload, dst, offset=2, n=n, check=check)
    message = str(info.value)
    assert "4 tiles, whose metadata alone is 2080 bytes" in message
    assert "decode with the n it was encoded with" in message
    if most < 0:
        assert f"{keep} bytes are fewer than the 16 of any Pici payload" in message
    else:
        assert f"at most {most} tile" in message and f"n <= {4096 * most}" in message
    assert bool((dst == 9.0).all())
    with pytest.raises(CorruptPayloadError, match=f"does not fit n={n}: n={n} takes 4 tiles"):
        F.pici_decode(payload, n, dtype)


@pytest.mark.parametrize("check", [False, True])
def test_prior_shorter_than_its_bitvectors_is_a_size_error(check):
    n = 4096 + 7
    x = torch.ones(n)
    dst = torch.zeros(n)
    prior = F.pici_encode(x)[:1000].clone()
    with pytest.raises(CorruptPayloadError, match="Pici prior of 1000 bytes does not fit n=4103") as info:
        F.decompress_into("pici", F.pici_encode(x), dst, prior=prior, check=check)
    assert "2 tiles, whose bitvectors alone are 1024 bytes" in str(info.value)
    assert "at most 1 tile, so it was made for n <= 4096" in str(info.value)
    assert bool((dst == 0).all())


def test_hand_made_pici_status_bits():
    """Fixed examples of each status bit, as test_kernels_cuda.py builds them for the kernels."""
    n = 4096 + 70
    x = torch.zeros(n)
    x[[0, 1, 64, 69, 4096, 4096 + 69]] = torch.tensor([1.0, 2.0, 3.0, -4.0, 5.0, 6.0])
    raw = _payload_bytes(F.pici_encode(x))
    words, index, values_offset = _pici_parts(raw, n)
    assert index == [0, 4, 6]
    values = raw[values_offset:]
    cases = {
        # I = [0, 7, 6]: tile 1 decreases (BAD_INDEX); tile 0 claims 7 > nnz and 3 more than its bits.
        "decreasing": ([0, 7, 6], words, values, STATUS.BAD_INDEX | STATUS.BAD_TILE_COUNT | STATUS.BAD_NNZ),
        "starts at 1": ([1, 4, 6], words, values, STATUS.BAD_INDEX),
        "one value short": ([0, 4, 7], words[:64] + [words[64] | 2] + words[65:], values, STATUS.BAD_NNZ),
        "nnz 2**32-1": ([0, 4, 0xFFFFFFFF], words, values, STATUS.BAD_NNZ),
    }
    for name, (idx, w, v, expected) in cases.items():
        status, message = _decode_both_ways("pici", _pici_join(w, idx, v), n, torch.float32)
        assert status == expected, name
        assert f"status {int(expected)}" in message, name
    status, message = _decode_both_ways("pici", _pici_join(words, [0, 4, 7], values), n, torch.float32)
    assert "claims nnz=7, but n=4166 and the payload holds at most 6 values" in message


# ----------------------------------------------------------------------------- decoding with the wrong n


def _range_in(message: str) -> tuple[int, int]:
    found = re.search(r"made for n from (\d+) to (\d+)", message)
    assert found, message
    return int(found.group(1)), int(found.group(2))


@settings(deadline=None, max_examples=200)
@given(
    x=sparse_tensors(lengths=st.integers(1, 4 * 4096 + 100), specials=False),
    data=st.data(),
)
def test_pici_decode_with_the_wrong_n_says_it_does_not_fit(x, data):
    """A wrong n either decodes x (cut or zero-extended: nothing past x's last nonzero is
    lost) or is reported as a payload that does not fit n, naming that n and the range of n
    the payload was made for, which holds the true n: never as a corrupt index."""
    n = x.numel()
    wrong = data.draw(
        st.integers(0, 6 * 4096) | st.sampled_from([n - 1, n + 1, n + 4096, max(0, n - 4096), 4096 * -(-n // 4096)]),
        label="wrong n",
    )
    assume(wrong != n)
    payload = F.pici_encode(x)
    try:
        y = F.pici_decode(payload, wrong, x.dtype)
    except CorruptPayloadError as error:
        message = str(error)
        assert f"does not fit n={wrong}" in message, message
        assert "decode with the n it was encoded with" in message
        lo, hi = _range_in(message)
        assert lo <= n <= hi, message
        assert not lo <= wrong <= hi, message
        # decompress_into allows bytes after a payload, so it may take the payload as a good one
        # with bytes to spare; when it does not, it names both n too (sizes bound n from above).
        dst = torch.zeros(wrong, dtype=x.dtype)
        try:
            unchecked = F.decompress_into("pici", payload, dst, check=False)
        except CorruptPayloadError as size_error:
            assert f"does not fit n={wrong}" in str(size_error)
            return
        try:
            assert F.decompress_into("pici", payload, dst) is None
        except CorruptPayloadError as checked:
            message = str(checked)
            assert int(unchecked) != 0
            assert f"does not fit n={wrong}" in message, message
            low, high = _range_in(message)  # an exact payload: its own n is found
            assert low <= n <= high, message
        else:
            assert int(unchecked) == 0
    else:
        expect = torch.zeros(wrong, dtype=x.dtype)
        keep = min(n, wrong)
        expect[:keep] = x[:keep]
        assert int((x[keep:] != 0).sum()) == 0
        _assert_bits_equal(y, _decoded_bits(expect))


def test_pici_wrong_n_messages_by_hand():
    x = torch.zeros(5 * 4096 + 7)
    x[::37] = 1.5
    x[-1] = 2.0  # the last nonzero at 20486; 555 of them
    payload = F.pici_encode(x)
    assert payload.numel() == 3104 + 4 * 555 == 5324
    cases = {
        # Fewer tiles: the index is read from the bitvectors. A good payload of 6 tiles.
        4096: "Pici payload of 5324 bytes does not fit n=4096 (1 tile): it is a good payload of 6 tiles "
        "(nnz=555), made for n from 20487 to 24576; decode with the n it was encoded with",
        # Same tiles, fewer elements than the last mark.
        20485: "Pici payload does not fit n=20485: it marks a nonzero past the end n=20485 (its last at "
        "position 20486, nnz=555), so it was made for n from 20487 to 24576 (6 tiles); "
        "decode with the n it was encoded with",
        # More tiles than its length can hold the metadata of.
        81920: "Pici payload of 5324 bytes does not fit n=81920: n=81920 takes 20 tiles, whose metadata "
        "alone is 10336 bytes, but by its length it was made for n from 1199 to 40960 (1 to 10 tiles); "
        "decode with the n it was encoded with",
        # Longer than any payload of n elements.
        100: "Pici payload of 5324 bytes does not fit n=100: a Pici payload of n=100 torch.float32 elements "
        "(1 tile) has at most 928 bytes, but by its length it was made for n from 1199 to 40960 (1 to 10 tiles)",
    }
    for wrong, expected in cases.items():
        with pytest.raises(CorruptPayloadError) as info:
            F.pici_decode(payload, wrong, torch.float32)
        assert expected in str(info.value), (wrong, str(info.value))
    # Same tiles, more elements than encoded: nothing can tell, and nothing is lost.
    _assert_bits_equal(F.pici_decode(payload, 6 * 4096, torch.float32)[: x.numel()], _bits(x))


def test_pici_decode_wants_the_exact_payload():
    """An empty first tile makes a 2-tile payload parse as a 1-tile one with bytes to spare;
    pici_decode takes exact payloads, so their length and I[NT] name the tile count."""
    x = torch.zeros(5075)
    x[-1] = 3.0
    payload = F.pici_encode(x)
    dst = torch.full((129,), 7.0)
    assert F.decompress_into("pici", payload, dst) is None  # bytes after a payload are allowed here
    assert bool((dst == 0).all())
    with pytest.raises(CorruptPayloadError) as info:
        F.pici_decode(payload, 129, torch.float32)
    assert "Pici payload of 1044 bytes does not fit n=129 (1 tile): it is a good payload of 2 tiles (nnz=1), " in str(
        info.value
    )
    assert "made for n from 5075 to 8192" in str(info.value)
    padded = torch.cat([payload, torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(CorruptPayloadError, match="Pici payload of 1048 bytes does not end with its values: read as "):
        F.pici_decode(padded, 5075, torch.float32)
    _assert_bits_equal(F.pici_decode(payload, 5075, torch.float32), _bits(x))


@settings(deadline=None, max_examples=150)
@given(x=sparse_tensors(lengths=st.integers(1, 3000), specials=False), wrong=st.integers(0, 4000))
def test_coo_decode_with_the_wrong_n_says_it_does_not_fit(x, wrong):
    n = x.numel()
    assume(wrong != n)
    payload = F.coo_encode(x)
    nonzero = torch.nonzero(x).view(-1)
    try:
        y = F.coo_decode(payload, wrong, x.dtype)
    except CorruptPayloadError as error:
        message = str(error)
        assert f"does not fit n={wrong}" in message and "decode with the n it was encoded with" in message
        nnz, last = nonzero.numel(), int(nonzero[-1])
        if nnz > wrong:
            assert (
                f"nnz={nnz} nonzeros of {x.dtype}, more than n={wrong} elements, so it was made for n >= {nnz}"
                in message
            )
        else:
            assert f"past the end n={wrong} (its last at position {last}), so it was made for n > {last}" in message
        assert n >= nnz and n > last
    else:
        assert not nonzero.numel() or int(nonzero[-1]) < wrong
        expect = torch.zeros(wrong, dtype=x.dtype)
        expect[: min(n, wrong)] = x[: min(n, wrong)]
        _assert_bits_equal(y, _decoded_bits(expect))


def test_coo_wrong_n_through_decompress_into():
    x = torch.zeros(300)
    x[[3, 50, 250]] = 1.0
    payload = F.coo_encode(x)
    dst = torch.zeros(200)
    status = F.decompress_into("coo", payload, dst, nnz=3, check=False)
    assert int(status) == STATUS.PAST_END
    with pytest.raises(CorruptPayloadError) as info:
        F.decompress_into("coo", payload, dst, nnz=3)
    assert "COO payload does not fit n=200: it has a nonzero past the end n=200 (its last at position 250), " in str(
        info.value
    )
    assert "so it was made for n > 250; decode with the n it was encoded with" in str(info.value)
    with pytest.raises(CorruptPayloadError, match="COO nnz=3 exceeds n=2: the payload does not fit n=2"):
        F.decompress_into("coo", payload, torch.zeros(2), nnz=3)


# ----------------------------------------------------------------------------- output too small


@pytest.mark.parametrize("fmt", FORMATS)
@settings(deadline=None, max_examples=100)
@given(x=sparse_tensors(lengths=st.integers(0, 2 * 4096 + 100)), data=st.data())
def test_buffer_too_small_raises_iff_payload_does_not_fit(fmt, x, data):
    n, nnz = x.numel(), int((x != 0).sum())
    need = _size(fmt, n, nnz, x.dtype)
    capacity = F.capacity_bytes(fmt, n, x.dtype)
    have = data.draw(
        st.integers(0, max(0, need - 1)) | st.integers(need, capacity + 8) | st.just(max(0, need - 1)), label="have"
    )
    out = torch.full((have,), 0x5A, dtype=torch.uint8)
    if have < need:
        with pytest.raises(PayloadTooSmallError, match=f"buffer of {have} bytes"):
            F.compress_into(fmt, x, out)
        assert bool((out == 0x5A).all())  # the reference writes nothing when it raises
    else:
        assert int(F.compress_into(fmt, x, out)) == nnz
        assert _payload_bytes(out[:need]) == SPEC[fmt](x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pici_buffer_smaller_than_metadata(dtype):
    n = 4097
    x = _make_tensor(n, dtype, 0.5, seed=2, specials=0)
    metadata = F.pici_metadata_bytes(n)
    for have in (0, 16, metadata - 1):
        with pytest.raises(PayloadTooSmallError, match="metadata") as info:
            F.compress_into("pici", x, torch.empty(have, dtype=torch.uint8))
        assert f"{have} bytes" in str(info.value) and "capacity_bytes" in str(info.value)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_buffer_holding_metadata_but_not_values(fmt, dtype):
    n = 1000
    x = _make_tensor(n, dtype, 0.5, seed=4, specials=0)
    nnz = int((x != 0).sum())
    need = _size(fmt, n, nnz, dtype)
    metadata = F.pici_metadata_bytes(n) if fmt == "pici" else F.align16(4 * nnz)
    for have in (metadata, metadata + 1, need - 1):
        with pytest.raises(PayloadTooSmallError, match=f"too small for the .* payload of {need} bytes") as info:
            F.compress_into(fmt, x, torch.empty(have, dtype=torch.uint8))
        assert "capacity_bytes" in str(info.value)


def test_coo_buffer_smaller_than_its_positions():
    x = torch.ones(10)
    with pytest.raises(PayloadTooSmallError, match="payload of 88 bytes"):
        F.compress_into("coo", x, torch.empty(20, dtype=torch.uint8))


# ----------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_tensors_are_rejected(fmt):
    src = torch.randn(16, 16).t()
    with pytest.raises(ValueError, match="src must be contiguous"):
        F.compress_into(fmt, src, torch.empty(4096, dtype=torch.uint8))
    with pytest.raises(ValueError, match="x must be contiguous"):
        ENCODE[fmt](src)
    out = torch.empty(2, 8192, dtype=torch.uint8)[:, ::2]
    with pytest.raises(ValueError, match="out must be contiguous"):
        F.compress_into(fmt, torch.ones(10), out)
    payload = ENCODE[fmt](torch.ones(256))
    with pytest.raises(ValueError, match="dst must be contiguous"):
        F.decompress_into(fmt, payload, torch.empty(16, 16).t(), nnz=256)
    with pytest.raises(ValueError, match="payload must be contiguous"):
        F.decompress_into(fmt, torch.cat([payload, payload])[::2], torch.empty(256), nnz=256)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.int64, torch.uint8])
def test_unsupported_element_types_are_type_errors(fmt, dtype):
    src = torch.ones(10, dtype=dtype)
    with pytest.raises(TypeError, match=f"unsupported dtype {dtype}"):
        F.compress_into(fmt, src, torch.empty(1024, dtype=torch.uint8))
    with pytest.raises(TypeError, match=f"unsupported dtype {dtype}"):
        ENCODE[fmt](src)
    payload = ENCODE[fmt](torch.ones(10))
    with pytest.raises(TypeError, match=f"unsupported dtype {dtype}"):
        F.decompress_into(fmt, payload, torch.empty(10, dtype=dtype), nnz=10)
    with pytest.raises(TypeError, match=f"unsupported dtype {dtype}"):
        F.decompress_into(fmt, payload, torch.empty(10), nnz=10, accumulate=True, dtype=dtype)
    with pytest.raises(TypeError, match=f"unsupported dtype {dtype}"):
        DECODE[fmt](payload, 10, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [torch.int8, torch.float32, torch.int32])
def test_byte_buffers_must_be_uint8(fmt, bad):
    with pytest.raises(TypeError, match=f"out must be a torch.uint8 byte buffer, got {bad}"):
        F.compress_into(fmt, torch.ones(10), torch.empty(1024, dtype=bad))
    with pytest.raises(TypeError, match=f"payload must be a torch.uint8 byte buffer, got {bad}"):
        F.decompress_into(fmt, torch.zeros(1024, dtype=bad), torch.empty(10), nnz=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_tensors_are_type_errors(fmt):
    with pytest.raises(TypeError, match="src must be a torch.Tensor, got list"):
        F.compress_into(fmt, [1.0, 2.0], torch.empty(1024, dtype=torch.uint8))
    with pytest.raises(TypeError, match="out must be a torch.Tensor, got bytearray"):
        F.compress_into(fmt, torch.ones(2), bytearray(1024))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("offset, n", [(-1, 3), (0, 11), (5, 6), (11, None), (10, 1), (3, -1), (-20, None)])
def test_range_out_of_bounds(fmt, offset, n):
    src = torch.ones(10)
    out = torch.full((4096,), 0x11, dtype=torch.uint8)
    with pytest.raises(ValueError, match="of src is outside its 10 elements"):
        F.compress_into(fmt, src, out, offset=offset, n=n)
    assert bool((out == 0x11).all())
    payload = ENCODE[fmt](torch.ones(3))
    dst = torch.full((10,), 2.0)
    with pytest.raises(ValueError, match="of dst is outside its 10 elements"):
        F.decompress_into(fmt, payload, dst, offset=offset, n=n, nnz=3)
    assert bool((dst == 2.0).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_range_longer_than_uint32_is_rejected(fmt):
    # Meta tensors: the checks run on shapes alone, so 2**32 elements cost nothing.
    big = torch.empty(2**32, device="meta")
    with pytest.raises(ValueError, match="cannot encode 4294967296 elements"):
        F.compress_into(fmt, big, torch.empty(16, dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match="cannot encode 4294967296 elements"):
        F.decompress_into(fmt, torch.empty(16, dtype=torch.uint8, device="meta"), big, nnz=0)


def test_coo_decode_without_nnz():
    payload = F.coo_encode(torch.ones(4))
    dst = torch.full((4,), 8.0)
    with pytest.raises(ValueError, match="pass nnz="):
        F.decompress_into("coo", payload, dst)
    assert bool((dst == 8.0).all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "payload_dtype, dst_dtype, accumulate",
    [
        (torch.bfloat16, torch.float16, False),
        (torch.bfloat16, torch.float16, True),
        (torch.float16, torch.bfloat16, True),
        (torch.bfloat16, torch.float32, False),
        (torch.float32, torch.bfloat16, True),
        (torch.float32, torch.float16, False),
    ],
)
def test_mixed_types_only_accumulate_into_float32(fmt, payload_dtype, dst_dtype, accumulate):
    payload = ENCODE[fmt](torch.ones(8, dtype=payload_dtype))
    dst = torch.full((8,), 4.0, dtype=dst_dtype)
    with pytest.raises(TypeError, match=f"cannot decode {payload_dtype} values into a {dst_dtype} tensor"):
        F.decompress_into(fmt, payload, dst, nnz=8, accumulate=accumulate, dtype=payload_dtype)
    assert bool((dst == 4.0).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_must_be_pici_or_coo(fmt):
    with pytest.raises(ValueError, match="dense data needs no encoding"):
        F.compress_into("dense", torch.ones(4), torch.empty(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="copy dense data directly"):
        F.decompress_into("dense", torch.empty(64, dtype=torch.uint8), torch.empty(4))
    with pytest.raises(ValueError):
        F.compress_into("csr", torch.ones(4), torch.empty(64, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_out_on_another_device(fmt):
    with pytest.raises(ValueError, match="put both on one device"):
        F.compress_into(fmt, torch.ones(4), torch.empty(64, dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match="put both on one device"):
        F.decompress_into(fmt, torch.empty(64, dtype=torch.uint8, device="meta"), torch.empty(4), nnz=0)


def test_coo_decode_rejects_payload_of_impossible_size():
    payload = F.coo_encode(torch.ones(5))
    with pytest.raises(ValueError, match="not the size of any COO payload"):
        F.coo_decode(payload[:-1].clone(), 5, torch.float32)


def test_uses_reference_on_cpu():
    assert not F.uses_kernels(torch.ones(1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_unchecked_cpu_decode_returns_the_status_instead_of_raising(fmt):
    x = torch.ones(100)
    payload = ENCODE[fmt](x)
    dst = torch.empty(100)
    status = F.decompress_into(fmt, payload, dst, nnz=100, check=False)
    assert status.dtype == torch.int32 and status.tolist() == [0]
    assert torch.equal(dst, x)
    # Four bytes short: the last value is missing, which the kernels report as BAD_NNZ.
    status = F.decompress_into(fmt, payload[:-4].clone(), dst, nnz=100, check=False)
    assert status.dtype == torch.int32 and status.shape == (1,) and status.device == dst.device
    assert int(status) == F.DecodeStatus.BAD_NNZ
    with pytest.raises(CorruptPayloadError, match=r"\(status 4: BAD_NNZ\)"):
        F.decompress_into(fmt, payload[:-4].clone(), dst, nnz=100)
    with pytest.raises(CorruptPayloadError, match=r"corrupt .* payload for n=100: .* \(status 4\); if it was"):
        F.raise_for_status(status, fmt, n=100)


def test_raise_for_status_names_every_reason():
    F.raise_for_status(0, "pici")
    F.raise_for_status(torch.zeros(1, dtype=torch.int32), "coo")
    with pytest.raises(CorruptPayloadError, match=r"corrupt pici payload: .*index array.*; nnz exceeds.*\(status 5\)"):
        F.raise_for_status(torch.tensor([5], dtype=torch.int32), "pici")
    with pytest.raises(
        CorruptPayloadError, match=r"corrupt coo payload: COO positions are not strictly ascending \(status 16\)"
    ):
        F.raise_for_status(16, F.Format.COO)
