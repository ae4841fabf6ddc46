"""Patch map build benchmark (run by hand; asserts nothing): what one engine pays at start to learn where each
checkpoint element lives, on vLLM's CPU build with plain weights (``DELTASYNC_VLLM_PLAIN_WEIGHTS=1``,
``load_format="dummy"``), next to its memory floor measured in the same worker: one copy of the model's
parameters (``clone``, one parameter at a time).

Engines, one after the other (each a fresh process):

* Qwen3-0.6B and Qwen3-1.7B, whole;
* Qwen3-8B layer shapes with 2 and 4 layers;
* Llama-3-70B layer shapes with 2 and 4 layers (vocabulary cut to 32000 so that four layers fit this machine's
  24 GB: the embedding is outside the layers and is mapped once).

The map is learned tensor by tensor for the first layer of each kind and derived, with its two proofs, for the
others: the build should grow with one layer's size, not with the number of layers. Ends with one JSON line.

    python benchmarks/bench_map.py [--only 0.6B 70B-2 ...]     (DELTASYNC_BENCH_PROFILE=1: where the second build goes;
                                                                 DELTASYNC_BENCH_PROFILE_CALLERS=regex: who calls)
    python benchmarks/bench_map.py --only 0.6B     # the smallest real run: one engine (about 35 s here)
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

QWEN3_1_7B = {"hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16, "num_key_value_heads": 8}
QWEN3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
LLAMA3_70B = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
CASES: dict[str, dict[str, Any]] = {
    "0.6B": {},
    "1.7B": QWEN3_1_7B,
    "8B-2": {**QWEN3_8B, "num_hidden_layers": 2},
    "8B-4": {**QWEN3_8B, "num_hidden_layers": 4},
    "70B-2": {**LLAMA3_70B, "num_hidden_layers": 2},
    "70B-4": {**LLAMA3_70B, "num_hidden_layers": 4},
}


def _build(worker: Any) -> dict[str, Any]:
    """On the worker: build the engine's map, then time one copy of every parameter (the floor)."""
    import torch

    engine = worker.weight_transfer_engine
    pm = engine.served.built_map  # built while vLLM started (DELTASYNC_MAP_AT_START): its own build time
    if pm is None:  # DELTASYNC_MAP_AT_START=0: the first build here (with DELTASYNC_BENCH_PROFILE=first, profiled)
        first_profile = None
        if os.environ.get("DELTASYNC_BENCH_PROFILE") == "first":
            import cProfile

            first_profile = cProfile.Profile()
            first_profile.enable()
        pm = engine.served.patch_map()
        if first_profile is not None:
            import pstats

            first_profile.disable()
            pstats.Stats(first_profile).sort_stats("tottime").print_stats(25)
    build_s = pm.build_s
    # the same build again, on memory this process has touched: what the first build pays the first touch of
    # fresh memory (on this VM ~1-3 ns per byte: the hypervisor backs guest pages as they are first written)
    profile = None
    if os.environ.get("DELTASYNC_BENCH_PROFILE") == "1":
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    t0 = time.perf_counter()
    again = engine.served.learn_map()
    rebuild_s = time.perf_counter() - t0
    if profile is not None:
        import pstats

        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
        if os.environ.get("DELTASYNC_BENCH_PROFILE_CALLERS"):  # a regex: who calls the functions it matches
            pstats.Stats(profile).print_callers(os.environ["DELTASYNC_BENCH_PROFILE_CALLERS"])
    params = [p for _, p in engine.model.named_parameters()]
    numel = sum(p.numel() for p in params)
    copy_s = 0.0
    with torch.no_grad():
        for p in params:  # one parameter at a time: the traffic of a whole copy without its peak memory
            t0 = time.perf_counter()
            copy = p.detach().clone()
            copy_s += time.perf_counter() - t0
            del copy
    layer = [p for n, p in engine.model.named_parameters() if ".layers.0." in n]
    return {
        "build_s": round(build_s, 3),
        "rebuild_s": round(rebuild_s, 3),
        "timings": dict(pm.timings),
        "rebuild_timings": dict(again.timings),
        "summary": pm.summary(),
        "params": numel,
        "copy_s": round(copy_s, 3),
        "layer_params": sum(p.numel() for p in layer),
    }


def run(name: str, overrides: dict[str, Any], tmp: Path) -> dict[str, Any]:
    from deltasync.testing.launchers import offline_llm
    from deltasync.testing.models import QWEN3_0_6B_CONFIG, write_config_only_model

    model = write_config_only_model(tmp / name, {**QWEN3_0_6B_CONFIG, **overrides})
    t0 = time.perf_counter()
    llm = offline_llm(model, load_format="dummy", max_model_len=256)
    start_s = time.perf_counter() - t0
    try:
        (out,) = llm.collective_rpc(_build)
    finally:
        del llm
        gc.collect()
    out.update(case=name, layers=overrides.get("num_hidden_layers", QWEN3_0_6B_CONFIG["num_hidden_layers"]))
    out["engine_start_s"] = round(start_s, 1)
    out["build_over_copy"] = round(out["build_s"] / out["copy_s"], 1)
    print(
        f"{name:6s} layers {out['layers']:3d}  params {out['params'] / 1e9:6.2f} B  map build {out['build_s']:7.2f} s"
        f" (again: {out['rebuild_s']:.2f} s)"
        f"  ({out['summary']['layers']}, {out['summary']['unmapped_count']} unmapped)  one copy of the model "
        f"{out['copy_s']:6.2f} s  = {out['build_over_copy']}x\n"
        f"       steps (s; minor_faults: pages of fresh memory touched): {out['timings']}; "
        f"again: {out['rebuild_timings']}",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="cases to run (default: all)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.only or list(CASES):
            results.append(run(name, CASES[name], Path(d)))
    by = {r["case"]: r for r in results}
    for shape in ("8B", "70B"):
        if f"{shape}-2" in by and f"{shape}-4" in by:
            ratio = by[f"{shape}-4"]["build_s"] / by[f"{shape}-2"]["build_s"]
            print(f"{shape} layer shapes: 4 layers cost {ratio:.2f}x what 2 layers cost (target <= 1.3x)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
