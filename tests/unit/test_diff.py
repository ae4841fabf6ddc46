from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync import compute_delta, tensor_checksum
from tests.conftest import assert_bit_equal, bits


def _apply(prev: dict[str, torch.Tensor], delta: dict) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in prev.items()}
    for name, d in delta.items():
        if d.indices is None:
            out[name].copy_(d.values)
        else:
            out[name].view(-1)[d.indices] = d.values
    return out


def test_bitwise_changes_count_signed_zero_and_nan_payloads() -> None:
    prev = {"w": torch.tensor([0.0, 1.0, float("nan"), 2.0, float("nan")], dtype=torch.bfloat16)}
    curr = {"w": prev["w"].clone()}
    curr["w"][0] = -0.0  # equal as floats, different bits
    b = bits(curr["w"])
    b[2] = b[2] ^ 1  # another NaN payload
    d = compute_delta(prev, curr)
    assert d["w"].indices.tolist() == [0, 2]
    assert torch.equal(bits(d["w"].values), bits(curr["w"])[[0, 2]])
    assert torch.equal(bits(d["w"].base_values), bits(prev["w"])[[0, 2]])
    # an unchanged NaN (index 4) is not a change, though NaN != NaN
    assert 4 not in d["w"].indices.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_over_chunks_and_threads(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    prev = {
        "a": torch.randn(37, 41, generator=g).to(dtype),
        "b": torch.randn(5, generator=g).to(dtype),
        "s": torch.tensor(3.0, dtype=dtype),
    }
    curr = {k: v.clone() for k, v in prev.items()}
    curr["a"].view(-1)[torch.randperm(37 * 41, generator=g)[:100]] += 1
    curr["s"].fill_(4.0)
    for chunk in (1, 7, 1 << 20):
        for workers in (1, 2):
            d = compute_delta(prev, curr, chunk_elems=chunk, max_workers=workers)
            assert set(d) == {"a", "s"}
            assert d["a"].indices.numel() == 100
            assert torch.all(d["a"].indices[1:] > d["a"].indices[:-1])
            assert_bit_equal(_apply(prev, d), curr)


def test_update_prev_turns_prev_into_curr_and_dense_when_most_changed() -> None:
    prev = {"w": torch.zeros(10, dtype=torch.bfloat16), "v": torch.zeros(100, dtype=torch.bfloat16)}
    curr = {"w": torch.arange(10, dtype=torch.bfloat16), "v": torch.zeros(100, dtype=torch.bfloat16)}
    curr["v"][3] = 1
    snapshot = {k: t.clone() for k, t in prev.items()}
    d = compute_delta(prev, curr, update_prev=True, dense_fraction=0.5)
    assert_bit_equal(prev, curr)
    assert d["w"].indices is None and d["w"].values.shape == (10,)
    assert torch.equal(bits(d["w"].base_values), bits(snapshot["w"]))
    assert d["v"].indices.tolist() == [3]
    assert compute_delta(prev, curr) == {}


def test_mismatches_name_the_tensor() -> None:
    a = {"x": torch.zeros(3, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"tensor 'x': shape changed from \[3\] to \[4\]"):
        compute_delta(a, {"x": torch.zeros(4, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"tensor 'x': dtype changed from torch.bfloat16 to torch.float32"):
        compute_delta(a, {"x": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"missing from the new one \['x'\], new names \['y'\]"):
        compute_delta(a, {"y": torch.zeros(3, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="update_prev=True needs a contiguous"):
        compute_delta({"x": torch.zeros(3, 2).t()}, {"x": torch.zeros(2, 3)}, update_prev=True)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 300),
    changes=st.lists(st.integers(0, 299), max_size=300),
    chunk=st.integers(1, 64),
)
def test_property_round_trip(n: int, changes: list[int], chunk: int) -> None:
    prev = {"t": torch.arange(n, dtype=torch.float32).to(torch.bfloat16)}
    curr = {"t": prev["t"].clone()}
    for i in changes:
        if i < n:
            curr["t"][i] = curr["t"][i] + 1000
    d = compute_delta(prev, curr, chunk_elems=chunk)
    assert_bit_equal(_apply(prev, d), curr)


def _both_ways(prev: dict[str, torch.Tensor], curr: dict[str, torch.Tensor], **kw: object) -> tuple[dict, dict]:
    """compute_delta by the compiled scan and by the numpy code (``use_compiled(False)``), on copies of ``prev``
    (``update_prev`` writes it)."""
    from deltasync._kernels import use_compiled

    fast_prev, slow_prev = ({k: v.clone() for k, v in prev.items()} for _ in range(2))
    fast = compute_delta(fast_prev, curr, **kw)  # type: ignore[arg-type]
    use_compiled(False)
    try:
        slow = compute_delta(slow_prev, curr, **kw)  # type: ignore[arg-type]
    finally:
        use_compiled(True)
    if kw.get("update_prev"):
        assert_bit_equal(fast_prev, curr)
        assert_bit_equal(slow_prev, curr)
    return fast, slow


def _same(fast: dict, slow: dict) -> None:
    assert list(fast) == list(slow)
    for name, d in slow.items():
        f = fast[name]
        assert (f.indices is None) == (d.indices is None), name
        if d.indices is not None:
            assert torch.equal(f.indices, d.indices), name
        assert torch.equal(bits(f.values), bits(d.values)), name
        assert torch.equal(bits(f.base_values), bits(d.base_values)), name


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 2000),
    density=st.sampled_from([0.0, 0.001, 0.02, 0.3, 0.9, 1.0]),
    offsets=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    update=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_compiled_scan_is_the_numpy_diff_bit_for_bit(
    n: int, density: float, offsets: tuple[int, int], dtype: torch.dtype, update: bool, seed: int
) -> None:
    """Any length (the 8-byte words' head and tail), any alignment of either tensor (offsets that do not line up
    fall back to numpy), every density (dense entries too), signed zeros and NaN payloads, with and without
    ``update_prev``: the compiled scan gives the numpy code's delta, and a digest of exactly the changed tensors."""
    g = torch.Generator().manual_seed(seed)
    width = torch.int16 if dtype != torch.float32 else torch.int32
    raw = torch.randint(-(2**15), 2**15, (n + 8,), generator=g, dtype=torch.int32).to(width)
    base = raw.clone()
    changed = torch.rand(n + 8, generator=g) < density
    raw[changed] ^= torch.randint(1, 2**15, (int(changed.sum()),), generator=g, dtype=torch.int32).to(width)
    prev_store, curr_store = torch.empty(n + 8, dtype=width), torch.empty(n + 8, dtype=width)
    prev_store.copy_(base)
    curr_store.copy_(raw)
    p0, c0 = offsets
    prev = {"t": prev_store[p0 : p0 + n].view(dtype), "same": torch.zeros(3, dtype=dtype)}
    curr = {"t": curr_store[c0 : c0 + n].view(dtype), "same": torch.zeros(3, dtype=dtype)}
    prev["t"].view(width).copy_(base[c0 : c0 + n])  # prev holds base's elements, at its own alignment
    fast, slow = _both_ways(prev, curr, update_prev=update, checksums=True)
    _same(fast, slow)
    for name, d in fast.items():
        assert d.checksum == tensor_checksum(curr[name]), name
    assert "same" not in fast


def test_compiled_scan_over_threads_and_a_tensor_split_in_tasks() -> None:
    """A tensor larger than one task of the scan (2**23 elements) is split, its parts joined in order; with
    ``checksums`` it is read in one task, and its digest is the whole tensor's."""
    g = torch.Generator().manual_seed(3)
    n = (1 << 23) + 12345
    prev = {
        "big": torch.randn(n, generator=g).to(torch.bfloat16),
        "small": torch.randn(7, generator=g).to(torch.bfloat16),
    }
    curr = {k: v.clone() for k, v in prev.items()}
    at = torch.randint(0, n, (5000,), generator=g)
    curr["big"][at] = curr["big"][at] + 1
    curr["big"][-1] = -curr["big"][-1]
    curr["small"][0] = 5
    for workers in (1, 2):
        fast, slow = _both_ways(prev, curr, max_workers=workers)
        _same(fast, slow)
        assert fast["big"].checksum is None
    fast = compute_delta(prev, curr, checksums=True)
    assert fast["big"].checksum == tensor_checksum(curr["big"])
    assert fast["small"].checksum == tensor_checksum(curr["small"])


def test_compiled_scan_tasks_start_on_a_word_of_a_misaligned_tensor() -> None:
    """A tensor whose data starts off an 8-byte boundary, split into tasks of an odd size: each task after the
    first starts on a word, so no element is compared by two tasks (no repeated index) or by none."""
    g = torch.Generator().manual_seed(5)
    n = (1 << 23) + 1001
    store = torch.randn(n + 1, generator=g).to(torch.bfloat16)
    prev = {"t": store[1:]}  # 2 bytes past the storage's start
    curr = {"t": prev["t"].clone()}
    at = torch.randint(0, n, (20_000,), generator=g)
    curr["t"][at] = curr["t"][at] * 2 + 1
    fast, slow = _both_ways(prev, curr, chunk_elems=(1 << 23) + 3)
    _same(fast, slow)
    assert torch.all(fast["t"].indices[1:] > fast["t"].indices[:-1])
