"""Tied and shared parameters: an ``lm_head`` tied to the embedding (one object, or two objects over one storage),
layers sharing a parameter (ALBERT-style), each loaded under both checkpoint names. Two tensors in one place are
never both mapped (a reload writes the last one loaded, the map would write both): what is served equals a
whole reload, and the build never writes probe values into a live weight. Toy loaders, torch only."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from deltasync.vllm.patch_map import MapCorruption, build_map
from tests.unit.map_fakes import H, Spec, assert_exact, differing, leaf, param, state, weights

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves


class Tied(torch.nn.Module):
    """``lm_head.weight`` tied to ``model.embed_tokens.weight``: the one object (``by="object"``) or two Parameter
    objects over one storage (``by="storage"``, tying by data). ``load``: ``"into-one"`` loads both names into the
    embedding (no tied-skip: the last one wins), ``"first-scaled"`` does so with the embedding's scaled (refused
    at its probe), ``"each-own"`` loads each name into its own parameter."""

    def __init__(self, by: str = "object", load: str = "into-one") -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Module()
        self.model.embed_tokens.weight = param(16, H)
        self.lm_head = torch.nn.Module()
        embedding = self.model.embed_tokens.weight
        self.lm_head.weight = embedding if by == "object" else torch.nn.Parameter(embedding.data, requires_grad=False)
        self.load = load

    def spec(self) -> Spec:
        return {"model.embed_tokens.weight": ("BF16", (16, H)), "lm_head.weight": ("BF16", (16, H))}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            head = name.startswith("lm_head")
            if self.load == "each-own":
                (self.lm_head if head else self.model.embed_tokens).weight.data.copy_(w)
            else:
                self.model.embed_tokens.weight.data.copy_(w if head or self.load == "into-one" else w * 2)


@pytest.mark.parametrize("load", ["into-one", "first-scaled"])
def test_a_tied_head_loaded_under_both_names_serves_the_last_one_loaded(load: str) -> None:
    """Both probes land in one place: the group load leaves lm_head's values there, so the embedding is misplaced
    (or refused: scaled) and left out; ``lm_head``, whose place is the embedding's, leaves with it, or the map
    would write lm_head and the reload of the embedding overwrite it."""
    assert_exact(Tied(load=load))


class SharedLayers(torch.nn.Module):
    """Layers 0 and 1 share one parameter (``by="object"``) or one storage (``by="storage"``); the checkpoint holds
    both names, each loaded into its layer's parameter."""

    def __init__(self, by: str = "object") -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
        self.layers[0].w = param(H, H)
        shared = self.layers[0].w
        self.layers[1].w = shared if by == "object" else torch.nn.Parameter(shared.data, requires_grad=False)
        self.layers[2].w = param(H, H)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.w": ("BF16", (H, H)) for i in range(3)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            self.layers[leaf(name)[0]].w.data.copy_(w)


def test_a_parameter_shared_by_two_layers_is_never_probed_live() -> None:
    """``layers.1`` has no parameter of its own (the shared one is grouped under ``layers.0``): every group that
    names a shared parameter swaps it for stand-ins, so no probe lands in a live weight."""
    model = SharedLayers()
    spec = model.spec()
    model.load_weights(list(weights(spec, 1).items()))
    before = state(model)
    try:
        build_map(model, spec, model.load_weights)
    except MapCorruption:
        pass
    assert differing(before, state(model)) == []


@pytest.mark.parametrize(
    "make", [lambda: Tied(by="storage", load="each-own"), lambda: SharedLayers(by="storage")], ids=["tied", "shared"]
)
def test_two_parameters_over_one_storage_are_neither_mapped(make) -> None:
    """Two Parameter objects over one storage (``Parameter(other.data)``) would each get stand-ins of their own,
    both tensors would land "right", and the map's writes would not commute (they run on threads), the first
    tensor's audit reading the second's values. Parameters whose memory overlaps another parameter object's are
    shared, and the tensors landing in them are left out (reloaded in checkpoint order, which is a whole reload:
    a deep copy would untie a reference, so the map itself is asserted). The weights are as they were."""
    model = make()
    spec = model.spec()
    model.load_weights(list(weights(spec, 1).items()))
    before = state(model)
    pm = build_map(model, spec, model.load_weights)
    assert not pm.runs and set(pm.unmapped) == set(spec), (sorted(pm.runs), pm.unmapped)
    assert all("shares memory" in why for why in pm.unmapped.values()), pm.unmapped
    assert differing(before, state(model)) == []
