"""Publisher in one process: exact versions, back-pressure, coalescing, failures, names, anchors."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import (
    LocalStore,
    ObjectWriter,
    StoreError,
    _commit,
    compute_delta,
    list_versions,
    read_manifest,
    read_weights,
)
from deltasync._sharding import TensorView, dense_entries, globalize
from deltasync.config import PublisherConfig
from deltasync.names import NameMap, checkpoint_state
from deltasync.publisher import Publisher
from deltasync.sketch import parse_sketch, tensor_sketch
from deltasync.testing.models import TINY_QWEN3_CONFIG, qwen3_shapes
from deltasync.testing.stream import UpdateStream
from tests.conftest import SMALL_QWEN3, assert_bit_equal


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


def test_raw_anchors_between_packed_deltas_read_back_exact(
    local_store: LocalStore, update_stream: UpdateStream
) -> None:
    """``anchor_encoding="raw"`` (a cold replica skips the anchor's decode): anchors are raw, deltas stay
    packed, the shards say so, and every version reads back bit-exact from the anchors and through the deltas."""
    truth = {}
    config = PublisherConfig(anchor_every=3, anchor_bytes_fraction=None, anchor_encoding="raw")
    with Publisher(local_store, config=config) as pub:
        for step in range(7):
            weights = update_stream.bf16() if step == 0 else update_stream.step()
            truth[pub.publish(weights, step)] = {k: v.clone() for k, v in weights.items()}
    listing = list_versions(local_store)
    objects = [(x.version, k) for x in listing for k, has in (("anchor", x.anchor), ("delta", x.delta)) if has]
    encodings = {(v, k): read_manifest(local_store, v, k).encoding for v, k in objects}  # type: ignore[arg-type]
    assert [v for v, k in objects if k == "anchor"] == [0, 3, 6]
    assert {v for v, k in objects if k == "delta"} >= set(range(1, 7))
    assert all(e == ("raw" if k == "anchor" else "packed") for (_, k), e in encodings.items()), encodings
    for version, weights in truth.items():
        assert_bit_equal(read_weights(local_store, version), weights)
    with pytest.raises(ValueError, match="anchor_encoding must be raw, packed or None"):
        PublisherConfig(anchor_encoding="zstd")  # type: ignore[arg-type]


def test_every_manifest_carries_the_sketch_of_every_tensor(
    local_store: LocalStore, update_stream: UpdateStream
) -> None:
    """Format 1.2: each delta and anchor gives every tensor's sketch at its version; a tensor a delta leaves
    unchanged keeps the one before (carried forward, never recomputed)."""
    names = list(update_stream.bf16())
    weights = update_stream.bf16()
    truth = {}
    with Publisher(local_store, config=PublisherConfig(anchor_every=3, anchor_bytes_fraction=None)) as pub:
        for step in range(6):
            if step:  # sparse changes, and each step leaves two thirds of the tensors as they were
                stepped = update_stream.step()
                weights = {n: stepped[n] if i % 3 == step % 3 else weights[n] for i, n in enumerate(names)}
            truth[pub.publish(weights, step)] = {n: t.clone() for n, t in weights.items()}
    published = pub.published
    assert [(m.kind, m.version) for m in published] == [
        ("anchor", 0),
        ("delta", 1),
        ("delta", 2),
        ("delta", 3),
        ("anchor", 3),
        ("delta", 4),
        ("delta", 5),
    ]
    for m in published:
        assert m.format_version == "1.5" and list(m.tensors) == sorted(truth[m.version])
        for name, entry in m.tensors.items():
            assert entry.sketch == tensor_sketch(truth[m.version][name]), (m.kind, m.version, name)
        assert read_manifest(local_store, m.version, m.kind).tensors == m.tensors  # as committed
        if m.kind == "delta":  # the carried-forward path ran
            assert sum(e.nnz == 0 for e in m.tensors.values()) >= len(names) // 2, m.version


class _ThreadRanks:
    """torch.distributed's object collectives for ranks that are threads of one process (rank: thread-local)."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=10)
        self.box: list[Any] = [None] * world
        self.local = threading.local()

    def all_gather_object(self, out: list[object], obj: object, group: object = None) -> None:
        self.box[self.local.rank] = obj
        self.barrier.wait()
        out[:] = list(self.box)
        self.barrier.wait()

    def broadcast_object_list(self, objs: list[object], src: int = 0, group: object = None) -> None:
        if self.local.rank == src:
            self.box[src] = list(objs)
        self.barrier.wait()
        objs[:] = self.box[src]
        self.barrier.wait()

    def run(
        self, ranks: Iterable[int], body: Callable[[int], None], failed: Callable[[int, BaseException], None]
    ) -> None:
        """``body(r)`` for each rank ``r`` of ``ranks``, in a thread of its own whose rank is ``r``, waiting up to
        20 s for each. A rank that raises is reported as ``failed(r, exc)`` and breaks the barrier, so that the other
        ranks do not wait for it."""

        def thread(r: int) -> None:
            self.local.rank = r
            try:
                body(r)
            except BaseException as exc:  # reported to failed; the other rank must not wait for this one
                failed(r, exc)
                self.barrier.abort()

        threads = [threading.Thread(target=thread, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)


def test_two_ranks_spans_sum_to_each_tensors_sketch(local_store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP in one process: rank 0 sums the ranks' span sketches, and a span a rank did not change keeps its
    sketch from the version before (here rank 1's rows of ``w`` at v1, rank 0's at v2)."""
    ranks = _ThreadRanks(2)
    monkeypatch.setattr(_commit, "dist", ranks)
    spans = {0: (0, 16), 1: (16, 28)}  # w is 7 x 4: rows 0-3 on rank 0, rows 4-6 on rank 1; b is rank 0's alone
    views = {r: {"w": TensorView((7, 4), spans[r], True), "b": TensorView((3,), None, r == 0)} for r in spans}
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(7, 4, generator=g).bfloat16(), "b": torch.randn(3, generator=g).bfloat16()}
    truth = [{n: t.clone() for n, t in full.items()}]
    for rows, b in (((0, 2), False), ((5,), False), ((), True)):  # v1: rank 0's rows; v2: rank 1's; v3: b only
        full = {n: t.clone() for n, t in full.items()}
        for row in rows:
            full["w"][row] += 1
        if b:
            full["b"] += 1
        truth.append(full)

    def local(r: int, v: int) -> dict[str, torch.Tensor]:
        rows = truth[v]["w"][spans[r][0] // 4 : spans[r][1] // 4].clone()
        return {"w": rows, "b": truth[v]["b"].clone()} if r == 0 else {"w": rows}

    errors: list[BaseException] = []

    def rank(r: int) -> None:  # what Publisher._process does on each rank
        commit = _commit.RankCommit(ObjectWriter(store=local_store), None, None, rank=r, world=2, group="gloo")
        anchor = dense_entries(local(r, 0), views[r])
        served = {d.ckpt_name: parse_sketch(str(d.sketch)) for d in anchor}
        commit.publish(0, "anchor", anchor, base_version=None, views=views[r], dtype_name="BF16")
        for v in range(1, len(truth)):
            prev, new = local(r, v - 1), local(r, v)
            deltas = []
            # the span's sketch moved by the changes only, as the publisher keeps it (checked whole below)
            for d in compute_delta(prev, new, checksums=True).values():
                name = d.ckpt_name
                entry, served[name] = globalize(d, new[name], views[r][name], served=served[name])
                deltas.append(entry)
            commit.publish(v, "delta", deltas, base_version=v - 1, views=views[r], dtype_name="BF16")

    ranks.run(spans, rank, lambda _, exc: errors.append(exc))
    assert not errors, errors
    assert [x.version for x in list_versions(local_store)] == [0, 1, 2, 3]
    for v, expected in enumerate(truth):
        m = read_manifest(local_store, v, "anchor" if v == 0 else "delta")
        assert {n: e.sketch for n, e in m.tensors.items()} == {n: tensor_sketch(t) for n, t in expected.items()}, v
        assert_bit_equal(read_weights(local_store, v), expected)
    # a rank that changed nothing wrote nothing: its span's sketch came from the version before
    files = [[s.file for s in read_manifest(local_store, v).shards] for v in (1, 2, 3)]
    assert files == [["shard-00000.safetensors"], ["shard-00001.safetensors"], ["shard-00000.safetensors"]]


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
