"""What one trainer rank publishes: its own rows of each tensor (FSDP2 ``Shard(0)``), or the whole tensor on
rank 0 (plain or replicated), in global flat coordinates. Nothing is ever gathered."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from .format import TensorDelta, tensor_checksum
from .names import NameMap, checkpoint_state
from .sketch import format_sketch, sketch_range

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


def _view(name: str, tensor: torch.Tensor, rank: int) -> tuple[TensorView, torch.Tensor | None]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return TensorView(tuple(tensor.shape), None, rank == 0), tensor.detach()
    placements = tensor.placements
    if all(isinstance(p, Replicate) for p in placements):
        return TensorView(tuple(tensor.shape), None, rank == 0), tensor.to_local().detach()
    if len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        row = math.prod(tensor.shape[1:])
        rows = local_shape[0] if local_shape else 0
        if rows == 0:  # uneven sharding: this rank holds no rows of this tensor
            return TensorView(tuple(tensor.shape), None, False), None
        span = (offset[0] * row, (offset[0] + rows) * row)
        return TensorView(tuple(tensor.shape), span, True), tensor.to_local().detach()
    raise ValueError(
        f"tensor {name!r}: placement {placements} is not supported; deltasync publishes Shard(0) "
        "on a 1-D mesh (FSDP2) or replicated tensors without gathering"
    )


def local_tensors(
    state: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    name_map: NameMap,
    rank: int,
) -> tuple[dict[str, torch.Tensor], dict[str, TensorView]]:
    """This rank's local tensors by checkpoint name, and every tensor's view (owned or not)."""
    raw = state.state_dict() if isinstance(state, torch.nn.Module) else dict(state)
    local: dict[str, torch.Tensor] = {}
    views: dict[str, TensorView] = {}
    for name, tensor in checkpoint_state(raw, name_map).items():
        if not tensor.is_floating_point():
            continue  # integer buffers are not weights vLLM loads
        view, part = _view(name, tensor, rank)
        views[name] = view
        if view.owned and part is not None:
            local[name] = part
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


def globalize(d: TensorDelta, new: torch.Tensor, view: TensorView) -> TensorDelta:
    """A local delta (this rank's rows) in global flat coordinates, with the checksum and sketch of its new span."""
    checksum, sketch = tensor_checksum(new), _span_sketch(new, view)
    if view.span is None:
        return dataclasses.replace(d, checksum=checksum, sketch=sketch)
    if d.indices is None:
        base = d.base_values.reshape(-1) if d.base_values is not None else None
        return dataclasses.replace(
            d,
            shape=view.shape,
            values=d.values.reshape(-1),
            base_values=base,
            span=view.span,
            checksum=checksum,
            sketch=sketch,
        )
    indices = d.indices + view.span[0]
    return dataclasses.replace(d, shape=view.shape, indices=indices, span=view.span, checksum=checksum, sketch=sketch)
