"""The codec's pieces (``deltasync._codec``): the bf16 ordinal, zigzag, byte planes, gaps and zstd frames round-trip
exactly, and the byte planes joined Horner's way, with the packed decode that uses them, are lossless for every
value and every plane count the header allows, including more planes than the values need (a writer other than
ours may store them); a shard whose planes lie is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deltasync import FormatError, TensorDelta, _codec, decode_shard, encode_shard, tensor_checksum
from deltasync import format as fmt

pytestmark = pytest.mark.usefixtures("kernel_modes")  # the compiled loops and the numpy code alike


def test_ordinal_is_a_monotonic_bijection_over_all_bf16_patterns() -> None:
    bits = np.arange(-(2**15), 2**15, dtype=np.int64).astype(np.int16)
    ords = _codec.to_ordinal(bits)
    assert np.unique(ords).size == 2**16
    assert np.array_equal(_codec.from_ordinal(ords), bits)
    values = torch.from_numpy(bits).view(torch.bfloat16).float().numpy()
    finite = np.isfinite(values)
    order = np.argsort(ords[finite], kind="stable")
    assert np.all(np.diff(values[finite][order]) >= 0)
    # -0.0 sits just below +0.0
    assert _codec.to_ordinal(np.array([-(2**15)], dtype=np.int16))[0] == -1


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=50))
def test_zigzag_round_trip(values: list[int]) -> None:
    d = np.array(values, dtype=np.int64)
    z = _codec.zigzag_encode(d, np.uint64)
    assert np.array_equal(_codec.zigzag_decode(z, np.int64), d)
    assert np.all(z[np.abs(d) <= 1] <= 2)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=60))
def test_planes_round_trip(values: list[int]) -> None:
    a = np.array(values, dtype=np.uint32)
    planes = _codec.planes_needed(a)
    # format 1.1: at least one plane for any element, so a frame's size bounds what it can declare
    assert planes == (0 if not values else max(1, (max(values).bit_length() + 7) // 8))
    buf = _codec.split_planes(a, planes)
    assert len(buf) == planes * a.size
    assert np.array_equal(_codec.join_planes(buf, a.size, planes, np.uint32), a)


@given(st.sets(st.integers(0, 10**6), max_size=80))
def test_gaps_round_trip(indices: set[int]) -> None:
    idx = np.array(sorted(indices), dtype=np.int64)
    gaps = _codec.encode_gaps(idx, np.uint32)
    assert np.all(gaps <= 10**6)
    assert np.array_equal(_codec.decode_gaps(gaps), idx)


def test_zstd_decompress_refuses_a_wrong_size() -> None:
    frame = _codec.zstd_compress(b"abc" * 10, 3)
    assert _codec.zstd_decompress(frame, 30) == b"abc" * 10
    with pytest.raises(ValueError, match="declares 30 bytes, expected 31"):
        _codec.zstd_decompress(frame, 31)
    with pytest.raises(ValueError, match="not a zstd frame"):
        _codec.zstd_decompress(b"nope", 3)


def test_a_frame_cannot_declare_more_than_zstd_can_expand() -> None:
    """Bounded reads: a 473-byte shard can declare 2**28 elements; a frame is refused before any
    allocation when it declares more than 32768x its own size (zstd's own ceiling: 128 KiB per 4-byte block)."""
    zeros = _codec.zstd_compress(bytes(1 << 24), 3)
    assert len(_codec.zstd_decompress(zeros, 1 << 24)) == 1 << 24  # the real ratio of zeros passes
    with pytest.raises(ValueError, match=r"a \d+-byte zstd frame cannot hold 268435456 bytes"):
        _codec.zstd_decompress(zeros[:473], 1 << 28)


@pytest.mark.parametrize(("narrow", "wide"), [(np.int16, np.uint32), (np.int32, np.uint64)])
def test_undo_ordinal_delta_in_place_is_the_composed_definition(narrow: type, wide: type) -> None:
    """The fused, in-place undo gives exactly from_ordinal(to_ordinal(base) + zigzag_decode(coded)) on every
    pattern class (signs, zeros, NaN payloads, the extremes), and refuses a result outside the dtype."""
    rng = np.random.default_rng(7)
    info = np.iinfo(narrow)
    base = rng.integers(info.min, info.max, size=20_000, endpoint=True, dtype=np.int64).astype(narrow)
    base[:6] = [0, -1, info.min, info.max, info.min + 1, info.max - 1]
    signed = np.int32 if wide is np.uint32 else np.int64
    ordinal = _codec.to_ordinal(base).astype(signed)
    step = rng.integers(-300, 300, size=base.size).astype(signed)
    step[:6] = [0, 1, 0, 0, -1, 1]  # every sum stays inside the dtype
    target = np.clip(ordinal + step, info.min, info.max)
    coded = _codec.zigzag_encode((target - ordinal).astype(signed), wide)
    expected = _codec.from_ordinal(target.astype(narrow))
    got = _codec.undo_ordinal_delta(base, coded.copy())
    assert got is not None and got.dtype == np.dtype(narrow) and np.array_equal(got, expected)
    over = _codec.zigzag_encode(np.array([1], dtype=signed), wide)  # one past the largest ordinal
    assert _codec.undo_ordinal_delta(np.array([info.max], dtype=narrow), over) is None
    under = _codec.zigzag_encode(np.array([-1], dtype=signed), wide)
    highest_negative = _codec.from_ordinal(np.array([info.min], dtype=narrow))
    assert _codec.undo_ordinal_delta(highest_negative, under) is None


_U = [np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("dtype", _U, ids=lambda d: d.__name__)
def test_planes_round_trip_every_plane_count_with_extreme_bytes(dtype: type) -> None:
    """Every plane count from the fewest that hold the values up to the type's width; the values include 0,
    the largest, every single-byte pattern 0x00..0xFF in every byte position, and random ones."""
    width = np.dtype(dtype).itemsize
    rng = np.random.default_rng(6)
    for planes in range(width + 1):
        top = (1 << (8 * planes)) - 1
        vals = [0, top, top >> 1, (top >> 1) + 1 if planes else 0]
        vals += [b << (8 * k) for k in range(planes) for b in range(256)]
        raw = rng.integers(0, 2**63, size=5000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        vals += [int(x) & top for x in raw]
        a = np.array(vals, dtype=dtype)
        assert _codec.planes_needed(a) <= max(planes, 1)
        for use in range(max(_codec.planes_needed(a), planes), width + 1):  # more planes than needed, too
            back = _codec.join_planes(_codec.split_planes(a, use), a.size, use, dtype)
            assert back.dtype == dtype and np.array_equal(back, a), (planes, use)
        # into a wider type, as the decoder joins index gaps straight into uint64
        back = _codec.join_planes(_codec.split_planes(a, max(planes, 1)), a.size, max(planes, 1), np.uint64)
        assert np.array_equal(back, a.astype(np.uint64))
    assert _codec.join_planes(b"", 0, 3, np.uint32).size == 0
    assert _codec.join_planes(b"", 4, 0, np.uint32).tolist() == [0, 0, 0, 0]


def _all_finite(dtype: torch.dtype) -> torch.Tensor:
    """Every non-NaN bit pattern of a 16-bit dtype; for fp32 the edges and 200,000 random non-NaN patterns."""
    if dtype == torch.float32:
        g = np.random.default_rng(7)
        edge = np.array(
            [
                0,
                0x80000000,
                1,
                0x80000001,
                0x7F7FFFFF,
                0xFF7FFFFF,
                0x7F800000,
                0xFF800000,
                0x00800000,
                0x007FFFFF,
                0x3F800000,
                0xBF800000,
            ],
            dtype=np.uint32,
        )
        bits = np.concatenate([edge, g.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)])
        t = torch.from_numpy(bits.view(np.int32)).view(torch.float32)
    else:
        t = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return t[~torch.isnan(t)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("extra", [False, True], ids=["fewest-planes", "widest-planes"])
def test_packed_round_trip_of_every_pattern_against_a_shuffled_base(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, extra: bool
) -> None:
    """Every finite (and infinite, -0.0) pattern as a new value, coded as bits and as ordinal differences to a
    shuffled base of every pattern (differences spanning the whole ordinal range), sparse and dense; with
    ``extra`` the writer stores as many planes as the header allows, not the fewest."""
    if extra:
        widest = {1: 1, 2: 2, 4: 4, 8: 8}
        monkeypatch.setattr(fmt._codec, "planes_needed", lambda v: widest[v.dtype.itemsize] if v.size else 0)
    new = _all_finite(dtype)
    g = torch.Generator().manual_seed(3)
    old = new[torch.randperm(new.numel(), generator=g)]
    n = new.numel()
    idx = torch.randperm(n, generator=g)[: n // 3].sort().values
    cs = tensor_checksum(new)
    deltas = [
        TensorDelta(ckpt_name="d", shape=(n,), dtype=dtype, indices=None, values=new, base_values=old, checksum=cs),
        TensorDelta(ckpt_name="b", shape=(n,), dtype=dtype, indices=None, values=new, checksum=cs),
        TensorDelta(
            ckpt_name="s", shape=(n,), dtype=dtype, indices=idx, values=new[idx], base_values=old[idx], checksum=cs
        ),
    ]
    buf = encode_shard(deltas, kind="delta", encoding="packed", base_version=1, target_version=2)
    _, out = decode_shard(bytearray(buf), name="f", base={"d": old, "s": old})
    ib = {2: torch.int16, 4: torch.int32}[new.element_size()]
    assert torch.equal(out["d"].values.view(ib), new.view(ib))
    assert torch.equal(out["b"].values.view(ib), new.view(ib))
    assert torch.equal(out["s"].indices, idx) and torch.equal(out["s"].values.view(ib), new[idx].view(ib))


def test_a_top_plane_that_pushes_a_bf16_ordinal_out_of_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed bf16 ordinal-delta entry stored with 4 planes whose top byte is set: the decoded difference is
    far outside bf16 and must be refused, not wrapped back into range."""
    real = fmt._codec.split_planes

    def forged(values: np.ndarray, planes: int) -> bytes:
        out = bytearray(real(values, 4))
        n = values.size
        out[3 * n : 4 * n] = b"\x80" * n  # the top byte of every coded value
        return bytes(out)

    monkeypatch.setattr(fmt._codec, "planes_needed", lambda v: 4 if v.dtype == np.uint32 else 1)
    monkeypatch.setattr(fmt._codec, "split_planes", lambda v, p: forged(v, p) if v.dtype == np.uint32 else real(v, p))
    old = torch.tensor([1.0, -2.0, 0.0, 3.0], dtype=torch.bfloat16)
    new = old + 1
    d = TensorDelta(
        ckpt_name="w",
        shape=(4,),
        dtype=torch.bfloat16,
        indices=None,
        values=new,
        base_values=old,
        checksum=tensor_checksum(new),
    )
    with monkeypatch.context() as numpy_encode:  # the forged planes go through the numpy encode's helpers
        numpy_encode.setattr(fmt._codec, "kernels", lambda: None)
        buf = encode_shard([d], kind="delta", encoding="packed", base_version=1, target_version=2)
    with pytest.raises(FormatError, match="outside the BF16 range"):
        decode_shard(buf, name="f", base={"w": old})
