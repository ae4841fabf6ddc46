"""Where the ``deltasync`` engine writes an update, one :class:`~deltasync.apply.Receiver` per apply mode; the apply
sequence itself (admit, check, write, verify, and the failure rule) is :func:`deltasync.apply.apply_update`.

* :class:`ShadowWrites` (``reload`` and ``lora``; ``inplace`` for the modules the map cannot hold): the host copy of
  the checkpoint, proven against the published checksums; the modules it feeds are reloaded (or the adapter served)
  when the session finishes.
* :class:`MapWrites` (``inplace``): each object's planned scatters into the live parameters, through the patch map.
* :class:`PatchWrites` (``patches``): vLLM's own ``load_checkpoint_weight_patches``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import apply
from ..errors import ApplyError
from ..format import TensorDelta
from ..manifest import DeltaManifest
from .patch_map import PatchMap
from .shadow import Shadow

__all__ = ["MapWrites", "PatchWrites", "ShadowWrites"]


class ShadowWrites(apply.Receiver):
    """The shadow receives each object, proven there; ``pending`` collects the checkpoint tensors whose modules the
    session's end reloads.

    Args:
        shadow: the host copy of the served checkpoint.
        pending: the tensors written this session (grows as objects are proven).
    """

    def __init__(self, shadow: Shadow, pending: set[str]) -> None:
        self.shadow, self.pending = shadow, pending
        self._anchor: dict[str, torch.Tensor] = {}

    def write(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        if manifest.kind == "anchor":  # built aside, proven, then it replaces the shadow
            self._anchor = dict(apply.write(None, manifest, deltas))
        else:
            apply.write(self.shadow.view(), manifest, deltas)

    def verify(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        if manifest.kind == "anchor":
            full, self._anchor = self._anchor, {}
            apply.verify(full, manifest)
            self.shadow.replace_all(full)
            self.pending.update(full)
        else:
            touched = {d.ckpt_name for d in deltas}
            apply.verify({n: self.shadow.get(n) for n in touched}, manifest, names=touched)
            self.pending.update(touched)


class MapWrites(apply.Receiver):
    """The live parameters, written through the patch map: one scatter per live parameter and object (planned and
    proven before the pause). A later object of the session overwrites some of an earlier one's elements, so each
    but the last is read back as soon as it is written; the last one's read-back is the audit's, right after the
    pause, which then holds only the writes. Tensors the map cannot hold go to ``unmapped``, the shadow, and their
    modules are reloaded when the session finishes.

    Args:
        pm: the patch map.
        ops: each object's planned writes, in order.
        unmapped: the shadow's writes, where the map leaves modules out (``None``: it holds every tensor).
    """

    def __init__(self, pm: PatchMap, ops: list[Any], unmapped: ShadowWrites | None) -> None:
        self.pm, self.ops, self.unmapped = pm, ops, unmapped
        self.written = 0
        """Elements written."""
        self._next = 0

    def write(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        # on threads over deltasync's cores (a parameter per thread): 1.10x index_copy_ of the same changes on all
        # the worker's cores, against 1.87x on the calling thread alone (benchmarks/bench_apply.py's floors, inside
        # the RPC, 7 tries each and 16 steady updates with no stall; an earlier run saw a 0.5 s step twice, while
        # vLLM's engine process busy-waited on the other core, and sent the write back to one thread for a while)
        self.written += self.pm.write(self.ops[self._next], threads=True)
        if self.unmapped is not None:
            self.unmapped.write(manifest, deltas)

    def verify(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        i, self._next = self._next, self._next + 1
        if i < len(self.ops) - 1:
            bad = self.pm.check_written(self.ops[i])
            if bad:
                raise ApplyError(f"v{manifest.version}: read back differs from what was written in {bad[:3]}")
        if self.unmapped is not None:
            self.unmapped.verify(manifest, deltas)
            self.unmapped.pending &= set(self.pm.unmapped)


class PatchWrites(apply.Receiver):
    """vLLM's ``load_checkpoint_weight_patches`` (one loader call per changed tensor), kept for comparison
    (``benchmarks/bench_apply.py``). Nothing is read back: the whole-state proof covers what the map can read.

    Args:
        model: the live model.
        device: where its parameters live.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    def write(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        sparse, dense = [], []
        for d in deltas:
            if d.indices is not None:
                values, idx = d.values.to(self.device), d.indices.to(self.device)
                sparse.append(CheckpointWeightPatch(d.ckpt_name, d.shape, d.dtype, values, idx))
            elif d.span is None:
                values = d.values.reshape(-1).to(self.device)
                dense.append(CheckpointWeightPatch(d.ckpt_name, d.shape, d.dtype, values, None))
            else:  # a span is a sparse patch over a contiguous range
                idx = torch.arange(d.span[0], d.span[1], device=self.device)
                sparse.append(CheckpointWeightPatch(d.ckpt_name, d.shape, d.dtype, d.values.to(self.device), idx))
        with disable_mtp_completeness_check(), torch.no_grad():
            for batch in (sparse, dense):  # one call may not mix sparse and dense patches
                if batch:
                    load_checkpoint_weight_patches(self.model, batch)

    def verify(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        return None
