"""Reading where a probe landed: the scan of a probed parameter gives the same runs however it is chunked (an
embedding has 10^8 elements), orders them by checkpoint index, refuses a value that is no element index and an
element written twice; and the fast compare it uses (libc ``memcmp``) agrees with ``torch.equal``."""

from __future__ import annotations

import pytest
import torch

from deltasync.vllm.patch_map import scan, tensors
from deltasync.vllm.patch_map.tensors import bits, same


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 22])
@pytest.mark.parametrize("fast", [False, True], ids=["scan", "probe-compare"])
def test_runs_are_the_same_whatever_the_scan_chunk(monkeypatch: pytest.MonkeyPatch, chunk: int, fast: bool) -> None:
    """Runs crossing a chunk edge are joined, runs are ordered by checkpoint index, and an element landing twice
    is caught. With the probe given, a chunk that is one stretch of it is taken in one compare: the same runs."""
    monkeypatch.setattr(tensors, "CHUNK", chunk)
    probe = torch.arange(1, 31, dtype=torch.int32) if fast else None
    flat = torch.zeros(40, dtype=torch.int32)
    flat[2:12] = torch.arange(21, 31)  # checkpoint 20..29 at 2..11
    flat[12:20] = torch.arange(1, 9)  # checkpoint 0..7 at 12..19 (adjacent in the parameter, not in the ckpt)
    flat[25:35] = torch.arange(9, 19)  # checkpoint 8..17 at 25..34
    r = scan.runs_of("p", flat, 30, probe)
    assert r is not None
    assert r.ckpt_start.tolist() == [0, 8, 20] and r.param_start.tolist() == [12, 25, 2]
    assert r.length.tolist() == [8, 10, 10]
    whole = torch.arange(1, 31, dtype=torch.int32)  # one tensor written whole: one run, however chunked
    r = scan.runs_of("p", whole, 30, probe)
    assert r is not None and (r.ckpt_start.tolist(), r.param_start.tolist(), r.length.tolist()) == ([0], [0], [30])
    flat[36] = 5  # checkpoint element 4 lands a second time
    with pytest.raises(ValueError, match="written twice"):
        scan.runs_of("p", flat, 30, probe)
    flat[36] = 31  # no element of a 30-element tensor
    with pytest.raises(ValueError, match="no element index"):
        scan.runs_of("p", flat, 30, probe)
    assert scan.runs_of("p", torch.zeros(9, dtype=torch.int32), 30, probe) is None
    twice = torch.cat([whole, whole])  # the whole tensor twice (chunks that each match the probe)
    with pytest.raises(ValueError, match="written twice"):
        scan.runs_of("p", twice, 30, probe)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool])
def test_the_fast_compare_agrees_with_torch_equal_on_every_slice(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, 2 if dtype == torch.bool else 100, (4099,), generator=g).to(dtype)
    b = a.clone()
    # one differing element at each edge and in the middle of the compared slices (a wrong length or a wrong
    # storage offset in the memcmp misses one of them)
    for at in (0, 1, 2048, 4097, 4098):
        c = b.clone()
        c[at] = ~c[at] if dtype == torch.bool else c[at] + 1
        for lo, hi in ((0, 4099), (at, at + 1), (max(at - 5, 0), at), (at, 4099), (1, 4098)):
            assert same(a[lo:hi], c[lo:hi]) == torch.equal(a[lo:hi], c[lo:hi]), (at, lo, hi)
    assert same(a, b) and same(a[3:3], b[5:5])
    assert not same(a[:10], b[:11])  # shapes differ: never equal, even where the shorter is a prefix
    assert not same(a.view(-1, 1)[:10], a[:10])  # one shape each, same bytes


def test_the_fast_compare_compares_bits_and_falls_back_where_bytes_and_values_differ() -> None:
    x = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    y = torch.tensor([-0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    assert not same(x, y)  # floats: torch.equal's values (nan != nan, 0 == -0)
    assert not same(bits(x), bits(y))  # their bits: -0 is not 0
    assert same(bits(x), bits(x.clone()))  # the same NaN bits
    # two dtypes: torch.equal's values, not bytes (an int16 -1 and an int32 -1 are one value)
    assert same(torch.tensor([-1], dtype=torch.int16), torch.tensor([-1], dtype=torch.int32))
    strided = torch.arange(20, dtype=torch.int32)[::2]
    assert same(strided, torch.arange(0, 20, 2, dtype=torch.int32))  # not contiguous: torch.equal
