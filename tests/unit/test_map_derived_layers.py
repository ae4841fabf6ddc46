"""The patch map learned once per kind of layer: the first layer of a kind is probed tensor by tensor, every other
one derives its map and proves it with two probe loads and the real-values checks. A derived map must be exactly
the probed one, and a layer that only looks alike (another shape, a loader that behaves otherwise for it) must be
probed in full, keeping every refusal probing makes. Toy vLLM-like loaders, torch only."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from deltasync.vllm.patch_map import build_map, values
from tests.unit.map_fakes import QKVStack, Spec, map_and_rewrite, param

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves


class Layer(torch.nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.qkv = param(3 * hidden, hidden)
        self.gate_up = param(2 * inter, hidden)
        self.down = param(hidden, inter // 2)
        self.norm = param(hidden)


class Stack(torch.nn.Module):
    """vLLM-like: fused qkv and gate_up, a TP-like half of ``down`` (one run per row), a padded embedding, and
    ``quirk`` (by layer) to make one layer load otherwise: ``swap-kv`` (another layout), ``stray`` (an element of
    ``down`` also written into ``norm``), ``scale`` (``norm`` doubled)."""

    def __init__(self, n: int = 6, hidden: int = 8, inter: int = 12, odd: int | None = None) -> None:
        super().__init__()
        self.embed = param(40, hidden)
        self.layers = torch.nn.ModuleList(
            [Layer(hidden, inter if i != odd else inter + 4) for i in range(n)]  # ``odd``: another kind
        )
        self.hidden, self.inter = hidden, inter
        self.quirk: dict[int, str] = {}

    def spec(self) -> Spec:
        out: Spec = {"model.embed.weight": ("BF16", (37, self.hidden))}
        for i, layer in enumerate(self.layers):
            h, inter = self.hidden, layer.gate_up.shape[0] // 2
            for w in ("q", "k", "v"):
                out[f"model.layers.{i}.{w}.weight"] = ("BF16", (h, h))
            out[f"model.layers.{i}.gate.weight"] = ("BF16", (inter, h))
            out[f"model.layers.{i}.up.weight"] = ("BF16", (inter, h))
            out[f"model.layers.{i}.down.weight"] = ("BF16", (h, inter))
            out[f"model.layers.{i}.norm.weight"] = ("BF16", (h,))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "model.embed.weight":
                self.embed.data[: w.shape[0]].copy_(w)
                self.embed.data[w.shape[0] :].zero_()
                continue
            i = int(name.split(".")[2])
            layer, part, quirk = self.layers[i], name.split(".")[3], self.quirk.get(i)
            h = self.hidden
            if part in ("q", "k", "v"):
                row = {"q": 0, "k": h, "v": 2 * h}[part]
                if quirk == "swap-kv" and part in ("k", "v"):
                    row = {"k": 2 * h, "v": h}[part]
                layer.qkv.data[row : row + h].copy_(w)
            elif part in ("gate", "up"):
                inter = layer.gate_up.shape[0] // 2
                layer.gate_up.data[(0 if part == "gate" else inter) : (inter if part == "gate" else 2 * inter)].copy_(w)
            elif part == "down":
                self.load_down(i, layer, w)
            elif part == "norm":
                layer.norm.data.copy_(w * 2 if quirk == "scale" else w)

    def load_down(self, i: int, layer: torch.nn.Module, w: torch.Tensor) -> None:
        layer.down.data.copy_(w[:, w.shape[1] // 2 :])  # this rank's half of the input dimension
        if self.quirk.get(i) == "stray":
            layer.norm.data[0] = w.reshape(-1)[5]  # one element lands twice


def test_one_layer_is_probed_and_every_other_derived_exactly() -> None:
    model = Stack(n=6)
    pm, differ = map_and_rewrite(model, model.spec())
    assert pm.layers == {"probed": 2, "derived": 5}  # the embedding's group, layer 0; layers 1-5 derived
    assert differ == [] and not pm.unmapped
    for i in range(6):  # each layer alone is a first of its kind: probed tensor by tensor
        one = Stack(n=6)
        spec = {n: v for n, v in one.spec().items() if f"layers.{i}." in n}
        for name, rs in build_map(one, spec, one.load_weights).runs.items():
            got = pm.runs[name]
            assert [r.param for r in got] == [r.param for r in rs], name
            for a, b in zip(got, rs, strict=True):
                assert torch.equal(a.ckpt_start, b.ckpt_start) and torch.equal(a.param_start, b.param_start)
                assert torch.equal(a.length, b.length), name


def test_a_layer_of_another_shape_is_its_own_kind() -> None:
    model = Stack(n=5, odd=3)
    pm, differ = map_and_rewrite(model, model.spec())
    assert pm.layers == {"probed": 3, "derived": 3} and differ == []


@pytest.mark.parametrize(
    ("quirk", "outcome"),
    [
        ("swap-kv", "mapped"),  # another layout for this layer alone: its own probing maps it right
        ("stray", "unmapped"),  # an element written twice: probing leaves `down` out, as for any layer
        ("scale", "unmapped"),  # arithmetic on this layer's values only: the real-value check leaves it out
    ],
)
def test_a_layer_whose_loader_behaves_differently_is_probed_in_full(quirk: str, outcome: str) -> None:
    model = Stack(n=6)
    model.quirk[4] = quirk
    pm, differ = map_and_rewrite(model, model.spec())
    assert pm.layers == {"probed": 3, "derived": 4}, pm.layers
    # what is served equals a whole reload (the stray loader's reload of `down`, which the map leaves out, writes
    # into `norm`'s place too: `norm` is left out with it)
    assert differ == []
    left_out = {n for n in pm.unmapped if "layers.4." in n}
    assert (left_out == set()) if outcome == "mapped" else left_out, pm.unmapped
    assert not {n for n in pm.unmapped if "layers.4." not in n}  # the other layers keep their derived map


class Padded(Stack):
    """``down``'s parameter has a padding column no checkpoint element lands in; layer 3 writes one there."""

    def __init__(self) -> None:
        super().__init__(n=5)
        for layer in self.layers:
            layer.down = param(self.hidden, self.inter // 2 + 1)

    def load_down(self, i: int, layer: torch.nn.Module, w: torch.Tensor) -> None:
        down = layer.down.data
        down[:, : self.inter // 2].copy_(w[:, w.shape[1] // 2 :])
        down[:, -1].zero_()
        if i == 3:
            down[0, -1] = w.reshape(-1)[1]  # the stray: into the padding


def test_a_stray_write_into_a_part_no_run_covers_still_sends_the_layer_to_probing() -> None:
    model = Padded()
    pm, differ = map_and_rewrite(model, model.spec())
    assert pm.layers == {"probed": 3, "derived": 3}, pm.layers  # layer 3's derived proof failed: probed in full
    assert differ == [] or differ == ["P:layers.3.down"], differ


def test_a_plain_fused_stack_is_derived_and_exact() -> None:
    """Layer 0 probed, layers 1-2 derived, writes through the map equal a whole reload."""
    model = QKVStack()
    pm, differ = map_and_rewrite(model, model.spec())
    assert pm.layers == {"probed": 1, "derived": 2} and not pm.unmapped and differ == []


def _assert_layer_2_probed_and_its_stray_left_out(model: QKVStack) -> None:
    pm, differ = map_and_rewrite(model, model.spec())
    # k, the culprit, is left out, and so is q, whose place k's reload writes (as a whole reload does)
    assert pm.layers == {"probed": 2, "derived": 1} and "model.layers.2.k.weight" in pm.unmapped
    assert {n for n in pm.unmapped if "layers.2." not in n} == set(), pm.unmapped
    assert differ == []


def test_a_stray_in_one_derived_layer_sends_it_to_probing() -> None:
    """Layer 2's proof sees k's stray into q's place: the layer is probed in full and k (written twice) is left
    out; what is served equals a whole reload."""
    _assert_layer_2_probed_and_its_stray_left_out(QKVStack(quirk=2))


def test_a_stray_where_the_real_values_collide_is_seen_by_the_probes_in_checkpoint_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same stray when q's and k's real values hold the same bits there (random values collide at one place
    about once in 600 builds; here every tensor gets the same real values, so they collide everywhere): the
    probes went in reverse order (q covers the stray) and the real values cannot show it; the second probe load,
    in checkpoint order, does."""
    real = values.real_values
    monkeypatch.setattr(
        values, "real_values", lambda shape, dtype, gen, edges=True: real(shape, dtype, torch.Generator(), edges)
    )
    _assert_layer_2_probed_and_its_stray_left_out(QKVStack(quirk=2))
