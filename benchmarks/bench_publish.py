"""Publisher benchmark on the update stream of ``deltasync.testing`` at Qwen3-0.6B shapes (run by hand; asserts
nothing).

One process: the time ``publish`` blocks the training thread (copy + cast of fp32 master weights to bf16)
against one memcpy of the bf16 model into an existing buffer, measured in the same run, the
publish-to-registered latency with a local store and a real coordinator process, and the background work per
delta (``Publisher.last_timings``: diff, sketch, encode, write, register) against the same memcpy, with the bytes
per changed element. Then 2 FSDP2 ranks (gloo): per-rank bytes, blocked time and latency (``--no-fsdp``: skip
them). Ends with one JSON line.

    python benchmarks/bench_publish.py [--steps 5] [--layers 28]
    python benchmarks/bench_publish.py --steps 2 --layers 1     # the smallest real run (about 30 s)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from deltasync.client import CoordinatorClient
from deltasync.config import PublisherConfig
from deltasync.publisher import Publisher
from deltasync.testing.credentials import PUBLISHER_TOKEN, TOKENS_ENV
from deltasync.testing.launchers import CoordinatorProcess, free_port
from deltasync.testing.models import QWEN3_0_6B_CONFIG, qwen3_shapes
from deltasync.testing.stream import UpdateStream


def single(steps: int, tmp: Path, config: dict) -> dict:
    stream = UpdateStream.from_shapes(qwen3_shapes(config), seed=0)
    bf16 = stream.bf16()
    scratch = {k: torch.empty_like(v) for k, v in bf16.items()}
    scratch32 = {k: torch.empty_like(v) for k, v in stream.master.items()}
    rows = []
    with (
        CoordinatorProcess(tmp / "ledger.db", env=TOKENS_ENV, log=tmp / "coordinator.log") as proc,
        CoordinatorClient(proc.url, token=PUBLISHER_TOKEN) as client,
    ):
        config = PublisherConfig(anchor_every=None, anchor_bytes_fraction=None)
        with Publisher(str(tmp / "store"), client, config) as pub:
            for step in range(steps + 1):
                if step:
                    stream.step()
                t0 = time.perf_counter()
                for k, v in bf16.items():
                    scratch[k].copy_(v)
                memcpy = time.perf_counter() - t0
                t0 = time.perf_counter()
                for k, v in stream.master.items():
                    scratch32[k].copy_(v)
                memcpy32 = time.perf_counter() - t0
                t0 = time.perf_counter()
                version = pub.publish(stream.master, step)  # fp32 master weights, cast while copied
                blocked = time.perf_counter() - t0
                pub.flush()
                latency = time.perf_counter() - t0
                registered = client.get_version(version).version == version
                stages = {k: v * 1e3 for k, v in pub.last_timings.items()}
                manifest = pub.published[-1]
                rows.append(
                    {
                        "version": version,
                        "blocked_ms": blocked * 1e3,
                        "memcpy_ms": memcpy * 1e3,
                        "memcpy_fp32_master_ms": memcpy32 * 1e3,
                        "blocked_over_memcpy": blocked / memcpy,
                        "blocked_over_memcpy_fp32_master": blocked / memcpy32,
                        "publish_to_registered_ms": latency * 1e3,
                        "registered": registered,
                        "bytes": manifest.total_bytes,
                        "bytes_per_changed_element": manifest.total_bytes / max(manifest.nnz, 1),
                        "background_ms": stages["total"],
                        "background_over_memcpy": stages["total"] / (memcpy * 1e3),
                        "stages_ms": stages,
                    }
                )
                print(
                    f"v{version}: blocked {blocked * 1e3:6.0f} ms (memcpy bf16 {memcpy * 1e3:5.0f} ms: "
                    f"{blocked / memcpy:4.2f}x; fp32 master {memcpy32 * 1e3:5.0f} ms: {blocked / memcpy32:4.2f}x), "
                    f"publish-to-registered {latency * 1e3:6.0f} ms, "
                    f"{rows[-1]['bytes'] / 1e6:7.2f} MB",
                    flush=True,
                )
                if step:
                    print(
                        f"    background {stages['total']:6.0f} ms = {stages['total'] / (memcpy * 1e3):4.2f}x the "
                        "memcpy: " + ", ".join(f"{k} {v:.0f}" for k, v in stages.items() if k != "total") + " ms; "
                        f"{rows[-1]['bytes_per_changed_element']:.4f} B per changed element",
                        flush=True,
                    )
    return {"rows": rows}


def _rank(rank: int, world: int, port: int, tmp: str, steps: int, config: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    shapes = qwen3_shapes(config)
    model = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        init = torch.randn(shape, generator=gen) * 0.02 if len(shape) > 1 else torch.ones(shape)
        model.register_parameter(name.replace(".", "__"), torch.nn.Parameter(init))
    fully_shard(model)
    names = {n.replace(".", "__"): n for n in shapes}
    params = dict(model.named_parameters())
    # the update stream, run by each rank on its own rows
    stream = UpdateStream({k: p.to_local() for k, p in params.items()}, seed=rank)
    rows = []
    with Publisher(
        str(Path(tmp) / "fsdp-store"), config=PublisherConfig(anchor_every=None, anchor_bytes_fraction=None)
    ) as pub:
        for step in range(steps + 1):
            if step:
                stream.step()
                with torch.no_grad():
                    for k, p in params.items():
                        p.to_local().copy_(stream.master[k])
            state = {names[k]: v for k, v in model.state_dict().items()}
            t0 = time.perf_counter()
            pub.publish(state, step)
            blocked = time.perf_counter() - t0
            pub.flush()
            latency = time.perf_counter() - t0
            shard = (
                Path(tmp)
                / "fsdp-store"
                / f"v{step:08d}"
                / ("anchor" if step == 0 else "")
                / f"shard-{rank:05d}.safetensors"
            )
            rows.append(
                {
                    "step": step,
                    "blocked_ms": blocked * 1e3,
                    "latency_ms": latency * 1e3,
                    "rank_bytes": shard.stat().st_size if shard.exists() else 0,
                }
            )
    torch.save(rows, Path(tmp) / f"fsdp-rank{rank}.pt")
    dist.destroy_process_group()


def fsdp(steps: int, tmp: Path, config: dict) -> dict:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, free_port(), str(tmp), steps, config), nprocs=2, join=True)
    out = {}
    for rank in range(2):
        rows = torch.load(tmp / f"fsdp-rank{rank}.pt")
        out[f"rank{rank}"] = rows
        deltas = rows[1:]
        print(
            f"FSDP rank {rank}: per delta {statistics.median(r['rank_bytes'] for r in deltas) / 1e6:.2f} MB, "
            f"blocked {statistics.median(r['blocked_ms'] for r in deltas):.0f} ms, publish-to-committed "
            f"{statistics.median(r['latency_ms'] for r in deltas):.0f} ms",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="published deltas after the first anchor (at least 2)")
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the Qwen3-0.6B shapes (28: all)")
    parser.add_argument("--no-fsdp", action="store_true", help="skip the 2-rank FSDP2 run (one process only)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the figures are medians over versions 2..N), got {args.steps}")
    config = {**QWEN3_0_6B_CONFIG, "num_hidden_layers": args.layers}
    with tempfile.TemporaryDirectory(prefix="deltasync-bench-publish-") as tmp:
        # first: the ranks are separate processes and need the memory
        two = {} if args.no_fsdp else fsdp(args.steps, Path(tmp), config)
        one = single(args.steps, Path(tmp), config)
    deltas = [r for r in one["rows"] if r["version"] >= 2]
    summary = {
        "blocked_ms": statistics.median(r["blocked_ms"] for r in deltas),
        "memcpy_ms": statistics.median(r["memcpy_ms"] for r in deltas),
        "blocked_over_memcpy": statistics.median(r["blocked_over_memcpy"] for r in deltas),
        "blocked_over_memcpy_fp32_master": statistics.median(r["blocked_over_memcpy_fp32_master"] for r in deltas),
        "publish_to_registered_ms": statistics.median(r["publish_to_registered_ms"] for r in deltas),
        "background_ms": statistics.median(r["background_ms"] for r in deltas),
        "background_over_memcpy": statistics.median(r["background_over_memcpy"] for r in deltas),
        "bytes_per_changed_element": statistics.median(r["bytes_per_changed_element"] for r in deltas),
        "stages_ms": {k: statistics.median(r["stages_ms"].get(k, 0.0) for r in deltas) for k in deltas[0]["stages_ms"]},
    }
    print(
        f"\none process: blocked {summary['blocked_ms']:.0f} ms = {summary['blocked_over_memcpy']:.2f}x a memcpy "
        f"of the bf16 model ({summary['memcpy_ms']:.0f} ms), {summary['blocked_over_memcpy_fp32_master']:.2f}x a "
        f"memcpy of the fp32 master weights it reads; publish-to-registered "
        f"{summary['publish_to_registered_ms']:.0f} ms\n"
        f"background per delta {summary['background_ms']:.0f} ms = {summary['background_over_memcpy']:.2f}x the "
        f"memcpy (medians; "
        + ", ".join(f"{k} {v:.0f}" for k, v in summary["stages_ms"].items() if k != "total")
        + f" ms), {summary['bytes_per_changed_element']:.4f} B per changed element\n"
    )
    print(json.dumps({**summary, "layers": args.layers, "single": one, "fsdp2": two}))


if __name__ == "__main__":
    main()
