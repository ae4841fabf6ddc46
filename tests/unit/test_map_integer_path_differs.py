"""Loaders whose integer path differs from their float path (vLLM routes integer tensors to packed-weight code,
and the probes are integers): a permutation, an offset or a stray write for integers only, or a float path that
reinterprets bits. The probes then describe a map that is wrong for real values; the real values' check leaves
such tensors out, so every tensor is mapped exactly where the loader puts real values, or reloaded. Split mode
(two int16 passes, a short period and scan chunk) unless said otherwise."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch

from deltasync.format import TensorDelta
from deltasync.vllm.patch_map import build_map, values
from tests.unit.map_fakes import (
    Llama,
    Spec,
    assert_promise,
    assert_unchanged,
    expand,
    llama,
    make_model,
    snapshot,
    split_mode,
)

NAME = "model.layers.0.w.weight"


@pytest.fixture(autouse=True)
def _split(monkeypatch: pytest.MonkeyPatch) -> None:
    split_mode(monkeypatch)


class _TransposesDownForIntegers(Llama):
    """Permutes both probe passes of ``down_proj`` the same way (a transpose of its rows); floats go straight."""

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        if w.dtype == torch.int16 and "down_proj" in name:
            w = w.t().contiguous().view(w.shape)
        super().put(name, w, call)


class _AddsOneToIntegers(Llama):
    """Adds 1 to ``gate_proj``'s probe values (in both passes): the joined index points at the next element."""

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        if w.dtype == torch.int16 and "gate_proj" in name:
            w = w + 1
        super().put(name, w, call)


class _IntegersAlsoIntoAnotherParameter(Llama):
    """For integers, ``up_proj`` is also written into another parameter of the group (``down_proj``'s first row)."""

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        super().put(name, w, call)
        if w.dtype == torch.int16 and "up_proj" in name:
            self.m.get_parameter(name.replace("up_proj", "down_proj")).data.view(-1)[:5].copy_(w.reshape(-1)[:5])


@pytest.mark.parametrize(
    ("loader", "left_out"),
    [
        (_TransposesDownForIntegers, None),
        (_AddsOneToIntegers, "model.layers.0.mlp.gate_proj.weight"),
        (_IntegersAlsoIntoAnotherParameter, None),
    ],
)
def test_a_loader_that_places_integers_otherwise_than_floats_is_mapped_as_it_places_floats(
    loader: type[Llama], left_out: str | None
) -> None:
    model, spec, pm, truth = llama(loader)
    if left_out is not None:
        assert left_out in pm.unmapped
    assert_promise(pm, model, truth, spec)


def _one_tensor(rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, Spec]:
    return make_model({NAME: ((rows, cols), dtype)}), {NAME: ("BF16", (rows, cols))}


class _SwapOnIntegers:
    """Straight for real (float) values; for integer probes, checkpoint elements ``a`` and ``b`` trade places."""

    def __init__(self, model: torch.nn.Module, a: int, b: int) -> None:
        self.m, self.a, self.b = model, a, b

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if not w.is_floating_point():
                flat = w.reshape(-1).clone()
                flat[self.a], flat[self.b] = flat[self.b].clone(), flat[self.a].clone()
                w = flat.view(w.shape)
            self.m.get_parameter(name).data.copy_(w)


def test_a_swap_of_two_elements_one_real_values_block_apart_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real values are one block of ``REAL_BLOCK`` values tiled, each tile rotated at random: elements a and
    a + ``REAL_BLOCK`` hold different bits, so a loader that swaps them for integer input only is caught (with
    this seed the two tiles are rotated apart; another draws equal values there about once in 600)."""
    split_mode(monkeypatch, 32767, 1 << 16)
    monkeypatch.setattr(values, "seed", lambda: 11)
    cols = 16
    model, spec = _one_tensor(values.REAL_BLOCK // cols + 2, cols)  # just over one block
    a, b = 5, 5 + values.REAL_BLOCK
    before = snapshot(model)
    pm = build_map(model, spec, _SwapOnIntegers(model, a, b))
    assert_unchanged(model, before)
    assert "layers.0" in pm.split
    if NAME in pm.runs:
        got = expand(pm, NAME, model)[NAME]
        assert int(got[a]) - 1 == a and int(got[b]) - 1 == b, (
            f"WRONG MAP accepted: the map says element {int(got[a]) - 1} sits at {a} and {int(got[b]) - 1} at {b}; "
            "the loader puts real values straight"
        )


def _raw_bits(model: torch.nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]]], None]:
    """``param.data.copy_(w.view(param.dtype))``: bf16 bits stored as they are in an fp16 parameter (for int16
    probes a no-op); a map writes ``value.to(fp16)``, by value."""

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for n, w in weights:
            p = model.get_parameter(n)
            p.data.copy_(w.view(p.dtype))

    return load


def test_a_parameter_that_stores_another_dtype_s_bits_raw_is_never_mapped_by_value() -> None:
    """Checked as the map writes (cast to the parameter's dtype), and a parameter of another dtype than its
    checkpoint tensor is left out: an update through the map never writes ``value.to(fp16)`` where the loader
    writes the bf16 bits."""
    model, spec = _one_tensor(8, 8, torch.float16)
    before = snapshot(model)
    pm = build_map(model, spec, _raw_bits(model))
    assert_unchanged(model, before)
    if NAME in pm.runs:
        new = torch.full((8, 8), 1.5, dtype=torch.bfloat16)
        twin, _ = _one_tensor(8, 8, torch.float16)
        _raw_bits(twin)([(NAME, new)])
        pm.write(pm.plan([TensorDelta(ckpt_name=NAME, shape=(8, 8), dtype=torch.bfloat16, indices=None, values=new)]))
        live = model.get_parameter(NAME).data.view(torch.int16)
        want = twin.get_parameter(NAME).data.view(torch.int16)
        assert torch.equal(live, want), (
            f"mapped, but an update through the map writes bits {hex(int(live[0, 0]) & 0xFFFF)} where the loader "
            f"writes {hex(int(want[0, 0]) & 0xFFFF)}"
        )


def test_an_fp32_parameter_holding_sign_extended_bf16_bits_is_left_out() -> None:
    """A loader that writes, for a bf16 checkpoint value with bits b, the fp32 value whose int32 bits are b
    sign-extended (1.0 -> 2.3e-41): the bits are compared at one width, never an int32 against an int16 by
    value."""
    model, spec = _one_tensor(8, 8, torch.float32)

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for n, w in weights:
            p = model.get_parameter(n)
            if w.is_floating_point():
                p.data.copy_(w.view(torch.int16).to(torch.int32).view(torch.float32))
            else:
                p.data.copy_(w)

    before = snapshot(model)
    pm = build_map(model, spec, load)
    assert_unchanged(model, before)
    assert NAME in pm.unmapped, f"a loader that turns 1.0 into 2.3e-41 is mapped: {pm.runs.get(NAME)}"
