"""Wordle RL with delta sync: a short supervised warm-up on scripted games, then GRPO whose rollouts come from a
vLLM server kept current by the deltasync sidecar agent.

**Asynchronous by default.** Rollout workers (threads) generate groups continuously against vLLM into a bounded
queue while the trainer trains; each optimizer step is published through :class:`DeltaSyncWeightTransfer` (TRL's
``WeightTransferProtocol``, called as AsyncGRPOTrainer calls it) and the sidecar applies it while vLLM keeps
serving. Every completion is tagged with the weight versions vLLM reports for its tokens; a group whose oldest
token is more than ``--max-staleness`` versions behind the trainer is dropped, and the loss corrects the rest with
a truncated importance ratio (:mod:`examples.wordle.grpo`). ``--sync`` is the lock-step baseline: before each
step the trainer waits until vLLM serves its last version, then generates, then trains.

**LoRA** (``--lora-rank R``): the trainer trains a LoRA adapter on the frozen base and publishes the adapter itself,
not merged (``Publisher(adapter=...)``); vLLM serves it under ``--adapter-name`` (started with ``--enable-lora`` and
``--lora-modules NAME=DIR``, its agent with ``--apply-mode lora --adapter-dir DIR``), and the rollouts name it.

Writes one JSON line per step to ``--out/metrics.jsonl`` and, at the end, ``--out/final.json`` (timings, staleness,
the bit-exact check of what vLLM serves against the trainer's weights).

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
from deltasync.integrations.trl import DeltaSyncWeightTransfer
from deltasync.names import NameMap, experts_of
from deltasync.publisher import Publisher
from deltasync.testing.models import qwen3_effective_checksums

from .env_server import env_client
from .game import render_messages
from .grpo import grpo_tis_loss
from .rollouts import LocalRollouts, RemoteRollouts, ServedVersions, prompt_ids, wordle_producer
from .solver import TreeSolver

logger = logging.getLogger("wordle.train")


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
        device = next(model.parameters()).device
        loss = model(
            input_ids=input_ids.to(device), attention_mask=attention.to(device), labels=label_ids.to(device)
        ).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == steps - 1:
            logger.info("warm-up step %d/%d: loss %.3f", step + 1, steps, losses[-1])
    return losses


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of the tiny Qwen3: what ``--lora-rank`` adapts."""


def lora_config(rank: int) -> Any:
    """The demo's adapter: rank ``rank`` on every linear layer, alpha ``2 x rank``, no dropout (the trainer's forward
    passes then match vLLM's)."""
    import peft

    return peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0)


def with_adapter(model: Any, rank: int) -> Any:
    """``model`` wrapped with the demo's adapter (PEFT's initialization: B = 0, the base's outputs)."""
    import peft

    return peft.get_peft_model(model, lora_config(rank))


def sync_weights(transfer: DeltaSyncWeightTransfer, model: Any) -> int:
    """One weight sync, with TRL AsyncGRPOTrainer's calls in its order (``_sync_weight_merged``)."""
    transfer.pause()
    transfer.send_weights((name, p.detach()) for name, p in model.named_parameters())
    transfer.resume()
    return transfer.versions[-1]


def trainer_checksums(model: Any) -> dict[str, Any]:
    """The checksum of every tensor as vLLM computes with it, from the trainer's weights in bf16 (a PEFT model's
    base weights: vLLM serves the adapter apart)."""
    from deltasync.names import NameMap

    names = NameMap()
    trained = {
        name: p.detach().to("cpu", torch.bfloat16)
        for n, p in model.state_dict().items()
        if (name := names(n)) is not None and name != "lm_head.weight"
    }
    return qwen3_effective_checksums(trained, model.config.num_hidden_layers)


def _is_moe(model: Any) -> bool:
    """A MoE policy (``--moe``): vLLM repacks its experts in a layout only vLLM knows, so no checksums are written
    down here; the demo compares the served engine with a fresh one instead (:mod:`examples.wordle.fresh_check`)."""
    return getattr(model.config, "num_experts", None) is not None


def served_adapter_differs(
    vllm_url: str, model: Any, adapter_name: str, prompts: list[list[int]], out: Path, max_tokens: int
) -> tuple[list[str], int]:
    """A LoRA run's final check, through vLLM's administrative routes (the engine credential): the adapter
    tensors vLLM loads (the agent's served directory) against the trainer's adapter in bf16, bit for bit; then
    vLLM loads the trainer's own adapter (float32, as PEFT saves it) under another name, and the served adapter
    must give the same tokens and logprobs, greedy, one prompt at a time. Returns what differs and how many
    tensors and prompts were checked."""
    from deltasync.format import tensor_checksum
    from deltasync.lora import adapter_state
    from deltasync.targets import EngineAuth
    from deltasync.vllm.guard import load_engine_token

    token = load_engine_token()
    if token is None:
        raise SystemExit("the final check needs DELTASYNC_ENGINE_TOKEN (or pass --skip-final-check)")
    expected = {n: tensor_checksum(t.detach().to("cpu", torch.bfloat16)) for n, t in adapter_state(model).items()}
    reference = (out / "final-adapter").absolute()
    model.save_pretrained(reference)
    differ: list[str] = []
    with httpx.Client(base_url=vllm_url, timeout=300, auth=EngineAuth(token)) as admin:
        served = admin.post("/collective_rpc", json={"method": "deltasync_adapter"}).json()["results"][0]
        got = served.get("checksums", {})
        differ += sorted(n for n in set(expected) | set(got) if got.get(n) != expected.get(n))
        response = admin.post("/v1/load_lora_adapter", json={"lora_name": "trainer-final", "lora_path": str(reference)})
        response.raise_for_status()
        for i, ids in enumerate(prompts):
            answers = []
            for name in (adapter_name, "trainer-final"):
                body = {
                    "model": name,
                    "token_ids": ids,
                    "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 3},
                }
                choice = admin.post("/inference/v1/generate", json=body).json()["choices"][0]
                answers.append((choice["token_ids"], choice["logprobs"]))
            if answers[0] != answers[1]:
                differ.append(f"prompt {i}: served {answers[0][0]}, trainer's adapter {answers[1][0]}")
        admin.post("/v1/unload_lora_adapter", json={"lora_name": "trainer-final"})
    return differ, len(expected) + len(prompts)


def served_differs(vllm_url: str, model: Any) -> tuple[list[str], int]:
    """Tensors whose checksum, as vLLM computes with them, differs from the trainer's; and how many were checked.

    An operator's check through vLLM's administrative ``/collective_rpc``: it needs the engine credential
    (``DELTASYNC_ENGINE_TOKEN``); the rollout workers never get it and reach only inference routes."""
    from deltasync.targets import EngineAuth
    from deltasync.vllm.guard import load_engine_token

    token = load_engine_token()
    if token is None:
        raise SystemExit("the final check needs DELTASYNC_ENGINE_TOKEN (or pass --skip-final-check)")
    expected = trainer_checksums(model)
    with httpx.Client(base_url=vllm_url, timeout=120, auth=EngineAuth(token)) as admin:
        got = admin.post("/collective_rpc", json={"method": "deltasync_effective"}).json()["results"][0]
    return sorted(k for k in expected if got.get(k) != expected[k]), len(expected)


def run_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every Wordle trainer takes: the model, where vLLM, the environment, the coordinator and the
    store are, and the output directory."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--vllm-url", help="vLLM's server (not needed with --rollouts-url, --served-from coordinator)")
    parser.add_argument(
        "--env-url", help="the environment (not needed with --rollouts-url; its bearer token: WORDLE_ENV_TOKEN)"
    )
    parser.add_argument("--coordinator", required=True, help="URL, or replicas of one ledger: URL1,URL2")
    parser.add_argument("--ca-bundle", help="CA certificates (PEM) for an https coordinator (and rollout service)")
    parser.add_argument(
        "--insecure-http",
        action="store_true",
        help="send tokens over plain http:// to another host anyway (the coordinator's, the rollout service's and "
        "the environment's)",
    )
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def main() -> None:
    parser = run_parser(__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--sync", action="store_true", help="lock-step: wait for vLLM to serve each version")
    parser.add_argument("--max-staleness", type=int, default=2, help="drop groups more versions behind than this")
    parser.add_argument("--rollout-workers", type=int, default=2, help="groups generated at a time")
    parser.add_argument(
        "--queue-size",
        type=int,
        help="groups queued or in flight at most (default: what the bound lets the trainer consume, "
        "--prompts-per-step x (K + 1))",
    )
    parser.add_argument(
        "--rollouts-url",
        help="take groups from a rollout service on another host (examples.wordle.rollout_server; bearer token from "
        "WORDLE_ROLLOUT_TOKEN) instead of generating them here",
    )
    parser.add_argument(
        "--served-from",
        choices=["vllm", "coordinator"],
        default="vllm",
        help="learn what vLLM serves from its /weight_info (needs the engine credential) or from the coordinator's "
        "record of its agent (--agent-id), for a trainer that must not hold the engine credential",
    )
    parser.add_argument("--agent-id", default="vllm-0", help="the engine's agent, with --served-from coordinator")
    parser.add_argument("--is-cap", type=float, default=2.0, help="cap of the truncated importance ratio")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train a LoRA adapter of this rank on the frozen base and publish it, not merged (0: full weights)",
    )
    parser.add_argument("--adapter-name", default="policy", help="the name vLLM serves the adapter under")
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="CPU threads for training (default on CPU: all cores but one, which vLLM's CPU worker binds to itself)",
    )
    parser.add_argument(
        "--skip-final-check",
        action="store_true",
        help="no bit-exact check (it needs the engine credential for vLLM's /collective_rpc)",
    )
    args = parser.parse_args()
    if args.max_staleness < 0 or args.steps < 1 or args.rollout_workers < 1:
        parser.error("need --max-staleness >= 0, --steps >= 1 and --rollout-workers >= 1")
    if args.rollouts_url and args.lora_rank:
        parser.error("--lora-rank names the adapter in the rollouts made here: it takes no --rollouts-url")
    if args.rollouts_url and args.sync:
        parser.error("--sync generates each step's groups here: it takes no --rollouts-url")
    if not args.rollouts_url and not args.env_url:
        parser.error("need --env-url (or --rollouts-url)")
    if not args.vllm_url and not (args.rollouts_url and args.served_from == "coordinator" and args.skip_final_check):
        parser.error("need --vllm-url (unless --rollouts-url, --served-from coordinator and --skip-final-check)")
    logging.basicConfig(level=logging.INFO, format="[trainer] %(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per rollout request otherwise
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    if args.torch_threads or not torch.cuda.is_available():
        # two OpenMP pools spinning on the same cores slow both several times over (measured: a warm-up step
        # 2.9 s with 2 threads beside vLLM, 0.44 s with 1)
        torch.set_num_threads(args.torch_threads or max(1, (os.cpu_count() or 2) - 1))
    args.out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    if args.warmup_steps > 0:
        t0 = time.perf_counter()
        losses = warmup(model, tok, args.warmup_steps, seed=args.seed)
        logger.info("warm-up done in %.0f s: loss %.3f -> %.3f", time.perf_counter() - t0, losses[0], losses[-1])
    adapter = None
    if args.lora_rank:
        from deltasync.lora import adapter_entry

        model = with_adapter(model, args.lora_rank)
        adapter = adapter_entry(model)
    served_model = args.adapter_name if adapter is not None else None

    token = os.environ.get("DELTASYNC_PUBLISHER_TOKEN")
    coordinator = CoordinatorClient(
        args.coordinator, token=token, ca_bundle=args.ca_bundle, insecure_http=args.insecure_http
    )
    # the weights reach the publisher as (name, tensor) pairs, as TRL sends them: a MoE's fused experts are named
    # from the model's family here (a module passed to publish() would say it itself)
    names = None if adapter is not None else NameMap(experts=experts_of(model))
    publisher = Publisher(
        args.store, coordinator, PublisherConfig(anchor_every=10, queue_size=2), adapter=adapter, name_map=names
    )
    transfer = DeltaSyncWeightTransfer(publisher, model=model if adapter is not None else None)
    if args.served_from == "coordinator":
        served = ServedVersions.from_coordinator(coordinator, args.agent_id)
    else:
        served = ServedVersions.from_vllm(args.vllm_url)
    rollouts: LocalRollouts | RemoteRollouts
    if args.rollouts_url:
        rollouts = RemoteRollouts(
            args.rollouts_url, os.environ.get("WORDLE_ROLLOUT_TOKEN"), args.ca_bundle, insecure_http=args.insecure_http
        )
    else:
        env = env_client(args.env_url, insecure_http=args.insecure_http)  # WORDLE_ENV_TOKEN, when set
        vllm = httpx.Client(base_url=args.vllm_url, timeout=300)
        make_group, positions, probe = wordle_producer(
            vllm,
            env,
            tok,
            positions=max(64, args.steps * args.prompts_per_step),
            seed=args.seed,
            n=args.num_generations,
            max_tokens=args.max_tokens,
            model=served_model,
        )
        # production sized to consumption: what is queued or in flight is consumed over the next steps, and more
        # than the bound allows would be generated only to be dropped (AsyncGRPO sizes its in-flight tasks so)
        rollouts = LocalRollouts(
            make_group,
            positions,
            workers=args.rollout_workers,
            max_staleness=args.max_staleness,
            per_step=args.prompts_per_step,
            sync=args.sync,
            maxsize=args.queue_size,
            probe=probe,
        )
    staleness = 0 if args.sync else args.max_staleness
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    metrics_file = open(args.out / "metrics.jsonl", "a")  # noqa: SIM115 (closed at the end)
    published_at: dict[int, float] = {}

    # train begin, as AsyncGRPOTrainer's _TrainBeginCallback: set up, cold sync, then start the rollout workers
    transfer.init_weight_transfer()
    version = sync_weights(transfer, model)
    published_at[version] = time.time()
    cold_sync_s = served.wait_for(version)
    rl_started_at = time.time()
    rollouts.start(version)
    model.train()
    for step in range(1, args.steps + 1):
        t_step = time.perf_counter()
        sync_wait_s = served.wait_for(version) if args.sync else 0.0  # async mode never waits for a weight sync
        groups, rollout_wait_s = rollouts.take(version, args.prompts_per_step)
        t0 = time.perf_counter()
        loss, stats = grpo_tis_loss(model, groups, pad_id=tok.pad_token_id, cap=args.is_cap)
        loss.backward()
        opt.step()
        opt.zero_grad()
        train_s = time.perf_counter() - t0
        policy_version = version
        version = sync_weights(transfer, model)  # the trainer's next policy, published without waiting for it
        published_at[version] = time.time()
        record = {
            "step": step,
            "version": version,
            "policy_version": policy_version,
            "reward": stats.reward,
            "loss": stats.loss,
            "is_weight_mean": stats.is_weight_mean,
            "is_capped": stats.is_capped,
            "logprob_gap": stats.logprob_gap,
            "groups": [[g.oldest_version, g.newest_version, round(g.finished_at, 3)] for g in groups],
            "staleness": [policy_version - g.oldest_version for g in groups],
            "spanning_update": sum(c.first_version != c.last_version for g in groups for c in g.completions),
            "dropped_total": rollouts.dropped,
            "sync_wait_s": sync_wait_s,
            "rollout_wait_s": rollout_wait_s,
            "train_s": train_s,
            "publish_blocked_s": publisher.last_blocked_s,
            "step_s": time.perf_counter() - t_step,
            "episodes_total": rollouts.episodes,
            "held_back_s": rollouts.held_back_s,
        }
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
    rl_ended_at = time.time()
    # train end, as AsyncGRPOTrainer: stop the rollout workers, then destroy the transfer (flushes the publisher)
    rollouts.stop()
    transfer.destroy()
    final_apply_wait_s = served.wait_for(version)
    if args.skip_final_check:
        differ, checked = [], 0
    elif adapter is not None:
        prompts = [ids for ids, _ in positions.rows[:4]]
        differ, checked = served_differs(args.vllm_url, model)  # the base, untouched
        lora_differ, lora_checked = served_adapter_differs(
            args.vllm_url, model, args.adapter_name, prompts, args.out, args.max_tokens
        )
        differ, checked = differ + lora_differ, checked + lora_checked
    else:
        differ, checked = served_differs(args.vllm_url, model)
    weight_version = str(served.current)
    final = {
        "mode": "sync" if args.sync else "async",
        "max_staleness": staleness,
        "version": version,
        "served_weight_version": weight_version,
        "bit_exact": None if args.skip_final_check else not differ,
        "tensors_checked": checked,
        "differ": differ,
        "final_apply_wait_s": final_apply_wait_s,
        "cold_sync_s": cold_sync_s,
        "rl_started_at": rl_started_at,
        "rl_ended_at": rl_ended_at,
        "episodes": rollouts.episodes,
        "held_back_s": rollouts.held_back_s,
        "dropped_groups": rollouts.dropped,
        "staleness_histogram": {str(k): v for k, v in sorted(rollouts.staleness.items())},
        "publish_to_served_s": {
            str(v): at - t for v, t in published_at.items() if (at := served.served_at(v)) is not None
        },
        "full_bytes": sum(p.numel() * 2 for p in model.parameters()),
        "lora_rank": args.lora_rank,
        # what vLLM should compute with at the final version, for a check on the inference host
        # (examples.wordle.check_served) where the trainer holds no engine credential
        "effective_checksums": None if _is_moe(model) else trainer_checksums(model),
        "published": [
            {"version": m.version, "kind": m.kind, "bytes": m.total_bytes, "changed": m.nnz / max(m.numel, 1)}
            for m in publisher.published
        ],
    }
    (args.out / "final.json").write_text(json.dumps(final, indent=1))
    logger.info("final v%d served as weight_version %s: bit-exact %s", version, weight_version, not differ)
    served.close()
    metrics_file.close()
    coordinator.close()
    if differ:
        raise SystemExit(f"vLLM serves other weights than the trainer's: {differ[:5]}")


if __name__ == "__main__":
    main()
