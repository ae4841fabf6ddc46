"""Tensor helpers the patch map and its build share: bit views, a fast compare, zeroed and index tensors."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["CHUNK", "arange", "bits", "nonzero_words", "numel", "reuse", "same", "zeros"]

CHUNK = 1 << 22
"""Elements scanned at once when reading a parameter: bounds a scan's extra memory (~100 MB). Read at call time
(``tensors.CHUNK``), so that tests can shrink it and make runs cross chunk edges."""

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_OF_WIDTH = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integers of its width: its bit patterns (NaN payloads and -0.0 included)."""
    return t.view(_INT_OF_WIDTH[t.element_size()])


_memcmp = ctypes.CDLL(None).memcmp
_memcmp.argtypes, _memcmp.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal(a, b)``, by libc's ``memcmp`` where both are contiguous host tensors of one dtype with no
    floats in it (bits, :func:`bits`, or integer stand-ins: where bits and values agree). ``torch.equal`` compares
    element by element, at ~3 GB/s on one thread (a vLLM worker's build runs on one): ``memcmp`` reads ~15 GB/s,
    and releases the GIL (ctypes), so ``parallel_map``'s threads run it side by side."""
    if (
        a.dtype != b.dtype
        or a.dtype.is_floating_point
        or a.dtype.is_complex
        or a.device.type != "cpu"
        or b.device.type != "cpu"
        or not (a.is_contiguous() and b.is_contiguous())
    ):
        return torch.equal(a, b)
    if a.shape != b.shape:
        return False
    n = a.numel() * a.element_size()
    return n == 0 or _memcmp(a.data_ptr(), b.data_ptr(), n) == 0


def numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def nonzero_words(t: torch.Tensor) -> int:
    """How many elements of ``t`` hold other bits than all zeros (-0.0 counts: it is a write)."""
    return int(torch.count_nonzero(bits(t)))


def zeros(shape: Iterable[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU from the allocator's zeroed pages (calloc): a page never written is never touched, so a
    stand-in that the loader writes only in part, and the scans of it, stay cheap."""
    shape = tuple(shape)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(shape, dtype=_NP_INT_OF_WIDTH[size])).view(dtype)


def arange(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``1, 2, ..., n`` (probe values: 1-based element indices) through numpy, about twice torch's speed here."""
    return torch.from_numpy(np.arange(1, n + 1, dtype=np.int64 if dtype == torch.int64 else np.int32))


def reuse(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``like`` in ``buf``'s memory when it fits (an int32 probe stand-in holds a bf16 or fp32
    parameter: no fresh pages to fault in), else a new zeroed one; what it holds is left to the caller."""
    nbytes = like.numel() * like.element_size()
    if buf.device != like.device or not buf.is_contiguous() or buf.numel() * buf.element_size() < nbytes:
        return zeros(like.shape, like.dtype, like.device)
    return buf.view(-1).view(torch.uint8)[:nbytes].view(like.dtype).view(like.shape)
