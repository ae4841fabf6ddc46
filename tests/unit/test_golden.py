"""Golden files pin docs/FORMAT.md byte for byte (regenerate: DELTASYNC_REGEN_GOLDEN=1 pytest this file).

Raw shards and manifests must match exactly. A packed shard must match exactly in its header and in
every decompressed stream; the zstd bitstream itself may differ between zstd releases.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import pytest
import torch
import zstandard

from deltasync import (
    AdapterEntry,
    DeltaManifest,
    ShardEntry,
    TensorDelta,
    TensorEntry,
    decode_shard,
    encode_shard,
    tensor_checksum,
)
from deltasync.sketch import tensor_sketch
from tests.conftest import bits

GOLDEN = Path(__file__).parents[1] / "data" / "golden"
REGEN = os.environ.get("DELTASYNC_REGEN_GOLDEN") == "1"


def _inputs() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    base = {
        "model.embed_tokens.weight": torch.tensor([[0.5, -0.25, 1.0], [2.0, -0.0, 0.125]], dtype=torch.bfloat16),
        "model.norm.weight": torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float32),
        "lm_head.bias": torch.tensor(0.75, dtype=torch.float16),
    }
    new = {k: v.clone() for k, v in base.items()}
    new["model.embed_tokens.weight"].view(-1)[[1, 4]] = torch.tensor([-0.2490234375, 0.0], dtype=torch.bfloat16)
    new["model.norm.weight"].copy_(torch.tensor([1.0, 0.5, 1.5, -1.0]))
    new["lm_head.bias"].fill_(0.5)
    return base, new


def _deltas(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list[TensorDelta]:
    e, n, b = "model.embed_tokens.weight", "model.norm.weight", "lm_head.bias"
    idx = torch.tensor([1, 4])
    return [
        TensorDelta(
            ckpt_name=e,
            shape=(2, 3),
            dtype=torch.bfloat16,
            indices=idx,
            values=new[e].view(-1)[idx],
            base_values=base[e].view(-1)[idx],
            checksum=tensor_checksum(new[e]),
        ),
        TensorDelta(
            ckpt_name=n,
            shape=(4,),
            dtype=torch.float32,
            indices=None,
            values=new[n],
            base_values=base[n],
            checksum=tensor_checksum(new[n]),
        ),
        TensorDelta(
            ckpt_name=b,
            shape=(),
            dtype=torch.float16,
            indices=torch.tensor([0]),
            values=new[b].view(-1),
            base_values=base[b].view(-1),
            checksum=tensor_checksum(new[b]),
        ),
    ]


def _anchor(state: dict[str, torch.Tensor]) -> list[TensorDelta]:
    return [
        TensorDelta(
            ckpt_name=k,
            shape=tuple(v.shape),
            dtype=v.dtype,
            indices=None,
            values=v,
            checksum=tensor_checksum(v),
        )
        for k, v in state.items()
    ]


def _cases() -> dict[str, bytes]:
    base, new = _inputs()
    out = {}
    for enc in ("raw", "packed"):
        out[f"delta-{enc}.safetensors"] = encode_shard(
            _deltas(base, new), kind="delta", encoding=enc, base_version=6, target_version=7
        )
        out[f"anchor-{enc}.safetensors"] = encode_shard(_anchor(new), kind="anchor", encoding=enc, target_version=7)
    shard = out["delta-packed.safetensors"]
    import hashlib

    manifest = DeltaManifest(
        kind="delta",
        version=7,
        base_version=6,
        encoding="packed",
        shards=(
            ShardEntry(file="shard-00000.safetensors", bytes=len(shard), sha256=hashlib.sha256(shard).hexdigest()),
        ),
        tensors={
            k: TensorEntry(
                shape=tuple(v.shape),
                dtype={torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}[v.dtype],
                nnz={"model.embed_tokens.weight": 2, "model.norm.weight": 4, "lm_head.bias": 1}[k],
                shards=(0,),
                checksums=((0, v.numel(), tensor_checksum(v)),),
                sketch=tensor_sketch(v),
            )
            for k, v in new.items()
        },
        run_id="run-golden",
        lease_epoch=3,
    )
    out["manifest-delta.json"] = manifest.to_json()
    adapter = AdapterEntry(
        r=2,
        lora_alpha=16,
        target_modules=("q_proj", "v_proj"),
        base_fingerprint="sha256:" + "ab" * 32,
        base_content="sha256:" + "cd" * 32,
    )
    lora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": new["model.embed_tokens.weight"]}
    out["manifest-adapter.json"] = dataclasses.replace(
        manifest,
        tensors={
            k: dataclasses.replace(manifest.tensors["model.embed_tokens.weight"], nnz=v.numel())
            for k, v in lora.items()
        },
        adapter=adapter,
    ).to_json()
    return out


def _streams(buf: bytes) -> tuple[dict, dict[str, bytes]]:
    n = struct.unpack("<Q", buf[:8])[0]
    header = json.loads(buf[8 : 8 + n])
    data = buf[8 + n :]
    streams = {}
    for k, info in header.items():
        if k != "__metadata__":
            blob = data[info["data_offsets"][0] : info["data_offsets"][1]]
            streams[k] = zstandard.ZstdDecompressor().decompress(blob) if info["dtype"] == "U8" else blob
            info.pop("data_offsets")
    return header, streams


@pytest.mark.parametrize("name", sorted(_cases()))
def test_golden(name: str) -> None:
    produced = _cases()[name]
    path = GOLDEN / name
    if REGEN:
        path.write_bytes(produced)
    golden = path.read_bytes()
    if "packed" in name:
        assert _streams(produced) == _streams(golden)
    else:
        assert produced == golden


@pytest.mark.parametrize(
    "directory",
    [GOLDEN, GOLDEN / "1.4", GOLDEN / "1.3", GOLDEN / "1.2", GOLDEN / "1.1", GOLDEN / "1.0"],
    ids=["1.5", "1.4", "1.3", "1.2", "1.1", "1.0"],
)
def test_golden_files_decode_to_the_documented_values(directory: Path) -> None:
    """Files of format 1.0 (before the model fingerprint and run identity), 1.1 (before the sketch), 1.2
    (before the lease epoch), 1.3 (before adapters) and 1.4 (before the adapter's base weights digest) stay
    readable."""
    base, new = _inputs()
    for name in ("delta-raw", "delta-packed", "anchor-raw", "anchor-packed"):
        header, out = decode_shard((directory / f"{name}.safetensors").read_bytes(), name=name, base=base)
        assert header.target_version == 7
        assert header.format_version == (directory.name if directory != GOLDEN else "1.5")
        for t, d in out.items():
            full = base[t].clone().reshape(-1)
            if d.indices is None:
                full.copy_(d.values.reshape(-1))
            else:
                full[d.indices] = d.values
            assert torch.equal(bits(full), bits(new[t].reshape(-1))), (name, t)
            assert d.checksum == tensor_checksum(new[t])
    m = DeltaManifest.from_json((directory / "manifest-delta.json").read_bytes(), name="golden")
    assert m.shards[0].bytes == len((directory / "delta-packed.safetensors").read_bytes())
    assert m.model_fingerprint.startswith("sha256:")
    sketches = {t: e.sketch for t, e in m.tensors.items()}
    with_sketch = directory.name not in ("1.0", "1.1")
    assert sketches == {t: tensor_sketch(v) if with_sketch else None for t, v in new.items()}
    newest = directory in (GOLDEN, GOLDEN / "1.4", GOLDEN / "1.3")
    assert (m.run_id, m.lease_epoch) == (("run-golden", 3) if newest else (m.run_id, None))
    assert m.adapter is None


@pytest.mark.parametrize(("directory", "content"), [(GOLDEN, "sha256:" + "cd" * 32), (GOLDEN / "1.4", None)])
def test_an_adapter_manifest_reads_back_as_written(directory: Path, content: str | None) -> None:
    """1.5 names the digest of the adapter's base weights; a 1.4 adapter manifest reads back without one."""
    m = DeltaManifest.from_json((directory / "manifest-adapter.json").read_bytes(), name="golden adapter")
    assert m.adapter == AdapterEntry(
        r=2, lora_alpha=16, target_modules=("q_proj", "v_proj"), base_fingerprint="sha256:" + "ab" * 32
    )
    assert m.adapter is not None and m.adapter.base_content == content
    assert m.to_json() == (directory / "manifest-adapter.json").read_bytes()


def test_documented_example_header() -> None:
    """docs/FORMAT.md quotes this header; keep them equal."""
    buf = (GOLDEN / "delta-raw.safetensors").read_bytes()
    n = struct.unpack("<Q", buf[:8])[0]
    doc = (Path(__file__).parents[2] / "docs" / "FORMAT.md").read_text()
    assert buf[8 : 8 + n].decode().rstrip() in doc.replace("\n", "")
