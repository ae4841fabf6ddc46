"""A MoE model as transformers 5 builds it (experts fused into 3-D parameters) publishes the checkpoint's per-expert
tensors: the names ``save_pretrained`` writes and vLLM's loaders take, bit for bit, as views of the trainer's
parameters; a step that moves one expert publishes that expert's slice only; a fused layout that cannot be split
is refused naming the tensor."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from deltasync import LocalStore, read_manifest, read_weights
from deltasync._sharding import local_tensors
from deltasync.config import PublisherConfig
from deltasync.names import QWEN_MOE_EXPERTS, NameMap
from deltasync.publisher import Publisher
from deltasync.testing.models import build_tiny_model
from tests.conftest import assert_bit_equal

FAMILIES = {  # one expert's names in layer 1 of the checkpoint, and the router's
    "qwen3_moe": ("model.layers.1.mlp.experts.2.{}.weight", ("gate_proj", "up_proj", "down_proj"), "mlp.gate"),
    "qwen2_moe": ("model.layers.1.mlp.experts.2.{}.weight", ("gate_proj", "up_proj", "down_proj"), "mlp.gate"),
    "mixtral": ("model.layers.1.block_sparse_moe.experts.2.{}.weight", ("w1", "w3", "w2"), "block_sparse_moe.gate"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = str(request.param)
    return arch, build_tiny_model(tmp_path_factory.mktemp("moe") / arch, arch=arch, seed=3)


def _load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def test_published_tensors_are_the_checkpoints_bit_for_bit(moe_dir: tuple[str, Path]) -> None:
    arch, path = moe_dir
    checkpoint = load_file(path / "model.safetensors")
    model = _load(path)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dim() == 3  # transformers fuses the experts
    local, views = local_tensors(model, name_map=NameMap(), rank=0)
    assert_bit_equal(local, checkpoint)
    assert set(views) == set(checkpoint)
    pattern, (gate, up, down), router = FAMILIES[arch]
    assert f"model.layers.1.{router}.weight" in local
    if arch == "qwen2_moe":  # the shared expert and its gate beside the routed experts
        assert {
            "model.layers.1.mlp.shared_expert.up_proj.weight",
            "model.layers.1.mlp.shared_expert_gate.weight",
        } <= set(local)
    # views of the trainer's own parameters: the publisher reads them, it never copies the experts
    fused = model.model.layers[1].mlp.experts
    inter = fused.down_proj.shape[2]
    for name, source in (
        (gate, fused.gate_up_proj[2, :inter]),
        (up, fused.gate_up_proj[2, inter:]),
        (down, fused.down_proj[2]),
    ):
        part = local[pattern.format(name)]
        assert part.dim() == 2 and part.data_ptr() == source.data_ptr() and part.shape == source.shape


def test_a_step_that_moves_one_expert_publishes_only_its_slice(moe_dir: tuple[str, Path], tmp_path: Path) -> None:
    arch, path = moe_dir
    model = _load(path)
    pattern, (gate, up, down), _ = FAMILIES[arch]
    experts = model.model.layers[1].mlp.experts
    inter = experts.down_proj.shape[2]
    store = LocalStore(tmp_path / "store")
    with Publisher(store, config=PublisherConfig(anchor_every=100, anchor_bytes_fraction=None)) as pub:
        pub.publish(model, 0)
        with torch.no_grad():
            experts.gate_up_proj[2, inter + 3, :5] += 1.0  # up rows of expert 2
            experts.down_proj[2, 7, 1] -= 1.0
        pub.publish(model, 1)
    manifest = read_manifest(store, 1, "delta")
    assert {n: e.nnz for n, e in manifest.tensors.items() if e.nnz} == {pattern.format(up): 5, pattern.format(down): 1}
    model.save_pretrained(tmp_path / "after")
    assert_bit_equal(read_weights(store, 1), load_file(tmp_path / "after" / "model.safetensors"))
    assert pattern.format(gate) in manifest.tensors


def test_a_fused_layout_that_cannot_be_split_is_refused(moe_dir: tuple[str, Path], tmp_path: Path) -> None:
    arch, path = moe_dir
    model = _load(path)
    experts = model.model.layers[0].mlp.experts
    hidden = experts.down_proj.shape[1]
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(experts.num_experts, 127, hidden, dtype=torch.bfloat16))
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    e, gate_up = experts.num_experts, 2 * experts.down_proj.shape[2]
    parts = "w1/w3" if arch == "mixtral" else "gate_proj/up_proj"
    message = (
        f"tensor 'model.layers.0.{block}.experts.gate_up_proj': fused experts of shape ({e}, 127, {hidden}) cannot "
        f"be split into the checkpoint's per-expert {parts} tensors: expected ({e}, {gate_up}, {hidden}). Give the "
        "model transformers' expert layout, or leave the tensor out with NameMap(rename=...)"
    )
    store = LocalStore(tmp_path / "store")
    with Publisher(store) as pub, pytest.raises(ValueError, match=re.escape(message)):
        pub.publish(model, 0)
    assert list(store.list("")) == ["run.json"]  # no version was written


def test_a_state_dict_with_fused_experts_needs_their_names() -> None:
    gate_up = torch.randn(2, 4, 8).to(torch.bfloat16).transpose(1, 2)  # strided: split by indexing, not unbind
    down = torch.randn(2, 4, 4).to(torch.bfloat16)
    state = {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down}
    message = (
        "tensor 'model.layers.0.mlp.experts.gate_up_proj' of shape (2, 8, 4) holds a layer's experts fused "
        "(transformers' layout) and this model's checkpoint names for them are unknown (a published model's "
        "config.model_type picks them for ['mixtral', 'qwen2_moe', 'qwen3_moe']): pass "
        "NameMap(experts=ExpertNames(gate=..., up=..., down=...))"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        local_tensors(state, name_map=NameMap(), rank=0)
    local, views = local_tensors(state, name_map=NameMap(experts=QWEN_MOE_EXPERTS), rank=0)
    assert sorted(local) == [
        f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in (0, 1) for p in ("down_proj", "gate_proj", "up_proj")
    ]
    assert views["model.layers.0.mlp.experts.1.gate_proj.weight"].shape == (4, 4)
    assert views["model.layers.0.mlp.experts.1.down_proj.weight"].shape == (4, 4)
    p = "model.layers.0.mlp.experts.1."
    assert_bit_equal(
        {n: local[p + n] for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")},
        {"gate_proj.weight": gate_up[1, :4], "up_proj.weight": gate_up[1, 4:], "down_proj.weight": down[1]},
    )


def test_a_model_of_a_family_whose_expert_names_are_unknown_is_refused(tmp_path: Path) -> None:
    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4, dtype=torch.bfloat16))
            self.down_proj = torch.nn.Parameter(torch.zeros(2, 4, 4, dtype=torch.bfloat16))

    class Model(torch.nn.Module):
        config = SimpleNamespace(model_type="deepseek_v3")

        def __init__(self) -> None:
            super().__init__()
            self.experts = Experts()

    store = LocalStore(tmp_path / "store")
    with (
        Publisher(store) as pub,
        pytest.raises(ValueError, match=r"^tensor 'experts.gate_up_proj' of shape \(2, 8, 4\)"),
    ):
        pub.publish(Model(), 0)
    with Publisher(store, name_map=NameMap(experts=QWEN_MOE_EXPERTS)) as pub:
        pub.publish(Model(), 0)
    assert sorted(read_weights(store, 0))[:3] == [
        "experts.0.down_proj.weight",
        "experts.0.gate_proj.weight",
        "experts.0.up_proj.weight",
    ]
