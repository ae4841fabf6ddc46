"""Loaders that hold on to what they are given: a staging pool that zeroes the tensors of its previous call, a
cache keyed by data pointer or storage (as a loader deduplicating tied checkpoint tensors would). The build hands
every load new tensors in new memory and checks that the values it compares with are still what it drew, so such
a loader is never checked against zeros or its own stale result: what is mapped is exact. Toy loaders, torch
only."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest
import torch

from deltasync.vllm.patch_map import build_map, values
from tests.unit.map_fakes import H, QKVStack, Spec, dense, map_and_rewrite, param, weights

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16)


class RecyclingClamp(torch.nn.Module):
    """A staging pool: at each call the loader first zeroes the tensors of its previous call, then copies the new
    ones in, clamping the tensors ``clamps`` names into fp16 range. In ``layers`` repeating layers (then layer 1
    clamps, layer 0 does not), or as ``embed`` and ``head`` (``head`` clamps)."""

    def __init__(self, layers: int = 0) -> None:
        super().__init__()
        if layers:
            self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(layers)])
            for layer in self.layers:
                layer.w = param(8, 16)
        else:
            self.embed, self.head = param(8, 16), param(8, 16)
        self.spent: list[torch.Tensor] = []

    def clamps(self, name: str) -> bool:
        return name in ("head", "layers.1.w")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(weights)
        for t in self.spent:
            t.zero_()  # the previous call's buffers are free again
        for name, t in items:
            src = t.clamp(-65504, 65504) if self.clamps(name) and t.is_floating_point() else t
            self.get_parameter(name).data.copy_(src)
        self.spent = [t for _, t in items]


def test_a_loader_that_zeroes_the_tensors_it_was_given_earlier_is_never_checked_with_zeros() -> None:
    """``head``'s real values are in new memory, never in a probe the loader kept and zeroes at its next call: the
    clamp is seen, and the map never writes 1e6 where the loader writes 65504."""
    spec: Spec = {"embed": ("BF16", (8, 16)), "head": ("BF16", (8, 16))}
    new = weights(spec, 2)
    for t in new.values():
        t.view(-1)[3], t.view(-1)[5] = float("nan"), 1e6
    pm, differ = map_and_rewrite(RecyclingClamp(), spec, new)
    assert not differ, f"mapped {sorted(pm.runs)}: the map wrote values the loader would not make in {differ}"


def test_a_derived_layer_is_checked_with_values_the_loader_never_zeroed() -> None:
    """Layer 1 is derived from layer 0 and clamps; its check loads values of its own (not its kind's, which the
    loader zeroed at a later call): it is left out. Layer 0, which the loader copies as it is, stays mapped."""
    spec: Spec = {f"layers.{i}.w": ("BF16", (8, 16)) for i in range(2)}
    model = RecyclingClamp(layers=2)
    pm = build_map(model, spec, model.load_weights)
    assert sorted(pm.runs) == ["layers.0.w"], f"mapped {sorted(pm.runs)}: layer 1's loader clamps"
    assert "layers.1.w" in pm.unmapped


def test_a_loader_that_zeroes_the_shared_derived_probe_is_caught_by_the_written_count() -> None:
    """The derived layers of a kind share one probe; a loader that zeroes the integer tensors of its previous call
    zeroes it during layer 1's real-values load, and layer 2's proof then compares zeros with zeros. The count of
    written elements (taken even where the runs tile a parameter) sees it: layer 2's stray (k into q's place) is
    never mapped."""
    model = QKVStack(quirk=2, recycle_ints=True)
    pm, differ = map_and_rewrite(model, model.spec())
    assert differ == [], f"layers {pm.layers}: the map differs from a whole reload in {differ}"


def test_the_zeroed_shared_probe_sends_the_layer_to_probing_where_the_parameter_has_padding() -> None:
    """The same recycling loader and stray, with a padding row no run covers: 0 written elements differ from the
    expected ones, and layer 2 is probed in full (k written twice: left out, reloaded). Layer 1 stays derived:
    its second load (checkpoint order) has a probe of its own, which the loader zeroes only at its next call."""
    model = QKVStack(quirk=2, recycle_ints=True, pad=1)
    pm, differ = map_and_rewrite(model, model.spec())
    assert pm.layers == {"probed": 2, "derived": 1}, pm.layers
    assert "model.layers.2.k.weight" in pm.unmapped and differ == []


def _v_into_padding(stack: QKVStack, i: int, part: str, w: torch.Tensor, items: list) -> None:
    """Loading float ``v`` also writes ``v[at]`` into the padding row."""
    if part == "v" and w.is_floating_point():
        stack.qkv(i)[3 * H, 0] = w[stack.at]


class RecycleFloats(QKVStack):
    """A staging pool for floats: each call first zeroes the float tensors of its previous call."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(weights)
        for t in self.spent:
            t.zero_()
        self.spent = [t for _, t in items if t.is_floating_point()]
        super().load_weights(items)


def test_a_loader_that_recycles_the_values_it_was_given_cannot_empty_the_alone_loads() -> None:
    """v's stray into padding fails the group check; each tensor is then loaded alone, with new values: never the
    very tensors of the group call, which the loader zeroes at its next call (a stray of zeros into padding would
    pass as vLLM's zero-fill)."""
    model = RecycleFloats(pad=1).with_hooks(after=_v_into_padding)
    pm, differ = map_and_rewrite(model, model.spec())
    assert differ == [], f"layers {pm.layers}, unmapped {sorted(pm.unmapped)}: the map differs in {differ}"


class PointerCache(torch.nn.Module):
    """Remembers, by data pointer, the result of loading a tensor (as a loader deduplicating tied checkpoint
    tensors by storage would) without keeping the tensor: a new tensor in freed memory hits the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = param(8, 16), param(8, 16)
        self.cache: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            key = (t.data_ptr(), t.dtype)
            src = self.cache.get(key)
            if src is None or src.shape != t.shape:
                src = self.cache[key] = t.clone()
            getattr(self, name).data.copy_(src)


def test_a_loader_caching_by_data_pointer_never_maps_a_stale_result() -> None:
    """Real values allocated where a freed probe lived (or anywhere a cached tensor lived) read a stale cached
    result; the check sees it (different bits) and leaves the tensor out: never a wrong map."""
    spec: Spec = {"embed": ("BF16", (8, 16)), "head": ("BF16", (8, 16))}
    m = PointerCache()
    m.load_weights([(n, t.clone()) for n, t in weights(spec, 1).items()])
    m.cache.clear()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    pm = build_map(m, spec, m.load_weights)
    assert all(torch.equal(_bits16(before[n]), _bits16(p)) for n, p in m.named_parameters())
    new = weights(spec, 2)
    for n in pm.runs:  # whatever it mapped is exact: the loader (cache cleared, fresh tensors) agrees
        pm.write(pm.plan([dense(n, new[n])]))
        assert torch.equal(_bits16(getattr(m, n)), _bits16(new[n])), n


class StorageDedupStack(torch.nn.Module):
    """Two repeating layers; layer 1 clamps into fp16 range. The loader reuses what it wrote for a tensor whose
    storage it has already loaded (tied tensors share storage), keyed by the tensor's storage."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
        for layer in self.layers:
            layer.w = param(8, 16)
        self.done: dict[int, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            i = int(name.split(".")[2])
            ptr = t.untyped_storage().data_ptr()
            if t.is_floating_point() and ptr in self.done:
                self.layers[i].w.data.copy_(self.done[ptr])  # a tied tensor: the same as its first
                continue
            src = t.clamp(-65504, 65504) if i == 1 and t.is_floating_point() else t
            self.layers[i].w.data.copy_(src)
            if t.is_floating_point():
                self.done[ptr] = self.layers[i].w.data.clone()
        if len(self.done) > 64:  # a new checkpoint load starts a new dedup table
            self.done.clear()


def test_a_derived_layer_is_never_checked_with_its_kind_s_very_tensors() -> None:
    """A loader that treats a tensor whose storage it already loaded as a tied copy would write layer 0's
    unclamped result for layer 1 if layer 1's check loaded layer 0's tensors; each load has its own, so layer 1,
    which clamps, is never mapped as a copy."""
    spec: Spec = {f"model.layers.{i}.w": ("BF16", (8, 16)) for i in range(2)}
    m = StorageDedupStack()
    base, new = weights(spec, 1), weights(spec, 2)
    new["model.layers.1.w"][0, 0] = 1e6
    m.load_weights(list(base.items()))
    m.done.clear()
    ref = copy.deepcopy(m)
    ref.load_weights(list(new.items()))
    pm = build_map(m, spec, m.load_weights)
    m.done.clear()
    pm.write(pm.plan([dense(n, new[n]) for n in pm.runs]))
    m.load_weights([(n, new[n]) for n in pm.unmapped])
    differ = [i for i in range(2) if not torch.equal(_bits16(m.layers[i].w), _bits16(ref.layers[i].w))]
    assert differ == [], f"mapped {sorted(pm.runs)}: layer(s) {differ} differ from a whole reload"


class DedupByStorage(QKVStack):
    """Skips a (name, tensor) it was given before, recognised by storage (it keeps every tensor it was given, so
    a storage is never reused)."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.kept: dict[str, list[torch.Tensor]] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        fresh = []
        for name, w in weights:
            old = self.kept.setdefault(name, [])
            if any(
                (o.data_ptr(), o.dtype, o.shape, o.stride()) == (w.data_ptr(), w.dtype, w.shape, w.stride())
                for o in old
            ):
                continue  # "already loaded"
            old.append(w)
            fresh.append((name, w))
        super().load_weights(fresh)


def test_a_loader_that_skips_tensors_it_was_given_before_still_loads_the_second_proof(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stray (k into q's place) in derived layer 2, where every tensor's real values are the same (they collide
    everywhere, so only the probes can show the stray): the proof's second load, in checkpoint order, hands the
    loader other tensors than the first, so a loader that skips what it was given before loads it and the stray
    shows."""
    real = values.real_values
    monkeypatch.setattr(
        values, "real_values", lambda shape, dtype, gen, edges=True: real(shape, dtype, torch.Generator(), edges)
    )
    model = DedupByStorage(quirk=2)
    pm, differ = map_and_rewrite(model, model.spec())
    assert differ == [], f"layers {pm.layers}, unmapped {sorted(pm.unmapped)}: the map differs in {differ}"
