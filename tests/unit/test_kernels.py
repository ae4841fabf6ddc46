"""deltasync's compiled loops (``deltasync._kernels``) against the numpy code they replace, bit for bit, on random
and edge inputs; and what the loops do where a caller is wrong or an input is hostile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync import _codec, _kernels
from deltasync.sketch import _CHUNK, add_sketches, sketch_at, sketch_change, sketch_range, sub_sketches


@pytest.fixture
def numpy_only(monkeypatch: pytest.MonkeyPatch):
    """Run a block with the numpy code: ``with numpy_only(): ...``."""
    import contextlib

    @contextlib.contextmanager
    def switch():
        with monkeypatch.context() as m:
            m.setenv(_kernels.KERNELS_ENV, "numpy")
            yield

    return switch


def test_the_loops_are_compiled_here_and_off_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM installs numba, so the loops run in every engine; ``DELTASYNC_KERNELS=numpy`` turns them off."""
    monkeypatch.delenv(_kernels.KERNELS_ENV, raising=False)
    assert _kernels.warm() and _kernels.kernels() is not None
    for name in ("undo_ordinal", "undo_planes", "change_lanes", "change_rows", "join_gaps"):
        assert callable(getattr(_kernels.kernels(), name))
    monkeypatch.setenv(_kernels.KERNELS_ENV, " NumPy ")
    assert _kernels.kernels() is None and not _kernels.warm()


def test_a_second_process_loads_the_loops_from_numba_s_cache(tmp_path: Path) -> None:
    """Each process used to compile two loops again (~3 s at every engine and agent start) and leave new cache
    files: one loop called another held in a closure cell, and numba keys its cache on the pickled cell, which
    holds a new id in each process. The second and third processes must add no file to the cache."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop(_kernels.KERNELS_ENV, None)
    code = "from deltasync import _kernels; assert _kernels.warm()"
    counts = []
    for _ in range(3):
        subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=Path(__file__).parents[2], timeout=300)
        counts.append(sorted(p.name for p in tmp_path.rglob("*") if p.is_file()))
    assert counts[0], "numba wrote no cache: the loops are not cached at all"
    assert counts[1] == counts[0] == counts[2], f"new cache files in later processes: {set(counts[2]) - set(counts[0])}"


def _coded(rng: np.random.Generator, base: np.ndarray, wide: type, spread: int) -> np.ndarray:
    signed = np.int32 if wide is np.uint32 else np.int64
    return _codec.zigzag_encode(rng.integers(-spread, spread, size=base.size).astype(signed), wide)


@pytest.mark.parametrize(("narrow", "wide"), [(np.int16, np.uint32), (np.int32, np.uint64)])
@pytest.mark.parametrize("spread", [3, 300, 1 << 20])
def test_undo_equals_numpy_on_every_pattern_and_refuses_alike(
    narrow: type, wide: type, spread: int, numpy_only
) -> None:
    """Every base pattern (zeros, signs, NaN payloads, extremes), small and wide steps (many fall outside the
    dtype: then both refuse the whole tensor), and a base left as it was."""
    rng = np.random.default_rng(spread)
    info = np.iinfo(narrow)
    base = rng.integers(info.min, info.max, size=50_000, endpoint=True, dtype=np.int64).astype(narrow)
    base[:8] = [0, -1, info.min, info.max, info.min + 1, info.max - 1, 0x7F81, -0x7F7F]
    for coded in (_coded(rng, base, wide, spread), np.zeros(base.size, dtype=wide)):
        kept = base.copy()
        got = _codec.undo_ordinal_delta(base, coded.copy())
        with numpy_only():
            want = _codec.undo_ordinal_delta(base, coded.copy())
        assert np.array_equal(base, kept)
        assert (got is None) == (want is None)
        if want is not None:
            assert got is not None and got.dtype == want.dtype and np.array_equal(got, want)
    # one value past either end refuses the tensor, wherever it sits
    for at in (0, 777, base.size - 1):
        edge = base.copy()
        edge[at] = _codec.from_ordinal(np.array([info.max], dtype=narrow))[0]
        coded = np.zeros(base.size, dtype=wide)
        coded[at] = 2  # zigzag of +1
        assert _codec.undo_ordinal_delta(edge, coded) is None


@pytest.mark.parametrize(("narrow", "wide"), [(np.int16, np.uint32), (np.int32, np.uint64)])
def test_a_coded_value_that_wraps_int64_is_refused_as_numpy_refuses_it(narrow: type, wide: type, numpy_only) -> None:
    """The widest coded values (zigzag of +-2**63 for fp32, of +-2**31 for 16-bit) plus the base's ordinal wrap
    int64 or overflow the dtype: refused, never a value inside the dtype by wrap-around."""
    info = np.iinfo(narrow)
    base = np.array([info.max, info.min, 0, -1, 1], dtype=narrow)
    top = np.iinfo(wide).max
    for value in (top, top - 1, top >> 1, (top >> 1) + 1):
        coded = np.full(base.size, value, dtype=wide)
        with numpy_only():
            want = _codec.undo_ordinal_delta(base, coded.copy())
        assert want is None
        assert _codec.undo_ordinal_delta(base, coded.copy()) is None


def test_undo_refuses_mismatched_sizes_before_reading() -> None:
    with pytest.raises(ValueError, match="3 coded values for 2 base values"):
        _codec.undo_ordinal_delta(np.zeros(2, dtype=np.int16), np.zeros(3, dtype=np.uint32))


def test_undo_of_other_layouts_runs_the_numpy_code() -> None:
    """A big-endian base or a strided one still gives the definition's result (numpy's code, or a contiguous
    copy for the loop)."""
    rng = np.random.default_rng(3)
    base = rng.integers(-30000, 30000, size=1000).astype(np.int16)
    coded = _coded(rng, base, np.uint32, 50)
    want = _codec.undo_ordinal_delta(base, coded.copy())
    strided = np.repeat(base, 2)[::2]
    assert not strided.flags.c_contiguous
    got = _codec.undo_ordinal_delta(strided, coded.copy())
    assert got is not None and want is not None and np.array_equal(got, want)


@given(
    st.integers(1, 8),
    st.lists(st.integers(0, 2**64 - 1), max_size=64),
    st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_join_gaps_equals_numpy(planes: int, raw: list[int], readonly: bool) -> None:
    """Any gaps that fit their planes, from a read-only buffer (a decompressed frame's bytes) or a writable one:
    the loop's indices are numpy's, wrap-around included (the caller checks bounds and order)."""
    gaps = np.array([g & ((1 << (8 * planes)) - 1) for g in raw], dtype=np.uint64)
    buf = _codec.split_planes(gaps, planes)
    got = _codec.join_gaps(buf if readonly else bytearray(buf), gaps.size, planes)
    want = _codec.decode_gaps(_codec.join_planes(buf, gaps.size, planes, np.uint64))
    assert got.dtype == np.uint64 and np.array_equal(got, want)


@pytest.mark.parametrize("planes", range(1, 9))
def test_join_gaps_equals_numpy_for_every_plane_count_and_long_runs(planes: int) -> None:
    """One and two planes take their own branch-free loops, three to eight the general one: thousands of gaps
    each (hypothesis draws short lists), every element compared with numpy's."""
    rng = np.random.default_rng(planes)
    for n in (1, 7, 100, 5000):
        gaps = rng.integers(0, 1 << min(8 * planes, 63), size=n, dtype=np.uint64)
        gaps[rng.integers(0, n, size=max(1, n // 50))] = (1 << (8 * planes)) - 1  # the planes' largest gap
        buf = _codec.split_planes(gaps, planes)
        got = _codec.join_gaps(buf, n, planes)
        want = _codec.decode_gaps(_codec.join_planes(buf, n, planes, np.uint64))
        assert np.array_equal(got, want), (planes, n)


@pytest.mark.parametrize(("narrow", "wide"), [(np.int16, np.uint32), (np.int32, np.uint64)])
@pytest.mark.parametrize("planes", [1, 2, 3])
def test_undo_planes_equals_numpy_for_long_runs_and_a_late_overflow(narrow: type, wide: type, planes: int) -> None:
    """The one- and two-plane loops (no branch, vectorized) against the numpy code over thousands of values,
    every element compared; a value that overflows the dtype late in the run is refused by both."""
    rng = np.random.default_rng(planes)
    info = np.iinfo(narrow)
    n = 5000
    base = rng.integers(info.min, info.max, size=n, dtype=narrow)
    base[::97] = info.max  # the largest patterns: +1 in ordinal order wraps for some of them
    coded = rng.integers(0, 1 << (8 * planes), size=n).astype(wide)
    buf = _codec.split_planes(coded, planes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_kernels.KERNELS_ENV, "numpy")
        want = _codec.undo_ordinal_planes(base, buf, n, planes, wide)
    got = _codec.undo_ordinal_planes(base, buf, n, planes, wide)
    assert (got is None) == (want is None)
    if want is not None:
        assert got is not None and np.array_equal(got, want)
    fine = np.zeros(n, dtype=wide)
    fine[::3] = 2  # +1 in ordinal order: fine everywhere but at the largest pattern, placed late in the run
    safe = np.zeros(n, dtype=narrow)
    safe[4002] = info.max
    buf = _codec.split_planes(fine, planes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_kernels.KERNELS_ENV, "numpy")
        assert _codec.undo_ordinal_planes(safe, buf, n, planes, wide) is None
    assert _codec.undo_ordinal_planes(safe, buf, n, planes, wide) is None
    safe[4002] = info.max - 1  # one below: decoded, the same by both
    want = _codec.undo_ordinal_planes(safe, buf, n, planes, wide)
    assert want is not None and int(want[4002]) == info.max


def test_join_gaps_refuses_a_buffer_of_another_size() -> None:
    with pytest.raises(ValueError, match="5 bytes for 2 values of 3 planes"):
        _codec.join_gaps(bytes(5), 2, 3)


def _change(rng: np.random.Generator, numel: int, count: int, dtype: torch.dtype, spread: int):
    at = torch.from_numpy(np.sort(rng.choice(numel, size=count, replace=False)).astype(np.int64))
    old = torch.from_numpy(rng.integers(-(2**15), 2**15, size=count).astype(np.int16)).view(dtype)
    step = rng.integers(-spread, spread + 1, size=count).astype(np.int32)
    new = torch.from_numpy((old.view(torch.int16).numpy().astype(np.int32) + step).astype(np.int16)).view(dtype)
    return at, new, old


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("numel", "count", "spread"),
    [
        (50, 50, 3),  # every element
        (200_000, 4_000, 3),  # below the histogram's size: each word's weights read directly
        (3_000_000, _CHUNK - 1, 3),  # the last size read directly
        (3_000_000, _CHUNK, 3),  # the first size summed per row and chunk
        (5_000_000, 200_000, 3),  # rows within float64's exact range
        (5_000_000, 200_000, 40_000),  # rows beyond it: the integer product
    ],
)
def test_sketch_change_equals_numpy_on_both_paths(
    dtype: torch.dtype, numel: int, count: int, spread: int, numpy_only
) -> None:
    rng = np.random.default_rng(count + spread)
    at, new, old = _change(rng, numel, count, dtype, spread)
    got = sketch_change(new, old, at, increasing=True)
    with numpy_only():
        want = sketch_change(new, old, at, increasing=True)
        assert sketch_change(new, old, at) == want
    assert got == want == sub_sketches(sketch_at(new, at), sketch_at(old, at))
    # in any order, told so: the same sketch
    order = torch.from_numpy(rng.permutation(count))
    assert sketch_change(new[order], old[order], at[order]) == want


@pytest.mark.parametrize("count", [5_000, 100_000])
def test_a_caller_wrong_about_increasing_still_gets_the_sketch(count: int) -> None:
    """``increasing=True`` with unsorted indices (a caller's bug): the loop's chunk table is taken from the ends,
    an index outside it is caught before anything is written for it, and the sketch is computed again from the
    indices' min and max: right, not a write outside the table."""
    rng = np.random.default_rng(count)
    at, new, old = _change(rng, 40_000_000, count, torch.bfloat16, 3)
    want = sketch_change(new, old, at, increasing=True)
    swap = torch.from_numpy(rng.permutation(count))
    swap[[0, -1]] = swap[[-1, 0]].clone()
    at, new, old = at[swap], new[swap], old[swap]
    at[[0, -1]] = at[[-1, 0]].clone()  # ends reversed: the table would span nothing
    new[[0, -1]], old[[0, -1]] = new[[-1, 0]].clone(), old[[-1, 0]].clone()
    assert sketch_change(new, old, at, increasing=True) == want


def test_sketch_change_far_into_a_huge_tensor() -> None:
    """Indices past 2**32 words (the offset table's far chunks are computed, not tabled): the loop's sketch of
    the change is the definition's."""
    rng = np.random.default_rng(9)
    start = (1 << 40) + 12345
    for count in (3_000, 70_000):
        at = torch.from_numpy(start + np.sort(rng.choice(1 << 23, size=count, replace=False)).astype(np.int64))
        old = torch.from_numpy(rng.integers(-(2**15), 2**15, size=count).astype(np.int16)).view(torch.bfloat16)
        new = torch.from_numpy(rng.integers(-(2**15), 2**15, size=count).astype(np.int16)).view(torch.bfloat16)
        assert sketch_change(new, old, at, increasing=True) == sub_sketches(sketch_at(new, at), sketch_at(old, at))


def test_a_whole_tensor_moved_by_its_change_is_its_new_sketch() -> None:
    """End to end on one tensor of 2**21 elements at 2% changed, through the loop: served sketch + change =
    the new tensor's sketch, and a one-element slip in the new values is caught."""
    rng = np.random.default_rng(11)
    old_full = torch.from_numpy(rng.integers(-(2**15), 2**15, size=1 << 21).astype(np.int16)).view(torch.bfloat16)
    at = torch.from_numpy(np.flatnonzero(rng.random(1 << 21) < 0.02).astype(np.int64))
    new_full = old_full.clone()
    new_full.view(torch.int16)[at] += 1
    moved = add_sketches(sketch_range(old_full), sketch_change(new_full[at], old_full[at], at, increasing=True))
    assert moved == sketch_range(new_full)
    slipped = new_full[at].clone()
    slipped.view(torch.int16)[1234] += 1
    assert add_sketches(sketch_range(old_full), sketch_change(slipped, old_full[at], at, increasing=True)) != moved


@pytest.mark.parametrize(("narrow", "wide"), [(np.int16, np.uint32), (np.int32, np.uint64)])
@pytest.mark.parametrize("spread", [3, 300, 1 << 20, 1 << 40])
def test_undo_from_planes_equals_numpy(narrow: type, wide: type, spread: int, numpy_only) -> None:
    """The coded values joined from their planes as they are undone: numpy's result for every plane count that
    holds them (the widest one too), from a read-only frame or a writable one, and the same refusals."""
    rng = np.random.default_rng(spread % 1000)
    info = np.iinfo(narrow)
    base = rng.integers(info.min, info.max, size=30_000, endpoint=True, dtype=np.int64).astype(narrow)
    coded = (
        _coded(rng, base, wide, min(spread, 1 << 30))
        if spread < 1 << 31
        else rng.integers(0, np.iinfo(wide).max, size=base.size, dtype=wide, endpoint=True)
    )
    least = _codec.planes_needed(coded)
    for planes in range(least, np.dtype(wide).itemsize + 1):
        buf = _codec.split_planes(coded, planes)
        with numpy_only():
            want = _codec.undo_ordinal_planes(base, buf, base.size, planes, wide)
        assert want is None or np.array_equal(want, _codec.undo_ordinal_delta(base, coded.copy()))
        for given_buf in (buf, bytearray(buf)):
            got = _codec.undo_ordinal_planes(base, given_buf, base.size, planes, wide)
            assert (got is None) == (want is None), planes
            if want is not None:
                assert got is not None and got.dtype == want.dtype and np.array_equal(got, want)


def test_undo_from_planes_refuses_mismatched_sizes() -> None:
    with pytest.raises(ValueError, match="4 coded values for 3 base values"):
        _codec.undo_ordinal_planes(np.zeros(3, dtype=np.int16), bytes(8), 4, 2, np.uint32)
    with pytest.raises(ValueError, match="7 bytes for 3 values of 2 planes"):
        _codec.undo_ordinal_planes(np.zeros(3, dtype=np.int16), bytes(7), 3, 2, np.uint32)
