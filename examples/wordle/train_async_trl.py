"""Wordle with TRL's own asynchronous trainer (GPU): ``AsyncGRPOTrainer`` generates with its rollout worker against
the vLLM server, and ``DeltaSyncWeightTransfer`` publishes every weight sync as a deltasync version that the
sidecar agent applies to vLLM (no NCCL group between trainer and vLLM, any number of vLLM replicas).

    python -m examples.wordle.train_async_trl --model Qwen/Qwen3-0.6B --vllm-url http://vllm:8000 \\
        --env-url http://env:8700 --coordinator http://coord:8600 --store s3://bucket/run1 --out run1

TRL 1.16's AsyncGRPOTrainer needs CUDA: its constructor asks ``torch.cuda.get_device_name`` for the peak FLOPs,
and it forces the ``tree_fa3`` attention, whose FlashAttention-3 kernel the ``kernels`` package fetches from the
Hub. On CPU, ``tests/integration/test_trl.py`` runs its weight-sync path (construction, the train-begin cold
sync, the per-step syncs) with ``build_trainer``; ``examples.wordle.train`` is the loop that runs here, making the
same protocol calls in the same order.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch

from deltasync.client import CoordinatorClient
from deltasync.config import PublisherConfig
from deltasync.integrations.trl import DeltaSyncWeightTransfer
from deltasync.publisher import Publisher

from .env_server import env_client
from .rollouts import game_positions, score
from .train import run_parser

__all__ = ["build_trainer"]


def parser() -> argparse.ArgumentParser:
    p = run_parser(__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p


def build_trainer(args: argparse.Namespace, *, rollout_worker: Any = None) -> Any:
    """The AsyncGRPOTrainer of this example, publishing through deltasync (``rollout_worker``: TRL's by default)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    env = env_client(args.env_url, insecure_http=args.insecure_http)  # WORDLE_ENV_TOKEN, when set
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = game_positions(env, tok, max(64, args.steps * args.prompts_per_step), args.seed)
    dataset = Dataset.from_list([{"prompt": messages, "session_id": sid} for _, messages, sid in rows])

    def wordle_reward(completions: list[Any], session_id: list[str], **kwargs: Any) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [score(env, sid, text) for text, sid in zip(texts, session_id, strict=True)]

    config = AsyncGRPOConfig(
        output_dir=str(args.out / "trainer"),
        vllm_server_base_url=args.vllm_url,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        num_generations=args.num_generations,
        max_completion_length=12,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        max_staleness=args.max_staleness,
        weight_sync_steps=1,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),  # only so that its weight sync can be tested on CPU
        bf16=torch.cuda.is_available(),
    )
    token = os.environ.get("DELTASYNC_PUBLISHER_TOKEN")
    coordinator = CoordinatorClient(args.coordinator, token=token, ca_bundle=args.ca_bundle)
    publisher = Publisher(args.store, coordinator, PublisherConfig(anchor_every=10))

    class CloseClients(TrainerCallback):  # type: ignore[misc]
        def on_train_end(self, *_: Any, **__: Any) -> None:
            env.close()
            coordinator.close()

    return AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=wordle_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[CloseClients()],
        rollout_worker=rollout_worker,
        weight_transfer=DeltaSyncWeightTransfer(publisher),
    )


def main() -> None:
    p = parser()
    args = p.parse_args()
    if not args.vllm_url or not args.env_url:
        p.error("need --vllm-url and --env-url")
    logging.basicConfig(level=logging.INFO, format="[trainer] %(asctime)s %(message)s")
    build_trainer(args).train()


if __name__ == "__main__":
    main()
