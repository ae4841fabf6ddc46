"""Publisher in one process: exact versions, back-pressure, coalescing, failures, names, anchors."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from deltasync import LocalStore, StoreError, list_versions, read_manifest, read_weights
from deltasync.config import PublisherConfig
from deltasync.names import NameMap, checkpoint_state
from deltasync.publisher import Publisher
from tests.conftest import SMALL_QWEN3, assert_bit_equal
from tests.support.models import TINY_QWEN3_CONFIG, qwen3_shapes
from tests.support.stream import UpdateStream


def test_twenty_step_stream_every_version_exact(local_store: LocalStore, update_stream: UpdateStream) -> None:
    truth = {}
    with Publisher(local_store, config=PublisherConfig(anchor_every=7, anchor_bytes_fraction=None)) as pub:
        for step in range(21):
            weights = update_stream.bf16() if step == 0 else update_stream.step()
            version = pub.publish(weights, step)
            truth[version] = {k: v.clone() for k, v in weights.items()}
    assert sorted(truth) == list(range(21))
    listing = list_versions(local_store)
    assert [x.version for x in listing if x.anchor] == [0, 7, 14]
    for version, weights in truth.items():
        assert_bit_equal(read_weights(local_store, version), weights)


def test_module_publishing_with_fp32_master_weights(local_store: LocalStore) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Publisher(local_store) as pub:
        for step in range(4):
            loss = model(torch.randn(16, 64)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            pub.publish(model, step)
            expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
            pub.flush()
            assert_bit_equal(read_weights(local_store, step), expected)


def test_back_pressure_blocks_and_keeps_exactness(tmp_path: Path, update_stream: UpdateStream) -> None:
    gate = threading.Event()

    class GatedStore(LocalStore):  # the first write waits for the test: the worker is busy until then
        def put(self, key, data):
            gate.wait(10)
            super().put(key, data)

    store = GatedStore(tmp_path / "gated")
    truth = {}
    with Publisher(store, config=PublisherConfig(queue_size=1)) as pub:
        for step in range(2):  # one being written, one queued
            weights = update_stream.step()
            truth[pub.publish(weights, step)] = weights
        third = update_stream.step()
        done = threading.Event()

        def publish_third() -> None:
            truth[pub.publish(third, 2)] = third
            done.set()

        t = threading.Thread(target=publish_third)
        t.start()
        assert not done.wait(0.3)  # the queue is full: publish waits for the worker
        gate.set()
        t.join(10)
        assert done.is_set() and pub.last_blocked_s > 0.25
        for step in range(3, 6):
            weights = update_stream.step()
            truth[pub.publish(weights, step)] = weights
    for version, weights in truth.items():
        assert_bit_equal(read_weights(store, version), weights)


def test_coalescing_merges_into_one_exact_delta(tmp_path: Path, update_stream: UpdateStream) -> None:
    gate = threading.Event()

    class GatedStore(LocalStore):
        def put(self, key, data):
            gate.wait(10)
            super().put(key, data)

    store = GatedStore(tmp_path / "gated")
    pub = Publisher(
        store, config=PublisherConfig(queue_size=1, coalesce=True, anchor_every=None, anchor_bytes_fraction=None)
    )
    versions, truth = [], {}
    for step in range(5):  # v0 is in the worker (blocked), v1 queued, v2..v4 coalesce into the queued one
        weights = update_stream.step()
        versions.append(pub.publish(weights, step))
        truth[versions[-1]] = weights
        time.sleep(0.05)
    gate.set()
    pub.close()
    committed = [x.version for x in list_versions(store)]
    assert versions == [0, 1, 2, 3, 4] and committed == [0, 4]
    m = read_manifest(store, 4)
    assert m.base_version == 0
    assert_bit_equal(read_weights(store, 4), truth[4])


def test_a_background_failure_surfaces_on_the_next_call(tmp_path: Path, update_stream: UpdateStream) -> None:
    class BrokenStore(LocalStore):
        def put(self, key, data):
            if key.startswith("v00000001/"):
                raise StoreError(f"{self.uri}: could not write {key!r} (disk full)")
            super().put(key, data)

    pub = Publisher(BrokenStore(tmp_path / "b"))
    pub.publish(update_stream.step(), 0)
    pub.publish(update_stream.step(), 1)
    with pytest.raises(StoreError, match="disk full"):
        pub.flush()
    with pytest.raises(StoreError, match="disk full"):
        pub.publish(update_stream.step(), 2)
    with pytest.raises(StoreError):
        pub.close()
    assert [x.version for x in list_versions(pub.store)] == [0]  # v1 never committed


def test_a_restarted_publisher_continues_with_an_anchor(local_store: LocalStore, update_stream: UpdateStream) -> None:
    with Publisher(local_store) as pub:
        for step in range(3):
            pub.publish(update_stream.step(), step)
    weights = update_stream.step()
    with Publisher(local_store) as again:
        assert again.publish(weights, 3) == 3
    listing = list_versions(local_store)
    assert (listing[-1].version, listing[-1].anchor, listing[-1].delta) == (3, True, False)
    assert_bit_equal(read_weights(local_store, 3), weights)


def test_model_changes_are_refused(local_store: LocalStore) -> None:
    with Publisher(local_store) as pub:
        pub.publish({"w": torch.zeros(4)}, 0)
        with pytest.raises(ValueError, match=r"the model changed since the first publish \(\['w'\]\)"):
            pub.publish({"w": torch.zeros(5)}, 1)


def test_names_wrappers_and_tied_weights() -> None:
    names = NameMap()
    assert names("_orig_mod.module.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert names("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert names("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert NameMap(lambda n: None if n.startswith("value_head") else n)("value_head.weight") is None
    embed = torch.zeros(10, 4)
    state = {"lm_head.weight": embed, "model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4)}
    assert list(checkpoint_state(state)) == ["model.embed_tokens.weight", "model.norm.weight"]
    with pytest.raises(ValueError, match="both map to checkpoint name 'w'"):
        checkpoint_state({"module.w": torch.zeros(1), "w": torch.zeros(1)})


def test_tied_model_publishes_embeddings_once(local_store: LocalStore) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            **{**TINY_QWEN3_CONFIG, **{k: SMALL_QWEN3[k] for k in ("vocab_size", "hidden_size", "intermediate_size")}}
        )
    )
    with Publisher(local_store) as pub:
        pub.publish(model, 0)
    weights = read_weights(local_store, 0)
    assert "lm_head.weight" not in weights
    assert set(weights) == set(qwen3_shapes(SMALL_QWEN3))


def test_lora_is_published_merged(local_store: LocalStore) -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(16, 8, bias=False))
    lora = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], init_lora_weights=False)
    )
    reference = lora.base_model.model.proj.base_layer.weight.detach().clone()
    with Publisher(local_store, merge_lora=True) as pub:
        pub.publish(lora, 0)
    published = read_weights(local_store, 0)
    assert list(published) == ["proj.weight"]
    layer = lora.base_model.model.proj
    expected = (reference.float() + layer.get_delta_weight("default").float()).to(torch.bfloat16)
    assert torch.equal(published["proj.weight"], expected)
    assert torch.equal(layer.base_layer.weight, reference)  # the trainer's weights were not touched
