"""Bit-exact diff of two state dicts: which elements changed, their new and old values."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from ._kernels import kernels
from .format import TensorDelta, tensor_checksum

__all__ = ["compute_delta"]

DEFAULT_CHUNK_ELEMS = 1 << 20
"""Elements compared per task: large enough to amortize dispatch, small enough to stay in cache."""

_SCAN_ELEMS = 1 << 18
"""Elements per step of the compiled scan: a step of both tensors (1 MiB in bf16) stays in a core's L2 while the
new one is hashed."""

_RANGE_ELEMS = 1 << 23
"""Elements per task of the compiled scan where no digest is taken (a digest reads its tensor in one task)."""

DEFAULT_DENSE_FRACTION = 0.5
"""A tensor whose changed fraction reaches this is returned dense (see ``compute_delta``)."""

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_of(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements as flat integers of their width (a view where the tensor is contiguous: writes reach it)."""
    return t.detach().reshape(-1).view(_INT_VIEW[t.element_size()]).numpy()


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
    checksums: bool = False,
) -> dict[str, TensorDelta]:
    """Compare two state dicts bit for bit and return what changed, tensor by tensor.

    Elements are compared as integers of the same width (bf16 and fp16 as int16, fp32 as
    int32), so ``-0.0`` vs ``0.0`` and different NaN payloads count as changes, and a NaN that
    did not change does not. Where numba is installed (:mod:`deltasync._kernels`), 16 and 32-bit
    tensors are compared by a compiled scan, 8 bytes at a time, in steps that stay in cache, on
    ``max_workers`` threads (default: all cores), with no temporary beyond the result; otherwise
    numpy compares chunks of ``chunk_elems`` (one boolean mask per thread and chunk).

    Args:
        prev: the previous version's tensors (CPU).
        curr: the new version's tensors (CPU), with the same names, shapes and dtypes.
        update_prev: also write the changed elements into ``prev`` (in place), so that it
            becomes a copy of ``curr`` at the cost of the changed elements only. This is how a
            publisher keeps its snapshot without a full copy per step. Not transactional: on an
            error part of ``prev`` may already be updated.
        dense_fraction: a tensor whose changed fraction is at least this comes back dense
            (``indices=None``, whole tensors in ``values`` and ``base_values``).
        chunk_elems: elements per task of the numpy code (the compiled scan's tasks are at least
            ``2**23`` elements, or whole tensors with ``checksums``).
        max_workers: threads; default ``os.cpu_count()``.
        checksums: also set each changed tensor's ``checksum`` (:func:`tensor_checksum` of the new
            tensor), fed by the scan from what it just read: a publisher's delta needs it, and a
            second pass over the model would cost about one more memcpy of it.

    Returns:
        Changed tensors only, in ``curr``'s order, each with int64 ``indices``, new ``values`` and
        the ``base_values`` that ``prev`` held there. ``checksum`` is ``None`` unless ``checksums``.

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
    compiled = kernels()
    tasks: list[_Task] = []
    currs: dict[str, torch.Tensor] = {}
    for name, c in curr.items():
        p = prev[name]
        _check_pair(name, p, c, update_prev)
        c = currs[name] = c.detach().contiguous()
        pb, cb = bits_of(p.detach() if update_prev else p.detach().contiguous()), bits_of(c)
        if compiled is not None and _scannable(pb, cb):
            # a digest reads its tensor in order: one task; else tasks that start on an 8-byte word (after the head)
            step = max(pb.size, 1) if checksums else max(chunk_elems, _RANGE_ELEMS) // 8 * 8
            cuts = [0, *range(_head(pb) + step, pb.size, step), pb.size]
            tasks.extend(_Task(name, pb, cb, a, b, True) for a, b in itertools.pairwise(cuts) if a < b)
        else:
            tasks.extend(
                _Task(name, pb, cb, s, min(s + chunk_elems, pb.size), False) for s in range(0, pb.size, chunk_elems)
            )

    def run(task: _Task) -> _Found:
        if task.compiled:
            return _scan(compiled, task, update_prev, checksums)
        a, b = task.prev[task.start : task.stop], task.curr[task.start : task.stop]
        idx = np.flatnonzero(a != b)
        new, old = b[idx], a[idx]
        if update_prev and idx.size:
            a[idx] = new
        idx += task.start
        return _Found(idx, new, old, None)

    workers = max_workers or os.cpu_count() or 1
    order = sorted(range(len(tasks)), key=lambda k: tasks[k].start - tasks[k].stop)  # the longest first
    if workers > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            done = dict(zip(order, pool.map(run, [tasks[k] for k in order]), strict=True))
    else:
        done = {k: run(tasks[k]) for k in order}
    parts: dict[str, list[_Found]] = {}
    for k, task in enumerate(tasks):
        if done[k].idx.size:
            parts.setdefault(task.name, []).append(done[k])
    out: dict[str, TensorDelta] = {}
    for name, c in currs.items():
        if name not in parts:
            continue
        found = parts[name]
        if len(found) == 1:  # one task: its buffers as they are (np.concatenate copies even one array)
            idx, new, old = found[0].idx, found[0].new, found[0].old
        else:
            idx, new, old = (np.concatenate(cols) for cols in zip(*((f.idx, f.new, f.old) for f in found), strict=True))
        digest = found[0].digest if len(found) == 1 and found[0].digest is not None else None
        if checksums and digest is None:
            digest = tensor_checksum(c)
        out[name] = _tensor_delta(name, c, idx, new, old, dense_fraction, digest)
    return out


class _Task(NamedTuple):
    """Flat elements ``[start, stop)`` of one tensor, compared by the compiled scan or by numpy."""

    name: str
    prev: np.ndarray
    curr: np.ndarray
    start: int
    stop: int
    compiled: bool


class _Found(NamedTuple):
    """The changes of one task: flat indices, new and old bits, and the new tensor's digest where the task read
    all of it in order."""

    idx: np.ndarray
    new: np.ndarray
    old: np.ndarray
    digest: str | None


def _scannable(pb: np.ndarray, cb: np.ndarray) -> bool:
    """Whether the compiled scan takes a tensor pair: 16 or 32-bit elements whose 8-byte words line up."""
    return pb.itemsize in (2, 4) and (pb.ctypes.data - cb.ctypes.data) % 8 == 0


def _head(a: np.ndarray) -> int:
    """The elements of ``a`` before its first 8-byte boundary (the compiled scan's words start there)."""
    return min(((-a.ctypes.data) % 8) // a.itemsize, a.size)


def _scan(compiled: Any, task: _Task, update_prev: bool, checksums: bool) -> _Found:
    """The changes of ``task`` by the compiled scan (:func:`deltasync._kernels` ``diff_words``): elements compared
    8 bytes at a time, the tensor read in steps that stay in cache, and, with ``checksums``, the new tensor's
    xxh3-128 fed from each step while it is still there (a whole tensor's task only). A digest starts at the first
    step with a change (the steps before it are read again then): an unchanged tensor is never hashed."""
    a, b, isz = task.prev, task.curr, task.prev.itemsize
    per = 8 // isz
    head = _head(a)
    words = (a.size - head) // per
    a64 = a[head : head + words * per].view(np.uint64)
    b64 = b[head : head + words * per].view(np.uint64)
    cap = (task.stop - task.start) // 16 + _SCAN_ELEMS  # room for 6% changed before the first doubling
    idx, new, old, n = np.empty(cap, np.int64), np.empty(cap, a.dtype), np.empty(cap, a.dtype), 0
    hasher = None
    body_end = head + words * per
    pos = task.start
    while pos < task.stop:
        if pos < head or pos >= body_end:  # an element outside the 8-byte words (at most 3 at each end)
            stop = min(task.stop, head if pos < head else a.size)
            idx, new, old, n = _append_plain(a, b, pos, stop, (idx, new, old, n), update_prev)
        else:
            w0 = (pos - head) // per
            w1 = min(w0 + _SCAN_ELEMS // per, (min(task.stop, body_end) - head) // per)
            stop = head + w1 * per
            if stop <= pos:  # a task that does not start on a word (compute_delta cuts them on words)
                raise AssertionError(f"compute_delta: a scan task starts at element {pos}, off a word")
            idx, new, old, n = compiled.diff_words(a, b, (a64, b64), (w0, w1, head), (idx, new, old, n), update_prev)
        if checksums and (hasher is not None or n):
            if hasher is None:
                hasher = xxhash.xxh3_128()
                hasher.update(b[:pos].data)  # the steps before the first change
            hasher.update(b[pos:stop].data)
        pos = stop
    digest = None if hasher is None or task.start or task.stop != a.size else "xxh3_128:" + hasher.hexdigest()
    # views, not copies: the buffers' pages past ``n`` were never touched (never resident), and a copy of the changes
    # was a second write of fresh memory per changed element
    return _Found(idx[:n], new[:n], old[:n], digest)


def _append_plain(
    a: np.ndarray,
    b: np.ndarray,
    start: int,
    stop: int,
    buf: tuple[np.ndarray, np.ndarray, np.ndarray, int],
    update_prev: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The changes among a few elements ``[start, stop)``, appended to ``buf`` (grown if needed)."""
    idx, new, old, n = buf
    at = np.flatnonzero(a[start:stop] != b[start:stop]) + start
    if n + at.size > idx.size:
        grow = max(2 * idx.size, n + at.size)
        idx, new, old = (np.concatenate([x[:n], np.empty(grow - n, x.dtype)]) for x in (idx, new, old))
    idx[n : n + at.size], new[n : n + at.size], old[n : n + at.size] = at, b[at], a[at]
    if update_prev:
        a[at] = b[at]
    return idx, new, old, n + at.size


def _tensor_delta(
    name: str,
    curr: torch.Tensor,
    idx: np.ndarray,
    new: np.ndarray,
    old: np.ndarray,
    dense_fraction: float,
    checksum: str | None,
) -> TensorDelta:
    shape = tuple(curr.shape)
    if idx.size >= dense_fraction * math.prod(shape):
        values = curr.clone()
        base = values.clone()
        bits_of(base)[idx] = old
        return TensorDelta(
            ckpt_name=name,
            shape=shape,
            dtype=curr.dtype,
            indices=None,
            values=values,
            base_values=base,
            checksum=checksum,
        )
    return TensorDelta(
        ckpt_name=name,
        shape=shape,
        dtype=curr.dtype,
        indices=torch.from_numpy(idx),
        values=torch.from_numpy(new).view(curr.dtype),
        base_values=torch.from_numpy(old).view(curr.dtype),
        checksum=checksum,
    )
