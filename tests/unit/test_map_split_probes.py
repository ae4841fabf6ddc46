"""Split probes: a group whose largest tensor is large (an embedding) is probed in two int16 passes instead of one
int32 pass, which halves the fresh memory a cold engine's map build touches. The map must be the one a single
pass learns, and a loader whose placement differs between the two passes (it depends on the values it is given,
and the halves' values differ) must never leave a wrong map: the scan refuses what the halves cannot join, the
real values catch the rest.

The period is cut from 32767 to a few elements here so that small tensors use both halves of the index, and the
scan chunk to a few elements so that stretches, copies and runs cross chunk edges."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from deltasync.vllm.patch_map import PatchMap, build_map, scan, tensors, values
from tests.unit.map_fakes import (
    LH,
    LLAMA_PARAMS,
    VPAD,
    Llama,
    Spec,
    V,
    assert_promise,
    assert_unchanged,
    float_truth,
    llama,
    llama_spec,
    make_model,
    snapshot,
    split_mode,
)


@pytest.mark.parametrize("period", [5, 7, 32767])
@pytest.mark.parametrize("numel", [1, 4, 5, 6, 34, 35, 36, 70_001])
def test_the_two_halves_name_every_element_once(monkeypatch: pytest.MonkeyPatch, period: int, numel: int) -> None:
    monkeypatch.setattr(scan, "PERIOD", period)
    low = scan.split_probe(numel, high=False).to(torch.int64)
    high = scan.split_probe(numel, high=True).to(torch.int64)
    assert low.numel() == high.numel() == numel
    assert bool((low >= 1).all()) and bool((low <= period).all()) and bool((high >= 1).all())
    assert torch.equal((high - 1) * period + low, torch.arange(1, numel + 1))


class Model(torch.nn.Module):
    """Loaders of every shape the scan must read: fused rows at an offset, rows reversed (no stretch of the
    probe), a vocabulary padded with zeros, a tied head, a tensor split over two parameters, and ``hook``, which
    may change what one checkpoint tensor's n-th load writes (1: the low pass, 2: the high pass, 3: the real
    values)."""

    def __init__(
        self, hook: Callable[[int, torch.Tensor], torch.Tensor | None] | None = None, target: str = "rev"
    ) -> None:
        super().__init__()
        self.fused = torch.nn.Parameter(torch.zeros(12, 6, dtype=torch.bfloat16), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(16, 6, dtype=torch.bfloat16), requires_grad=False)
        self.head = self.embed
        self.rev = torch.nn.Parameter(torch.zeros(9, 4, dtype=torch.bfloat16), requires_grad=False)
        self.left = torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.bfloat16), requires_grad=False)
        self.right = torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.bfloat16), requires_grad=False)
        self.hook, self.target = hook, target
        self.calls: dict[str, int] = {}

    def load_weights(self, weights: Any) -> None:
        for name, w in weights:
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.hook is not None and name == self.target:
                changed = self.hook(self.calls[name], w)
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


SPEC: Spec = {
    n: ("BF16", shape)
    for n, shape in [("a", (5, 6)), ("b", (5, 6)), ("embed", (13, 6)), ("rev", (9, 4)), ("wide", (5, 6))]
}


def _map(monkeypatch: pytest.MonkeyPatch, split: bool, model: Model | None = None) -> PatchMap:
    model = model or Model()
    pm = build_map(model, SPEC, model.load_weights, split_at=0 if split else 1 << 40)
    assert pm.split == ([""] if split else []), pm.split
    return pm


def _runs(pm: PatchMap) -> dict[str, list[tuple[str, list[int], list[int], list[int]]]]:
    return {
        n: [(r.param, r.ckpt_start.tolist(), r.param_start.tolist(), r.length.tolist()) for r in rs]
        for n, rs in sorted(pm.runs.items())
    }


@pytest.fixture
def fixed_real_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """One seed for the real values (new for each build otherwise): a loader here that swaps two elements in one
    pass is caught by the real values unless the two happen to be equal (~1/600 a pair); with this seed they are
    not, in every case below."""
    monkeypatch.setattr(values, "seed", lambda: 7)


@pytest.mark.parametrize("period", [9, 13, 32767])  # 9: 81 indices, the largest tensor has 78
@pytest.mark.parametrize("chunk", [1, 4, 7, 1 << 22])
def test_split_probes_learn_the_same_map_as_one_int32_pass(
    monkeypatch: pytest.MonkeyPatch, period: int, chunk: int
) -> None:
    monkeypatch.setattr(scan, "PERIOD", period)
    monkeypatch.setattr(tensors, "CHUNK", chunk)
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


def _swap(call: int, w: torch.Tensor) -> torch.Tensor:
    """Swaps two neighbours (flat 8 and 9, whose high halves differ at the period 9)."""
    out = w.clone().view(-1)
    out[8], out[9] = w.view(-1)[9], w.view(-1)[8]
    return out.view(w.shape)


_SCAN_REFUSES = (_negate, _nothing, _hole)
"""What the scan itself refuses, in either pass: values no half holds, places one pass wrote and the other not."""


@pytest.mark.usefixtures("fixed_real_values")
@pytest.mark.parametrize("period", [9, 32767])
@pytest.mark.parametrize("chunk", [3, 1 << 22])
@pytest.mark.parametrize("transform", [_shift_rows, _swap, *_SCAN_REFUSES])
@pytest.mark.parametrize("which", [1, 2], ids=["low-pass", "high-pass"])
@pytest.mark.parametrize("target", ["rev", "embed"])  # rows reversed (no stretch), or whole (stretches)
def test_a_loader_whose_placement_differs_between_the_two_passes_leaves_no_wrong_map(
    monkeypatch: pytest.MonkeyPatch, period: int, chunk: int, transform: Any, which: int, target: str
) -> None:
    """The two halves of an index come from two loader calls: a loader that writes one of them elsewhere (or not
    at all, or negated) would join into wrong indices. Each is refused by the scan (a place written in one pass
    only, a value no half holds, an element written twice) or by the real values, which the loader then writes
    where it really does."""
    monkeypatch.setattr(scan, "PERIOD", period)
    monkeypatch.setattr(tensors, "CHUNK", chunk)
    model = Model(lambda call, w: transform(call, w) if call == which else None, target)
    pm = _map(monkeypatch, split=True, model=model)
    honest = _runs(_map(monkeypatch, split=False))
    # at the full period a tensor of 36 or 78 elements has one high value: a high pass that moves its elements
    # moves ones among ones, and the map (from the low pass alone) is right
    if not (which == 2 and transform in (_shift_rows, _swap) and period >= 78):
        assert target in pm.unmapped and target not in pm.runs, (pm.unmapped, _runs(pm).get(target))
        if transform in _SCAN_REFUSES:
            assert "the loader transforms" in pm.unmapped[target] or "of a probe only" in pm.unmapped[target]
    else:
        assert _runs(pm)[target] == honest[target] and target not in pm.unmapped
    others = {n: rs for n, rs in honest.items() if n != target}
    assert {n: rs for n, rs in _runs(pm).items() if n != target} == others


@pytest.mark.usefixtures("fixed_real_values")
@pytest.mark.parametrize("period", [9, 32767])
def test_a_loader_that_replays_the_first_pass_in_the_second_leaves_no_wrong_map(
    monkeypatch: pytest.MonkeyPatch, period: int
) -> None:
    """A cache keyed by the name alone: the high pass gets the low pass's values back."""
    monkeypatch.setattr(scan, "PERIOD", period)
    first: list[torch.Tensor] = []

    def replay(call: int, w: torch.Tensor) -> torch.Tensor | None:
        if call == 1:
            first.append(w.clone())
        return first[0].clone() if call == 2 else None

    pm = _map(monkeypatch, split=True, model=Model(replay))
    assert "rev" in pm.unmapped and "rev" not in pm.runs, (pm.unmapped, _runs(pm).get("rev"))


@pytest.mark.usefixtures("fixed_real_values")
def test_a_place_written_only_by_the_high_pass_is_refused_by_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan, "PERIOD", 9)
    model = Model(lambda call, w: torch.zeros_like(w) if call == 1 else None)
    pm = _map(monkeypatch, split=True, model=model)
    assert "second half of a probe only" in pm.unmapped["rev"], pm.unmapped


def test_a_tensor_the_halves_cannot_index_is_probed_in_one_int32_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan, "PERIOD", 8)  # 64 indices: the 78 elements of "embed" need one pass of int32
    model = Model()
    pm = build_map(model, SPEC, model.load_weights, split_at=0)
    assert pm.split == [] and not pm.unmapped
    assert _runs(pm) == _runs(_map(monkeypatch, split=False))


# -- a vLLM-like Llama in split mode -----------------------------------------------------------------------------


@pytest.mark.parametrize(("period", "chunk"), [(61, 7), (9, 3), (15, 4), (32767, 1 << 22)])
def test_a_fused_and_padded_llama_in_split_mode_maps_like_the_float_load(
    monkeypatch: pytest.MonkeyPatch, period: int, chunk: int
) -> None:
    """Every tensor mapped, exactly where the loader puts real values; groups probed in split mode."""
    split_mode(monkeypatch, period, chunk)
    model, spec, pm, truth = llama(need_split=False)
    assert pm.split, "nothing was probed in split mode"
    assert not pm.unmapped, pm.unmapped
    assert_promise(pm, model, truth, spec)


class _HighPassSwapsRowsOnePeriodApart(Llama):
    """The high pass swaps the halves of the embedding's rows one period apart, so a chunk whose low values are a
    valid periodic stretch is found at another place (i + P)."""

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        if call == 2 and "embed" in name and w.dtype == torch.int16:
            flat = w.reshape(-1).clone()
            p = scan.PERIOD
            a, b = flat[0:p].clone(), flat[p : 2 * p].clone()
            flat[0:p], flat[p : 2 * p] = b, a
            w = flat.view(w.shape)
        super().put(name, w, call)


class _LowPassWritesElementsOnePeriodAway(Llama):
    """The low pass puts element i + P where i belongs (the same low value: indistinguishable in that pass)."""

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        if call == 1 and "lm_head" in name and w.dtype == torch.int16:
            flat = w.reshape(-1).clone()
            p = scan.PERIOD
            flat[0 : 2 * p] = flat[p : 3 * p].clone()
            w = flat.view(w.shape)
        super().put(name, w, call)


class _OneElementTwiceInTheLowPass(Llama):
    """The low pass writes element 0 at its place and into a padding row; the high pass writes element 0's high at
    its place and another element's high into that padding row: the joined index there is a third element."""

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        super().put(name, w, call)
        if "embed" in name and w.dtype == torch.int16:
            p = self.m.get_parameter("model.embed_tokens.weight").data.view(-1)
            flat = w.reshape(-1)
            p[V * LH + 1] = flat[0] if call == 1 else flat[100]


class _FlipsItsLowProbeInPlace(Llama):
    """The low pass writes a reversed probe into the parameter, then reverses the probe it was given in place (a
    compare against that probe would agree); the high pass is straight."""

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        if call == 1 and "norm" in name and w.dtype == torch.int16:
            self.m.get_parameter("model.norm.weight").data.copy_(w.flip(0))
            w.copy_(w.flip(0).clone())
            return
        super().put(name, w, call)


class _WritesTheLowProbeIntoPaddingInTheHighPass(Llama):
    """The high pass writes the high probe at the right place and the (kept) low probe into padding rows."""

    kept: torch.Tensor | None = None

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        super().put(name, w, call)
        if "lm_head" in name and call == 1 and w.dtype == torch.int16:
            self.kept = w
        if "lm_head" in name and call == 2 and self.kept is not None and w.dtype == torch.int16:
            self.m.get_parameter("lm_head.weight").data[V:].copy_(self.kept[: VPAD - V])


class _HalfAChunkInOnePassOnly(Llama):
    """Half a chunk of padding written in the low pass only, another half-chunk in the high pass only."""

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        super().put(name, w, call)
        if "embed" in name and w.dtype == torch.int16:
            p = self.m.get_parameter("model.embed_tokens.weight").data.view(-1)
            at = V * LH + (0 if call == 1 else 3)
            p[at : at + 3] = w.reshape(-1)[at - V * LH : at - V * LH + 3]


class _CachesByDataPointer(Llama):
    """Caches its result by the data pointer of the tensor it is given (keeping nothing): the high probe is made
    right after the low one is freed, so it may get the same address and the cache replays the low pass."""

    cache: dict[tuple[int, str], torch.Tensor]

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        cache = self.__dict__.setdefault("cache", {})
        key = (w.data_ptr(), name)
        if w.dtype == torch.int16 and key in cache:
            w = cache[key]
        elif w.dtype == torch.int16:
            cache[key] = w.clone()
        super().put(name, w, call)


@pytest.mark.parametrize(
    ("loader", "period", "chunk", "left_out"),
    [
        (_HighPassSwapsRowsOnePeriodApart, 15, 3, None),
        (_LowPassWritesElementsOnePeriodAway, 15, 3, None),
        (_OneElementTwiceInTheLowPass, 15, 3, None),
        (_FlipsItsLowProbeInPlace, 15, 3, None),
        (_WritesTheLowProbeIntoPaddingInTheHighPass, 15, 3, "lm_head.weight"),
        (_HalfAChunkInOnePassOnly, 15, 7, "model.embed_tokens.weight"),
        (_CachesByDataPointer, 61, 7, None),
    ],
)
def test_a_llama_whose_loader_places_the_two_passes_differently_is_mapped_exactly_or_left_out(
    monkeypatch: pytest.MonkeyPatch, loader: type[Llama], period: int, chunk: int, left_out: str | None
) -> None:
    """Every tensor is left out, or mapped exactly where the loader puts real values (which it writes straight)."""
    split_mode(monkeypatch, period, chunk)
    model, spec, pm, truth = llama(loader)
    if left_out is not None:
        assert left_out in pm.unmapped
    assert_promise(pm, model, truth, spec)


@pytest.mark.parametrize("extra", [0, 1])
def test_exactly_p_squared_elements_landing_transposed(monkeypatch: pytest.MonkeyPatch, extra: int) -> None:
    """A tensor of exactly P * P elements (the last high half is P), and one more (one int32 pass), landing
    transposed (a permutation every element of which has its own high and low pair)."""
    split_mode(monkeypatch, 9, 4)
    n = 81 + extra
    params = {"model.layers.0.w.weight": ((n, 1), torch.bfloat16), "model.layers.0.pad.weight": ((5,), torch.bfloat16)}
    spec: Spec = {"model.layers.0.w.weight": ("BF16", (1, n))}

    def loader(model: torch.nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]]], None]:
        def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, w in weights:
                model.get_parameter(name).data.copy_(w.t())

        return load

    model = make_model(params)
    before = snapshot(model)
    pm = build_map(model, spec, loader(model))
    assert_unchanged(model, before)
    assert ("layers.0" in pm.split) == (extra == 0)
    assert not pm.unmapped
    assert_promise(pm, model, float_truth(lambda: make_model(params), loader, spec), spec)


def _tied() -> torch.nn.Module:
    m = make_model(LLAMA_PARAMS)
    m.lm_head.weight = m.model.embed_tokens.weight  # type: ignore[union-attr]
    return m


def _fp32_norm() -> torch.nn.Module:
    return make_model({**LLAMA_PARAMS, "model.norm.weight": ((LH,), torch.float32)})


@pytest.mark.parametrize("make", [_tied, _fp32_norm], ids=["tied-embedding", "fp32-norm-upcast"])
def test_a_tied_embedding_and_an_upcast_norm_in_split_mode(monkeypatch: pytest.MonkeyPatch, make) -> None:
    """``lm_head`` tied to the embedding (one parameter under two names, both in the checkpoint), and an fp32 norm
    in a bf16 group loaded by an upcast (``copy_`` converts): mapped exactly or left out."""
    split_mode(monkeypatch)
    model = make()
    spec = llama_spec()
    before = snapshot(model)
    pm = build_map(model, spec, Llama(model))
    assert_unchanged(model, before)
    assert_promise(pm, model, float_truth(make, Llama, spec), spec)
