"""Property tests of the Pici and COO codecs on CPU (the reference path), through the public API.

The byte layout is checked against FORMATS.md three ways: hand-worked payloads written out byte
by byte, an independent numpy encoder below (``_spec_pici`` / ``_spec_coo``), and round trips.
Inputs are drawn fresh each run by hypothesis; tensors come from a drawn seed so a failure
replays from hypothesis' report.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
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
    with pytest.raises(CorruptPayloadError, match="shorter than its metadata"):
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


def _pici_fields(payload: bytes, n: int) -> tuple[list[int], list[int], int]:
    tiles = -(-n // 4096)
    words = list(struct.unpack_from(f"<{64 * tiles}Q", payload, 0))
    index = list(struct.unpack_from(f"<{tiles + 1}I", payload, 512 * tiles))
    return words, index, F.pici_layout(n).values_offset


def _pici_build(words: list[int], index: list[int], values: bytes) -> torch.Tensor:
    raw = struct.pack(f"<{len(words)}Q", *words) + struct.pack(f"<{len(index)}I", *index)
    return _u8(raw + bytes(-len(raw) % 16) + values)


def _decode_into_guarded(fmt: str, payload: torch.Tensor, n: int, dtype, nnz=None, accumulate=False, match=None):
    """Decode into the middle of a sentinel-filled dst; the corrupt payload must raise and leave
    every element (inside the range as well) untouched."""
    pad = 37
    dst = torch.full((n + 2 * pad,), 9.0, dtype=dtype)
    dst[pad - 1] = float("nan")
    before = _bits(dst).clone()
    extra = {"nnz": nnz} if fmt == "coo" else {}
    with pytest.raises(CorruptPayloadError, match=match) as info:
        F.decompress_into(fmt, payload, dst, offset=pad, n=n, accumulate=accumulate, **extra)
    assert torch.equal(_bits(dst), before)
    return str(info.value)


def _pici_example(n: int = 4096 + 70, dtype=torch.float32) -> tuple[torch.Tensor, bytes]:
    x = torch.zeros(n, dtype=dtype)
    x[[0, 1, 64, 69, 4096, 4096 + 69]] = torch.tensor([1.0, 2.0, 3.0, -4.0, 5.0, 6.0], dtype=dtype)
    return x, _payload_bytes(F.pici_encode(x))


@pytest.mark.parametrize("accumulate", [False, True])
def test_pici_nnz_beyond_capacity(accumulate):
    x, payload = _pici_example()
    words, index, values_offset = _pici_fields(payload, x.numel())
    assert index == [0, 4, 6]
    index[2] = 7  # one more than the values present
    words[64 + 1] |= 1  # keep the popcount consistent so only the capacity is wrong
    bad = _pici_build(words, index, payload[values_offset:])
    message = _decode_into_guarded("pici", bad, x.numel(), torch.float32, accumulate=accumulate, match="nnz=7")
    assert "at most 6" in message
    with pytest.raises(CorruptPayloadError):
        F.pici_decode(bad, x.numel(), torch.float32)


@pytest.mark.parametrize("accumulate", [False, True])
def test_pici_nnz_beyond_n(accumulate):
    n = 70
    x = torch.ones(n)
    payload = _payload_bytes(F.pici_encode(x))
    words, index, values_offset = _pici_fields(payload, n)
    index[1] = n + 1
    # Room for n + 1 values, so only "nnz > n" is wrong.
    bad = _pici_build(words, index, payload[values_offset:] + struct.pack("<f", 1.0))
    message = _decode_into_guarded("pici", bad, n, torch.float32, accumulate=accumulate, match=f"nnz={n + 1}")
    assert f"n={n}" in message


def test_pici_huge_nnz():
    x, payload = _pici_example()
    words, index, values_offset = _pici_fields(payload, x.numel())
    index[2] = 0xFFFFFFFF
    bad = _pici_build(words, index, payload[values_offset:])
    _decode_into_guarded("pici", bad, x.numel(), torch.float32, match="nnz=4294967295")


@pytest.mark.parametrize("accumulate", [False, True])
def test_pici_decreasing_index(accumulate):
    x, payload = _pici_example()
    words, index, values_offset = _pici_fields(payload, x.numel())
    index[1] = 7  # [0, 7, 6]
    bad = _pici_build(words, index, payload[values_offset:])
    _decode_into_guarded("pici", bad, x.numel(), torch.float32, accumulate=accumulate, match="decreases at tile 1")


@pytest.mark.parametrize("accumulate", [False, True])
def test_pici_index_not_starting_at_zero(accumulate):
    x, payload = _pici_example()
    words, index, values_offset = _pici_fields(payload, x.numel())
    index[0] = 1
    bad = _pici_build(words, index, payload[values_offset:])
    _decode_into_guarded("pici", bad, x.numel(), torch.float32, accumulate=accumulate, match="starts at 1, not 0")


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("change", ["extra bit", "missing bit", "bit moved to other tile"])
def test_pici_bit_count_disagrees_with_index(accumulate, change):
    x, payload = _pici_example()
    words, index, values_offset = _pici_fields(payload, x.numel())
    if change == "extra bit":
        words[7] |= 1 << 40
    elif change == "missing bit":
        words[0] &= ~1
    else:
        words[0] &= ~1
        words[64 + 3] |= 1
    bad = _pici_build(words, index, payload[values_offset:])
    _decode_into_guarded(
        "pici", bad, x.numel(), torch.float32, accumulate=accumulate, match="bits set but its index step"
    )


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("past", [70, 100, 4095])
def test_pici_bits_past_the_end(accumulate, past):
    n = 70
    x = torch.zeros(n)
    x[[3, 69]] = torch.tensor([1.0, 2.0])
    payload = _payload_bytes(F.pici_encode(x))
    words, index, values_offset = _pici_fields(payload, n)
    row, col = divmod(past, 64)
    words[col] |= 1 << row
    index[1] += 1
    bad = _pici_build(words, index, payload[values_offset:] + struct.pack("<f", 3.0))
    _decode_into_guarded("pici", bad, n, torch.float32, accumulate=accumulate, match="past the end")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep", [0, 1, 15, 512, 4 * 512 - 1])
def test_pici_payload_shorter_than_metadata(dtype, keep):
    n = 3 * 4096 + 5  # metadata: 4 tiles of words + 20 bytes of I padded to 32 = 2080
    payload = F.pici_encode(_make_tensor(n, dtype, 0.1, seed=1, specials=0))
    _decode_into_guarded("pici", payload[:keep].clone(), n, dtype, match="shorter than its metadata")
    with pytest.raises(CorruptPayloadError, match="2080 bytes for n="):
        F.pici_decode(payload[:keep].clone(), n, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pici_truncated_values(dtype):
    n = 500
    x = _make_tensor(n, dtype, 0.5, seed=3, specials=0)
    payload = F.pici_encode(x)
    size = torch.empty((), dtype=dtype).element_size()
    for cut in (1, size, 3 * size):
        _decode_into_guarded("pici", payload[:-cut].clone(), n, dtype, match="nnz=")


@settings(deadline=None, max_examples=250)
@given(x=sparse_tensors(lengths=st.integers(0, 2 * 4096 + 100)), data=st.data())
def test_pici_random_corruption_never_escapes(x, data):
    """Random byte damage: either a clean CorruptPayloadError with dst untouched, or a decode that
    stays inside its range."""
    n = x.numel()
    raw = bytearray(_payload_bytes(F.pici_encode(x)))
    metadata = F.pici_layout(n).values_offset
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        where = data.draw(st.integers(0, len(raw) - 1), label="byte")
        raw[where] = data.draw(st.integers(0, 255), label="value")
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw)), label="length")]
    extend = data.draw(st.integers(0, 40), label="extend")
    raw += bytes(extend)
    note(f"metadata={metadata} length={len(raw)}")
    pad = 11
    dst = torch.full((n + 2 * pad,), 3.0, dtype=x.dtype)
    before = _bits(dst).clone()
    accumulate = data.draw(st.booleans(), label="accumulate")
    try:
        F.decompress_into("pici", _u8(raw), dst, offset=pad, n=n, accumulate=accumulate)
    except CorruptPayloadError:
        assert torch.equal(_bits(dst), before)
    else:
        assert torch.equal(_bits(dst)[:pad], before[:pad])
        assert torch.equal(_bits(dst)[pad + n :], before[pad + n :])


def _coo_example_values() -> bytes:
    """The value bytes of a float32 COO payload with 5 nonzeros over n = 200."""
    x = torch.zeros(200)
    x[[0, 3, 64, 150, 199]] = torch.tensor([1.0, -2.0, 3.0, 4.0, -5.0])
    values = _payload_bytes(F.coo_encode(x))[32:]  # 5 positions: 20 bytes, padded to 32
    assert len(values) == 5 * 4
    return values


def _coo_build(positions: list[int], values: bytes) -> torch.Tensor:
    raw = struct.pack(f"<{len(positions)}I", *positions)
    return _u8(raw + bytes(-len(raw) % 16) + values)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize(
    "positions", [[0, 3, 150, 64, 199], [3, 0, 64, 150, 199], [0, 3, 64, 64, 199], [0, 0, 0, 0, 0]]
)
def test_coo_positions_not_ascending(accumulate, positions):
    values = _coo_example_values()
    _decode_into_guarded(
        "coo",
        _coo_build(positions, values),
        200,
        torch.float32,
        nnz=5,
        accumulate=accumulate,
        match="not strictly ascending",
    )


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("last", [200, 201, 4096, 0xFFFFFFFF])
def test_coo_position_past_the_end(accumulate, last):
    values = _coo_example_values()
    bad = _coo_build([0, 3, 64, 150, last], values)
    message = _decode_into_guarded(
        "coo", bad, 200, torch.float32, nnz=5, accumulate=accumulate, match="past the end n=200"
    )
    assert str(last) in message


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_coo_nnz_larger_than_payload(accumulate, dtype):
    x = _make_tensor(300, dtype, 0.3, seed=5, specials=0)
    payload = F.coo_encode(x)
    nnz = int((x != 0).sum())
    _decode_into_guarded("coo", payload, 300, dtype, nnz=nnz + 1, accumulate=accumulate, match="shorter than")
    _decode_into_guarded("coo", payload[:-1].clone(), 300, dtype, nnz=nnz, accumulate=accumulate, match="shorter than")


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("nnz", [201, 10**6, -1])
def test_coo_nnz_outside_n(accumulate, nnz):
    n = 200
    big = _u8(bytes(F.coo_bytes(2 * n, 2 * n, torch.float32)))
    _decode_into_guarded("coo", big, n, torch.float32, nnz=nnz, accumulate=accumulate, match=f"nnz={nnz}")


def test_coo_nnz_as_device_tensor_is_checked_too():
    values = _coo_example_values()
    bad = _coo_build([0, 3, 64, 150, 250], values)
    _decode_into_guarded("coo", bad, 200, torch.float32, nnz=torch.tensor([5]), match="past the end")


@settings(deadline=None, max_examples=250)
@given(x=sparse_tensors(lengths=st.integers(0, 3000)), data=st.data())
def test_coo_random_corruption_never_escapes(x, data):
    n = x.numel()
    raw = bytearray(_payload_bytes(F.coo_encode(x)))
    true_nnz = int((x != 0).sum())
    nnz = data.draw(st.sampled_from([true_nnz]) | st.integers(-2, n + 2), label="nnz")
    for _ in range(data.draw(st.integers(0, 4), label="flips")):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1), label="byte")] = data.draw(st.integers(0, 255), label="value")
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw)), label="length")]
    pad = 5
    dst = torch.full((n + 2 * pad,), -1.0, dtype=x.dtype)
    before = _bits(dst).clone()
    accumulate = data.draw(st.booleans(), label="accumulate")
    try:
        F.decompress_into("coo", _u8(raw), dst, offset=pad, n=n, nnz=nnz, accumulate=accumulate)
    except CorruptPayloadError:
        assert torch.equal(_bits(dst), before)
    else:
        assert 0 <= nnz <= n
        assert torch.equal(_bits(dst)[:pad], before[:pad])
        assert torch.equal(_bits(dst)[pad + n :], before[pad + n :])


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
def test_reference_raises_at_once_even_unchecked(fmt):
    x = torch.ones(100)
    payload = ENCODE[fmt](x)
    dst = torch.empty(100)
    status = F.decompress_into(fmt, payload, dst, nnz=100, check=False)
    assert status.dtype == torch.int32 and status.tolist() == [0]
    assert torch.equal(dst, x)
    with pytest.raises(CorruptPayloadError):
        F.decompress_into(fmt, payload[:-4].clone(), dst, nnz=100, check=False)


def test_raise_for_status_names_every_reason():
    F.raise_for_status(0, "pici")
    F.raise_for_status(torch.zeros(1, dtype=torch.int32), "coo")
    with pytest.raises(CorruptPayloadError, match=r"corrupt pici payload: .*index array.*; nnz exceeds.*\(status 5\)"):
        F.raise_for_status(torch.tensor([5], dtype=torch.int32), "pici")
    with pytest.raises(
        CorruptPayloadError, match=r"corrupt coo payload: COO positions are not strictly ascending \(status 16\)"
    ):
        F.raise_for_status(16, F.Format.COO)
