"""A PEFT LoRA adapter published as itself (issue 24): its own tensors by PEFT's names, every manifest naming the
adapter (rank, alpha, targets) and the fingerprint of its base, which equals the fingerprint the base model's own
publisher gives; what a reader rebuilds equals the trainer's adapter bit for bit, at every version."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltasync import Publisher, read_weights
from deltasync.config import PublisherConfig
from deltasync.lora import adapter_entry, adapter_state
from deltasync.store import LocalStore
from tests.conftest import assert_bit_equal

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _peft_model(tiny_model_dir: Path, **config: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    lora = peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **config})
    return peft.get_peft_model(base, lora)


def _step(model: torch.nn.Module, seed: int) -> None:
    """A small update of every adapter matrix (B starts at zero, as PEFT initializes it; PEFT keeps adapters in
    float32, the publisher sends them in bf16)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 1e-2)


def test_an_adapter_publishes_as_itself_and_reads_back_bit_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = _peft_model(tiny_model_dir)
    entry = adapter_entry(model)
    store = LocalStore(tmp_path / "adapter")
    truth = {}
    with Publisher(store, config=PublisherConfig(anchor_every=3), adapter=entry) as pub:
        for step in range(5):
            _step(model, step)
            truth[pub.publish(model, step)] = {k: v.to(torch.bfloat16) for k, v in adapter_state(model).items()}
    published = pub.published
    assert {m.adapter for m in published} == {entry}
    assert {m.format_version for m in published} == {"1.4"}
    names = set(published[0].tensors)
    assert names and all(n.startswith("base_model.model.") and ".lora_" in n for n in names)
    assert len(names) == 2 * len(TARGETS) * 2  # A and B of each target, in each of the tiny model's 2 layers
    for version, expected in truth.items():
        assert_bit_equal(read_weights(store, version), expected)
    # the adapter is small: a delta is the adapter's changed elements, not the base model's
    assert max(m.numel for m in published) == sum(t.numel() for t in truth[0].values())

    # the base fingerprint is what the base model's own publisher calls the model
    with Publisher(LocalStore(tmp_path / "base")) as base_pub:
        base_pub.publish(model.get_base_model())
    assert entry.base_fingerprint == base_pub.published[0].model_fingerprint
    assert (entry.r, entry.lora_alpha, entry.target_modules) == (4, 8, tuple(sorted(TARGETS)))


def test_another_rank_or_alpha_is_another_adapter(tiny_model_dir: Path) -> None:
    entry = adapter_entry(_peft_model(tiny_model_dir))
    assert adapter_entry(_peft_model(tiny_model_dir, r=8)) != entry
    other = adapter_entry(_peft_model(tiny_model_dir, lora_alpha=16))
    assert other != entry and "lora_alpha 8 here, 16 in the object" in other.describe_difference(entry)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"target_modules": ".*proj"}, "as a pattern"),
    ],
    ids=["dora", "rank-pattern", "bias", "regex"],
)
def test_an_adapter_an_engine_cannot_serve_as_one_is_refused_at_once(
    tiny_model_dir: Path, config: dict[str, object], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        adapter_entry(_peft_model(tiny_model_dir, **config))


def test_an_adapter_publisher_refuses_full_weights_and_merging(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = _peft_model(tiny_model_dir)
    entry = adapter_entry(model)
    with pytest.raises(ValueError, match="choose one"):
        Publisher(LocalStore(tmp_path / "s0"), adapter=entry, merge_lora=True)
    pub = Publisher(LocalStore(tmp_path / "s1"), adapter=entry)
    try:
        with pytest.raises(ValueError, match="adapter tensors"):
            pub.publish(model.get_base_model().state_dict())
    finally:
        pub.close()
    assert pub.published == []
