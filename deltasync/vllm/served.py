"""The base values an engine decodes a published object against: what it serves, read where the changes go.

A ``packed`` delta codes each changed value against the base version's value at that element (``ordinal-delta``).
An engine that holds every tensor it serves decodes it against its own live parameters, reading only the changed
elements, so its agent needs no copy of the model. The values read for the first object that changes a tensor are
the very values that object replaces: the proof before the first write reuses them
(:func:`~deltasync.vllm.proof.prove_update`), one gather for both.

Within one update session (a catch-up: an anchor, then deltas; or several deltas), each later object decodes
against what the earlier ones give, held here as an overlay (:meth:`ServedValues.advance`); the engine has written
nothing yet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

from ..errors import FormatError
from ..format import TensorDelta

__all__ = ["ServedValues", "merge_changes"]


def merge_changes(
    first: tuple[torch.Tensor, torch.Tensor], then: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sparse changes of one tensor (sorted flat indices, values), applied in order, as one: sorted, each
    element once, the later value winning."""
    idx = torch.cat([first[0], then[0]])
    new = torch.cat([first[1].reshape(-1), then[1].reshape(-1)])
    order = torch.argsort(idx, stable=True)
    idx, new = idx[order], new[order]
    keep = torch.ones(idx.numel(), dtype=torch.bool)
    keep[:-1] = idx[1:] != idx[:-1]
    return idx[keep], new[keep]


class ServedValues:
    """:class:`~deltasync.format.BaseValues` for one update session of an engine.

    Args:
        live: reads what the engine serves of a tensor at sorted flat indices (``name``, ``indices``, ``dtype``);
            raises ``FormatError`` when it cannot (the tensor is not served here).
        holds: which of a tensor's sorted flat indices this engine holds (``name``, ``indices``): a bool tensor,
            or ``None`` for all (a tensor-parallel rank holds parts of tensors and decodes only those; the ranks
            holding the rest decode theirs). Default: every element.
    """

    def __init__(
        self,
        live: Callable[[str, torch.Tensor, torch.dtype], torch.Tensor],
        holds: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None,
    ) -> None:
        self._live = live
        self._holds = holds
        self._dense: dict[str, torch.Tensor] = {}  # written whole earlier in the session: flat values
        self._owned: set[str] = set()  # dense values this session owns (copied before a later change)
        self._sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # changed earlier: sorted indices, values
        self._lock = threading.Lock()
        self.served: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """Per tensor, the (indices, values) read from what the engine serves, for the first object that changes
        it (a tensor split over shards is read once per part)."""

    def held(self, name: str, indices: torch.Tensor) -> torch.Tensor | None:
        if self._holds is None or name in self._dense:  # a tensor written whole earlier in the session is held whole
            return None
        return self._holds(name, indices)

    def values_at(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, indices: torch.Tensor) -> torch.Tensor:
        dense = self._dense.get(name)
        if dense is not None:
            if dense.dtype != dtype or dense.numel() != _numel(shape):
                raise FormatError(f"tensor {name!r}: coded against {dtype} {list(shape)}, the session holds another")
            return dense.index_select(0, indices)
        values = self._live(name, indices, dtype)
        changed = self._sparse.get(name)
        if changed is None:
            with self._lock:  # the decoder reads tensors on several threads
                self.served.setdefault(name, []).append((indices, values))
            return values
        at, new = changed
        pos = torch.searchsorted(at, indices).clamp_(max=max(at.numel() - 1, 0))
        hit = at.index_select(0, pos) == indices if at.numel() else torch.zeros_like(indices, dtype=torch.bool)
        values[hit] = new.index_select(0, pos[hit])
        return values

    def advance(self, deltas: Iterable[TensorDelta]) -> None:
        """What the later objects of the session decode against: ``deltas`` (one object's, decoded) applied."""
        spans: dict[str, list[TensorDelta]] = {}
        for d in deltas:
            if d.indices is None and d.span is not None:
                spans.setdefault(d.ckpt_name, []).append(d)
            else:
                self._change(d)
        for name, parts in spans.items():
            numel = _numel(parts[0].shape)
            partial = any(p.held is not None for p in parts)  # decoded here in part: only those elements are known
            if partial or sum(b - a for a, b in (p.bounds for p in parts)) != numel:  # a part (or a forgery)
                for p in parts:
                    self._change(p)
                continue
            # one object's spans cover the tensor (an anchor published by ranks): held whole from now on, and
            # nothing more is read from the engine for it (the decoder checked the spans do not overlap)
            whole = torch.empty(numel, dtype=parts[0].values.dtype)
            for p in parts:
                whole[p.bounds[0] : p.bounds[1]] = p.values.reshape(-1)
            self._dense[name] = whole
            self._owned.add(name)
            self._sparse.pop(name, None)

    def _change(self, d: TensorDelta) -> None:
        name = d.ckpt_name
        if d.indices is None and d.span is None and d.held is None:  # written whole
            self._dense[name] = d.values.reshape(-1)
            self._owned.discard(name)
            self._sparse.pop(name, None)
            return
        idx = d.indices if d.indices is not None else torch.arange(*d.bounds, dtype=torch.int64)
        values = d.values.reshape(-1)
        if d.held is not None:  # the elements this rank decoded; the others' values are placeholders
            idx, values = idx[d.held], values[d.held]
        dense = self._dense.get(name)
        if dense is not None:
            if name not in self._owned:  # the earlier object's values are written as they are: never change them
                dense = self._dense[name] = dense.clone()
                self._owned.add(name)
            dense.index_copy_(0, idx, values.to(dense.dtype))
            return
        before = self._sparse.get(name)
        self._sparse[name] = (idx, values) if before is None else merge_changes(before, (idx, values))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
