"""Split probes (issue 22): a group whose largest tensor is large (an embedding) is probed in two int16 passes
instead of one int32 pass, which halves the fresh memory a cold engine's map build touches. The map must be the
one a single pass learns, and a loader that behaves differently in the two passes must never leave a wrong map.

The period is cut from 32767 to a few elements here so that small tensors use both halves of the index, and the
scan chunk to a few elements so that stretches, copies and runs cross chunk edges."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from deltasync.vllm import patch_map
from deltasync.vllm.patch_map import SPLIT_AT_ENV, build_map


@pytest.mark.parametrize("period", [5, 7, 32767])
@pytest.mark.parametrize("numel", [1, 4, 5, 6, 34, 35, 36, 70_001])
def test_the_two_halves_name_every_element_once(monkeypatch: pytest.MonkeyPatch, period: int, numel: int) -> None:
    monkeypatch.setattr(patch_map, "_PERIOD", period)
    low = patch_map._split_probe(numel, high=False).to(torch.int64)
    high = patch_map._split_probe(numel, high=True).to(torch.int64)
    assert low.dtype == high.dtype == torch.int64 and low.numel() == high.numel() == numel
    assert bool((low >= 1).all()) and bool((low <= period).all()) and bool((high >= 1).all())
    assert torch.equal((high - 1) * period + low, torch.arange(1, numel + 1))


class Model(torch.nn.Module):
    """Loaders of every shape the scan must read: fused rows at an offset, rows reversed (no stretch of the
    probe), a vocabulary padded with zeros, a tied head, a tensor split over two parameters, and ``hostile``, a
    hook that may change what one checkpoint tensor's n-th load writes (1: the low pass, 2: the high pass,
    3: the real values)."""

    def __init__(
        self, hostile: Callable[[int, torch.Tensor], torch.Tensor | None] | None = None, target: str = "rev"
    ) -> None:
        super().__init__()
        bf16 = {"dtype": torch.bfloat16}
        self.fused = torch.nn.Parameter(torch.zeros(12, 6, **bf16), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(16, 6, **bf16), requires_grad=False)
        self.head = self.embed
        self.rev = torch.nn.Parameter(torch.zeros(9, 4, **bf16), requires_grad=False)
        self.left = torch.nn.Parameter(torch.zeros(5, 3, **bf16), requires_grad=False)
        self.right = torch.nn.Parameter(torch.zeros(5, 3, **bf16), requires_grad=False)
        self.hostile, self.target = hostile, target
        self.calls: dict[str, int] = {}

    def load_weights(self, weights: Any) -> None:
        for name, w in weights:
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.hostile is not None and name == self.target:
                changed = self.hostile(self.calls[name], w)
                if changed is not None:
                    w = changed
            if name in ("a", "b"):
                row = {"a": 1, "b": 6}[name]
                self.fused.data[row : row + 5].copy_(w)
            elif name == "embed":
                self.embed.data[: w.shape[0]].copy_(w)
                self.embed.data[w.shape[0] :].fill_(0)
            elif name == "rev":
                self.rev.data.copy_(w.flip(0))
            elif name == "wide":
                self.left.data.copy_(w[:, :3])
                self.right.data.copy_(w[:, 3:])


SPEC = {
    "a": ("BF16", (5, 6)),
    "b": ("BF16", (5, 6)),
    "embed": ("BF16", (13, 6)),
    "rev": ("BF16", (9, 4)),
    "wide": ("BF16", (5, 6)),
}


def _map(monkeypatch: pytest.MonkeyPatch, split: bool, model: Model | None = None) -> patch_map.PatchMap:
    monkeypatch.setenv(SPLIT_AT_ENV, "0" if split else str(1 << 40))
    model = model or Model()
    pm = build_map(model, SPEC, model.load_weights)
    assert pm.split == ([""] if split else []), pm.split
    return pm


def _runs(pm: patch_map.PatchMap) -> dict[str, list[tuple[str, list[int], list[int], list[int]]]]:
    return {
        n: [(r.param, r.ckpt_start.tolist(), r.param_start.tolist(), r.length.tolist()) for r in rs]
        for n, rs in sorted(pm.runs.items())
    }


@pytest.fixture(autouse=True)
def _fixed_real_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """One seed for the real values (new for each build otherwise): a loader here that swaps two elements in one
    pass is caught by the real values unless the two happen to be equal (~1/600 a pair); with this seed they are
    not, in every case below."""
    monkeypatch.setattr(patch_map, "_seed", lambda: 7)


@pytest.mark.parametrize("period", [9, 13, 32767])  # 9: 81 indices, the largest tensor has 78
@pytest.mark.parametrize("chunk", [1, 4, 7, 1 << 22])
def test_split_probes_learn_the_same_map_as_one_int32_pass(
    monkeypatch: pytest.MonkeyPatch, period: int, chunk: int
) -> None:
    monkeypatch.setattr(patch_map, "_PERIOD", period)
    monkeypatch.setattr(patch_map, "_CHUNK", chunk)
    whole = _map(monkeypatch, split=False)
    split = _map(monkeypatch, split=True)
    assert not whole.unmapped and not split.unmapped
    assert _runs(split) == _runs(whole)
    assert [r.length.tolist() for r in split.runs["rev"]] == [[4] * 9]  # reversed rows: one run per row
    assert [r.param for r in split.runs["wide"]] == ["left", "right"]


def test_split_probes_leave_the_live_parameters_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Model()
    g = torch.Generator().manual_seed(3)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _map(monkeypatch, split=True, model=model)
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n


def _shift_rows(call: int, w: torch.Tensor) -> torch.Tensor:
    return w.roll(1, 0)


def _negate(call: int, w: torch.Tensor) -> torch.Tensor:
    return -w


def _nothing(call: int, w: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(w)


def _hole(call: int, w: torch.Tensor) -> torch.Tensor:
    out = w.clone()
    out.view(-1)[5] = 0  # one place written in the other pass only
    return out


class _Swap:
    """Swaps two neighbours (flat 8 and 9, whose high halves differ at the period 9) in one pass only."""

    def __call__(self, call: int, w: torch.Tensor) -> torch.Tensor:
        out = w.clone().view(-1)
        out[8], out[9] = w.view(-1)[9], w.view(-1)[8]
        return out.view(w.shape)


_SCAN_REFUSES = (_negate, _nothing, _hole)
"""What the scan itself refuses, in either pass: values no half holds, places one pass wrote and the other not."""


@pytest.mark.parametrize("period", [9, 32767])
@pytest.mark.parametrize("chunk", [3, 1 << 22])
@pytest.mark.parametrize("transform", [_shift_rows, _Swap, *_SCAN_REFUSES])
@pytest.mark.parametrize("which", [1, 2], ids=["low-pass", "high-pass"])
@pytest.mark.parametrize("target", ["rev", "embed"])  # rows reversed (no stretch), or whole (stretches)
def test_a_loader_that_differs_between_the_two_passes_leaves_no_wrong_map(
    monkeypatch: pytest.MonkeyPatch, period: int, chunk: int, transform: Any, which: int, target: str
) -> None:
    """The two halves of an index come from two loader calls: a loader that writes one of them elsewhere (or not
    at all, or negated) would join into wrong indices. Each is refused by the scan (a place written in one pass
    only, a value no half holds, an element written twice) or by the real values, which the loader then writes
    where it really does."""
    monkeypatch.setattr(patch_map, "_PERIOD", period)
    monkeypatch.setattr(patch_map, "_CHUNK", chunk)
    hook = transform() if isinstance(transform, type) else transform
    model = Model(lambda call, w: hook(call, w) if call == which else None, target)
    pm = _map(monkeypatch, split=True, model=model)
    honest = _runs(_map(monkeypatch, split=False))
    # at the full period a tensor of 36 or 78 elements has one high value: a high pass that moves its elements
    # moves ones among ones, and the map (from the low pass alone) is right
    if not (which == 2 and transform in (_shift_rows, _Swap) and period >= 78):
        assert target in pm.unmapped and target not in pm.runs, (pm.unmapped, _runs(pm).get(target))
        if transform in _SCAN_REFUSES:
            assert "the loader transforms" in pm.unmapped[target] or "of a probe only" in pm.unmapped[target]
    else:
        assert _runs(pm)[target] == honest[target] and target not in pm.unmapped
    others = {n: rs for n, rs in honest.items() if n != target}
    assert {n: rs for n, rs in _runs(pm).items() if n != target} == others


@pytest.mark.parametrize("period", [9, 32767])
def test_a_loader_that_replays_the_first_pass_in_the_second_leaves_no_wrong_map(
    monkeypatch: pytest.MonkeyPatch, period: int
) -> None:
    """A cache keyed by the name alone: the high pass gets the low pass's values back."""
    monkeypatch.setattr(patch_map, "_PERIOD", period)
    first: list[torch.Tensor] = []

    def replay(call: int, w: torch.Tensor) -> torch.Tensor | None:
        if call == 1:
            first.append(w.clone())
        return first[0].clone() if call == 2 else None

    pm = _map(monkeypatch, split=True, model=Model(replay))
    assert "rev" in pm.unmapped and "rev" not in pm.runs, (pm.unmapped, _runs(pm).get("rev"))


def test_a_place_written_only_by_the_high_pass_is_refused_by_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patch_map, "_PERIOD", 9)
    model = Model(lambda call, w: torch.zeros_like(w) if call == 1 else None)
    pm = _map(monkeypatch, split=True, model=model)
    assert "second half of a probe only" in pm.unmapped["rev"], pm.unmapped


def test_a_tensor_the_halves_cannot_index_is_probed_in_one_int32_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patch_map, "_PERIOD", 8)  # 64 indices: the 78 elements of "embed" need one pass of int32
    monkeypatch.setenv(SPLIT_AT_ENV, "0")
    model = Model()
    pm = build_map(model, SPEC, model.load_weights)
    assert pm.split == [] and not pm.unmapped
    assert _runs(pm) == _runs(_map(monkeypatch, split=False))


def test_a_bad_split_threshold_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPLIT_AT_ENV, "lots")
    model = Model()
    with pytest.raises(ValueError, match=f"{SPLIT_AT_ENV}='lots': expected a number of elements"):
        build_map(model, SPEC, model.load_weights)
