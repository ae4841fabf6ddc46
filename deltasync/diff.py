"""Bit-exact diff of two state dicts: which elements changed, their new and old values."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .format import TensorDelta

__all__ = ["compute_delta"]

DEFAULT_CHUNK_ELEMS = 1 << 20
"""Elements compared per task: large enough to amortize dispatch, small enough to stay in cache."""

DEFAULT_DENSE_FRACTION = 0.5
"""A tensor whose changed fraction reaches this is returned dense (see ``compute_delta``)."""

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(_INT_VIEW[t.element_size()]).numpy()


def _check_pair(name: str, prev: torch.Tensor, curr: torch.Tensor, update_prev: bool) -> None:
    if prev.shape != curr.shape:
        raise ValueError(
            f"tensor {name!r}: shape changed from {list(prev.shape)} to {list(curr.shape)}; "
            "a delta needs identical shapes (publish an anchor of the new model instead)"
        )
    if prev.dtype != curr.dtype:
        raise ValueError(
            f"tensor {name!r}: dtype changed from {prev.dtype} to {curr.dtype}; "
            "cast the state dict to the published dtype before diffing"
        )
    if prev.device.type != "cpu" or curr.device.type != "cpu":
        raise ValueError(
            f"tensor {name!r}: diff runs on CPU tensors, got {prev.device} and {curr.device}; "
            "copy the weights to host memory first"
        )
    if prev.element_size() not in _INT_VIEW:
        raise ValueError(f"tensor {name!r}: dtype {prev.dtype} has no integer view for a bitwise diff")
    if update_prev and not prev.is_contiguous():
        raise ValueError(f"tensor {name!r}: update_prev=True needs a contiguous previous tensor")


def compute_delta(
    prev: Mapping[str, torch.Tensor] | MutableMapping[str, torch.Tensor],
    curr: Mapping[str, torch.Tensor],
    *,
    update_prev: bool = False,
    dense_fraction: float = DEFAULT_DENSE_FRACTION,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    max_workers: int | None = None,
) -> dict[str, TensorDelta]:
    """Compare two state dicts bit for bit and return what changed, tensor by tensor.

    Elements are compared as integers of the same width (bf16 and fp16 as int16, fp32 as
    int32), so ``-0.0`` vs ``0.0`` and different NaN payloads count as changes, and a NaN that
    did not change does not. The work runs in chunks of ``chunk_elems`` on ``max_workers``
    threads (default: all cores); beyond the result, the extra memory is one boolean mask per
    thread and chunk.

    Args:
        prev: the previous version's tensors (CPU).
        curr: the new version's tensors (CPU), with the same names, shapes and dtypes.
        update_prev: also write the changed elements into ``prev`` (in place), so that it
            becomes a copy of ``curr`` at the cost of the changed elements only. This is how a
            publisher keeps its snapshot without a full copy per step. Not transactional: on an
            error part of ``prev`` may already be updated.
        dense_fraction: a tensor whose changed fraction is at least this comes back dense
            (``indices=None``, whole tensors in ``values`` and ``base_values``).
        chunk_elems: elements per task.
        max_workers: threads; default ``os.cpu_count()``.

    Returns:
        Changed tensors only, in ``curr``'s order, each with int64 ``indices``, new ``values`` and
        the ``base_values`` that ``prev`` held there. ``checksum`` is left ``None``.

    Raises:
        ValueError: the names, shapes, dtypes or devices differ (the message names the tensor).
    """
    if not 0 < dense_fraction <= 1:
        raise ValueError(f"dense_fraction must be in (0, 1], got {dense_fraction}")
    if chunk_elems <= 0:
        raise ValueError(f"chunk_elems must be > 0, got {chunk_elems}")
    missing, extra = sorted(set(prev) - set(curr)), sorted(set(curr) - set(prev))
    if missing or extra:
        raise ValueError(
            f"state dicts differ in names: missing from the new one {missing[:5]}, new names "
            f"{extra[:5]} ({len(missing)} and {len(extra)} in all); publish an anchor instead"
        )
    tasks: list[tuple[str, np.ndarray, np.ndarray, int, int]] = []
    currs: dict[str, torch.Tensor] = {}
    for name, c in curr.items():
        p = prev[name]
        _check_pair(name, p, c, update_prev)
        c = currs[name] = c.detach().contiguous()
        pb, cb = _bits(p.detach() if update_prev else p.detach().contiguous()), _bits(c)
        tasks.extend((name, pb, cb, s, min(s + chunk_elems, pb.size)) for s in range(0, pb.size, chunk_elems))

    def run(task: tuple[str, np.ndarray, np.ndarray, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        _, pb, cb, s, e = task
        a, b = pb[s:e], cb[s:e]
        idx = np.flatnonzero(a != b)
        new, old = b[idx], a[idx]
        if update_prev and idx.size:
            a[idx] = new
        idx += s
        return idx, new, old

    workers = max_workers or os.cpu_count() or 1
    if workers > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(run, tasks))
    else:
        results = [run(t) for t in tasks]

    parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for task, res in zip(tasks, results, strict=True):
        if res[0].size:
            parts.setdefault(task[0], []).append(res)
    out: dict[str, TensorDelta] = {}
    for name, c in currs.items():
        if name not in parts:
            continue
        idx, new, old = (np.concatenate(cols) for cols in zip(*parts[name], strict=True))
        out[name] = _tensor_delta(name, c, idx, new, old, dense_fraction)
    return out


def _tensor_delta(
    name: str, curr: torch.Tensor, idx: np.ndarray, new: np.ndarray, old: np.ndarray, dense_fraction: float
) -> TensorDelta:
    shape = tuple(curr.shape)
    if idx.size >= dense_fraction * math.prod(shape):
        values = curr.clone()
        base = values.clone()
        _bits(base)[idx] = old
        return TensorDelta(ckpt_name=name, shape=shape, dtype=curr.dtype, indices=None, values=values, base_values=base)
    return TensorDelta(
        ckpt_name=name,
        shape=shape,
        dtype=curr.dtype,
        indices=torch.from_numpy(idx),
        values=torch.from_numpy(new).view(curr.dtype),
        base_values=torch.from_numpy(old).view(curr.dtype),
    )
