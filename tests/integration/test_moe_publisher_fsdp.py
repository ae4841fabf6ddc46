"""FSDP2 with 2 gloo ranks on CPU: a MoE model whose experts transformers fuses publishes, each rank its own experts
and without a gather, the same per-expert checkpoint tensors as the same model in one process."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltasync import LocalStore, list_versions, read_manifest, read_weights
from deltasync.config import PublisherConfig
from deltasync.publisher import Publisher
from deltasync.testing.launchers import free_port
from deltasync.testing.models import TINY_QWEN2_MOE_CONFIG, build_tiny_model
from tests.conftest import assert_bit_equal
from tests.integration.test_publisher_fsdp import AllocationProbe

pytestmark = pytest.mark.slow
STEPS = 3
EXPERTS = 5  # FSDP2 splits dim 0, the experts: 3 on rank 0, 2 on rank 1
CONFIG = PublisherConfig(anchor_every=100, anchor_bytes_fraction=None)


def _load(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def _move(model: torch.nn.Module, step: int) -> None:
    """A sparse change of every parameter, the same whether the model is whole or sharded: each parameter's change
    is drawn whole from a seed of its own and each rank adds its own rows of it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(model.named_parameters())):
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i))
            change = torch.where(noise.abs() > 2.0, noise, torch.zeros(())).to(p.dtype)
            if isinstance(p, DTensor):
                rows, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                if rows[0]:
                    p.to_local().add_(change[offset[0] : offset[0] + rows[0]])
            else:
                p.add_(change)


def _rank(rank: int, world: int, port: int, tmp: str) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _load(str(Path(tmp) / "model"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    record: dict[str, Any] = {"max_bytes": 0, "f64_bytes": 0, "collectives": set()}
    pub = Publisher(LocalStore(Path(tmp) / "fsdp"), config=CONFIG)
    process = pub._process

    def probed(item: Any) -> Any:
        with AllocationProbe(record):
            return process(item)

    pub._process = probed  # type: ignore[method-assign]
    for step in range(STEPS):
        if step:
            _move(model, step)
        with AllocationProbe(record):
            pub.publish(model, step)
        pub.flush()
    pub.close()
    torch.save(sorted(record["collectives"]), Path(tmp) / f"collectives-{rank}.pt")
    dist.destroy_process_group()


def test_fsdp2_ranks_publish_the_plain_models_experts_without_a_gather(tmp_path: Path) -> None:
    build_tiny_model(
        tmp_path / "model", arch="qwen2_moe", seed=5, config=TINY_QWEN2_MOE_CONFIG | {"num_experts": EXPERTS}
    )
    model = _load(str(tmp_path / "model"))
    with Publisher(LocalStore(tmp_path / "plain"), config=CONFIG) as pub:
        for step in range(STEPS):
            if step:
                _move(model, step)
            pub.publish(model, step)
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)

    plain, fsdp = LocalStore(tmp_path / "plain"), LocalStore(tmp_path / "fsdp")
    assert [x.version for x in list_versions(fsdp)] == list(range(STEPS))
    expert = re.compile(r"model\.layers\.\d\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    for v in range(STEPS):
        weights = read_weights(fsdp, v)
        assert sum(1 for n in weights if expert.fullmatch(n)) == 2 * EXPERTS * 3
        assert_bit_equal(weights, read_weights(plain, v))
        kind = "anchor" if v == 0 else "delta"
        ours, theirs = read_manifest(fsdp, v, kind), read_manifest(plain, v, kind)
        assert {n: (e.shape, e.nnz, e.sketch) for n, e in ours.tensors.items()} == {
            n: (e.shape, e.nnz, e.sketch) for n, e in theirs.tensors.items()
        }
        # an expert is held whole by one rank: one checksum part, the plain model's (the other tensors' parts are
        # the ranks' rows)
        assert {n: e.checksums for n, e in ours.tensors.items() if expert.fullmatch(n)} == {
            n: e.checksums for n, e in theirs.tensors.items() if expert.fullmatch(n)
        }
        # each expert is published whole by the rank that holds it: experts 0-2 in rank 0's shard, 3-4 in rank 1's
        for name, entry in ours.tensors.items():
            m = expert.fullmatch(name)
            if m is not None and entry.nnz:
                files = {ours.shards[i].file for i in entry.shards}
                assert files == {f"shard-0000{int(int(m.group(1)) >= 3)}.safetensors"}, (v, name, files)
    for rank in range(2):
        gathers = [(n, d) for n, d in torch.load(tmp_path / f"collectives-{rank}.pt") if "gather" in n]
        # the only gathers are the publisher's metadata (object collectives: int64 sizes, uint8 pickles)
        assert gathers and all(set(dtypes) <= {"torch.int64", "torch.uint8"} for _, dtypes in gathers), gathers
