"""The patch map learned once per kind of layer (issue 22): the first layer of a kind is probed tensor by
tensor, every other one derives its map and proves it with two loader calls. A derived map must be exactly the
probed one, and a layer that only looks alike (another shape, a loader that behaves differently for it) must be
probed in full, keeping every refusal probing makes. Toy vLLM-like loaders, torch only."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from deltasync.vllm import patch_map
from deltasync.vllm.patch_map import build_map
from tests.unit.test_attacks_patch_map import Spec, _map_and_rewrite, _weights

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves


class Layer(torch.nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * hidden, hidden, dtype=torch.bfloat16), requires_grad=False)
        self.gate_up = torch.nn.Parameter(torch.zeros(2 * inter, hidden, dtype=torch.bfloat16), requires_grad=False)
        self.down = torch.nn.Parameter(torch.zeros(hidden, inter // 2, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(hidden, dtype=torch.bfloat16), requires_grad=False)


class Stack(torch.nn.Module):
    """vLLM-like: fused qkv and gate_up, a TP-like half of ``down`` (one run per row), a padded embedding, and
    hooks to make one layer different."""

    def __init__(self, n: int = 6, hidden: int = 8, inter: int = 12, odd: int | None = None) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(40, hidden, dtype=torch.bfloat16), requires_grad=False)
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
            layer, leaf, quirk = self.layers[i], name.split(".")[3], self.quirk.get(i)
            h = self.hidden
            if leaf in ("q", "k", "v"):
                row = {"q": 0, "k": h, "v": 2 * h}[leaf]
                if quirk == "swap-kv" and leaf in ("k", "v"):
                    row = {"k": 2 * h, "v": h}[leaf]
                layer.qkv.data[row : row + h].copy_(w)
            elif leaf in ("gate", "up"):
                inter = layer.gate_up.shape[0] // 2
                layer.gate_up.data[(0 if leaf == "gate" else inter) : (inter if leaf == "gate" else 2 * inter)].copy_(w)
            elif leaf == "down":
                layer.down.data.copy_(w[:, w.shape[1] // 2 :])  # this rank's half of the input dimension
                if quirk == "stray":
                    layer.norm.data[0] = w.reshape(-1)[5]  # one element lands twice
            elif leaf == "norm":
                layer.norm.data.copy_(w * 2 if quirk == "scale" else w)


def _rewrite_through_the_map(model: Stack) -> tuple[patch_map.PatchMap, list[str]]:
    return _map_and_rewrite(model, model.spec())


def test_one_layer_is_probed_and_every_other_derived_exactly() -> None:
    model = Stack(n=6)
    pm, differ = _rewrite_through_the_map(model)
    assert pm.layers == {"probed": 2, "derived": 5}  # the embedding's group, layer 0; layers 1-5 derived
    assert differ == [] and not pm.unmapped
    probed = Stack(n=6)
    probed.load_weights(list(_weights(probed.spec(), 1).items()))
    full = patch_map.PatchMap({}, {}, {}, 0.0)
    for i in range(6):  # each layer alone is a first of its kind: probed tensor by tensor
        one = Stack(n=6)
        spec = {n: v for n, v in one.spec().items() if f"layers.{i}." in n}
        full.runs.update(build_map(one, spec, one.load_weights).runs)
    for name, rs in full.runs.items():
        got = pm.runs[name]
        assert [r.param for r in got] == [r.param for r in rs], name
        for a, b in zip(got, rs, strict=True):
            assert torch.equal(a.ckpt_start, b.ckpt_start) and torch.equal(a.param_start, b.param_start)
            assert torch.equal(a.length, b.length), name


def test_a_layer_of_another_shape_is_its_own_kind() -> None:
    pm, differ = _rewrite_through_the_map(Stack(n=5, odd=3))
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
    pm, differ = _rewrite_through_the_map(model)
    assert pm.layers == {"probed": 3, "derived": 4}, pm.layers
    # what is served equals a whole reload (the stray loader's reload of `down`, which the map leaves out, writes
    # into `norm`'s place too: `norm` is left out with it, thirteenth round)
    assert differ == []
    left_out = {n for n in pm.unmapped if "layers.4." in n}
    assert (left_out == set()) if outcome == "mapped" else left_out, pm.unmapped
    assert not {n for n in pm.unmapped if "layers.4." not in n}  # the other layers keep their derived map


def test_a_stray_write_into_a_part_no_run_covers_still_sends_the_layer_to_probing() -> None:
    class Padded(Stack):
        """``down``'s parameter has a padding column no checkpoint element lands in; layer 3 writes one there."""

        def __init__(self) -> None:
            super().__init__(n=5)
            for layer in self.layers:
                layer.down = torch.nn.Parameter(
                    torch.zeros(self.hidden, self.inter // 2 + 1, dtype=torch.bfloat16), requires_grad=False
                )

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, w in weights:
                if ".down." not in name:
                    super().load_weights([(name, w)])
                    continue
                i = int(name.split(".")[2])
                down = self.layers[i].down.data
                down[:, : self.inter // 2].copy_(w[:, w.shape[1] // 2 :])
                down[:, -1].zero_()
                if i == 3:
                    down[0, -1] = w.reshape(-1)[1]  # the stray: into the padding

    model = Padded()
    pm, differ = _map_and_rewrite(model, model.spec())
    assert pm.layers == {"probed": 3, "derived": 3}, pm.layers  # layer 3's derived proof failed: probed in full
    assert differ == [] or differ == ["P:layers.3.down"], differ


def test_real_values_of_a_large_tensor_are_one_block_tiled_each_tile_rotated() -> None:
    """One block drawn, tiled with each tile rotated at random: the elements one block apart hold different
    values (a loader swapping them on integer input only would otherwise be unseen: adversarial review, round 8)."""
    block = patch_map._REAL_BLOCK
    for dtype in (torch.bfloat16, torch.float32):
        small = patch_map._real_values((block,), dtype, torch.Generator().manual_seed(5))
        large = patch_map._real_values((3, block - 1), dtype, torch.Generator().manual_seed(5))
        assert large.shape == (3, block - 1) and large.dtype == dtype and large.is_contiguous()
        bits = patch_map._bits(small)
        flat = patch_map._bits(large.reshape(-1))
        shifts = []
        twice = torch.cat([bits, bits])  # every rotation of the block is a window of it
        for lo in range(0, flat.numel(), block):
            tile = flat[lo : lo + block]
            starts = torch.nonzero(bits == tile[0]).squeeze(1).tolist()  # candidates, then their first 64, then all
            starts = [s for s in starts if torch.equal(twice[s : s + 64], tile[:64])]
            shifts += [s for s in starts if torch.equal(twice[s : s + tile.numel()], tile)][:1]
        assert len(shifts) == 3 and len(set(shifts)) == 3, shifts  # rotations of the block, each its own
        same = flat[: 2 * block - 2 - block] == flat[block : 2 * block - 2]
        assert float(same.double().mean()) < 0.05  # one block apart: equal only where the random values are
