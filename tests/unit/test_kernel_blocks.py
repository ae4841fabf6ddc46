"""A repacked module's kernel is referenced and read back in blocks of its input columns (vLLM's CPU build): the
digests of the blocks are those of the weight's own columns, a read-back of a run of blocks is exactly those
columns, and a sliced audit plans runs of blocks that cover every block of every module once, within the bound."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltasync.format import tensor_checksum
from deltasync.targets.vllm import OfflineLLMTarget
from deltasync.vllm.plain import KernelRef, kernel_block, kernel_reference, read_through_kernel


class RepackedLinear:
    """Stands for a module vLLM's CPU build repacked: its ``weight`` emptied, its GEMM on a private copy (the
    packed one), called the way vLLM calls ``cpu_linear``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = weight.clone()
        self.weight = torch.empty(0, dtype=weight.dtype)
        self.input_size_per_partition = weight.shape[1]

    def cpu_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
        return x @ self.packed.t()


def test_block_sizes_follow_the_multiply_adds() -> None:
    assert kernel_block(1024, 3072) == 1024  # 3.2G multiply-adds: read whole
    assert kernel_block(3072, 1024) == 1024  # 9.7G: 3 blocks of 1,024 columns
    assert kernel_block(1024, 151936) == 16  # a Qwen3-0.6B lm_head: 64 blocks of 16 columns
    assert kernel_block(8, 8, macs=1) == 1  # never less than one column
    assert kernel_block(0, 8) == 1


def test_the_reference_is_the_digest_of_each_block_of_columns() -> None:
    w = torch.randn(48, 40).to(torch.bfloat16)
    whole = kernel_reference(w)
    assert whole == KernelRef(block=40, digests=(tensor_checksum(w),))
    ref = kernel_reference(w, macs=8 * 40 * 48)  # 8 columns a block: 5 blocks
    assert ref.block == 8 and len(ref.digests) == 5
    assert ref.digests == tuple(tensor_checksum(w[:, c : c + 8].contiguous()) for c in range(0, 40, 8))
    odd = kernel_reference(w[:, :36].contiguous(), macs=8 * 36 * 48)  # the last block is a short one
    assert odd.digests[-1] == tensor_checksum(w[:, 32:36].contiguous())


def test_a_read_back_of_a_run_of_blocks_is_exactly_those_columns() -> None:
    w = torch.randn(48, 40).to(torch.bfloat16)
    module = RepackedLinear(w)
    assert torch.equal(read_through_kernel(module), w)
    ref = kernel_reference(w, macs=8 * 40 * 48)
    got = read_through_kernel(module, torch.bfloat16, (8, 24))  # blocks 1 and 2
    assert got.shape == (48, 16)
    assert [tensor_checksum(got[:, i : i + 8].contiguous()) for i in (0, 8)] == list(ref.digests[1:3])
    module.packed[5, 17] += 1  # drift in block 2 only
    got = read_through_kernel(module, torch.bfloat16, (16, 24))
    assert tensor_checksum(got.contiguous()) != ref.digests[2]
    assert tensor_checksum(read_through_kernel(module, torch.bfloat16, (0, 8))) == ref.digests[0]
    with pytest.raises(ValueError, match=r"columns \[32, 48\) outside the module's 40 inputs"):
        read_through_kernel(module, None, (32, 48))


class ScriptedRanks:
    """Two engine ranks answering a sliced audit's calls (``deltasync_prove``) as the worker extension does, with
    no tensors to prove: records every call's windows and reports ``seconds_per_mac`` for the read-backs."""

    def __init__(self, kernels: dict[str, int], blocks: list[dict[str, int]], seconds_per_mac: float) -> None:
        self.kernels, self.blocks, self.seconds_per_mac = kernels, blocks, seconds_per_mac
        self.calls: list[list[list[Any]]] = []

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        assert method == "deltasync_prove"
        windows = kwargs.get("windows")
        base = {"ok": True, "version": 3, "proven": True, "bad": [], "parts": {}, "unproven": []}
        if windows == [] and not kwargs.get("extras", True):  # the plan
            return [{**base, "tensors": {}, "kernels": self.kernels, "kernel_blocks": b} for b in self.blocks]
        self.calls.append(windows or [])
        macs = 0.0
        for name, b0, b1 in windows or []:
            module = name.removeprefix("kernel:")
            n = self.blocks[0].get(module, 1)
            share = (b1 - b0) / n if (b0, b1) != (0, 0) else 1
            macs += self.kernels[module] * share
        return [{**base, "prove_s": macs * self.seconds_per_mac} for _ in self.blocks]


def _read(calls: list[list[list[Any]]]) -> dict[str, list[tuple[int, int]]]:
    seen: dict[str, list[tuple[int, int]]] = {}
    for windows in calls:
        for name, b0, b1 in windows:
            seen.setdefault(name, []).append((b0, b1))
    return seen


def test_a_sliced_audit_reads_every_block_once_in_calls_within_the_bound() -> None:
    g = 1_000_000_000
    kernels = {"lm_head": 160 * g, "layers.0.down_proj": 9 * g, "layers.0.qkv_proj": 3 * g}
    blocks = {"lm_head": 64, "layers.0.down_proj": 3}
    ranks = ScriptedRanks(kernels, [blocks, blocks], seconds_per_mac=7e-12)  # ~1.1 s for the whole lm_head
    target = OfflineLLMTarget(ranks)
    assert target.prove(stall_s=0.05) == []
    kernel_calls = ranks.calls[:-1]  # the last call proves what is beside the tensors
    seen = _read(kernel_calls)
    assert seen.pop("kernel:layers.0.qkv_proj") == [(0, 0)]  # one block: read whole
    for name, n in (("kernel:lm_head", 64), ("kernel:layers.0.down_proj", 3)):
        covered = sorted(b for b0, b1 in seen.pop(name) for b in range(b0, b1))
        assert covered == list(range(n)), name  # every block once, none twice
    assert not seen
    assert max(target.audit_stalls[:-1]) <= 0.05 / 0.7 * 1.01  # the first call's guess is slow-engine safe
    assert len(kernel_calls) >= 160 * g * 7e-12 / 0.05  # the lm_head alone took several calls


def test_ranks_that_disagree_on_a_module_s_blocks_read_it_whole() -> None:
    g = 1_000_000_000
    ranks = ScriptedRanks({"lm_head": 160 * g}, [{"lm_head": 64}, {"lm_head": 32}], seconds_per_mac=7e-12)
    assert OfflineLLMTarget(ranks).prove(stall_s=0.05) == []
    assert _read(ranks.calls[:-1]) == {"kernel:lm_head": [(0, 0)]}
