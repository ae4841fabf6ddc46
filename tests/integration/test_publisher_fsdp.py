"""FSDP2 with 2 gloo ranks on CPU: each rank publishes its own rows, nothing is gathered, versions are exact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from deltasync import LocalStore, list_versions, read_manifest, read_weights
from deltasync.config import PublisherConfig
from deltasync.publisher import Publisher
from deltasync.sketch import tensor_sketch
from deltasync.testing.launchers import free_port
from tests.conftest import assert_bit_equal

pytestmark = pytest.mark.slow
STEPS = 6
BIG = "embed.weight"  # 4001 x 32: uneven rows across 2 ranks (2001 + 2000)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4001, 32)
        self.proj = torch.nn.Linear(32, 7)  # 7 rows: 4 + 3
        self.head = torch.nn.Linear(7, 3)  # 3 rows: 2 + 1
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(self.norm(self.embed(ids)))))


class AllocationProbe(TorchDispatchMode):
    """Records the largest tensor any torch op produces (float64 apart: the sketch's exact scratch), and what
    every collective moves (this thread)."""

    def __init__(self, record: dict) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if "c10d" in name or "gather" in name or "all_reduce" in name:
            self.record["collectives"].add((name, tuple(sorted({str(t.dtype) for t in inputs}))))
        seen = {t.untyped_storage().data_ptr() for t in inputs if type(t) is torch.Tensor}
        for t in torch.utils._pytree.tree_leaves(out):
            # only plain tensors with a storage of their own allocate: views and aliases share their input's
            # storage, and a DTensor reports its global size while its local ops are seen on their own
            if type(t) is torch.Tensor and t.untyped_storage().data_ptr() not in seen:
                nbytes = t.untyped_storage().nbytes()
                if t.dtype == torch.float64:
                    self.record["f64_bytes"] = max(self.record["f64_bytes"], nbytes)
                elif nbytes > self.record["max_bytes"]:
                    self.record["max_bytes"], self.record["max_op"] = nbytes, name
        return out


def _rank(rank: int, world: int, port: int, tmp: str) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Model()
    for module in (model.embed, model.proj, model.head, model.norm):
        fully_shard(module)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    record = {"max_bytes": 0, "f64_bytes": 0, "collectives": set()}
    pub = Publisher(LocalStore(Path(tmp) / "store"), config=PublisherConfig(anchor_every=4, anchor_bytes_fraction=None))
    process = pub._process

    def probed(item):
        with AllocationProbe(record):
            return process(item)

    pub._process = probed
    torch.manual_seed(1 + rank)
    for step in range(STEPS):
        loss = model(torch.randint(0, 4001, (8, 5))).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with AllocationProbe(record):
            version = pub.publish(model, step)
        pub.flush()
        truth = {n: p.full_tensor().detach().to(torch.bfloat16) for n, p in model.named_parameters()}  # test only
        if rank == 0:
            torch.save(truth, Path(tmp) / f"truth-{version}.pt")
    pub.close()
    torch.save(
        {
            "max_bytes": record["max_bytes"],
            "max_op": record.get("max_op"),
            "f64_bytes": record["f64_bytes"],
            "collectives": sorted(record["collectives"]),
        },
        Path(tmp) / f"probe-{rank}.pt",
    )
    dist.destroy_process_group()


def test_fsdp2_two_ranks_exact_without_a_gather(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    store = LocalStore(tmp_path / "store")
    assert [x.version for x in list_versions(store)] == list(range(STEPS))
    assert [x.version for x in list_versions(store) if x.anchor] == [0, 4]
    for v in range(STEPS):
        truth = torch.load(tmp_path / f"truth-{v}.pt")
        assert_bit_equal(read_weights(store, v), truth)
        # every manifest gives each tensor's sketch: rank 0 sums the ranks' span sketches, old spans carried forward
        for kind in ["delta"] * (v > 0) + ["anchor"] * (v in (0, 4)):
            sketches = {n: e.sketch for n, e in read_manifest(store, v, kind).tensors.items()}
            assert sketches == {n: tensor_sketch(t) for n, t in truth.items()}, (kind, v)
    for v in range(1, STEPS):
        m = read_manifest(store, v)
        assert [s.file for s in m.shards] == ["shard-00000.safetensors", "shard-00001.safetensors"]
        assert len(m.tensors[BIG].checksums) == 2 and m.tensors[BIG].checksums[0][:2] == (0, 2001 * 32)
    full_bf16_bytes = 4001 * 32 * 2  # what one gathered copy of the big tensor would take
    for rank in range(2):
        probe = torch.load(tmp_path / f"probe-{rank}.pt")
        gathers = [(name, dtypes) for name, dtypes in probe["collectives"] if "gather" in name]
        # the only gathers are the publisher's metadata (object collectives: int64 sizes, uint8 pickles)
        assert gathers and all(set(dtypes) <= {"torch.int64", "torch.uint8"} for _, dtypes in gathers), gathers
        assert 0 < probe["max_bytes"] <= 2001 * 32 * 2 < full_bf16_bytes, probe  # never a full-size tensor
        # the sketch reads a span's 16-bit words as exact float64 (deltasync.sketch): a rank's span at most
        assert probe["f64_bytes"] <= 2001 * 32 * 8 < 4 * full_bf16_bytes, probe


def _adapter_rank(rank: int, world: int, port: int, tmp: str, model_dir: str) -> None:
    """A LoRA adapter trained under FSDP2: every decoder layer and the model sharded; each rank publishes the rows
    of the adapter's tensors it holds."""
    import peft
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from deltasync.lora import adapter_entry, adapter_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    entry = adapter_entry(model)  # before sharding: the base model as a single process sees it
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert adapter_entry(model) == entry  # the same adapter and base, sharded
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    pub = Publisher(LocalStore(Path(tmp) / "store"), config=PublisherConfig(anchor_bytes_fraction=None), adapter=entry)
    torch.manual_seed(1 + rank)
    for step in range(3):
        if step:
            loss = model(input_ids=torch.randint(0, 512, (2, 6))).logits.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        version = pub.publish(model, step)
        pub.flush()
        truth = {
            n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().to(torch.bfloat16)
            for n, t in adapter_state(model).items()
        }  # test only
        if rank == 0:
            torch.save(truth, Path(tmp) / f"adapter-truth-{version}.pt")
    pub.close()
    dist.destroy_process_group()


def test_fsdp2_two_ranks_publish_an_adapter_exact_without_a_gather(tmp_path: Path, tiny_model_dir: Path) -> None:
    pytest.importorskip("peft")
    mp.spawn(_adapter_rank, args=(2, free_port(), str(tmp_path), str(tiny_model_dir)), nprocs=2, join=True)
    store = LocalStore(tmp_path / "store")
    assert [x.version for x in list_versions(store)] == [0, 1, 2]
    for v in range(3):
        truth = torch.load(tmp_path / f"adapter-truth-{v}.pt")
        assert truth and all(".lora_" in n for n in truth)
        assert_bit_equal(read_weights(store, v), truth)
        m = read_manifest(store, v, "anchor" if v == 0 else "delta")
        assert m.adapter is not None and m.adapter.r == 8
        assert [s.file for s in m.shards] == ["shard-00000.safetensors", "shard-00001.safetensors"]  # one per rank
    assert not torch.equal(*(torch.load(tmp_path / f"adapter-truth-{v}.pt")[sorted(truth)[1]] for v in (0, 2)))
