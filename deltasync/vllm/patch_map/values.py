"""The real values the build loads after the probes: random values with a float format's edge cases dense among
them (a loader that transforms values, even only some of them, changes their bits), and the background the
stand-ins hold meanwhile (finite and zero-free: a write of zeros, or one that depends on what a parameter held,
shows against it)."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from ...format import tensor_checksum
from ...vocab import DTYPES
from .tensors import bits, numel

__all__ = ["REAL_BLOCK", "Background", "draw_real_values", "real_values", "seed"]

REAL_BLOCK = 1_000_003
"""Real check values repeat with this (prime) period: one random draw serves a tensor of any size."""

EDGE_STEP = 7
"""Every 7th real check value is an edge case (7 is prime: they fall in every row and every short stretch)."""

SMALL = 4096
"""A tensor this size or smaller gets real values of its own draw (:meth:`Background.values`)."""

BG_PERIOD = 1_048_573
"""The background's period (a prime: it falls across rows of any width, and no row repeats the one above it)."""


def edge_bits(dtype: torch.dtype) -> torch.Tensor:
    """The edge cases of a float ``dtype`` as its bit patterns (a signed integer tensor of its width): NaNs of both
    signs and several payloads (quiet, signalling, all ones: a loader that canonicalises NaNs changes them),
    infinities, -0.0, the largest finite values, a subnormal, large magnitudes."""
    info = torch.finfo(dtype)
    floats = [float("nan"), float("inf"), float("-inf"), -0.0, info.max, -info.max, info.smallest_normal / 4]
    floats += [1e6, -1e6, 7e4, -7e4]
    patterns = bits(torch.tensor(floats, dtype=dtype))
    quiet, inf = int(patterns[0]), int(patterns[1])
    sign = -(1 << (8 * patterns.element_size() - 1))
    nans = [quiet | sign, inf | 1, (inf | 1) | sign, -1]  # -qNaN, +sNaN, -sNaN, all ones (a NaN in every format)
    return torch.cat([patterns, torch.tensor(nans, dtype=patterns.dtype)])


def real_values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, edges: bool = True) -> torch.Tensor:
    """Random values with the edge cases (:func:`edge_bits`) dense among them (``edges``), every
    :data:`EDGE_STEP`-th element from a random start per tensor (so no two tensors hold the same edge at the same
    place): a loader that clamps, cleans or renormalises any of them, anywhere, is caught. One block of
    :data:`REAL_BLOCK` values is drawn and tiled, each tile rotated by a random amount (where a value lands is the
    integer probes' proof; these catch arithmetic on the values, and an element swapped with its neighbour one
    block away: identical tiles would hold the same bits at both places). Without ``edges`` they are finite, as
    a checkpoint's are: a loader may treat a tensor with a NaN or an infinity in it otherwise (an fp8 scale is
    computed for finite weights only)."""
    n = numel(shape)
    block = torch.randn(min(n, REAL_BLOCK), generator=gen).to(dtype)
    if block.numel() and dtype.is_floating_point and edges:
        edge = edge_bits(dtype)
        start = int(torch.randint(0, min(EDGE_STEP, block.numel()), (1,), generator=gen))
        at = torch.arange(start, block.numel(), EDGE_STEP)
        first = int(torch.randint(0, edge.numel(), (1,), generator=gen))
        bits(block)[at] = edge[(torch.arange(at.numel()) + first) % edge.numel()]
    if n <= block.numel():
        return block.reshape(shape)
    return tiled(block, n, gen).view(dtype).reshape(shape)


def tiled(block: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` bits of ``block`` (one dimension), tiled, each tile rotated by a random amount (a new tensor)."""
    # tiled in numpy's memory: numpy asks the kernel for huge pages for large arrays and torch's allocator does
    # not, so a large tensor's values fault in ~4x faster (the embedding's are 311 MB at Qwen3-0.6B)
    src = bits(block).numpy()
    size = src.size
    out = np.empty(n, dtype=src.dtype)
    shifts = torch.randint(0, size, (-(-n // size),), generator=gen).tolist()
    for lo, shift in zip(range(0, n, size), shifts, strict=True):
        m = min(size, n - lo)
        head = min(m, size - shift)
        out[lo : lo + head] = src[shift : shift + head]
        out[lo + head : lo + m] = src[: m - head]
    return torch.from_numpy(out)


def seed() -> int:
    """A new seed for each build's real values: where two tensors' values happen to hold the same bits at the
    place a loader moves one of them to (about once in 600 places for bf16), the next build draws others, so no
    such coincidence is the same in every build of a model."""
    return secrets.randbits(63)


def draw_real_values(
    names: Iterable[str], spec: Mapping[str, tuple[str, tuple[int, ...]]]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A group's real values (:func:`real_values`, one draw of a new seed, by checkpoint name) and their digests."""
    gen = torch.Generator().manual_seed(seed())
    values = {n: real_values(spec[n][1], DTYPES[spec[n][0]], gen) for n in names}
    return values, {n: tensor_checksum(v) for n, v in values.items()}


class Background:
    """What the stand-ins of a real-values check hold before the load: finite random values, none of them zero
    (one block per dtype, new per build), repeating with period :data:`BG_PERIOD`, from a random place per
    parameter and check. Zeroed stand-ins would hide a loader whose writes depend on what the parameter held (one
    that accumulates, or copies only into rows that hold zeros) and a write of zeros into another tensor's place;
    it is finite because loaded weights are (a loader may take a row holding a NaN for uninitialised memory). It
    also makes the real values of the checks after the first (:meth:`values`)."""

    def __init__(self) -> None:
        self._gen = torch.Generator().manual_seed(seed())
        self._blocks: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._start: dict[str, int] = {}
        self._values: dict[tuple[torch.dtype, bool], torch.Tensor] = {}

    def values(self, shape: tuple[int, ...], dtype: torch.dtype, edges: bool = False) -> torch.Tensor:
        """Real values (finite; with ``edges``: with the edge cases, :func:`real_values`) for one load, in new
        memory (a loader that recycles or caches the tensors it was given never meets one twice): this build's
        block of :data:`REAL_BLOCK` values for ``dtype``, one window of it from a random place, or tiled from
        random places: one copy, no random draw of the whole tensor (a tensor of :data:`SMALL` elements or fewer
        is drawn: cheaper than the block, which a model of small tensors then never makes)."""
        n = numel(shape)
        if n <= SMALL:
            return real_values(shape, dtype, self._gen, edges)
        block = self._values.get((dtype, edges))
        if block is None:
            block = self._values[dtype, edges] = real_values((REAL_BLOCK,), dtype, self._gen, edges)
        if n > block.numel():
            return tiled(block, n, self._gen).view(dtype).reshape(shape)
        b, at = bits(block), self.draw(block.numel())  # one window of the block from a random place (it wraps)
        head = min(n, b.numel() - at)
        out = torch.empty(n, dtype=b.dtype)
        out[:head] = b[at : at + head]
        out[head:] = b[: n - head]
        return out.view(dtype).reshape(shape)

    def draw(self, n: int) -> int:
        """A random integer in ``[0, n)`` (0 if ``n`` is 0) from this build's generator."""
        return int(torch.randint(0, n, (1,), generator=self._gen)) if n > 0 else 0

    def fill(self, param: str, t: torch.Tensor, again: bool = False) -> None:
        """Fill stand-in ``t`` (contiguous) of ``param`` from a new random place (``again``: the last one)."""
        if not again or param not in self._start:
            self._start[param] = self.draw(BG_PERIOD)
        flat = bits(t.view(-1))
        for lo, block in self._pieces(param, flat, 0, flat.numel()):
            flat[lo : lo + block.numel()].copy_(block)

    def differing(self, param: str, t: torch.Tensor, p: int = 0, n: int = -1) -> int:
        """How many of stand-in ``t``'s flat elements ``p .. p + n`` (``n < 0``: to the end) hold other bits than
        its background."""
        flat = bits(t.view(-1))
        n = flat.numel() - p if n < 0 else n
        return sum(
            int(torch.count_nonzero(flat[p + lo : p + lo + b.numel()] != b))
            for lo, b in self._pieces(param, flat, p, n)
        )

    def changed(self, param: str, t: torch.Tensor, p: int, n: int) -> torch.Tensor:
        """Which of stand-in ``t``'s flat elements ``p .. p + n`` hold other bits than its background (a mask)."""
        flat = bits(t.view(-1))
        parts = [flat[p + lo : p + lo + b.numel()] != b for lo, b in self._pieces(param, flat, p, n)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool, device=flat.device)

    def _pieces(self, param: str, flat: torch.Tensor, p: int, n: int) -> Iterable[tuple[int, torch.Tensor]]:
        """``(offset from p, the background there)`` covering ``flat[p : p + n]``, one period at most each."""
        key = (flat.dtype, flat.device)
        block = self._blocks.get(key)
        if block is None:
            dtype = {torch.int16: torch.bfloat16, torch.int32: torch.float32, torch.int64: torch.float64}.get(
                flat.dtype, flat.dtype
            )
            values = real_values((BG_PERIOD,), dtype, self._gen, edges=False)
            if values.is_floating_point():
                values[values == 0] = 1  # no zero (of either sign) in it: a write of zeros shows
            block = bits(values)
            block[block == 0] = 1
            block = block.to(flat.device)
            self._blocks[key] = block
        lo, at = 0, (p + self._start[param]) % BG_PERIOD
        while lo < n:
            m = min(BG_PERIOD - at, n - lo)
            yield lo, block[at : at + m]
            lo, at = lo + m, 0
