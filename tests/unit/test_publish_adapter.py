"""A PEFT LoRA adapter published as itself: its own tensors by PEFT's names, every manifest naming the
adapter (rank, alpha, targets) and the fingerprint of its base, which equals the fingerprint the base model's own
publisher gives; what a reader rebuilds equals the trainer's adapter bit for bit, at every version."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import AdapterEntry, DeltaManifest, Publisher, ShardEntry, TensorEntry, UpdateRefused, read_weights
from deltasync.apply import Holding, admit
from deltasync.config import AgentConfig, PublisherConfig
from deltasync.errors import RefusalReason
from deltasync.lora import adapter_entry, adapter_state
from deltasync.store import LocalStore
from deltasync.testing.models import peft_model
from tests.conftest import assert_bit_equal

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _peft_model(tiny_model_dir: Path, **config: Any) -> torch.nn.Module:
    """Rank 4, alpha 8 on :data:`TARGETS` unless ``config`` says otherwise; PEFT's own initialization (B = 0)."""
    settings = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **config}
    return peft_model(tiny_model_dir, seed=0, rank=settings.pop("r"), random=False, **settings)


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
    assert {m.format_version for m in published} == {"1.5"}
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
        ({"use_dora": True}, "use_dora=True"),
        ({"rank_pattern": {"q_proj": 8}}, r"rank_pattern=\{'q_proj': 8\}"),
        ({"alpha_pattern": {"v_proj": 32}}, r"alpha_pattern=\{'v_proj': 32\}"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa' .it rewrites the base weights"),
        ({"init_lora_weights": "olora"}, "init_lora_weights='olora'"),
        ({"layers_to_transform": [0]}, r"layers_to_transform=\[0\]"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save="),
        ({"exclude_modules": ["layers.0.self_attn.q_proj"]}, "exclude_modules="),
        ({"layer_replication": [[0, 2]]}, "layer_replication="),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"target_modules": ".*proj"}, "as a pattern"),
        ({"lora_bias": True}, "lora_bias=True"),
        ({"target_modules": ["embed_tokens", "q_proj"]}, r"embedding targets \['embed_tokens'\]"),
    ],
    ids=[
        "dora",
        "rank-pattern",
        "alpha-pattern",
        "pissa",
        "olora",
        "layers-to-transform",
        "modules-to-save",
        "exclude-modules",
        "layer-replication",
        "bias",
        "regex",
        "lora-bias",
        "embedding",
    ],
)
def test_an_adapter_an_engine_cannot_serve_as_one_is_refused_at_once(
    tiny_model_dir: Path, config: dict[str, object], why: str
) -> None:
    import warnings

    with warnings.catch_warnings():  # PEFT warns that the tied embedding would be adapted
        warnings.simplefilter("ignore")
        model = _peft_model(tiny_model_dir, **config)
    with pytest.raises(ValueError, match=why):
        adapter_entry(model)


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal"])
def test_an_initialization_that_leaves_the_base_alone_is_published(tiny_model_dir: Path, init: object) -> None:
    """PEFT's initializations that only set the adapter's first weights leave a plain LoRA adapter behind."""
    assert adapter_entry(_peft_model(tiny_model_dir, init_lora_weights=init)).r == 4


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


# ------------------------------------------------------------------ admission: an adapter's objects, and no other


def _manifest(adapter: AdapterEntry | None) -> DeltaManifest:
    """An anchor of a rank-8 adapter of one ``q_proj`` (16 x 16)."""
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {
        f"{prefix}.lora_{k}.weight": TensorEntry(
            shape=shape, dtype="BF16", nnz=128, shards=(0,), checksums=((0, 128, "xxh3_128:" + "0" * 32),)
        )
        for k, shape in (("A", (8, 16)), ("B", (16, 8)))
    }
    shard = ShardEntry(file="shard-00000.safetensors", bytes=1, sha256="0" * 64)
    return DeltaManifest(
        kind="anchor", version=3, base_version=None, encoding="raw", shards=(shard,), tensors=tensors, adapter=adapter
    )


BASE = "sha256:" + "1" * 64
ENTRY = AdapterEntry(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), base_fingerprint=BASE)


@pytest.mark.parametrize(
    ("holding", "adapter", "message"),
    [
        (Holding(), ENTRY, "run its agent with --apply-mode lora"),
        (Holding(adapter_base=BASE), None, "is a model's own weights"),
        (Holding(adapter_base="sha256:" + "2" * 64), ENTRY, "an adapter for another base model"),
        (Holding(adapter_base="unknown"), ENTRY, "an adapter for another base model"),
        (
            Holding(adapter_base=BASE, adapter=dataclasses.replace(ENTRY, lora_alpha=32)),
            ENTRY,
            "lora_alpha 32 here, 16 in the object",
        ),
        (
            Holding(adapter_base=BASE, adapter=dataclasses.replace(ENTRY, use_rslora=True)),
            ENTRY,
            "use_rslora True here, False in the object",
        ),
    ],
    ids=["adapter-to-full-weights", "weights-to-adapter", "other-base", "unknown-base", "other-alpha", "rslora"],
)
def test_an_object_that_is_not_a_version_of_the_served_adapter_is_refused(
    holding: Holding, adapter: AdapterEntry | None, message: str
) -> None:
    with pytest.raises(UpdateRefused, match=message) as exc:
        admit(_manifest(adapter), holding, where="store/v3")
    assert exc.value.reason is RefusalReason.MODEL


def test_a_version_of_the_served_adapter_is_admitted_and_becomes_the_served_one() -> None:
    holding = Holding(adapter_base=BASE)  # no adapter yet: the first anchor defines it
    admit(_manifest(ENTRY), holding, where="store/v3")
    after = holding.after(_manifest(ENTRY))
    assert after.adapter == ENTRY and after.adapter_base == BASE
    admit(_manifest(ENTRY), after, where="store/v3")
    admit(_manifest(None), Holding(), where="store/v3")  # full weights to a full-weights receiver, as before


@pytest.mark.parametrize(
    "fields",
    [{"apply_mode": "lora"}, {"adapter_dir": "/srv/adapter"}, {"apply_mode": "lora", "adapter_dir": "relative/dir"}],
    ids=["no-dir", "dir-without-mode", "relative"],
)
def test_the_agent_config_names_the_served_adapter_directory_with_lora_mode_only(fields: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="apply_mode lora goes with adapter_dir"):
        AgentConfig(**fields)  # type: ignore[arg-type]
    assert AgentConfig(apply_mode="lora", adapter_dir="/srv/adapter").adapter_dir == "/srv/adapter"


def test_an_initialization_that_rewrote_the_base_is_refused(tiny_model_dir: Path) -> None:
    """LoRA-GA subtracts its first B A from each adapted base weight while it initializes (PEFT 0.21): the saved
    adapter is wrong on the served base, as PiSSA's is."""
    model = _peft_model(tiny_model_dir)
    model.peft_config["default"].init_lora_weights = "lora_ga"
    with pytest.raises(ValueError, match="init_lora_weights='lora_ga' .it rewrites the base weights"):
        adapter_entry(model)


def test_the_adapter_published_is_the_one_the_entry_describes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A model with two adapters (a frozen reference and the one trained): the publisher publishes the active one,
    or the one named in adapter_entry, never PEFT's 'default' by accident."""
    peft = pytest.importorskip("peft")
    model = _peft_model(tiny_model_dir)
    model.add_adapter("policy", peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    model.set_adapter("policy")
    _step(model, 1)
    policy = {k: v.to(torch.bfloat16) for k, v in adapter_state(model, "policy").items()}
    default = {k: v.to(torch.bfloat16) for k, v in adapter_state(model, "default").items()}
    assert any(not torch.equal(policy[n], default[n]) for n in policy)
    for entry in (adapter_entry(model), adapter_entry(model, adapter="policy")):
        store = LocalStore(tmp_path / f"s-{id(entry)}")
        with Publisher(store, adapter=entry) as pub:
            pub.publish(model)
        assert_bit_equal(read_weights(store, 0), policy)
    model.set_adapter("default")  # the entry names policy: what it publishes does not follow the active one
    store = LocalStore(tmp_path / "named")
    with Publisher(store, adapter=adapter_entry(model, adapter="policy")) as pub:
        pub.publish(model)
    assert_bit_equal(read_weights(store, 0), policy)
    with pytest.raises(ValueError, match="has no adapter 'nope'"):
        adapter_entry(model, adapter="nope")
