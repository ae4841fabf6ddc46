"""Reading where probes landed: the runs of a probed parameter (values: 1-based checkpoint indices), and the split
probe (two int16 passes, ``i % PERIOD + 1`` then ``i // PERIOD + 1``) that halves the fresh memory a large group's
probing touches."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from . import tensors
from .core import Runs
from .tensors import same

__all__ = ["PERIOD", "SPLIT_AT", "high_pass", "indices", "low_pass", "probe_dtype", "runs_of", "split_probe"]


def runs_of(param: str, flat: torch.Tensor, numel: int, probe: torch.Tensor | None = None) -> Runs | None:
    """The runs of one probed parameter (values: 1-based checkpoint index, 0: not written); ``None`` when
    nothing landed in it. Scans the parameter in chunks, in its own order (no sort of its elements: the extra
    memory stays bounded however large the parameter), then orders the runs by checkpoint index. A chunk that
    is one stretch of the flat ``probe`` (a whole tensor, a row block: most of a model) is taken in one compare.

    Raises:
        ValueError: a value that is no element index, or a checkpoint element written twice.
    """

    def pieces() -> Iterable[tuple[int, int, int, torch.Tensor | None]]:
        for lo in range(0, flat.numel(), tensors.CHUNK):
            chunk = flat[lo : lo + tensors.CHUNK]
            first, n = int(chunk[0]), chunk.numel()
            if probe is not None and 0 < first <= numel - n + 1 and same(chunk, probe[first - 1 : first - 1 + n]):
                yield lo, n, first - 1, None
            else:
                yield lo, n, -1, chunk

    return join(param, pieces(), numel)


def join(param: str, pieces: Iterable[tuple[int, int, int, torch.Tensor | None]], numel: int) -> Runs | None:
    """:func:`runs_of` from a parameter's chunks, in its order, each ``(start, length, checkpoint start, None)``
    where the chunk is one stretch of the checkpoint tensor, else ``(start, length, -1, values)`` with its values
    as 1-based checkpoint indices (0: not written)."""
    ck_starts: list[torch.Tensor] = []
    pos_starts: list[torch.Tensor] = []
    lengths: list[torch.Tensor] = []
    prev_ck = prev_pos = -2  # the last written element of the previous chunk, to join runs across chunks
    for lo, n, first, chunk in pieces:
        if chunk is None:
            if first == prev_ck + 1 and lo == prev_pos + 1:
                lengths[-1][-1] += n  # continues the previous run
            else:
                ck_starts.append(torch.tensor([first]))
                pos_starts.append(torch.tensor([lo]))
                lengths.append(torch.tensor([n]))
            prev_ck, prev_pos = first + n - 1, lo + n - 1
            continue
        pos = torch.nonzero(chunk != 0).squeeze(1)  # a negative image (a derived ``-w``) counts as a write
        if pos.numel() == 0:
            continue
        ck = chunk[pos].to(torch.int64) - 1
        pos = pos + lo
        if int(ck.min()) < 0 or int(ck.max()) >= numel:
            raise ValueError(f"{param}: holds values that are no element index (the loader transforms them)")
        brk = torch.ones(ck.numel(), dtype=torch.bool)
        if ck.numel() > 1:
            brk[1:] = ((ck[1:] - ck[:-1]) != 1) | ((pos[1:] - pos[:-1]) != 1)
        if int(ck[0]) == prev_ck + 1 and int(pos[0]) == prev_pos + 1:
            brk[0] = False  # continues the last run of the previous chunk
        starts = torch.nonzero(brk).squeeze(1)
        ends = torch.cat([starts[1:], torch.tensor([ck.numel()])])
        if not bool(brk[0]):  # extend the previous chunk's last run up to this chunk's first break
            first_end = int(starts[0]) if starts.numel() else ck.numel()
            lengths[-1][-1] += first_end
        if starts.numel():  # only non-empty pieces: the previous chunk's last run is always lengths[-1][-1]
            ck_starts.append(ck[starts])
            pos_starts.append(pos[starts])
            lengths.append(ends - starts)
        prev_ck, prev_pos = int(ck[-1]), int(pos[-1])
    if not ck_starts:
        return None
    ck_start, pos_start, length = torch.cat(ck_starts), torch.cat(pos_starts), torch.cat(lengths)
    order = torch.argsort(ck_start, stable=True)
    ck_start, pos_start, length = ck_start[order], pos_start[order], length[order]
    if ck_start.numel() > 1 and bool((ck_start[:-1] + length[:-1] > ck_start[1:]).any()):
        raise ValueError(f"{param}: an element is written twice")
    return Runs(param, ck_start.contiguous(), pos_start.contiguous(), length.contiguous())


PERIOD = 32767
"""A split probe's period: element ``i`` is probed as ``i % PERIOD + 1``, then as ``i // PERIOD + 1`` (both
non-zero int16 values), for tensors of up to ``PERIOD ** 2`` (1.07 billion) elements."""

SPLIT_AT = 1 << 25
"""The default size from which a group is probed in two int16 passes (:func:`split_probe`) instead of one int32
pass: the embedding of a 0.6B model and up (the engine's ``DELTASYNC_MAP_SPLIT_AT``)."""


def split_probe(numel: int, high: bool) -> torch.Tensor:
    """One half of a split probe of ``numel`` elements, int16: ``i % PERIOD + 1`` (low) or ``i // PERIOD + 1``
    (high), written through numpy's memory (huge pages) with no temporary of the tensor's size."""
    out = np.empty(numel, dtype=np.int16)
    rows = numel // PERIOD
    whole = rows * PERIOD
    if high:
        out[:whole].reshape(rows, PERIOD)[:] = np.arange(1, rows + 1, dtype=np.int16)[:, None]
        out[whole:] = rows + 1
    else:
        block = np.arange(1, PERIOD + 1, dtype=np.int16)
        out[:whole].reshape(rows, PERIOD)[:] = block
        out[whole:] = block[: numel - whole]
    return torch.from_numpy(out)


def probe_dtype(biggest: int, sizes: Iterable[int], split_at: int = SPLIT_AT) -> tuple[torch.dtype, bool]:
    """The probes' integer type for a group whose largest tensor or parameter has ``biggest`` elements (its
    tensors: ``sizes``), and whether they go in two int16 passes: int64 at 2^31 elements or more (a probe and the
    parameters it lands in share one type), int16 halves from ``split_at`` elements where the halves can
    index every tensor, else int32."""
    if biggest >= 2**31 - 1:
        return torch.int64, False
    split = biggest >= split_at and all(n <= PERIOD**2 for n in sizes)
    return (torch.int16 if split else torch.int32), split


def low_pass(flat: torch.Tensor, numel: int, low: torch.Tensor) -> list[int | torch.Tensor | None]:
    """A parameter after a split probe's low pass, chunk by chunk (:func:`low_chunk`)."""
    return [low_chunk(flat[lo : lo + tensors.CHUNK], numel, low) for lo in range(0, flat.numel(), tensors.CHUNK)]


def high_pass(
    param: str, flat: torch.Tensor, numel: int, high: torch.Tensor, lows: list[int | torch.Tensor | None]
) -> Runs | None:
    """The runs of a parameter after a split probe's high pass, from its low pass (:func:`low_pass`).

    Raises:
        ValueError: a value that is no element index, a place written in one pass only, or an element written twice.
    """
    return join(param, high_pieces(param, flat, numel, high, lows), numel)


def low_chunk(chunk: torch.Tensor, numel: int, low: torch.Tensor) -> int | torch.Tensor | None:
    """A chunk after the low pass: the start ``r < PERIOD`` of the stretch of the (periodic) low probe it equals,
    ``None`` if nothing was written in it, else a copy of it."""
    r, n = int(chunk[0]) - 1, chunk.numel()
    if 0 <= r < PERIOD and r + n <= numel and same(chunk, low[r : r + n]):
        return r
    return chunk.clone() if int(torch.count_nonzero(chunk)) else None


def high_pieces(
    param: str, flat: torch.Tensor, numel: int, high: torch.Tensor, lows: list[int | torch.Tensor | None]
) -> Iterable[tuple[int, int, int, torch.Tensor | None]]:
    """:func:`join`'s pieces of a parameter after the high pass, from its chunks' low pass (:func:`low_chunk`)."""
    for lo, kept in zip(range(0, flat.numel(), tensors.CHUNK), lows, strict=True):
        chunk = flat[lo : lo + tensors.CHUNK]
        n = chunk.numel()
        if isinstance(kept, int):  # one stretch of the low probe: where both halves say it starts, if they agree
            first = (int(chunk[0]) - 1) * PERIOD + kept
            if 0 <= first <= numel - n and same(chunk, high[first : first + n]):
                yield lo, n, first, None
                continue
            yield lo, n, -1, indices(param, torch.arange(kept, kept + n).remainder_(PERIOD).add_(1), chunk)
        elif kept is None:
            if int(torch.count_nonzero(chunk)):
                yield lo, n, -1, indices(param, torch.zeros(n, dtype=torch.int16), chunk)
        else:
            yield lo, n, -1, indices(param, kept, chunk)


def indices(param: str, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """A chunk's 1-based checkpoint indices from its two probe halves (0: written in neither pass).

    Raises:
        ValueError: a place written in one pass only, or a value neither half can hold.
    """
    low64, high64 = low.to(torch.int64), high.to(torch.int64)
    written = low64 != 0
    bad = (written != (high64 != 0)) | (written & ((low64 < 1) | (low64 > PERIOD) | (high64 < 1)))
    if bool(bad.any()):
        raise ValueError(f"{param}: holds values that are no element index (the loader transforms them)")
    return torch.where(written, (high64 - 1) * PERIOD + low64, 0)
