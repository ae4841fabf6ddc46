from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync import compute_delta
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
