"""Layouts real loaders make, mapped exactly: fused q/k/v rows, a padded vocabulary, a tied head, a TP-like slice,
GPT-2-style blocks, odd shapes and dtypes, empty tensors; what cannot be patched in place (a non-contiguous
parameter, a refused or transformed tensor) is left out and reloaded. Toy vLLM-like loaders, torch only; the real
vLLM models are in tests/integration/test_inplace.py."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from deltasync.format import TensorDelta
from deltasync.vllm.patch_map import build_map
from tests.unit.map_fakes import FusedPaddedTied, H, QKVStack, Spec, assert_exact, leaf, param, weights

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16)


def _delta(name: str, like: torch.Tensor, indices: torch.Tensor | None, values: torch.Tensor) -> TensorDelta:
    return TensorDelta(ckpt_name=name, shape=tuple(like.shape), dtype=like.dtype, indices=indices, values=values)


def test_a_fused_padded_tied_and_sliced_model_is_written_exactly_where_its_loader_writes() -> None:
    model = FusedPaddedTied()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pm = build_map(model, FusedPaddedTied.SPEC, model.load_weights)
    assert {n: p.detach() for n, p in model.named_parameters()}.keys() == before.keys()
    for n, p in model.named_parameters():  # the probes left the live parameters exactly as they were
        assert p.dtype == torch.bfloat16 and torch.equal(_bits16(p), _bits16(before[n]))
    assert set(pm.unmapped) == {"quantized", "norm"} and "TypeError" in pm.unmapped["quantized"]
    assert "the loader transforms them" in pm.unmapped["norm"]
    assert [r.param for r in pm.runs["q"]] == ["qkv"] and int(pm.runs["v"][0].param_start[0]) == 16
    assert pm.runs["down"][0].length.tolist() == [3, 3, 3, 3]  # four rows of this rank's half

    truth = FusedPaddedTied.truth()
    model.load_weights([(n, t) for n, t in truth.items() if n != "quantized"])
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_weights([(n, torch.zeros_like(t)) for n, t in truth.items() if n != "quantized"])
    ops = pm.plan([_delta(n, t, None, t) for n, t in truth.items() if n in pm])
    assert pm.write(ops) > 0 and not pm.check_written(ops)
    for n, p in model.named_parameters():
        if n != "norm":  # unmapped: the engine reloads its module instead
            assert torch.equal(_bits16(p), _bits16(expected[n])), n

    new = {n: t.clone() for n, t in truth.items()}
    for t in new.values():
        t.view(-1)[::3] += 1
    deltas = []
    for n in pm.runs:
        idx = torch.nonzero(_bits16(new[n]) != _bits16(truth[n])).squeeze(1)
        deltas.append(_delta(n, new[n], idx, new[n].view(-1)[idx]))
    ops = pm.plan(deltas)
    pm.write(ops)
    assert not pm.check_written(ops)
    values = pm.read_whole("q")
    assert values is not None and torch.equal(_bits16(values), _bits16(new["q"]))
    assert pm.read_whole("down") is None  # a rank holds part: the audit counts it as partial
    written = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_weights([(n, t) for n, t in new.items() if n != "quantized"])  # what a full reload gives
    for n, p in model.named_parameters():
        if n != "norm":
            assert torch.equal(_bits16(p), _bits16(written[n])), n


def test_gpt2_style_blocks_are_probed_one_at_a_time_and_non_contiguous_parameters_left_out() -> None:
    blocks, peak = 6, [0]

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = torch.nn.ModuleList([torch.nn.Module() for _ in range(blocks)])
            for b in self.h:
                b.w = param(8, 8)
            self.t = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16).t(), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            peak[0] = max(peak[0], sum(p.numel() for p in self.parameters() if not p.is_floating_point()))
            for n, t in weights:
                if n == "t":
                    self.t.data.copy_(t)
                else:
                    self.h[int(n.split(".")[2])].w.data.copy_(t)

    spec: Spec = {f"transformer.h.{i}.w": ("BF16", (8, 8)) for i in range(blocks)}
    spec["t"] = ("BF16", (4, 3))
    m = GPT()
    m.load_weights(list(weights(spec, 1).items()))
    peak[0] = 0
    pm = build_map(m, spec, m.load_weights)
    assert peak[0] <= 64 + 12  # one block (and the layer-less rest) swapped at a time, not the whole model
    assert "not contiguous" in pm.unmapped["t"] and all(f"transformer.h.{i}.w" in pm for i in range(blocks))
    assert_exact(GPT(), spec)


class NonContiguous(torch.nn.Module):
    """A parameter that is a transposed view (non-contiguous) in every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
        for layer in self.layers:
            layer.w = torch.nn.Parameter(torch.zeros(H, 2 * H, dtype=torch.bfloat16).t(), requires_grad=False)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.w": ("BF16", (2 * H, H)) for i in range(2)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            self.layers[leaf(name)[0]].w.data.copy_(w)


def test_a_non_contiguous_parameter_in_repeating_layers_is_left_out_and_reloaded() -> None:
    assert_exact(NonContiguous())


class OddShapes(torch.nn.Module):
    """Per layer a 0-d bf16 parameter, an fp16 one, an fp32 one that requires grad, and an empty one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
        for layer in self.layers:
            layer.s = torch.nn.Parameter(torch.zeros((), dtype=torch.bfloat16), requires_grad=False)
            layer.h = param(5, 3, dtype=torch.float16)
            layer.f = torch.nn.Parameter(torch.zeros(7), requires_grad=True)
            layer.e = param(0, 4)

    def spec(self) -> Spec:
        out: Spec = {}
        for i in range(3):
            out[f"model.layers.{i}.s"] = ("BF16", ())
            out[f"model.layers.{i}.h"] = ("F16", (5, 3))
            out[f"model.layers.{i}.f"] = ("F32", (7,))
            out[f"model.layers.{i}.e"] = ("BF16", (0, 4))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, part = leaf(name)
            getattr(self.layers[i], part).data.copy_(w)


def test_odd_shapes_and_dtypes_build_and_stay_exact() -> None:
    """A 0-d parameter, fp16 (whose background is bf16 bit patterns read as fp16), fp32 with gradients, and an
    empty tensor."""
    assert_exact(OddShapes())


class WithEmpty(QKVStack):
    """Each layer also has an empty checkpoint tensor the loader ignores."""

    def spec(self) -> Spec:
        out = super().spec()
        for i in range(len(self.layers)):
            out[f"model.layers.{i}.e.weight"] = ("BF16", (0, H))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights([(n, w) for n, w in weights if ".e." not in n])


def test_an_empty_tensor_in_every_layer_that_the_loader_ignores() -> None:
    assert_exact(WithEmpty())
