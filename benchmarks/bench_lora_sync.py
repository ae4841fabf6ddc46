"""LoRA sync, side by side in one run (run by hand, asserts nothing): the adapter itself against today's
merged path, at Qwen3-0.6B shapes, rank 16 on all seven linear modules of every layer.

One trainer (a PEFT model on the Qwen3-0.6B architecture, random bf16 base, float32 adapters as PEFT keeps them)
takes the same steps for both paths (every adapter element moves by about ``--lr`` per step, as Adam moves it).
Each path gets its own coordinator, store and vLLM engine (CPU, dummy weights, one after the other):

* **adapter**: ``Publisher(adapter=adapter_entry(model))`` publishes the adapter's own tensors; vLLM serves it
  with ``enable_lora``; the agent runs in apply mode ``lora`` (the served directory holds each version, vLLM loads
  it at its next step).
* **merged**: ``Publisher(merge_lora=True)`` publishes ``base + B @ A`` for every adapted matrix; the agent applies
  it in place (the patch map, plain weights).

Per step: the bytes published (the delta), the publisher's time (copy + diff + encode + write, flushed), the
agent's time before the pause and the pause, and for the adapter the first request after the update (vLLM loads
the new version then). Ends with one JSON line.

    python benchmarks/bench_lora_sync.py [--rank 16] [--steps 4] [--lr 1e-4]
    python benchmarks/bench_lora_sync.py --rank 8 --steps 1 --paths adapter     # the smallest real run (~40 s here)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("DELTASYNC_VLLM_PLAIN_WEIGHTS", "1")  # the merged path in place, through the patch map

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trainer(model_dir: Path, rank: int) -> Any:
    """A PEFT LoRA model on the architecture in ``model_dir`` (random bf16 base; PEFT's float32 adapters)."""
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    return peft.get_peft_model(base, lora)


def train_step(model: Any, step: int, lr: float) -> None:
    """Every adapter element moves by about ``lr`` (an Adam-like step)."""
    import torch

    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * lr)


def run_path(path: str, tmp: Path, model_dir: Path, model: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One path: coordinator, store, engine, agent; the first sync, then ``args.steps`` steps."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from deltasync import Publisher
    from deltasync.agent import Agent
    from deltasync.client import CoordinatorClient
    from deltasync.config import AgentConfig, PublisherConfig
    from deltasync.lora import adapter_entry
    from deltasync.store import LocalStore
    from deltasync.testing.credentials import PUBLISHER_TOKEN, TOKENS_ENV, agent_token
    from deltasync.testing.launchers import CoordinatorProcess, offline_llm

    lora = path == "adapter"
    served = tmp / f"served-{path}"
    extra = {"enable_lora": True, "max_loras": 1, "max_lora_rank": args.rank} if lora else {}
    llm = offline_llm(model_dir, load_format="dummy", **extra)
    request = LoRARequest("policy", 1, str(served)) if lora else None
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rows: list[dict[str, Any]] = []
    # deltas only: a near-dense delta is about an anchor's size, and the default (an anchor once the deltas since
    # the last one pass half its bytes) would add an anchor to every step of either path
    config = PublisherConfig(anchor_every=None, anchor_bytes_fraction=None)
    try:
        with (
            CoordinatorProcess(tmp / f"ledger-{path}.db", env=TOKENS_ENV, log=tmp / f"coordinator-{path}.log") as c,
            CoordinatorClient(c.url, token=PUBLISHER_TOKEN) as pub_client,
            CoordinatorClient(c.url, token=agent_token(f"bench-{path}")) as agent_client,
        ):
            store = LocalStore(tmp / f"store-{path}")
            agent_config = AgentConfig(
                agent_id=f"bench-{path}",
                staging_dir=str(tmp / f"staging-{path}"),
                apply_mode="lora" if lora else None,
                adapter_dir=str(served) if lora else None,
            )
            agent = Agent.for_llm(llm, store=store, coordinator=agent_client, config=agent_config)
            publisher = Publisher(
                store,
                pub_client,
                config,
                adapter=adapter_entry(model) if lora else None,
                merge_lora=not lora,
            )
            with publisher:
                for step in range(args.steps + 1):
                    if step:
                        train_step(model, step, args.lr)
                    t0 = time.perf_counter()
                    publisher.publish(model, step)
                    blocked = publisher.last_blocked_s
                    publisher.flush()
                    publish_s = time.perf_counter() - t0
                    m = publisher.published[-1]
                    result = agent.sync()
                    t = result.timings
                    t0 = time.perf_counter()
                    llm.generate(["The quick brown fox"], params, lora_request=request, use_tqdm=False)
                    first_request_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    llm.generate(["The quick brown fox"], params, lora_request=request, use_tqdm=False)
                    steady_request_s = time.perf_counter() - t0
                    before = sum(t.get(k, 0.0) for k in ("fetch", "decode", "stage", "prepare"))
                    row = {
                        "path": path,
                        "step": step,
                        "kind": m.kind,
                        "bytes": m.total_bytes,
                        "changed": m.nnz,
                        "changed_fraction": round(m.nnz / max(m.numel, 1), 4),
                        "publish_s": round(publish_s, 3),
                        "publish_blocked_s": round(blocked, 3),
                        "agent_before_pause_s": round(before, 3),
                        "pause_s": round(t.get("pause", 0.0), 4),
                        "agent_total_s": round(sum(t.values()), 3),
                        "first_request_s": round(first_request_s, 4),
                        "steady_request_s": round(steady_request_s, 4),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--paths", nargs="+", default=["adapter", "merged"], choices=["adapter", "merged"])
    args = parser.parse_args()
    from deltasync.testing.models import write_config_only_model

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = write_config_only_model(tmp / "model")
        model = trainer(model_dir, args.rank)
        adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        print(f"Qwen3-0.6B shapes, rank {args.rank} on {len(TARGETS)} modules: {adapter / 1e6:.1f}M adapter elements")
        rows = []
        for path in args.paths:
            rows += run_path(path, tmp, model_dir, model, args)
    summary: dict[str, Any] = {"rank": args.rank, "lr": args.lr, "adapter_elements": adapter}
    for path in args.paths:
        steps = [r for r in rows if r["path"] == path and r["step"] > 0]
        for key in ("bytes", "changed", "publish_s", "agent_before_pause_s", "pause_s", "first_request_s"):
            summary[f"{path}_{key}"] = statistics.median(r[key] for r in steps)
        print(
            f"{path:8s} per step (median of {len(steps)}): {summary[f'{path}_bytes'] / 1e6:8.1f} MB, "
            f"{summary[f'{path}_changed'] / 1e6:6.1f}M elements changed, publish {summary[f'{path}_publish_s']:.2f} s, "
            f"agent before the pause {summary[f'{path}_agent_before_pause_s']:.2f} s, "
            f"pause {summary[f'{path}_pause_s'] * 1e3:.0f} ms, first request after {summary[f'{path}_first_request_s'] * 1e3:.0f} ms"
        )
    if len(args.paths) == 2:
        for key in ("bytes", "publish_s", "agent_before_pause_s", "pause_s"):
            summary[f"merged_over_adapter_{key}"] = round(
                summary[f"merged_{key}"] / max(summary[f"adapter_{key}"], 1e-9), 1
            )
        print({k: v for k, v in summary.items() if k.startswith("merged_over")})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
