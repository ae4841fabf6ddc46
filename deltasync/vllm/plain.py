"""Plain parameters on vLLM's CPU build: keep linear weights as the tensors the loader wrote (no repack).

vLLM's CPU build repacks every unquantized linear layer after loading (oneDNN, or the SGL kernel for small
ones): ``layer.weight`` becomes an empty tensor and the GEMM uses a packed copy captured in
``layer.cpu_linear``. Nothing addressable is left to patch in place, so every update has to re-run the loader
and the repack (``reload`` mode). With ``DELTASYNC_VLLM_PLAIN_WEIGHTS=1`` in the environment of vLLM's
processes, the deltasync plugin (loaded by vLLM in every process, before the model) makes that dispatch keep
the weight and use ``torch.nn.functional.linear`` on it, as the GPU build does with its own kernels: the live
parameters are then addressable and ``inplace`` mode scatters deltas straight into them.

Off by default: it trades generation speed (oneDNN's packed GEMM against torch's) for update pauses that grow
with the changed elements; ``benchmarks/bench_apply.py`` measures both sides.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["install", "kernel_modules", "plain_parameters", "read_through_kernel"]

logger = logging.getLogger("vllm.deltasync.plain")


def _plain_linear(x: Any, weight: Any, bias: Any) -> Any:
    import torch

    return torch.nn.functional.linear(x, weight, bias)


def install() -> None:
    """Replace vLLM's CPU GEMM dispatch by one that keeps plain weights; idempotent. The plugin calls it where the
    engine's settings ask for it (:attr:`~deltasync.vllm.config.EngineConfig.plain_weights`)."""
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "_deltasync_plain", False):
        return
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch_plain(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            original(layer, remove_weight)  # not a dense linear layer: vLLM's own handling
            return
        layer.cpu_linear = _plain_linear

    dispatch_plain._deltasync_plain = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch_plain
    logger.info("deltasync: DELTASYNC_VLLM_PLAIN_WEIGHTS=1: vLLM's CPU linear weights stay plain (no repack)")


def plain_parameters(model: Any) -> tuple[bool, list[str]]:
    """Whether every dense linear layer of ``model`` computes from its live ``weight`` (GPU builds always do;
    the CPU build only with ``DELTASYNC_VLLM_PLAIN_WEIGHTS=1``), and the modules that do not (repacked: ``weight``
    emptied)."""
    packed = []
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear"):
            continue
        weight = getattr(module, "weight", None)
        if weight is None or weight.numel() == 0 or module.cpu_linear is not _plain_linear:
            packed.append(name)
    return not packed, packed


def kernel_modules(model: Any) -> Iterator[tuple[str, Any]]:
    """``(qualified name, module)`` of every module whose GEMM goes through ``layer.cpu_linear`` (vLLM's CPU
    build; ``embed_tokens`` aside: it is a lookup, its ``lm_head`` twin is not)."""
    for qualname, module in model.named_modules():
        if hasattr(module, "cpu_linear") and "embed_tokens" not in qualname:
            yield qualname, module


def read_through_kernel(module: Any, dtype: Any = None) -> Any:
    """The weight ``module``'s kernel really computes with, ``(out, in)`` as the checkpoint lays it out: an identity
    matrix multiplied through ``cpu_linear`` (one non-zero term per output element, so exact), which also reads a
    repacked copy whose parameter is left empty."""
    import torch

    weight = getattr(module, "weight", None)
    if weight is not None and weight.numel():
        k = weight.shape[1]
    else:  # a replicated layer (a MoE router's GateLinear) has no partition: its whole input
        k = int(getattr(module, "input_size_per_partition", None) or module.input_size)
    eye = torch.eye(k, dtype=torch.bfloat16 if dtype is None else dtype)
    return module.cpu_linear(eye, weight, None).t().contiguous()
