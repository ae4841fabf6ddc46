from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deltasync import _codec

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
    """Issue 11 (unbounded reads): a 473-byte shard declared 2**28 elements; a frame is refused before any
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
