"""Adversarial: the repacked-kernel proof reads a weight back through vLLM's real CPU kernel (oneDNN) with an
identity matrix and compares the bits with the digest of the loaded weight. Values the kernel computes with
exactly but cannot return bit for bit make an honest engine "drift":

* ``-0.0`` (a pruned negative weight, ``w * 0``): ``1 * -0.0 + 0 * w`` accumulates to ``+0.0``;
* a bf16 subnormal: oneDNN flushes it to zero;
* an ``inf`` or ``NaN`` anywhere in a row: ``0 * inf`` is ``NaN`` in every column of that row, every block.

Each is a module whose kernel holds exactly the weight its loader built (no drift), read back at a block size that
does not divide the input size (the last block is short), as ``Prover._prove_kernels`` does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltasync.format import tensor_checksum
from deltasync.vllm.plain import kernel_inputs, kernel_reference, read_through_kernel


class OneDnnLinear:
    """A module as vLLM's CPU build leaves it: ``weight`` emptied, ``cpu_linear`` on oneDNN's packed copy."""

    def __init__(self, weight: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        handler = ops.create_onednn_mm(weight.t(), 32)
        self.cpu_linear = lambda x, w, bias: ops.onednn_mm(handler, x, bias)
        self.weight = torch.empty(0, dtype=weight.dtype)
        self.input_size_per_partition = weight.shape[1]


def _drifted_blocks(weight: torch.Tensor, module: Any, macs: int) -> list[int]:
    """The blocks ``Prover._prove_kernels`` would call drift: the read-back's digest against the reference's."""
    ref = kernel_reference(weight, macs)
    k = kernel_inputs(module)
    return [
        b
        for b, digest in enumerate(ref.digests)
        if tensor_checksum(read_through_kernel(module, torch.bfloat16, (b * ref.block, min(b * ref.block + ref.block, k))))
        != digest
    ]


@pytest.fixture
def onednn() -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    if not getattr(ops, "_supports_onednn", False):
        pytest.skip("no oneDNN in this vLLM build")


@pytest.mark.parametrize("macs", [1, 16 * 200 * 64], ids=["block-1", "block-16-of-200"])
def test_an_honest_weight_reads_back_bit_exact(onednn: None, macs: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 200).to(torch.bfloat16)
    assert _drifted_blocks(w, OneDnnLinear(w), macs) == []


@pytest.mark.parametrize("macs", [1, 16 * 200 * 64], ids=["block-1", "block-16-of-200"])
@pytest.mark.parametrize(
    "value", [-0.0, 1e-39, float("inf"), float("nan")], ids=["negative-zero", "subnormal", "inf", "nan"]
)
def test_an_honest_special_value_is_not_drift(onednn: None, macs: int, value: float) -> None:
    """BROKEN: every case reports drift on a kernel that holds exactly the loaded weight."""
    torch.manual_seed(0)
    w = torch.randn(64, 200).to(torch.bfloat16)
    w[5, 199] = value  # in the last, short block
    module = OneDnnLinear(w)
    x = torch.zeros(1, 200, dtype=torch.bfloat16)
    x[0, 199] = 2
    if value == -0.0:  # the kernel computes with it exactly as the checkpoint says (2 * -0.0 == 0)
        assert module.cpu_linear(x, None, None)[0, 5] == 0
    assert _drifted_blocks(w, module, macs) == []
