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

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

__all__ = [
    "KERNEL_BLOCK_MACS",
    "KernelRef",
    "canonical",
    "digest_of",
    "install",
    "kernel_block",
    "kernel_inputs",
    "kernel_modules",
    "kernel_reference",
    "plain_parameters",
    "read_block",
    "read_through_kernel",
]

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


KERNEL_BLOCK_MACS = 1 << 32
"""A repacked module whose read-back (an identity of its input size through its GEMM: ``inputs**2 x outputs``
multiply-adds) costs more than this is referenced, and read back, in blocks of its input columns that cost at most
this each (~30 ms on the CPU box): a sliced audit's call holds the worker for a block, not for a whole large
vocabulary's ``lm_head`` (~1.1 s at Qwen3-0.6B)."""


def kernel_block(inputs: int, outputs: int, macs: int = KERNEL_BLOCK_MACS) -> int:
    """The input columns per block of a module with these sizes: all of them where one read-back costs at most
    ``macs`` multiply-adds, else the largest power of two whose block does (at least 1)."""
    if inputs * inputs * outputs <= macs:
        return max(inputs, 1)
    block = 1
    while block * 2 * inputs * outputs <= macs:
        block *= 2
    return block


@dataclasses.dataclass(frozen=True)
class KernelRef:
    """What a repacked module's kernel must compute with: the ``xxh3_128`` of each block of ``block`` input
    columns of the weight its loader built (``weight[:, b * block:(b + 1) * block]``, contiguous, as
    :func:`canonical`; one block: the whole weight), taken right before vLLM's post-load processing repacked it.
    ``digests`` is ``None`` where the weight holds an infinity or a NaN: an identity read-back computes ``0 * inf``,
    a NaN across the whole row, and cannot show such a weight (the module is then unproven, never proven)."""

    block: int
    digests: tuple[str, ...] | None


def canonical(t: Any) -> Any:
    """``t`` as an identity read-back through a CPU kernel returns it: ``-0.0`` as ``+0.0`` (``1 * -0.0 + 0 * w``
    sums to ``+0.0``) and subnormals as ``+0.0`` (oneDNN flushes them: its GEMM computes with 0); a new tensor.
    A read-back proves each weight up to these (a kernel that kept subnormals would compute with what a read-back
    cannot tell apart; the shadow's proof covers the checkpoint's bits). ``t`` itself where it holds neither (or is
    not floating point)."""
    import torch

    if not t.is_floating_point():
        return t
    small = t.abs() < torch.finfo(t.dtype).tiny
    return t.masked_fill(small, 0.0) if bool(small.any()) else t


def digest_of(t: Any) -> str:
    """The ``xxh3_128`` of ``t`` as :func:`canonical` (what a reference and a read-back are compared by)."""
    from ..format import tensor_checksum

    return tensor_checksum(canonical(t))


_REFERENCE_CHUNK_BYTES = 4 << 20
"""Rows of a weight hashed at once by :func:`kernel_reference` (its column blocks copied out of them in cache)."""


def kernel_reference(weight: Any, macs: int = KERNEL_BLOCK_MACS) -> KernelRef:
    """:class:`KernelRef` of a module's freshly loaded ``(out, in)`` weight (:func:`kernel_block` columns a block,
    for blocks of at most ``macs`` multiply-adds). The blocks' digests are fed a few MiB of rows at a time, each
    row chunk made :func:`canonical` and its column blocks copied out while it is in cache: one pass over the
    weight, not one per block."""
    import torch
    import xxhash

    weight = weight.detach().cpu()
    if weight.is_floating_point() and not bool(torch.isfinite(weight).all()):
        return KernelRef(block=weight.shape[-1] if weight.dim() == 2 else 0, digests=None)
    if weight.dim() != 2:
        return KernelRef(block=0, digests=(digest_of(weight),))
    out, k = weight.shape
    block = kernel_block(k, out, macs)
    if block >= k:
        return KernelRef(block=k, digests=(digest_of(weight),))
    starts = range(0, k, block)
    hashers = [xxhash.xxh3_128() for _ in starts]
    rows = max(1, _REFERENCE_CHUNK_BYTES // max(k * weight.element_size(), 1))
    for r in range(0, out, rows):
        chunk = canonical(weight[r : r + rows])
        for hasher, c in zip(hashers, starts, strict=True):
            hasher.update(chunk[:, c : c + block].contiguous().view(torch.uint8).numpy().data)
    return KernelRef(block, tuple("xxh3_128:" + h.hexdigest() for h in hashers))


def read_block(module: Any, ref: KernelRef, b: int, dtype: Any = None) -> str:
    """The digest (:func:`digest_of`) of block ``b`` of ``module``'s weight as its kernel computes with it: the
    columns :class:`KernelRef` ``ref`` blocks it by, read back through the kernel."""
    if ref.digests is not None and len(ref.digests) == 1:
        return digest_of(read_through_kernel(module, dtype))
    lo = b * ref.block
    return digest_of(read_through_kernel(module, dtype, (lo, min(lo + ref.block, kernel_inputs(module)))))


def kernel_inputs(module: Any) -> int:
    """The input size of a module whose GEMM goes through ``cpu_linear`` (its weight's columns; a repacked one's
    partition of the input, or a replicated layer's whole input: a MoE router's GateLinear has no partition)."""
    weight = getattr(module, "weight", None)
    if weight is not None and weight.numel():
        return int(weight.shape[1])
    return int(getattr(module, "input_size_per_partition", None) or module.input_size)


def read_through_kernel(module: Any, dtype: Any = None, columns: tuple[int, int] | None = None) -> Any:
    """The weight ``module``'s kernel really computes with, ``(out, in)`` as the checkpoint lays it out: an identity
    matrix multiplied through ``cpu_linear`` (one non-zero term per output element, so exact), which also reads a
    repacked copy whose parameter is left empty. ``columns``: only input columns ``[lo, hi)`` (their rows of the
    identity: the multiply-adds shrink with them), ``(out, hi - lo)``."""
    import torch

    weight = getattr(module, "weight", None)
    k = kernel_inputs(module)
    lo, hi = (0, k) if columns is None else columns
    if not 0 <= lo < hi <= k:
        raise ValueError(f"read_through_kernel: columns [{lo}, {hi}) outside the module's {k} inputs")
    eye = torch.eye(k, dtype=torch.bfloat16 if dtype is None else dtype)[lo:hi]
    return module.cpu_linear(eye, weight, None).t().contiguous()
