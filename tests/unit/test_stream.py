"""The light update stream (``UlpStream``) the apply benchmark runs at 70B layer shapes: each step moves about the
fraction it is given of every tensor's elements by exactly one unit in the last place, never into a NaN or inf,
and the same seed gives the same stream."""

from __future__ import annotations

import pytest
import torch

from deltasync.testing.stream import UlpStream


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.int16).to(torch.int32)


def test_each_step_moves_about_the_fraction_by_one_unit() -> None:
    stream = UlpStream.from_shapes({"w": (256, 512), "norm": (512,)}, changed=0.05, seed=3)
    for _ in range(3):
        before = stream.bf16()
        after = stream.step()
        for name, t in after.items():
            moved = _bits(t) - _bits(before[name])
            changed = moved != 0
            # drawn with replacement: a few positions are drawn twice and move once
            assert 0.045 < changed.float().mean().item() <= 0.05, name
            assert set(moved[changed].abs().unique().tolist()) == {1}, name
            assert torch.isfinite(t).all(), name


def test_zeros_only_move_up_and_never_become_nan() -> None:
    zeros = torch.tensor([0.0, -0.0] * 4096, dtype=torch.bfloat16)
    stream = UlpStream({"z": zeros}, changed=1.0, seed=0)
    for _ in range(40):
        assert torch.isfinite(stream.step()["z"]).all()


def test_same_seed_same_stream_and_step_returns_its_own_tensors() -> None:
    a = UlpStream.from_shapes({"w": (64, 64)}, changed=0.1, seed=7)
    b = UlpStream.from_shapes({"w": (64, 64)}, changed=0.1, seed=7)
    c = UlpStream.from_shapes({"w": (64, 64)}, changed=0.1, seed=8)
    wa, wb, wc = a.step()["w"], b.step()["w"], c.step()["w"]
    assert torch.equal(_bits(wa), _bits(wb))
    assert not torch.equal(_bits(wa), _bits(wc))
    assert a.step()["w"] is wa  # stepped in place: the caller keeps a copy where it needs the old values


def test_refuses_what_it_cannot_step() -> None:
    with pytest.raises(ValueError, match=r"\['w'\] are not bf16"):
        UlpStream({"w": torch.zeros(4)})
    with pytest.raises(ValueError, match="fraction in"):
        UlpStream({"w": torch.zeros(4, dtype=torch.bfloat16)}, changed=0.0)
