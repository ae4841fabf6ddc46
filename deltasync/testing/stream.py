"""A realistic update stream: fp32 master weights trained by AdamW on noise, cast to bf16."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["UpdateStream"]


class UpdateStream:
    """A realistic stream of bf16 weights: fp32 master weights trained by AdamW on noise.

    The workload every benchmark and bit-exact test uses: AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), gradients
    ~N(0, grad_std), a bf16 cast after each step. With lr 1e-6 about 1-3% of bf16 elements
    change per step, as measured in real RL runs. Deterministic for a given seed.

    Example:
        >>> stream = UpdateStream.from_shapes({"w": (4, 4)}, seed=0)
        >>> w1 = stream.step()["w"]
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        lr: float = 1e-6,
        grad_std: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        seed: int = 0,
    ) -> None:
        if lr <= 0 or grad_std <= 0:
            raise ValueError(f"lr and grad_std must be > 0, got {lr} and {grad_std}")
        self.master = {n: t.detach().to(torch.float32).clone() for n, t in weights.items()}
        self.exp_avg = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.exp_avg_sq = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.lr, self.grad_std, self.betas, self.eps = lr, grad_std, betas, eps
        self.steps = 0
        self._gen = torch.Generator().manual_seed(seed)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]], *, seed: int = 0, **kwargs: Any) -> UpdateStream:
        """Initialise like a model: matrices ~N(0, 0.02), vectors (norms) 1.0."""
        gen = torch.Generator().manual_seed(seed + 1_000_003)
        stream = cls({}, seed=seed, **kwargs)
        for n, s in shapes.items():  # made in place, one tensor at a time: no second copy of the model
            stream.master[n] = torch.randn(s, generator=gen).mul_(0.02) if len(s) > 1 else torch.ones(s)
            stream.exp_avg[n], stream.exp_avg_sq[n] = torch.zeros(s), torch.zeros(s)
        return stream

    def bf16(self) -> dict[str, torch.Tensor]:
        """The current weights cast to bf16 (new tensors)."""
        return {n: p.to(torch.bfloat16) for n, p in self.master.items()}

    def step(self) -> dict[str, torch.Tensor]:
        """Take one AdamW step and return the new bf16 weights (new tensors)."""
        self.steps += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1**self.steps, 1 - b2**self.steps
        for n, p in self.master.items():
            g = torch.randn(p.shape, generator=self._gen).mul_(self.grad_std)
            m, v = self.exp_avg[n], self.exp_avg_sq[n]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = v.sqrt().div_(math.sqrt(bc2)).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / bc1)
        return self.bf16()
