"""The GRPO loss with a truncated importance ratio for rollouts sampled by (possibly older) vLLM weights.

Advantages are group-normalized rewards (GRPO). Each completion token is weighted by the truncated importance
ratio ``min(pi_trainer(t) / pi_vllm(t), cap)``: the trainer's probability of the token under the weights being
trained over vLLM's sampling probability, detached and capped. This is token-level truncated importance sampling
(TIS, Yao et al. 2025), what TRL's GRPOTrainer applies with ``vllm_importance_sampling_mode="token_truncate"``
and what prime-rl uses for its asynchronous off-policy steps. It corrects both for staleness (the rollout came from
an older version) and for the numeric mismatch between vLLM's bf16 kernels and the trainer at the same version.
The loss is averaged over completion tokens (one optimizer step per batch, so the PPO ratio is 1 and no clip is
needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .rollouts import Group

__all__ = ["LossStats", "grpo_tis_loss"]


@dataclass(frozen=True, slots=True)
class LossStats:
    loss: float
    reward: float
    is_weight_mean: float
    """Mean truncated importance weight over completion tokens."""
    is_capped: float
    """Fraction of tokens whose ratio was capped."""
    logprob_gap: float
    """Mean |log pi_trainer - log pi_vllm| per token: how far the behaviour policy was from the trained one."""


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Group-normalized rewards; zero for a group whose rewards are all equal (no signal)."""
    std = rewards.std()
    return torch.zeros_like(rewards) if float(std) < 1e-6 else (rewards - rewards.mean()) / (std + 1e-4)


def grpo_tis_loss(model: Any, groups: list[Group], *, pad_id: int, cap: float = 2.0) -> tuple[torch.Tensor, LossStats]:
    """The loss over ``groups`` (call ``.backward()`` on it) and its statistics."""
    rows, adv, behaviour = [], [], []
    for g in groups:
        a = advantages(torch.tensor([c.reward for c in g.completions], dtype=torch.float32))
        for c, ai in zip(g.completions, a, strict=True):
            if c.token_ids:
                rows.append((g.prompt_ids, c.token_ids))
                adv.append(float(ai))
                behaviour.append(c.logprobs)
    if not rows:
        raise ValueError("every completion of these groups is empty: nothing to train on")
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # completion tokens, at their own positions
    vllm_lp = torch.zeros((len(rows), width))
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ((prompt, reply), lp) in enumerate(zip(rows, behaviour, strict=True)):
        end = len(prompt) + len(reply)
        input_ids[i, :end] = torch.tensor(prompt + reply)
        attention[i, :end] = 1
        mask[i, len(prompt) : end] = True
        vllm_lp[i, len(prompt) : end] = torch.tensor(lp)
    device = next(model.parameters()).device
    input_ids, attention, mask, vllm_lp = (t.to(device) for t in (input_ids, attention, mask, vllm_lp))
    logits = model(input_ids=input_ids, attention_mask=attention).logits.float()
    # the token at position t is predicted by the logits at t - 1
    logp = torch.zeros((len(rows), width), device=device)
    logp[:, 1:] = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    ratio = torch.exp(logp.detach() - vllm_lp)
    weight = ratio.clamp(max=cap)
    a = torch.tensor(adv, device=device)[:, None]
    per_token = -weight * torch.exp(logp - logp.detach()) * a
    loss = per_token[mask].mean()
    stats = LossStats(
        loss=float(loss.detach()),
        reward=sum(c.reward for g in groups for c in g.completions) / sum(len(g.completions) for g in groups),
        is_weight_mean=float(weight[mask].mean()),
        is_capped=float((ratio[mask] > cap).float().mean()),
        logprob_gap=float((logp.detach() - vllm_lp)[mask].abs().mean()),
    )
    return loss, stats
