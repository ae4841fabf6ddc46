"""Whole-state proof benchmark (run by hand; asserts nothing): what one audit pass costs at Qwen3-0.6B shapes
(310 tensors, 596M bf16 elements), against a warm memcpy of the model measured in the same
process.

One pass is what every rank does every ``--audit-interval-s``: the linear sketch (:mod:`deltasync.sketch`) of
every element it holds, read through its patch map. At TP=1 the map's runs are whole tensors (or a few long
runs), so a pass is :func:`~deltasync.sketch.sketch_range` over every tensor; a TP=2 row-parallel slice
(``o_proj``, ``down_proj``: one run per row) goes through :func:`~deltasync.sketch.sketch_at`, timed on one
layer's ``down_proj`` half. Also: xxh3-128 of the model, the proof the sketch does not replace (it proves
whole tensors only). Ends with one JSON line.

    python benchmarks/bench_audit.py [--repeat 3] [--threads 2] [--layers 28]
    python benchmarks/bench_audit.py --repeat 1 --layers 1      # the smallest real run (seconds)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deltasync.format import tensor_checksum
from deltasync.sketch import sketch_at, sketch_range
from deltasync.testing.models import QWEN3_0_6B_CONFIG, qwen3_shapes


def timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the Qwen3-0.6B shapes (28: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = qwen3_shapes({**QWEN3_0_6B_CONFIG, "num_hidden_layers": args.layers})
    model = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    numel = sum(t.numel() for t in model.values())
    copies = {n: torch.empty_like(t) for n, t in model.items()}

    def memcpy() -> None:
        for n, t in model.items():
            copies[n].copy_(t)

    def sketch_pass() -> None:
        for t in model.values():
            sketch_range(t)

    def xxh3_pass() -> None:
        for t in model.values():
            tensor_checksum(t)

    memcpy()  # warm
    f: dict[str, float] = {"threads": args.threads, "layers": args.layers, "elements": numel}
    f["memcpy_s"] = timed(memcpy, args.repeat)
    f["sketch_s"] = timed(sketch_pass, args.repeat)
    f["xxh3_s"] = timed(xxh3_pass, args.repeat)
    half = model["model.layers.0.mlp.down_proj.weight"][:, :1536]  # rank 0 of TP=2: 1024 runs of 1536
    index = (torch.arange(1024)[:, None] * 3072 + torch.arange(1536)[None, :]).reshape(-1)
    values = half.reshape(-1).contiguous()
    f["sketch_at_ns_per_element"] = timed(lambda: sketch_at(values, index), args.repeat) / values.numel() * 1e9
    f["sketch_ns_per_element"] = f["sketch_s"] / numel * 1e9
    f["sketch_over_memcpy"] = f["sketch_s"] / f["memcpy_s"]
    print(
        f"Qwen3-0.6B shapes, {args.layers} of 28 layers: {numel:,} elements, {args.threads} threads, "
        f"median of {args.repeat}"
    )
    print(f"  memcpy of the model      {f['memcpy_s'] * 1e3:8.0f} ms")
    print(f"  sketch of every element  {f['sketch_s'] * 1e3:8.0f} ms  ({f['sketch_over_memcpy']:.1f}x the memcpy)")
    print(f"  xxh3-128 of every tensor {f['xxh3_s'] * 1e3:8.0f} ms")
    print(f"  sketch_at (a TP=2 row-parallel slice): {f['sketch_at_ns_per_element']:.1f} ns per element")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in f.items()}))


if __name__ == "__main__":
    main()
