"""The repacked-kernel proof reads a weight back through vLLM's real CPU kernel (oneDNN) with an identity matrix
and compares it with the reference of the loaded weight (found by an adversary: values the kernel computes with
exactly but cannot return bit for bit made an honest engine "drift"):

* ``-0.0`` (a pruned negative weight, ``w * 0``): ``1 * -0.0 + 0 * w`` accumulates to ``+0.0``;
* a bf16 subnormal: oneDNN flushes it to zero;
* an ``inf`` or ``NaN`` anywhere in a row: ``0 * inf`` is ``NaN`` in every column of that row, every block.

Both sides are compared as :func:`~deltasync.vllm.plain.canonical` (zeros and subnormals as ``+0.0``): the first
two read back as themselves; a weight with an inf or a NaN has no reference (the module is unproven, never
proven). Each module's kernel holds exactly the weight its loader built, read back at a block size that does not
divide the input size (the last block is short), as ``Prover._prove_kernels`` does; a changed element is still
found."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltasync.vllm.plain import kernel_reference, read_block


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
    assert ref.digests is not None
    return [b for b, digest in enumerate(ref.digests) if read_block(module, ref, b, torch.bfloat16) != digest]


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
@pytest.mark.parametrize("value", [-0.0, 1e-39, -1e-39], ids=["negative-zero", "subnormal", "negative-subnormal"])
def test_an_honest_zero_or_subnormal_is_not_drift_and_a_change_still_is(onednn: None, macs: int, value: float) -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 200).to(torch.bfloat16)
    w[5, 199] = value  # in the last, short block
    module = OneDnnLinear(w)
    x = torch.zeros(1, 200, dtype=torch.bfloat16)
    x[0, 199] = 2
    if value == -0.0:  # the kernel computes with it exactly as the checkpoint says (2 * -0.0 == 0)
        assert module.cpu_linear(x, None, None)[0, 5] == 0
    assert _drifted_blocks(w, module, macs) == []
    changed = w.clone()
    changed[5, 199] = 0.25  # the kernel holds another weight than the reference's
    ref = kernel_reference(changed, macs)
    assert ref.digests is not None and read_block(module, ref, len(ref.digests) - 1, torch.bfloat16) != ref.digests[-1]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_a_weight_with_an_inf_or_a_nan_has_no_reference(value: float) -> None:
    """``0 * inf`` is a NaN in every column of its row: no read-back can show such a weight, so the module is left
    unproven (``digests`` is ``None``), never proven and never drift."""
    w = torch.randn(64, 200).to(torch.bfloat16)
    w[5, 199] = value
    assert kernel_reference(w, 16 * 200 * 64).digests is None
    assert kernel_reference(w).digests is None
