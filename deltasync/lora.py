"""LoRA adapters merged into their base weights, on copies, for publishing (PEFT models)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["lora_merged_state"]


def lora_merged_state(module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The state dict of a PEFT LoRA model with every adapter merged into its base weight.

    The merge is computed on copies (``base + get_delta_weight()`` in float32, then cast), so the
    trainer's weights are never merged and unmerged in place (which would not round-trip exactly).
    """
    from peft.tuners.lora import LoraLayer

    state = dict(module.state_dict())
    for qualname, m in module.named_modules():
        if isinstance(m, LoraLayer) and not getattr(m, "merged", False):
            base_layer: Any = getattr(m, "get_base_layer")()  # noqa: B009
            base = base_layer.weight
            merged = base.detach().float().clone()
            for adapter in m.active_adapters:
                if adapter in m.lora_A or adapter in getattr(m, "lora_embedding_A", {}):
                    merged += m.get_delta_weight(adapter).float()  # type: ignore[attr-defined]
            state[f"{qualname}.base_layer.weight"] = merged.to(dtype)
    return state
