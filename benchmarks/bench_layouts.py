"""Unit costs for docs/SCALING.md (run by hand; asserts nothing but bit-exactness): bytes and decode time per
element of one delta in each layout (sparse, dense) and encoding (raw, packed = byte planes + zstd), and of an
anchor, on the update stream of ``deltasync.testing`` with Qwen3-0.6B layer shapes but only ``--layers`` layers
(the full vocabulary kept), so it runs in a few GB on a shared CPU. Decode = ``decode_shard`` + the host-copy write.

    python benchmarks/bench_layouts.py [--layers 4] [--steps 3] [--lr 1e-6]
    python benchmarks/bench_layouts.py --layers 1 --steps 1      # the smallest real run (~20 s, ~6 GB)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from deltasync import TensorDelta, compute_delta, decode_shard, encode_shard, tensor_checksum
from deltasync.testing.models import QWEN3_0_6B_CONFIG, qwen3_shapes
from deltasync.testing.stream import UpdateStream


def _decode_s(data: bytes, host: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    _, deltas = decode_shard(bytearray(data), name="shard.safetensors", base=host)
    for d in deltas.values():  # the write step of deltasync.apply, without a manifest
        flat = host[d.ckpt_name].view(-1)
        if d.indices is None:
            flat.copy_(d.values.reshape(-1))
        else:
            flat[d.indices] = d.values
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps measured after Adam's warm-up step")
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()
    shapes = qwen3_shapes({**QWEN3_0_6B_CONFIG, "num_hidden_layers": args.layers})
    stream = UpdateStream.from_shapes(shapes, lr=args.lr, seed=0)
    prev = stream.bf16()
    numel = sum(t.numel() for t in prev.values())
    print(f"{len(shapes)} tensors, {numel:,} elements, lr {args.lr}, torch threads {torch.get_num_threads()}")
    rows = []
    for step in range(1, args.steps + 2):
        curr = stream.step()
        if step == 1:  # Adam's warm-up step: not reported
            prev = curr
            continue
        for layout, fraction in (("sparse", 0.5), ("dense", 1e-9)):
            changes = compute_delta(prev, curr, dense_fraction=fraction)
            changes = {n: dataclasses.replace(d, checksum=tensor_checksum(curr[n])) for n, d in changes.items()}
            nnz = sum(
                int((d.values.view(torch.int16) != d.base_values.view(torch.int16)).sum()) for d in changes.values()
            )
            stored = sum(d.values.numel() for d in changes.values())
            for encoding in ("raw", "packed"):
                data = encode_shard(
                    changes.values(), kind="delta", encoding=encoding, base_version=step - 1, target_version=step
                )
                host = {k: v.clone() for k, v in prev.items()}
                dec_s = _decode_s(data, host)
                assert all(torch.equal(host[k].view(torch.int16), curr[k].view(torch.int16)) for k in curr)
                rows.append(
                    dict(
                        kind="delta",
                        step=step,
                        layout=layout,
                        encoding=encoding,
                        changed_fraction=nnz / numel,
                        bytes=len(data),
                        B_per_changed=len(data) / nnz,
                        B_per_stored=len(data) / stored,
                        decode_ns_per_changed=dec_s * 1e9 / nnz,
                        decode_ns_per_stored=dec_s * 1e9 / stored,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
        prev = curr
    entries = [  # as deltasync.writer.write_anchor builds them
        TensorDelta(
            ckpt_name=n, shape=tuple(t.shape), dtype=t.dtype, indices=None, values=t, checksum=tensor_checksum(t)
        )
        for n, t in prev.items()
    ]
    for encoding in ("raw", "packed"):
        data = encode_shard(entries, kind="anchor", encoding=encoding, target_version=args.steps + 1)
        host = {k: torch.zeros_like(v) for k, v in prev.items()}
        dec_s = _decode_s(data, host)
        assert all(torch.equal(host[k].view(torch.int16), prev[k].view(torch.int16)) for k in prev)
        row = dict(
            kind="anchor",
            encoding=encoding,
            bytes=len(data),
            B_per_elem=len(data) / numel,
            decode_ns_per_elem=dec_s * 1e9 / numel,
        )
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
