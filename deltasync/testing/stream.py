"""Update streams: a realistic one (fp32 master weights trained by AdamW on noise, cast to bf16), and a light one
for shapes whose optimizer state does not fit (bf16 weights stepped by one unit in the last place)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["UlpStream", "UpdateStream"]


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


class UlpStream:
    """A light stream of bf16 weights for shapes whose AdamW state (16 bytes per element) does not fit: each step
    moves ``changed`` of every tensor's elements, drawn at random, by one unit in the last place, up or down (what
    lr 1e-6 does to most changed elements). It holds the weights alone (2 bytes per element) and steps them in
    place: :meth:`step` returns the stream's own tensors, which the next step changes. Deterministic for a seed.

    Example:
        >>> stream = UlpStream.from_shapes({"w": (64, 64)}, changed=0.25, seed=0)
        >>> before = stream.bf16()["w"]
        >>> 0 < int((stream.step()["w"] != before).sum()) <= 1024
        True
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], *, changed: float = 0.025, seed: int = 0) -> None:
        if not 0 < changed <= 1:
            raise ValueError(f"changed must be a fraction in (0, 1], got {changed}")
        bad = [n for n, t in weights.items() if t.dtype != torch.bfloat16]
        if bad:
            raise ValueError(f"UlpStream steps bf16 weights; {bad[:3]} are not bf16 (cast them first)")
        self.weights = dict(weights)
        self.changed = changed
        self.steps = 0
        self._gen = torch.Generator().manual_seed(seed)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]], *, seed: int = 0, **kwargs: Any) -> UlpStream:
        """Initialise like a model: matrices ~N(0, 0.02), vectors (norms) 1.0, made in bf16 one tensor at a time
        (no float32 copy of the model)."""
        gen = torch.Generator().manual_seed(seed + 1_000_003)
        weights = {}
        for n, s in shapes.items():
            if len(s) > 1:
                t = torch.empty(s, dtype=torch.bfloat16)
                for row in t.view(s[0], -1):  # float32 one row at a time
                    row.copy_(torch.randn(row.shape, generator=gen).mul_(0.02))
            else:
                t = torch.ones(s, dtype=torch.bfloat16)
            weights[n] = t
        return cls(weights, seed=seed, **kwargs)

    def bf16(self) -> dict[str, torch.Tensor]:
        """The current weights (new tensors)."""
        return {n: t.clone() for n, t in self.weights.items()}

    def step(self) -> dict[str, torch.Tensor]:
        """Move about ``changed`` of every tensor's elements (drawn with replacement, then each distinct one once)
        by one unit in the last place; returns the stream's own tensors."""
        self.steps += 1
        for t in self.weights.values():
            bits = t.view(-1).view(torch.int16)
            k = max(1, int(bits.numel() * self.changed))
            idx = torch.unique(torch.randint(bits.numel(), (k,), generator=self._gen))  # each moves once
            step = torch.randint(0, 2, (idx.numel(),), generator=self._gen, dtype=torch.int16).mul_(2).sub_(1)
            # |x| moves by one unit either way, but a zero (+0.0 or -0.0) only up: one unit below it is a NaN's bits
            step[(bits[idx] & 0x7FFF) == 0] = 1
            bits.index_add_(0, idx, step)
        return self.weights
