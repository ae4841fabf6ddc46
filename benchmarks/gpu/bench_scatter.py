"""GPU check of deltasync's own torch code (run by hand; asserts nothing but its own bit-exactness): the
publisher's diff on the device, the decode of a delta's indices (gap coding, as the ``packed`` encoding stores
them) and values into device tensors, and the scatter into fused live parameters through the patch map
(:mod:`deltasync.vllm.patch_map`), for a Qwen3-0.6B-shaped and a Qwen3-8B-shaped model at ~2% changed elements.

The GPU machines this runs on have torch but no vLLM: it imports the patch map as a user does
(:mod:`deltasync.vllm.patch_map` needs no vLLM), and leaves out the zstd stage of the decode (it runs on the
host, before the pause, and is measured by ``benchmarks/bench_codec.py``). Finishes in well under 4 minutes on
one H200. CI runs it with ``--device cpu --quick`` so it cannot rot.

    python benchmarks/gpu/bench_scatter.py [--device cuda] [--fraction 0.02] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # deltasync from this checkout

from deltasync.format import TensorDelta  # noqa: E402
from deltasync.vllm.patch_map import PatchMap, Runs  # noqa: E402

QWEN3_0_6B = {"vocab": 151936, "hidden": 1024, "inter": 3072, "layers": 28, "heads": 16, "kv": 8, "head_dim": 128}
QWEN3_8B = {"vocab": 151936, "hidden": 4096, "inter": 12288, "layers": 36, "heads": 32, "kv": 8, "head_dim": 128}
QUICK = {"vocab": 512, "hidden": 128, "inter": 256, "layers": 2, "heads": 2, "kv": 1, "head_dim": 64}


def layout(
    c: dict[str, int],
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], dict[str, tuple[str, int]]]:
    """Checkpoint shapes, vLLM's fused parameter shapes (TP=1), and where each checkpoint tensor sits: the live
    parameter and its first row."""
    h, inter, q, kv = c["hidden"], c["inter"], c["heads"] * c["head_dim"], c["kv"] * c["head_dim"]
    ckpt: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab"], h), "model.norm.weight": (h,)}
    live: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab"], h), "model.norm.weight": (h,)}
    where: dict[str, tuple[str, int]] = {n: (n, 0) for n in ckpt}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        parts = {
            "self_attn.q_proj.weight": ((q, h), "self_attn.qkv_proj.weight", 0),
            "self_attn.k_proj.weight": ((kv, h), "self_attn.qkv_proj.weight", q),
            "self_attn.v_proj.weight": ((kv, h), "self_attn.qkv_proj.weight", q + kv),
            "self_attn.o_proj.weight": ((h, q), "self_attn.o_proj.weight", 0),
            "mlp.gate_proj.weight": ((inter, h), "mlp.gate_up_proj.weight", 0),
            "mlp.up_proj.weight": ((inter, h), "mlp.gate_up_proj.weight", inter),
            "mlp.down_proj.weight": ((h, inter), "mlp.down_proj.weight", 0),
            "input_layernorm.weight": ((h,), "input_layernorm.weight", 0),
            "post_attention_layernorm.weight": ((h,), "post_attention_layernorm.weight", 0),
        }
        live |= {
            p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_up_proj.weight": (2 * inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        for name, (shape, param, row) in parts.items():
            ckpt[p + name] = shape
            where[p + name] = (p + param, row)
    return ckpt, live, where


def timed(device: torch.device, fn: Any) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def run(name: str, config: dict[str, int], device: torch.device, fraction: float) -> dict[str, Any]:
    ckpt, live_shapes, where = layout(config)
    gen = torch.Generator(device=device).manual_seed(0)
    live = {
        n: torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
        for n, s in live_shapes.items()
    }
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in live.items()}
    runs = {}
    for n, shape in ckpt.items():
        param, row = where[n]
        cols = shape[1] if len(shape) > 1 else 1
        numel = shape[0] * cols
        one = torch.tensor([0]), torch.tensor([row * cols]), torch.tensor([numel])
        runs[n] = [Runs(param, *one)]
    patch_map = PatchMap(runs, {}, params, 0.0)

    # the trainer's step: old and new weights in checkpoint names, ~fraction of elements changed
    old = {}
    for n, shape in ckpt.items():
        param, row = where[n]
        rows = shape[0]
        old[n] = params[param].data[row : row + rows].clone() if len(shape) > 1 else params[param].data.clone()
    new = {}
    for n, t in old.items():
        flip = torch.rand(t.shape, generator=gen, device=device) < fraction
        bits = t.view(torch.int16).clone()
        bits[flip] ^= 1  # the last mantissa bit: what a small lr does to bf16
        new[n] = bits.view(torch.bfloat16)

    def diff() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for n in ckpt:
            a, b = old[n].view(-1).view(torch.int16), new[n].view(-1).view(torch.int16)
            idx = torch.nonzero(a != b).squeeze(1)
            out[n] = (idx, new[n].view(-1)[idx])
        return out

    changes, diff_s = timed(device, diff)
    nnz = sum(int(i.numel()) for i, _ in changes.values())
    numel = sum(t.numel() for t in old.values())
    # what travels: gaps (uint32 as int32) and value bits on the host, as a decoded packed shard holds them
    host = {
        n: (torch.diff(i, prepend=torch.zeros(1, dtype=i.dtype, device=device)).to(torch.int32).cpu(), v.cpu())
        for n, (i, v) in changes.items()
    }
    if device.type == "cuda":
        host = {n: (g.pin_memory(), v.pin_memory()) for n, (g, v) in host.items()}

    def decode() -> list[TensorDelta]:
        out = []
        for n, (gaps, values) in host.items():
            g = gaps.to(device, non_blocking=True)
            idx = torch.cumsum(g.to(torch.int64), 0)
            values = values.to(device, non_blocking=True)
            out.append(TensorDelta(ckpt_name=n, shape=ckpt[n], dtype=torch.bfloat16, indices=idx, values=values))
        return out

    deltas, decode_s = timed(device, decode)
    for n, r in runs.items():  # the map's runs live on the device too (searchsorted there)
        runs[n] = [Runs(x.param, x.ckpt_start.to(device), x.param_start.to(device), x.length.to(device)) for x in r]
    ops, plan_s = timed(device, lambda: patch_map.plan(deltas))
    written, scatter_s = timed(device, lambda: patch_map.write(ops))
    bad, check_s = timed(device, lambda: patch_map.check_written(ops))
    exact = not bad and all(
        torch.equal(
            params[where[n][0]].data[where[n][1] : where[n][1] + ckpt[n][0]].view(torch.int16)
            if len(ckpt[n]) > 1
            else params[where[n][0]].data.view(torch.int16),
            new[n].view(torch.int16),
        )
        for n in ckpt
    )
    result = {
        "model": name,
        "device": str(device),
        "elements": numel,
        "changed": nnz,
        "changed_fraction": nnz / numel,
        "written": int(written),
        "diff_ms": diff_s * 1e3,
        "decode_h2d_ms": decode_s * 1e3,
        "plan_ms": plan_s * 1e3,
        "scatter_ms": scatter_s * 1e3,
        "readback_ms": check_s * 1e3,
        "pause_ms": (scatter_s + check_s) * 1e3,
        "bit_exact": exact,
    }
    print(
        f"{name:>10} on {device}: {numel / 1e9:.2f}B elements, {nnz / numel:.2%} changed; diff {diff_s * 1e3:.1f} ms, "
        f"decode+H2D {decode_s * 1e3:.1f} ms, plan {plan_s * 1e3:.1f} ms, scatter {scatter_s * 1e3:.1f} ms, "
        f"read back {check_s * 1e3:.1f} ms; bit-exact: {exact}",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fraction", type=float, default=0.02)
    parser.add_argument("--quick", action="store_true", help="tiny shapes only (the CI run of the CPU fallback)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    models = {"tiny": QUICK} if args.quick else {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B}
    results = []
    for name, config in models.items():
        results.append(run(name, config, device, args.fraction))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the model of the run before is gone
    print(json.dumps({"torch": torch.__version__, "results": results}))
    return results


if __name__ == "__main__":
    main()
