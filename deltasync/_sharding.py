"""What one trainer rank publishes: its own rows of each tensor (FSDP2 ``Shard(0)``), or the whole tensor on
rank 0 (plain or replicated), in global flat coordinates. Nothing is ever gathered."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from .format import TensorDelta, tensor_checksum
from .names import ExpertSlice, NameMap, checkpoint_state, experts_of, is_fused_experts
from .sketch import Sketch, add_sketches, format_sketch, sketch_change, sketch_range

__all__ = ["TensorView", "dense_entries", "globalize", "local_tensors"]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorView:
    """One tensor as this rank sees it."""

    shape: tuple[int, ...]
    """Full (global) shape."""
    span: tuple[int, int] | None
    """This rank's flat element range (FSDP ``Shard(0)`` rows); ``None``: the whole tensor."""
    owned: bool
    """This rank publishes it (its rows, or rank 0 for replicated tensors)."""


def _rows(name: str, tensor: torch.Tensor, rank: int) -> tuple[torch.Tensor | None, int | None, int, bool]:
    """This rank's rows of ``tensor`` along dim 0: (local tensor, first global row or ``None`` for a tensor held
    whole, rows held, whether this rank publishes them). A plain or replicated tensor is held whole and published
    by rank 0; a ``Shard(0)`` rank publishes its rows."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rows = tensor.shape[0] if tensor.dim() else 1
    if not isinstance(tensor, DTensor):
        return tensor.detach(), None, rows, rank == 0
    placements = tensor.placements
    if all(isinstance(p, Replicate) for p in placements):
        return tensor.to_local().detach(), None, rows, rank == 0
    if len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        held = local_shape[0] if local_shape else 0
        if held == 0:  # uneven sharding: this rank holds no rows of this tensor
            return None, 0, 0, False
        return tensor.to_local().detach(), offset[0], held, True
    raise ValueError(
        f"tensor {name!r}: placement {placements} is not supported; deltasync publishes Shard(0) "
        "on a 1-D mesh (FSDP2) or replicated tensors without gathering"
    )


def _view(name: str, tensor: torch.Tensor, rank: int) -> tuple[TensorView, torch.Tensor | None]:
    local, first, held, owned = _rows(name, tensor, rank)
    if local is None or not owned:
        return TensorView(tuple(tensor.shape), None, False), None
    if first is None:
        return TensorView(tuple(tensor.shape), None, True), local
    row = math.prod(tensor.shape[1:])
    return TensorView(tuple(tensor.shape), (first * row, (first + held) * row), True), local


def _expert_views(
    name: str, tensor: torch.Tensor, slices: list[ExpertSlice], rank: int
) -> list[tuple[str, TensorView, torch.Tensor | None]]:
    """Each per-expert tensor of a fused expert parameter: a 2-D view of this rank's local experts (FSDP2's
    ``Shard(0)`` splits the experts, so an expert is held whole by the one rank that publishes it)."""
    local, first, held, owned = _rows(name, tensor, rank)
    start, rows = first or 0, slices[0].rows[1] - slices[0].rows[0]
    pieces: tuple[torch.Tensor, ...] = ()
    if local is not None and owned and local.is_contiguous():
        # one unbind gives every piece as a view, about 4x cheaper than indexing each: a model with 128 experts
        # in 48 layers has 18k pieces, named again at every publish
        pieces = local.view(-1, rows, *local.shape[2:]).unbind(0)
    out: list[tuple[str, TensorView, torch.Tensor | None]] = []
    for s in slices:
        mine = local is not None and owned and start <= s.expert < start + held
        part: torch.Tensor | None = None
        if mine and pieces:
            part = pieces[(s.expert - start) * (tensor.shape[1] // rows) + s.rows[0] // rows]
        elif mine and local is not None:
            part = local[s.expert - start, s.rows[0] : s.rows[1]]
        out.append((s.name, TensorView((s.rows[1] - s.rows[0], *tensor.shape[2:]), None, mine), part))
    return out


def local_tensors(
    state: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    name_map: NameMap,
    rank: int,
) -> tuple[dict[str, torch.Tensor], dict[str, TensorView]]:
    """This rank's local tensors by checkpoint name, and every tensor's view (owned or not).

    Fused expert parameters are published as the checkpoint's per-expert tensors (:meth:`NameMap.expert_slices`),
    each a view of this rank's rows: nothing is copied or gathered.

    Raises:
        ValueError: a placement other than ``Shard(0)`` or replicated, fused experts that cannot be split, or two
            tensors under one checkpoint name.
    """
    raw = state.state_dict() if isinstance(state, torch.nn.Module) else dict(state)
    if isinstance(state, torch.nn.Module) and name_map.experts is None and any(map(is_fused_experts, raw)):
        name_map = name_map.with_experts(experts_of(state))
    named = checkpoint_state(raw, name_map)
    shapes = {name: tuple(t.shape) for name, t in named.items()}
    local: dict[str, torch.Tensor] = {}
    views: dict[str, TensorView] = {}
    for name, tensor in named.items():
        if not tensor.is_floating_point():
            continue  # integer buffers are not weights vLLM loads
        slices = name_map.expert_slices(name, shapes)
        parts = [(name, *_view(name, tensor, rank))] if slices is None else _expert_views(name, tensor, slices, rank)
        for part_name, view, part in parts:
            if part_name in views:
                raise ValueError(
                    f"tensor {name!r} gives checkpoint name {part_name!r}, which another tensor has; "
                    "pass NameMap(rename=...) to tell them apart"
                )
            views[part_name] = view
            if view.owned and part is not None:
                local[part_name] = part
    return local, views


def _span_sketch(local: torch.Tensor, view: TensorView) -> str:
    """The sketch of this rank's elements (its span, or the whole tensor), placed where they are in the tensor."""
    return format_sketch(sketch_range(local, 0 if view.span is None else view.span[0]))


def dense_entries(buffers: Mapping[str, torch.Tensor], views: Mapping[str, TensorView]) -> list[TensorDelta]:
    """An anchor's entries for this rank's buffers: whole tensors, or this rank's span."""
    out = []
    for name, t in buffers.items():
        view = views[name]
        out.append(
            TensorDelta(
                ckpt_name=name,
                shape=view.shape,
                dtype=t.dtype,
                indices=None,
                values=t if view.span is None else t.reshape(-1),
                span=view.span,
                checksum=tensor_checksum(t),
                sketch=_span_sketch(t, view),
            )
        )
    return out


def globalize(
    d: TensorDelta, new: torch.Tensor, view: TensorView, *, served: Sketch | None = None, sketch: Sketch | None = None
) -> tuple[TensorDelta, Sketch]:
    """A local delta (this rank's rows) in global flat coordinates, with the checksum and sketch of its new span,
    and that sketch's lanes.

    The checksum is ``d.checksum`` where the diff took it (:func:`~deltasync.diff.compute_delta`'s
    ``checksums``), else read from ``new``. The sketch is ``served`` (the span's sketch before the change) moved
    by the change, read from the changed elements only (the sketch is linear), where ``d`` is sparse and
    ``served`` is given; ``sketch`` where the caller knows it (a squash: the version's own); else read from
    ``new``."""
    checksum = d.checksum if d.checksum is not None else tensor_checksum(new)
    start = 0 if view.span is None else view.span[0]
    indices = None if d.indices is None else d.indices + start if start else d.indices
    if sketch is not None:
        lanes = sketch
    elif indices is not None and served is not None and d.base_values is not None:
        lanes = add_sketches(served, sketch_change(d.values, d.base_values, indices, increasing=True))
    else:
        lanes = sketch_range(new, start)
    text = format_sketch(lanes)
    if view.span is None:
        return dataclasses.replace(d, checksum=checksum, sketch=text), lanes
    if d.indices is None:
        base = d.base_values.reshape(-1) if d.base_values is not None else None
        return dataclasses.replace(
            d,
            shape=view.shape,
            values=d.values.reshape(-1),
            base_values=base,
            span=view.span,
            checksum=checksum,
            sketch=text,
        ), lanes
    return dataclasses.replace(
        d, shape=view.shape, indices=indices, span=view.span, checksum=checksum, sketch=text
    ), lanes
