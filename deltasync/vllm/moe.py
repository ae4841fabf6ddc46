"""vLLM's fused MoE experts as the patch map sees them (:class:`~deltasync.vllm.patch_map.experts.FusedExperts`):
which modules hold a layer's routed experts, the shapes vLLM's loader writes them in, and, on the CPU build, its
kernel's own post-load layout of one expert (padding the intermediate size, repacking into tiles), run on a
stand-in module so that the live one is never touched."""

from __future__ import annotations

import logging
from typing import Any

import torch

from .patch_map.experts import FusedExperts

__all__ = ["fused_experts", "is_fused_experts"]

logger = logging.getLogger("vllm.deltasync.engine")

_FUSED = ("w13_weight", "w2_weight")


def is_fused_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a layer's routed experts in vLLM's fused 3-D parameters."""
    params = [module._parameters.get(leaf) for leaf in _FUSED]
    return all(p is not None and p.ndim == 3 for p in params)


def fused_experts(model: torch.nn.Module) -> tuple[list[FusedExperts], dict[str, str]]:
    """The fused experts layers of ``model`` that the patch map can place (unquantized, on the CPU build, each
    processed after loading by its kernel's own ``process_weights_after_loading``), and why the others cannot be
    (module -> reason: their experts are reloaded)."""
    from vllm.platforms import current_platform

    found: list[FusedExperts] = []
    refused: dict[str, str] = {}
    for qualname, module in model.named_modules():
        if not is_fused_experts(module):
            continue
        why = _unplaceable(module, current_platform.is_cpu())
        if why is not None:
            refused[qualname] = why
            continue
        config = module.moe_config
        w13, w2 = module.w13_weight, module.w2_weight
        inter = int(config.intermediate_size_per_partition)
        shapes: dict[str, tuple[int, ...]] = {
            f"{qualname}.w13_weight": (
                int(w13.shape[0]),
                (2 if config.is_act_and_mul else 1) * inter,
                int(w13.shape[2]),
            ),
            f"{qualname}.w2_weight": (int(w2.shape[0]), int(w2.shape[1]), inter),
        }
        found.append(FusedExperts(qualname, shapes, _repack_of(module)))
    return found, refused


def _unplaceable(module: Any, cpu: bool) -> str | None:
    """Why ``module``'s experts cannot be placed (``None``: they can)."""
    method = getattr(module, "quant_method", None)
    if type(method).__name__ != "UnquantizedFusedMoEMethod":
        return f"its experts are quantized ({type(method).__name__})"
    if not cpu:
        return "fused experts are placed on vLLM's CPU build only (GPU builds reload them)"
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or not callable(getattr(experts, "process_weights_after_loading", None)):
        return "no CPU experts kernel found (quant_method.moe_kernel.fused_experts)"
    if any(getattr(module, leaf, None) is not None for leaf in ("w13_bias", "w2_bias")):
        return "its experts have biases (not placed yet)"
    if getattr(module, "moe_config", None) is None:
        return "no moe_config"
    return None


def _repack_of(module: Any) -> Any:
    """The kernel's post-load processing of one expert: a stand-in module holding the given ``(1, ...)`` weights
    (and the live module's configuration) goes through the kernel's own ``process_weights_after_loading``; the
    kernel object's own state is put back after it."""
    experts = module.quant_method.moe_kernel.fused_experts

    def repack(held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        holder = torch.nn.Module()
        for leaf, t in held.items():
            holder.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
        for attr in ("moe_config", "activation", "layer_name"):
            if hasattr(module, attr):
                setattr(holder, attr, getattr(module, attr))
        state = dict(vars(experts))
        try:
            with torch.no_grad():
                experts.process_weights_after_loading(holder)
        finally:
            vars(experts).clear()
            vars(experts).update(state)
        return {leaf: getattr(holder, leaf).data for leaf in held}

    return repack
