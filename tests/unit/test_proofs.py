"""Adding up the ranks' proofs: parts of a tensor held by different ranks, in any layout, prove it
against the published sketch; overlapping or missing parts are unproven, never proven."""

from __future__ import annotations

import torch

from deltasync.sketch import format_sketch, sketch_at, sketch_range
from deltasync.targets.base import combine_proofs

T = (torch.randn(6, 8, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
PUBLISHED = format_sketch(sketch_range(T))


def _rank(cols: slice, tensor: torch.Tensor = T, *, count_extra: int = 0) -> dict:
    """A rank holding a column slice (a row-parallel layout: one run per row)."""
    index = torch.arange(T.numel()).reshape(T.shape)[:, cols].reshape(-1)
    part = sketch_at(tensor.reshape(-1)[index], index)
    return {
        "ok": True,
        "version": 3,
        "parts": {"w": [["model.w", format_sketch(part), index.numel() + count_extra]]},
        "published": {"w": PUBLISHED},
        "numel": {"w": T.numel()},
    }


def test_column_slices_add_up_to_the_published_whole() -> None:
    assert combine_proofs([_rank(slice(0, 4)), _rank(slice(4, 8))]) == ([], [])
    assert combine_proofs([_rank(slice(0, 3)), _rank(slice(3, 8))]) == ([], [])  # uneven, any partition


def test_one_element_changed_on_one_rank_is_drift() -> None:
    drifted = T.clone()
    drifted.view(torch.int16)[2, 6] ^= 1
    assert combine_proofs([_rank(slice(0, 4)), _rank(slice(4, 8), drifted)]) == (["w"], [])


def test_overlapping_or_missing_parts_are_unproven_never_proven() -> None:
    assert combine_proofs([_rank(slice(0, 4)), _rank(slice(2, 8))]) == ([], ["w"])  # a replicated slice
    assert combine_proofs([_rank(slice(0, 4))]) == ([], ["w"])  # a rank missing


def test_a_rank_that_found_drift_itself_is_drift() -> None:
    rank = {"ok": False, "version": 3, "bad": ["model.norm.weight"], "parts": {}}
    assert combine_proofs([rank, _rank(slice(0, 4)), _rank(slice(4, 8))]) == (["model.norm.weight"], [])
