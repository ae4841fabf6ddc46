"""Runtime names (what ``module.state_dict()`` says under FSDP, ``torch.compile``, DDP or PEFT) to
checkpoint names (what vLLM's ``load_weights`` expects), tied tensors published once."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["WRAPPER_PREFIXES", "NameMap", "checkpoint_state"]

WRAPPER_PREFIXES = (
    "_orig_mod.",
    "module.",
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
    "base_model.model.",
)
"""Prefixes (anywhere in a dotted name) added by torch.compile, DDP, FSDP1, activation checkpointing and PEFT."""

_LORA_PART = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


class NameMap:
    """Maps a runtime name to a checkpoint name, or to ``None`` to leave a tensor out.

    Args:
        rename: applied after the built-in rules, for anything model-specific (return ``None`` to skip).

    Example:
        >>> NameMap()("_orig_mod.model.layers.0.mlp.up_proj.base_layer.weight")
        'model.layers.0.mlp.up_proj.weight'
    """

    def __init__(self, rename: Callable[[str], str | None] | None = None) -> None:
        self.rename = rename

    def __call__(self, runtime_name: str) -> str | None:
        if _LORA_PART.search(runtime_name):
            return None  # adapters are published merged (deltasync.lora) or not at all
        name = runtime_name
        for prefix in WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        name = name.replace(".base_layer.", ".")
        return self.rename(name) if self.rename is not None else name


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What tied tensors share: their storage (a DTensor's: its shard's on this rank, FSDP2 keeps one parameter for
    both names); ``None`` when it cannot tell (meta, empty shards, other subclasses)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    local = t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]
    if type(local) is not torch.Tensor or local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape), tuple(local.stride()), t.dtype)


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def checkpoint_state(state: Mapping[str, torch.Tensor], name_map: NameMap | None = None) -> dict[str, torch.Tensor]:
    """Rename a runtime state dict to checkpoint names and drop tied duplicates.

    Tensors that share storage (``lm_head.weight`` tied to ``model.embed_tokens.weight``) are
    published once, under the name that is not ``lm_head.*``, as HF checkpoints of tied models do.

    Raises:
        ValueError: two different tensors map to one checkpoint name.
    """
    name_map = name_map or NameMap()
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for runtime_name, tensor in state.items():
        name = name_map(runtime_name)
        if name is None:
            continue
        key = _storage_key(tensor)
        if key is not None and key in seen:
            if name.startswith("lm_head.") or not seen[key].startswith("lm_head."):
                continue  # a tied duplicate
            del out[seen[key]]
        if name in out:
            raise ValueError(
                f"tensors {runtime_name!r} and another one both map to checkpoint name {name!r}; "
                "pass NameMap(rename=...) to tell them apart"
            )
        out[name] = tensor
        if key is not None:
            seen[key] = name
    return out
