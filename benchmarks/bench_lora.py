"""LoRA adapter replaced in place in a running vLLM (the engine side; run by hand, asserts nothing).

A Qwen3-0.6B engine (dummy weights, vLLM on CPU, ``enable_lora``) serves a rank-16 adapter on all seven linear
modules of every layer (about 10M adapter parameters, 20 MB in bf16); each version replaces it in its slot
(``deltasync_lora_replace``: vLLM's loader, packing and scaling, then each layer's ``set_lora``). Printed per
version: the replace time seen by the caller (one RPC), next to what the same version costs as merged full weights
(the elements ``B @ A`` moves, and their bytes as a dense delta), and vLLM's own ``load_inplace`` reload of the
same directory for reference.

    python benchmarks/bench_lora.py [--rank 16] [--versions 5]
    python benchmarks/bench_lora.py --rank 8 --versions 1      # the smallest real run (about 30 s here)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

MODULES = {  # PEFT module -> (in, out) at Qwen3-0.6B shapes
    "self_attn.q_proj": (1024, 2048),
    "self_attn.k_proj": (1024, 1024),
    "self_attn.v_proj": (1024, 1024),
    "self_attn.o_proj": (2048, 1024),
    "mlp.gate_proj": (1024, 3072),
    "mlp.up_proj": (1024, 3072),
    "mlp.down_proj": (3072, 1024),
}


def write_adapter(path: Path, layers: int, rank: int, seed: int) -> int:
    """A PEFT adapter directory with random bf16 A and B; returns its parameter count."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for module, (fan_in, fan_out) in MODULES.items():
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.02).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.02).bfloat16()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted({m.split(".")[-1] for m in MODULES}),
        "bias": "none",
        "base_model_name_or_path": "Qwen/Qwen3-0.6B",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return sum(t.numel() for t in tensors.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--versions", type=int, default=5)
    args = parser.parse_args()
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from deltasync.testing.launchers import offline_llm
    from deltasync.testing.models import QWEN3_0_6B_CONFIG, write_config_only_model

    layers = int(QWEN3_0_6B_CONFIG["num_hidden_layers"])
    merged = layers * sum(i * o for i, o in MODULES.values())  # elements B @ A moves: every one of each matrix
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_config_only_model(root / "model")
        adapters = [root / f"v{v}" for v in range(args.versions + 1)]
        params = [write_adapter(a, layers, args.rank, seed=v) for v, a in enumerate(adapters)][0]
        llm = offline_llm(model, load_format="dummy", enable_lora=True, max_loras=1, max_lora_rank=args.rank)
        try:
            request = LoRARequest("policy", 1, str(adapters[0]))
            llm.generate(["warm up"], SamplingParams(max_tokens=2), lora_request=request, use_tqdm=False)
            print(
                f"Qwen3-0.6B, rank {args.rank} on {len(MODULES)} modules x {layers} layers: {params / 1e6:.1f}M "
                f"adapter parameters ({params * 2 / 1e6:.1f} MB bf16); merged, each version moves {merged / 1e6:.0f}M "
                f"elements of the base ({merged * 2 / 1e6:.0f} MB as a dense bf16 delta)"
            )
            replace, reload = [], []
            for v in range(1, args.versions + 1):
                t0 = time.perf_counter()
                out = llm.collective_rpc("deltasync_lora_replace", args=(1, str(adapters[v])))[0]
                replace.append(time.perf_counter() - t0)
                assert out["ok"], out
                t0 = time.perf_counter()
                llm.llm_engine.add_lora(LoRARequest("policy", 1, str(adapters[v]), load_inplace=True))
                reload.append(time.perf_counter() - t0)
                print(
                    f"v{v}: replace in slot {replace[-1] * 1e3:7.1f} ms; vLLM load_inplace {reload[-1] * 1e3:7.1f} ms"
                )
            med = sorted(replace)[len(replace) // 2]
            print(
                f"median: replace {med * 1e3:.1f} ms for {params * 2 / 1e6:.1f} MB of adapter "
                f"({med / params * 1e9:.1f} ns per adapter element); vLLM load_inplace "
                f"{sorted(reload)[len(reload) // 2] * 1e3:.1f} ms"
            )
        finally:
            llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
