"""MoE patch map benchmark (run by hand; asserts nothing): at Qwen3-30B-A3B's layer shapes (hidden 2048, experts of
768, 32 heads of 128, 4 KV heads) with a few layers, on vLLM's CPU build (``DELTASYNC_VLLM_PLAIN_WEIGHTS=1``,
``load_format="dummy"``), what placing the experts in the patch map costs as the experts grow from 32 to 128 at
the same size (target: <= 4.4x for 4x the experts), and an update that changes every expert (a fraction of each
expert's elements, as Adam at a small learning rate does), next to its floor:

* **build**: the whole map build at start, and its experts' part (one expert learned per kind through the loader
  and the kernel's own repack, the others derived), next to one copy of the model's parameters;
* **before the pause**: planning the update's writes (each changed element placed through its kind's table);
* **the pause**: the planned writes into the live packed experts, next to ``index_copy_`` of the same changes at
  the same places (the floor: one call per parameter, its indices ready) on the worker's threads alike.

Ends with one JSON line.

    python benchmarks/bench_moe.py                      # 32 and 128 experts, 2 layers (about 2 minutes here)
    python benchmarks/bench_moe.py --experts 32 --layers 1 --changed 0.01   # the smallest real run (~40 s)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["DELTASYNC_VLLM_PLAIN_WEIGHTS"] = "1"
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a function (this script's own)

QWEN3_30B_A3B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _measure(worker: Any, changed: float, repeats: int) -> dict[str, Any]:
    """On the worker: the map built at start, an update changing ``changed`` of every expert's elements planned
    and written (best of ``repeats``), and the floors: ``index_copy_`` of the same changes, one copy of the model."""
    import torch

    from deltasync._cpus import parallel_map
    from deltasync.format import TensorDelta

    engine = worker.weight_transfer_engine
    pm = engine.served.built_map
    spec = engine.served.spec()
    experts = sorted(n for n in spec if ".experts." in n and n in pm)
    gen = torch.Generator().manual_seed(0)
    deltas = []
    for name in experts:
        dtype, shape = spec[name]
        n = shape[0] * shape[1]
        k = max(1, int(n * changed))
        idx = torch.randperm(n, generator=gen)[:k].sort().values
        old = pm.gather(name, idx)
        new = (old.float() * (1 + 2**-7)).to(old.dtype)  # one step of the mantissa's last bit, about
        deltas.append(TensorDelta(ckpt_name=name, shape=tuple(shape), dtype=old.dtype, indices=idx, values=new))
    nnz = sum(d.nnz for d in deltas)
    plan_s, write_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ops = pm.plan(deltas)
        plan_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pm.write(ops)
        write_s.append(time.perf_counter() - t0)
    # the floor: the same changes, one index_copy_ per parameter with its indices and values ready
    by_param: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for op in ops:
        idx_vals = by_param.setdefault(op.param, ([], []))
        idx_vals[0].append(op.index)
        idx_vals[1].append(op.values)
    joined = [(q, torch.cat(i), torch.cat(v)) for q, (i, v) in by_param.items()]

    def copy_one(item: tuple[str, torch.Tensor, torch.Tensor]) -> int:
        q, i, v = item
        with torch.no_grad():
            pm.param(q).data.view(-1).index_copy_(0, i, v)
        return i.numel()

    floor_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        parallel_map(copy_one, joined, nnz, cost=lambda item: item[1].numel())
        floor_s.append(time.perf_counter() - t0)
    params = [p for _, p in engine.model.named_parameters()]
    copy_s = 0.0
    with torch.no_grad():
        for p in params:
            t0 = time.perf_counter()
            c = p.detach().clone()
            copy_s += time.perf_counter() - t0
            del c
    return {
        "build_s": round(pm.build_s, 3),
        "experts_build_s": round(pm.timings.get("experts_s", 0.0), 3),
        "summary": pm.summary(),
        "params": sum(p.numel() for p in params),
        "copy_s": round(copy_s, 3),
        "expert_tensors": len(experts),
        "changed": nnz,
        "plan_s": round(min(plan_s), 4),
        "write_s": round(min(write_s), 4),
        "floor_s": round(min(floor_s), 4),
        "threads": torch.get_num_threads(),
    }


def run(experts: int, layers: int, changed: float, repeats: int, tmp: Path) -> dict[str, Any]:
    from deltasync.testing.launchers import offline_llm
    from deltasync.testing.models import write_config_only_model

    config = {**QWEN3_30B_A3B, "num_experts": experts, "num_hidden_layers": layers}
    model = write_config_only_model(tmp / f"moe-{experts}-{layers}", config, arch="qwen3_moe")
    t0 = time.perf_counter()
    llm = offline_llm(model, load_format="dummy", max_model_len=256)
    start_s = time.perf_counter() - t0
    try:
        (got,) = llm.collective_rpc(_measure, kwargs={"changed": changed, "repeats": repeats})
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    out: dict[str, Any] = dict(got)
    out.update(experts=experts, layers=layers, engine_start_s=round(start_s, 1))
    per = out["changed"]
    print(
        f"{experts:4d} experts x {layers} layers  params {out['params'] / 1e9:5.2f} B  map build {out['build_s']:6.2f} s "
        f"(experts {out['experts_build_s']:5.2f} s = {out['experts_build_s'] / layers:5.2f} s a layer; "
        f"{out['summary']['layers']})  one copy of the model {out['copy_s']:5.2f} s\n"
        f"      update: {per:,} changed elements in {out['expert_tensors']} expert tensors: plan "
        f"{out['plan_s'] * 1e3:7.1f} ms ({out['plan_s'] / per * 1e9:5.1f} ns/elem), write {out['write_s'] * 1e3:7.1f} ms "
        f"({out['write_s'] / per * 1e9:5.1f} ns/elem) = {out['write_s'] / out['floor_s']:.2f}x index_copy_ "
        f"({out['floor_s'] * 1e3:.1f} ms, {out['threads']} threads)",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="*", default=[32, 128], help="experts per layer, one run each")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2; Qwen3-30B-A3B has 48)")
    parser.add_argument("--changed", type=float, default=0.02, help="fraction of each expert's elements changed")
    parser.add_argument("--repeats", type=int, default=3, help="updates timed (the best is kept)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as d:
        for experts in args.experts:
            results.append(run(experts, args.layers, args.changed, args.repeats, Path(d)))
    if len(results) > 1:
        a, b = results[0], results[-1]
        growth = b["experts_build_s"] / a["experts_build_s"]
        whole = b["build_s"] / a["build_s"]
        print(
            f"experts {a['experts']} -> {b['experts']} ({b['experts'] / a['experts']:.0f}x): the experts' map build "
            f"grows {growth:.2f}x (target <= 4.4x for 4x), the whole build {whole:.2f}x"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
