"""Adversarial review r6 of the patch map's "real values" check for groups outside the repeating layers, whose
values are now written into the memory of the spent integer probe (``_real_values(..., out=probe)``).

Promise under attack: a loader that transforms values never ends up in the map (it is left in ``pm.unmapped``
or the build raises MapCorruption); the map never writes values that differ from what the loader would make."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from deltasync.format import TensorDelta
from deltasync.vllm.patch_map import build_map

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves

Spec = dict[str, tuple[str, tuple[int, ...]]]
SPEC: Spec = {"embed": ("BF16", (8, 16)), "head": ("BF16", (8, 16))}  # no ``layers.N.``: one group, kind None


def _p() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(8, 16, dtype=torch.bfloat16), requires_grad=False)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).bfloat16() for n, (_, shape) in SPEC.items()}


def _rewrite_through_map(model: Any, new: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Build the map, write ``new`` through it (reloading what it leaves out, as the engine does), and compare
    bit for bit with a copy of the model that loaded ``new`` itself: (mapped names, names whose values differ)."""
    model.load_weights([(n, t.clone()) for n, t in _weights(1).items()])
    ref = copy.deepcopy(model)
    ref.load_weights([(n, t.clone()) for n, t in new.items()])
    pm = build_map(model, SPEC, model.load_weights)
    pm.write(
        pm.plan(
            [
                TensorDelta(ckpt_name=n, shape=tuple(t.shape), dtype=t.dtype, indices=None, values=t.clone())
                for n, t in new.items()
                if n in pm
            ]
        )
    )
    if pm.unmapped:
        model.load_weights([(n, new[n].clone()) for n in SPEC if n in pm.unmapped])
    differ = [
        n
        for n in SPEC
        if not torch.equal(getattr(model, n).data.view(torch.int16), getattr(ref, n).data.view(torch.int16))
    ]
    return sorted(pm.runs), differ


def _new_with_edges() -> dict[str, torch.Tensor]:
    new = _weights(2)
    for t in new.values():
        t.view(-1)[3], t.view(-1)[5] = float("nan"), 1e6
    return new


class ZeroCopyCleaner(torch.nn.Module):
    """Zero-copy loading: an integer tensor (an index table such as ``g_idx``) is taken as it is, as the
    parameter's data; a float tensor is cleaned of NaN and clamped into fp16 range into a new tensor. Probes are
    integers, so the probe *becomes* the parameter's data."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = _p(), _p()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            p = getattr(self, name)
            p.data = torch.nan_to_num(t).clamp(-65504, 65504) if t.is_floating_point() else t


def test_r6_a_loader_that_aliases_the_integer_probe_hides_its_transform_from_the_real_values_check() -> None:
    """Was broken by writing the real values into the spent probes (reverted: fresh memory again): the probe
    aliased as the parameter's data is the memory ``_real_values`` wrote the
    real values into, and ``_reuse`` then carves the zeroed stand-in out of that same memory, so every real value
    is zeroed before the check loads it. Zeros survive NaN cleaning and clamping, the check passes, and the map
    writes NaN / 1e6 where the loader makes 0 / 65504 (with values in a fresh tensor, as before, the NaN and
    1e6 edge values caught it)."""
    mapped, differ = _rewrite_through_map(ZeroCopyCleaner(), _new_with_edges())
    assert not differ, f"mapped {mapped}: the map wrote values the loader would not make in {differ}"


class RecyclingClamp(torch.nn.Module):
    """A loader that recycles the tensors it was given as scratch: at each call it first zeroes the tensors of
    its previous call (a staging-buffer pool), then copies the new ones in, clamping ``head`` into fp16 range."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = _p(), _p()
        self.spent: list[torch.Tensor] = []

    def clamps(self, name: str) -> bool:
        return name == "head"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(weights)
        for t in self.spent:
            t.zero_()  # the previous call's buffers are free again
        for name, t in items:
            src = t.clamp(-65504, 65504) if self.clamps(name) and t.is_floating_point() else t
            self.get_parameter(name).data.copy_(src)
        self.spent = [t for _, t in items]


def test_r6_a_loader_that_zeroes_the_tensors_it_was_given_earlier_erases_the_real_values() -> None:
    """Was broken by writing the real values into the spent probes (reverted): ``head``'s real values lived in
    its spent probe, which the loader was given (and kept) in the probe call; it zeroes that buffer when the
    real-values load starts, so ``head`` is checked with zeros and the clamp goes unseen (the map writes 1e6 where the loader writes 65504)."""
    mapped, differ = _rewrite_through_map(RecyclingClamp(), _new_with_edges())
    assert not differ, f"mapped {mapped}: the map wrote values the loader would not make in {differ}"


class InPlaceCleaner(torch.nn.Module):
    """A loader that cleans the tensor it is given in place (NaN -> 0, clamped to fp16 range) before copying it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = _p(), _p()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            if t.is_floating_point():
                t.nan_to_num_().clamp_(-65504, 65504)
            getattr(self, name).data.copy_(t)


def test_r6_a_loader_that_writes_into_the_tensor_it_is_given_is_left_out_of_the_map() -> None:
    """Was broken (before the r6 change too): the check compares the parameter with the very tensor handed to
    the loader, after the load, so a loader that transforms that tensor in place makes both sides agree. Fixed:
    the real values must still have the digest they had when drawn."""
    mapped, differ = _rewrite_through_map(InPlaceCleaner(), _new_with_edges())
    assert not differ, f"mapped {mapped}: the map wrote values the loader would not make in {differ}"


class Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = _p(), _p()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            getattr(self, name).data.copy_(t)


class KeepsFirst(torch.nn.Module):
    """Keeps the first tensor it was ever given per name (the probe) and copies from it on every later call."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = _p(), _p()
        self.first: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            getattr(self, name).data.copy_(self.first.setdefault(name, t))


def test_r6_a_plain_loader_is_mapped_and_a_loader_reading_its_kept_probe_is_not() -> None:
    """Held: a plain copying loader maps both tensors exactly; one that reads the kept probe later (now holding
    the real values' bits as int32) is caught by the check."""
    mapped, differ = _rewrite_through_map(Plain(), _new_with_edges())
    assert mapped == ["embed", "head"] and not differ
    m = KeepsFirst()
    # the first load (the base weights) is what this loader keeps: clear it so it keeps the probes
    m.load_weights([(n, t.clone()) for n, t in _weights(1).items()])
    m.first.clear()
    pm = build_map(m, SPEC, m.load_weights)
    assert not pm.runs and set(pm.unmapped) == set(SPEC), pm.summary()


class LayeredRecyclingClamp(RecyclingClamp):
    """:class:`RecyclingClamp` with two repeating layers, clamping layer 1's floats (layer 0's it copies as they
    are). The layer kind's real values, drawn once and reused for layer 1's check, were given to the loader in
    layer 0's check: by layer 1's they are zeros."""

    def __init__(self) -> None:
        super().__init__()
        del self.embed, self.head
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
        for layer in self.layers:
            layer.w = _p()

    def clamps(self, name: str) -> bool:
        return name.startswith("layers.1.")


def test_r6_a_derived_layer_checked_with_values_the_loader_zeroed_earlier_is_left_out() -> None:
    """The digest check covers a layer kind's reused values: layer 1 is derived from layer 0, and its check
    would load zeros (the clamp unseen) and map it; it is left out instead. Layer 0, which the loader copies as
    it is, stays mapped."""
    spec: Spec = {f"layers.{i}.w": ("BF16", (8, 16)) for i in range(2)}
    model = LayeredRecyclingClamp()
    pm = build_map(model, spec, model.load_weights)
    assert sorted(pm.runs) == ["layers.0.w"], f"mapped {sorted(pm.runs)}: layer 1's loader clamps"
    assert "layers.1.w" in pm.unmapped
