"""Wordle RL with delta sync: a short supervised warm-up on scripted games, then TRL's GRPOTrainer whose
rollouts come from a vLLM server kept current by the deltasync sidecar agent.

Each optimizer step is published (DeltaSyncCallback); before generating, the trainer waits until the fleet has
applied the last published version (staleness 0), so every rollout uses exactly the weights it trains. Writes one
JSON line per step to ``--out/metrics.jsonl`` and, at the end, ``--out/final.json`` with the bit-exact check.

    python -m examples.wordle.train --model DIR --vllm-url URL --env-url URL --coordinator URL --store URI --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from deltasync.client import CoordinatorClient
from deltasync.config import PublisherConfig
from deltasync.integrations.trl import DeltaSyncCallback
from deltasync.publisher import Publisher
from tests.support.models import qwen3_effective_checksums

from .game import allowed_words, parse_guess, render_messages
from .solver import TreeSolver

logger = logging.getLogger("wordle.train")
FORMAT_BONUS = 0.1


def prompt_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt, ready for the reply."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids: list[int] = tok(text, add_special_tokens=False)["input_ids"]
    return ids


def scripted_examples(n: int, rng: random.Random) -> list[tuple[list[dict[str, str]], str]]:
    """(prompt, reply) pairs from the tree solver's games, starting from random positions."""
    from .game import answer_words, feedback

    solver, out = TreeSolver(), []
    while len(out) < n:
        answer, history = rng.choice(answer_words()), []
        while not history or history[-1][1] != "GGGGG":
            guess = solver.guess(history)
            out.append((render_messages(history), f"<guess>{guess}</guess>"))
            history.append((guess, feedback(guess, answer)))
    rng.shuffle(out)
    return out[:n]


def warmup(model: Any, tok: Any, steps: int, *, batch: int = 16, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Supervised warm-up on scripted games (loss on the reply only), so the reward curve is not a flat zero."""
    rng = random.Random(seed)
    data = scripted_examples(steps * batch, rng)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        rows = data[step * batch : (step + 1) * batch]
        ids, labels = [], []
        for messages, reply in rows:
            prompt = prompt_ids(tok, messages)
            target = tok(reply + tok.eos_token, add_special_tokens=False)["input_ids"]
            ids.append(prompt + target)
            labels.append([-100] * len(prompt) + target)
        width = max(map(len, ids))
        pad = tok.pad_token_id
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
        label_ids = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        attention = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()
        loss = model(input_ids=input_ids, attention_mask=attention, labels=label_ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if step % 50 == 0 or step == steps - 1:
            logger.info("warm-up step %d/%d: loss %.3f", step + 1, steps, losses[-1])
    return losses


class Rollouts:
    """TRL ``rollout_func``: completions from the vLLM server, after the fleet caught up with the trainer."""

    def __init__(
        self,
        vllm_url: str,
        model_name: str,
        tok: Any,
        coordinator: CoordinatorClient,
        publisher: Publisher,
        *,
        max_tokens: int,
        metrics: dict[str, Any],
    ) -> None:
        self.vllm_url, self.model_name, self.tok = vllm_url, model_name, tok
        self.coordinator, self.publisher, self.max_tokens, self.metrics = coordinator, publisher, max_tokens, metrics
        self.http = httpx.Client(base_url=vllm_url, timeout=300)

    def wait_applied(self, version: int, timeout_s: float = 300) -> float:
        """Seconds until every agent reports ``version`` applied."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            fleet = self.coordinator.agents()
            if fleet and all(a.applied_version is not None and a.applied_version >= version for a in fleet):
                return time.perf_counter() - t0
            time.sleep(0.05)
        raise TimeoutError(f"the agents did not apply v{version} within {timeout_s} s: {fleet}")

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        self.publisher.flush()  # the version of the last step is committed and registered
        version = self.publisher.published[-1].version
        self.metrics["applied_wait_s"] = self.wait_applied(version)
        self.metrics["served_version"] = version
        ids = [prompt_ids(self.tok, p) for p in prompts]
        body = {
            "model": self.model_name,
            "prompt": ids,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "n": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": [self.tok.eos_token_id],
        }
        response = self.http.post("/v1/completions", json=body)
        response.raise_for_status()
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        return {
            "prompt_ids": ids,
            "completion_ids": [c["token_ids"] for c in choices],
            "logprobs": [c["logprobs"]["token_logprobs"] for c in choices],
        }


def make_reward(env: httpx.Client):
    """The reward: the environment's (1.0 win, 0.1 per green + 0.05 per yellow) plus 0.1 for a well-formed,
    valid guess; 0 for an invalid move (malformed reply, not 5 letters, not an allowed word)."""

    def wordle_reward(completions: list[Any], session_id: list[str], **kwargs: Any) -> list[float]:
        rewards = []
        for completion, sid in zip(completions, session_id, strict=True):
            text = completion if isinstance(completion, str) else completion[-1]["content"]
            guess = parse_guess(text)
            if guess is None or guess not in allowed_words():
                rewards.append(0.0)
                continue
            fork = env.post(f"/v1/sessions/{sid}/fork").json()["session_id"]
            step = env.post(f"/v1/sessions/{fork}/guess", json={"guess": guess}).json()
            env.delete(f"/v1/sessions/{fork}")
            rewards.append(step["reward"] + FORMAT_BONUS if step["valid"] else 0.0)
        return rewards

    return wordle_reward


def sessions_dataset(env: httpx.Client, n: int, seed: int) -> Any:
    """Game positions from the environment: a random answer and 0-2 opening moves of the scripted solver."""
    from datasets import Dataset

    rng, solver, rows = random.Random(seed), TreeSolver(), []
    for i in range(n):
        obs = env.post("/v1/sessions", json={"seed": seed * 100_000 + i}).json()
        for _ in range(rng.randint(0, 2)):
            history = [(h["guess"], h["feedback"]) for h in obs["history"]]
            obs = env.post(f"/v1/sessions/{obs['session_id']}/guess", json={"guess": solver.guess(history)}).json()
        if obs["done"]:
            continue
        history = [(h["guess"], h["feedback"]) for h in obs["history"]]
        rows.append({"prompt": render_messages(history), "session_id": obs["session_id"]})
    return Dataset.from_list(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--vllm-url", required=True)
    parser.add_argument("--env-url", required=True)
    parser.add_argument("--coordinator", required=True, help="URL, or replicas of one ledger: URL1,URL2")
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[trainer] %(asctime)s %(message)s")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.warmup_steps > 0:
        t0 = time.perf_counter()
        losses = warmup(model, tok, args.warmup_steps, seed=args.seed)
        logger.info("warm-up done in %.0f s: loss %.3f -> %.3f", time.perf_counter() - t0, losses[0], losses[-1])

    token = os.environ.get("DELTASYNC_PUBLISHER_TOKEN")
    env = httpx.Client(base_url=args.env_url, timeout=60)
    coordinator = CoordinatorClient(args.coordinator, token=token)
    publisher = Publisher(args.store, coordinator, PublisherConfig(anchor_every=10, queue_size=1))
    step_metrics: dict[str, Any] = {}
    rollouts = Rollouts(args.vllm_url, args.model, tok, coordinator, publisher, max_tokens=12, metrics=step_metrics)
    metrics_file = open(args.out / "metrics.jsonl", "a")  # noqa: SIM115 (closed at the end)
    full_bytes = sum(p.numel() * 2 for n, p in model.named_parameters() if n != "lm_head.weight")

    class Report(TrainerCallback):  # type: ignore[misc]
        def on_log(self, targs: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if not logs or "reward" not in logs:
                return
            publisher.flush()  # this step's version is committed (the next rollout waits for it anyway)
            latest = publisher.published[-1].version if publisher.published else None
            objects = [m for m in publisher.published if m.version == latest]
            delta = next((m for m in objects if m.kind == "delta"), objects[0] if objects else None)
            record = {
                "step": state.global_step,
                "reward": logs.get("reward"),
                "reward_std": logs.get("reward_std"),
                "loss": logs.get("loss"),
                "served_version": step_metrics.get("served_version"),
                "applied_wait_s": step_metrics.get("applied_wait_s"),
                "full_bytes": full_bytes,
            }
            if delta is not None:  # what an agent that is up to date fetches; an anchor written beside it is noted
                record.update(
                    version=delta.version,
                    kind=delta.kind,
                    delta_bytes=delta.total_bytes,
                    changed_fraction=delta.nnz / max(delta.numel, 1),
                    anchor=len(objects) > 1,
                    publish_blocked_s=publisher.last_blocked_s,
                )
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

    config = trl.GRPOConfig(
        output_dir=str(args.out / "trainer"),
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        num_generations=args.num_generations,
        max_completion_length=12,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        logging_steps=1,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        beta=0.0,
        seed=args.seed,
        temperature=1.0,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=make_reward(env),
        args=config,
        processing_class=tok,
        train_dataset=sessions_dataset(env, max(64, args.steps * args.prompts_per_step), args.seed),
        rollout_func=rollouts,
        callbacks=[DeltaSyncCallback(publisher, close_on_end=False), Report()],
    )
    trainer.train()
    # the last step: publish, wait for the fleet, then prove what vLLM serves equals the trainer's weights
    publisher.flush()
    final_version = publisher.published[-1].version
    latency = rollouts.wait_applied(final_version)
    trained = {n: p.detach().to(torch.bfloat16) for n, p in trainer.model.state_dict().items() if n != "lm_head.weight"}
    expected = qwen3_effective_checksums(trained, trainer.model.config.num_hidden_layers)
    served = httpx.post(args.vllm_url + "/collective_rpc", json={"method": "deltasync_effective"}, timeout=120)
    got = served.json()["results"][0]
    differ = sorted(k for k in expected if got.get(k) != expected[k])
    weight_version = httpx.get(args.vllm_url + "/weight_info", timeout=30).json()["weight_version"]
    final = {
        "version": final_version,
        "served_weight_version": weight_version,
        "bit_exact": not differ,
        "tensors_checked": len(expected),
        "differ": differ,
        "final_apply_wait_s": latency,
        "published": [{"version": m.version, "kind": m.kind, "bytes": m.total_bytes} for m in publisher.published],
    }
    (args.out / "final.json").write_text(json.dumps(final, indent=1))
    logger.info(
        "final v%d served as weight_version %s: bit-exact %s (%d tensors)",
        final_version,
        weight_version,
        not differ,
        len(expected),
    )
    publisher.close()
    metrics_file.close()
    coordinator.close()
    if differ:
        raise SystemExit(f"vLLM serves other weights than the trainer's: {differ[:5]}")


if __name__ == "__main__":
    main()
