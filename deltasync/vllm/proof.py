"""The ``deltasync`` engine's proofs (:class:`Prover`): an update proven before its first write, read back after
it, and the whole served state proven against the published checksums (drift).

* :func:`prove_update`: before the pause, the planned writes give the published checksums (``inplace`` mode);
* :meth:`Prover.audit`: right after the pause, every written element reads back as planned;
* :meth:`Prover.prove_state`: every element this rank serves, against the served version's checksums and
  sketches, through the patch map, the shadow, or (vLLM's CPU build) the repacked kernels, and in ``lora`` mode
  the directories the adapter is served from and (:meth:`Prover.prove_slots`) its slots in vLLM's LoRA buffers;
  :meth:`Prover.report_drift` unlabels the engine when one differs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._cpus import parallel_map
from ..errors import RefusalReason, UpdateRefused
from ..format import TensorDelta, tensor_checksum
from ..manifest import DeltaManifest, TensorEntry
from ..sketch import ZERO, ChangeProof, add_sketches, format_sketch, parse_sketch, sketch_change, sketch_range
from ..vocab import DTYPES
from .adapter import ServedAdapter
from .label import Label
from .model import ServedModel
from .patch_map import PatchMap
from .plain import kernel_inputs, kernel_modules, read_block
from .served import merge_changes

__all__ = ["Prover", "Written", "change_parts", "prove_update"]

logger = logging.getLogger("vllm.deltasync.engine")

_KERNEL = "kernel:"
"""A sliced audit's window that reads one repacked module back through its kernel: ``kernel:<module>`` (a
checkpoint name has no ``:``)."""

_BLOCK = 1 << 20
"""Changed elements proven at a time (:func:`_changes`)."""

Checked = list[tuple[DeltaManifest, list[TensorDelta]]]


@dataclass
class Written:
    """What an update session wrote, for the audit after the pause to read back."""

    writes: list[Any] = field(default_factory=list)
    """The last object's planned writes into the live parameters (``inplace``; the earlier objects' were read
    back during the session, before a later one overwrote them)."""
    touched: set[str] = field(default_factory=set)
    """The checkpoint tensors the session changed (with TP > 1, proven in parts after the pause)."""
    prepared: bool = False
    """Written from a plan prepared (and proven) before the pause, whose tensors held in parts the agent added
    up over the ranks."""


def _read_for(parts: list[tuple[torch.Tensor, torch.Tensor]] | None, ds: list[TensorDelta]) -> torch.Tensor | None:
    """The live values the decoder read at exactly the changed elements of a tensor one sparse entry changes, or
    ``None`` (read again)."""
    if parts is None or len(parts) != 1 or len(ds) != 1 or ds[0].indices is None:
        return None
    at, values = parts[0]
    same = at.numel() == ds[0].indices.numel() and (at.numel() == 0 or at.data_ptr() == ds[0].indices.data_ptr())
    return values if same else None


def _matches(values: torch.Tensor, entry: TensorEntry) -> bool:
    """Whether a tensor held whole (flat or shaped) has every published checksum of ``entry``."""
    return all(tensor_checksum(values, (a, b)) == digest for a, b, digest in entry.checksums)


def prove_update(
    pm: PatchMap,
    served: DeltaManifest | None,
    checked: Checked,
    ops: list[Any],
    reads: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None,
) -> dict[str, Any]:
    """Before any write, prove that the planned update gives what was published, for every tensor this rank holds
    whole. Returns, for the tensors it holds in part (TP > 1), its changes to them as sketches
    (:func:`change_parts`), which the agent adds up over the ranks before the first write.

    A tensor written whole last (an anchor) is proven by its staged values' checksums (the map that writes them was
    proven when it was built, and the writes are read back after the pause). A tensor that only sparse deltas
    change is proven **from its changed elements**: its served sketch (the served version's manifest ``served``)
    moved by ``sketch_change(new, old)`` over the composed changes, the old values read from the live parameters
    (or ``reads``: what the decoder read of them already), must be the published sketch of the last object that
    changed it; the cost follows the delta, not the model. All such tensors are proven in one sum
    (:class:`~deltasync.sketch.ChangeProof`: one histogram of the changes, one product with the weights), and each
    alone only when the sum fails, to name them. Anything else (an anchor or dense span in the update, a served
    version without sketches) is proven whole: the planned writes ``ops`` applied to copies of the live parameters
    holding it, checksummed against the published checksums. A forged or swapped staged file, a wrong base or a
    stale map is refused here and never reaches the live weights.

    Raises:
        UpdateRefused: (reason ``integrity``) the planned result differs from what was published.
    """
    reads = reads or {}
    last: dict[str, DeltaManifest] = {}
    changes: dict[str, list[TensorDelta]] = {}
    for manifest, deltas in checked:
        for d in deltas:
            if d.ckpt_name in pm:
                last[d.ckpt_name] = manifest
                changes.setdefault(d.ckpt_name, []).append(d)
    bad: list[str] = []
    whole: list[str] = []
    in_parts: dict[str, Any] = {}
    proof = ChangeProof()  # every sparse change held whole, proven in one sum (checked after the loop)
    proving: dict[str, tuple[list[TensorDelta], str, TensorEntry, torch.Tensor | None]] = {}
    for name, ds in changes.items():
        entry = last[name].tensors[name]
        final = ds[-1]
        before = served.tensors.get(name) if served is not None else None
        if any(d.held is not None for d in ds):  # decoded here in part (TP > 1): the ranks' changes add up
            if before is not None and before.sketch is not None and entry.sketch is not None:
                in_parts[name] = {
                    "parts": change_parts(pm, name, ds, DTYPES[entry.dtype]),
                    "served": before.sketch,
                    "published": entry.sketch,
                    "numel": entry.numel,
                }
            continue  # else proven after the pause, by the ranks' sketch parts (the audit)
        if final.indices is None and (final.span is None or tuple(final.span) == (0, entry.numel)):
            # written whole last (an anchor): the result is the staged values themselves
            if not _matches(final.values.reshape(-1), entry):
                bad.append(name)
            continue
        sparse = not any(d.indices is None for d in ds) and pm.holds_whole(name, entry.numel)
        if before is None or before.sketch is None or entry.sketch is None or not sparse:
            whole.append(name)
            continue
        read = _read_for(reads.get(name), ds)
        proof.expect(name, parse_sketch(before.sketch), parse_sketch(entry.sketch))
        proving[name] = (ds, before.sketch, entry, read)

    def add(name: str) -> None:
        ds, _, entry, read = proving[name]
        for new, old, at in _changes(pm, name, ds, DTYPES[entry.dtype], read):
            proof.add(name, new, old, at, increasing=True)

    def size(name: str) -> int:
        return sum(d.nnz for d in proving[name][0])

    names = list(proving)  # on the decoder's threads: each adds to its own histogram
    parallel_map(add, names, sum(size(n) for n in names), cost=size)
    if not proof.holds():  # some tensor's sketch does not match: prove each alone to name them
        failed = [n for n, (ds, b, e, r) in proving.items() if not _prove_change(pm, n, ds, b, e, r)]
        bad += failed or sorted(proving)
    bad += _prove_whole(pm, whole, last, ops)
    if bad:
        raise UpdateRefused(
            f"deltasync: applied to what this engine serves, the update would give {len(bad)} tensors that "
            f"differ from the published checksums (e.g. {sorted(bad)[0]}); nothing was written",
            reason=RefusalReason.INTEGRITY,
        )
    return in_parts


def change_parts(pm: PatchMap, name: str, ds: list[TensorDelta], dtype: torch.dtype) -> list[list[Any]]:
    """How the sparse changes ``ds`` (in order; decoded on this rank in part) move the sketch of each live
    parameter's part of tensor ``name``: ``[parameter, sketch change, elements of the tensor it holds]``. Added up
    over the ranks whose parts cover the tensor once, plus the served sketch, they must give the published sketch
    (:func:`deltasync.targets.base.combine_changes`)."""
    idx: torch.Tensor | None = None
    new: torch.Tensor | None = None
    for d in ds:
        at = d.indices if d.indices is not None else torch.arange(*d.bounds, dtype=torch.int64)
        values = d.values.reshape(-1)
        if d.held is not None:
            at, values = at[d.held], values[d.held]
        idx, new = (at, values) if idx is None or new is None else merge_changes((idx, new), (at, values))
    assert idx is not None and new is not None
    new = new.to(dtype)
    out: dict[str, list[Any]] = {}
    for r in pm.runs[name]:
        held, where = r.locate(idx)
        flat = pm.param(r.param).data.view(-1)
        moved = ZERO
        at, values = idx[held], new[held]
        for a in range(0, at.numel(), _BLOCK):
            old = flat.index_select(0, where[a : a + _BLOCK].to(flat.device)).cpu().to(dtype)
            moved = add_sketches(moved, sketch_change(values[a : a + _BLOCK], old, at[a : a + _BLOCK], increasing=True))
        part = out.setdefault(r.param, [r.param, ZERO, 0])
        part[1], part[2] = add_sketches(part[1], moved), part[2] + r.numel
    return [[param, format_sketch(sk), count] for param, sk, count in out.values()]


def _changes(
    pm: PatchMap, name: str, ds: list[TensorDelta], dtype: torch.dtype, read: torch.Tensor | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The sparse changes ``ds`` (in order) of tensor ``name``, held whole on this rank, composed (a catch-up: the
    last write of each element wins), block by block: ``(new, old, flat indices)``, strictly increasing (decoded
    indices are, the decoder checks; a catch-up's are sorted and deduplicated). ``read``: the live values at the
    changed elements, read already (by the decoder); else read here, a block at a time."""
    idx, new = ds[0].indices, ds[0].values
    for d in ds[1:]:
        assert idx is not None and d.indices is not None
        idx, new = merge_changes((idx, new), (d.indices, d.values))
    assert idx is not None
    new = new.reshape(-1).to(dtype)
    # block by block (the sketch adds up over any partition): the temporaries stay in memory the allocator
    # reuses, where one pass over tens of millions of changes would fault in fresh pages for each of them
    for a in range(0, idx.numel(), _BLOCK):
        at = idx[a : a + _BLOCK]
        old = (read[a : a + _BLOCK] if read is not None else pm.gather(name, at)).to(dtype)
        yield new[a : a + _BLOCK], old, at


def _prove_change(
    pm: PatchMap, name: str, ds: list[TensorDelta], served: str, entry: TensorEntry, read: torch.Tensor | None
) -> bool:
    """Whether the sparse changes ``ds`` (in order) of a tensor held whole move its served sketch to the published
    one, proven for this tensor alone (:class:`~deltasync.sketch.ChangeProof` proves them all at once; this names
    the tensors that fail)."""
    moved = parse_sketch(served)
    for new, old, at in _changes(pm, name, ds, DTYPES[entry.dtype], read):
        moved = add_sketches(moved, sketch_change(new, old, at, increasing=True))
    return format_sketch(moved) == entry.sketch


def _prove_whole(pm: PatchMap, names: list[str], last: dict[str, DeltaManifest], ops: list[Any]) -> list[str]:
    """The planned writes applied to copies of the live parameters, a few at a time (those holding one tensor;
    extra memory: the largest such set): the tensors of ``names`` held whole whose checksums differ."""
    by_params: dict[frozenset[str], list[str]] = {}  # a tensor may span parameters (a fused gate_up split)
    for name in names:
        by_params.setdefault(frozenset(pm.params_of(name)), []).append(name)
    bad: list[str] = []
    for held, group in by_params.items():
        copy = {param: pm.param(param).data.view(-1).clone() for param in held}
        for object_ops in ops:
            pm.write(object_ops, into=copy)
        for name in group:
            values = pm.read_whole(name, source=copy)
            entry = last[name].tensors[name]
            if values is None or values.numel() != entry.numel:
                continue
            if not _matches(values, entry):
                bad.append(name)
        del copy
    return bad


class Prover:
    """One engine's proofs of what it serves.

    Args:
        served: the served model (its map, shadow and reloader).
        label: the engine's label (the served version's manifest; a drift unlabels it).
        adapter: ``lora`` mode's served adapter.
    """

    def __init__(self, served: ServedModel, label: Label, adapter: ServedAdapter) -> None:
        self.served, self.label, self.adapter = served, label, adapter
        self.proofs: dict[str, Any] = {}
        """The last whole-state proof: when, how long, how many tensors."""

    def prove_update(self, checked: Checked, ops: list[Any], reads: dict[str, Any] | None = None) -> dict[str, Any]:
        """:func:`prove_update` against this engine's map and served version."""
        return prove_update(self.served.patch_map(), self.label.manifest, checked, ops, reads)

    def audit(self, written: Written, proven: list[str] | None = None) -> dict[str, Any]:
        """The last update read back from the live parameters (the ``deltasync_audit`` RPC, right after the
        pause, which holds only the writes): every written element is compared bit for bit with the plan.
        The plan itself was proven against the published checksums before the first write (:func:`prove_update`),
        so together they prove what is served. On a mismatch the engine is marked unhealthy and the agent
        pauses it until an anchor restores it.

        With TP > 1 the tensors this rank holds in part are also proven whole here, as sketches of its parts for
        the agent to add up, except ``proven``: those whose changes the agent added up over the ranks before the
        first write (their parts cover each once), so the audit stays proportional to what changed."""
        if not written.prepared:  # written from a plan made in the session: nothing was added up before
            proven = None
        touched = sorted(written.touched - set(proven or ()))
        # TP > 1: the tensors this rank holds in part and whose changes could not be added up before the write
        # (overlapping parts) were proven only against the plan; their sketches, added up over the ranks by the
        # agent, prove them against the published checksums
        parts = self.served.tensor_parallel and self.label.healthy
        proof = self.prove_state(touched) if parts and touched else None
        pm = self.served.built_map
        if self.served.mode != "inplace" or pm is None or not written.writes:
            return {"ok": self.label.healthy, "checked": 0, "bad": [], "proof": proof}
        bad = pm.check_written(written.writes)
        if bad:
            self.label.fail_unhealthy(f"the live parameters {bad[:3]} differ from what was written (read back)")
        return {"ok": not bad and self.label.healthy, "checked": len(written.writes), "bad": bad[:8], "proof": proof}

    def prove_state(
        self,
        names: list[str] | None = None,
        windows: list[tuple[str, int, int]] | None = None,
        extras: bool | None = None,
        kernels: bool = True,
    ) -> dict[str, Any]:
        """Prove what this rank holds against the served version's published checksums (the ``deltasync_prove``
        RPC): every element of every tensor (``names``: only these), read from the live parameters through the
        patch map (``inplace``; in ``reload`` mode from the shadow the reloads are made from). A tensor this rank
        holds whole is proven here: a mismatch marks the engine unhealthy at once (drift). A tensor it holds in
        part is returned as per-parameter sketches for the agent to add up over the ranks
        (:func:`deltasync.targets.base.combine_proofs`): sketches add up over any partition, whatever the
        TP layout. Never raises.

        A sliced audit (the agent's ``audit_stall_s``) proves the state in many short calls, each holding the
        worker for a bounded time: ``windows`` (instead of ``names``) are ``(tensor, lo, hi)`` checkpoint flat
        index ranges, each returned as parts for the agent to add up over the windows and the ranks; ``extras``
        (default: ``names is None and windows is None``) also proves what is beside the tensors (the kernels of
        repacked modules, a MoE kernel's padding, the adapter directories vLLM loads; ``kernels=False``: not the
        kernels, which a sliced audit reads back in windows of their own, ``("kernel:<module>", b0, b1)``: blocks
        ``[b0, b1)`` of the module's input columns, ``(.., 0, 0)`` all of them). An answer with no windows and no
        names lists the served version's tensors and their sizes (``tensors``), the repacked modules and the
        multiply-adds that read each back (``kernels``), and the blocks of those referenced in more than one
        (``kernel_blocks``), for the agent to plan.
        """
        t0 = time.perf_counter()
        manifest, version = self.label.manifest, self.label.version
        if not self.label.healthy or version is None:
            return {"ok": False, "version": None, "reason": self.label.detail or "no known version", "parts": {}}
        if manifest is None or manifest.version != version:
            return {"ok": True, "version": version, "proven": False, "reason": f"no published checksums for v{version}"}
        extras = (names is None and windows is None) if extras is None else extras
        if windows is not None:
            wanted = []
        else:
            wanted = list(manifest.tensors) if names is None else [n for n in names if n in manifest.tensors]
        try:
            bad, parts, unproven = self._prove_tensors(manifest, wanted)
            if windows:
                modules: dict[str, list[tuple[int, int]]] = {}
                for w in windows:
                    if w[0].startswith(_KERNEL):
                        modules.setdefault(w[0].removeprefix(_KERNEL), []).append((int(w[1]), int(w[2])))
                if modules:
                    kernel_bad, kernel_unproven = self._prove_kernels(modules)
                    bad += kernel_bad
                    unproven += kernel_unproven
                self._prove_windows(manifest, [w for w in windows if not w[0].startswith(_KERNEL)], parts, unproven)
            if extras and self.served.mode == "lora":  # the whole state: also the directories vLLM loads
                bad += self.adapter.prove_dirs(manifest)
            elif extras:  # the whole state: also what the kernels of repacked modules compute with
                if kernels:
                    kernel_bad, kernel_unproven = self._prove_kernels()
                    bad += kernel_bad
                    unproven += kernel_unproven
                pm = self.served.proof_map()
                if pm is not None:  # and the padding a MoE kernel computes with beside the experts' elements
                    bad += pm.padding_drift()
        except Exception as exc:  # noqa: BLE001 - a proof that cannot run proves nothing: said, never raised
            return {"ok": False, "version": version, "reason": f"{type(exc).__name__}: {exc}", "parts": {}}
        elapsed = time.perf_counter() - t0
        if windows is None:
            self.proofs = {"at": time.time(), "s": round(elapsed, 4), "tensors": len(wanted), "whole": names is None}
        elif extras:  # the last call of a sliced whole-state proof
            self.proofs = {"at": time.time(), "s": round(elapsed, 4), "tensors": 0, "whole": True, "sliced": True}
        if bad:
            self.report_drift(bad, by="this rank")
        answer = {
            "ok": not bad,
            "version": version,
            "proven": True,
            "bad": bad[:16],
            "parts": parts,
            "published": {n: manifest.tensors[n].sketch for n in parts},
            "numel": {n: manifest.tensors[n].numel for n in parts},
            "unproven": unproven[:16],
            "prove_s": round(elapsed, 4),
        }
        if windows is not None and not windows and names is None:
            answer["tensors"] = {n: e.numel for n, e in manifest.tensors.items()}
            costs = self._kernel_costs()
            refs = self.served.reloader.kernel_refs if self.served.mode != "patches" else {}
            answer["kernels"] = costs
            answer["kernel_blocks"] = {
                q: len(digests)
                for q in costs
                if q in refs and (digests := refs[q].digests) is not None and len(digests) > 1
            }
        return answer

    def _shadow_flat(self, shadow: Any, name: str) -> torch.Tensor | None:
        """Tensor ``name`` flat in the shadow, where it is proven from there (patches mode never writes the shadow:
        it proves nothing), else ``None``."""
        if self.served.mode == "patches" or shadow is None or shadow.empty or name not in shadow.spec():
            return None
        flat: torch.Tensor = shadow.get(name).reshape(-1)
        return flat

    def _prove_windows(
        self,
        manifest: DeltaManifest,
        windows: list[tuple[str, int, int]],
        parts: dict[str, list[list[Any]]],
        unproven: list[str],
    ) -> None:
        """The parts of each window ``(tensor, lo, hi)`` this rank holds, added to ``parts`` (the agent adds them
        up over the windows and the ranks and compares the sums with the published sketches); a tensor this rank
        cannot read, or with no published sketch, goes to ``unproven``."""
        pm = self.served.proof_map()
        shadow = self.served.loaded_shadow()
        for name, lo, hi in windows:
            entry = manifest.tensors.get(name)
            if entry is None or entry.sketch is None or not 0 <= lo < hi <= entry.numel:
                unproven.append(name)
                continue
            dtype = DTYPES[entry.dtype]
            if pm is not None and name in pm:
                held = pm.sketch_parts(name, dtype, window=(lo, hi))
                whole = pm.holds_whole(name, entry.numel)
            elif (flat := self._shadow_flat(shadow, name)) is not None:
                held = [("shadow", sketch_range(flat[lo:hi], lo), hi - lo)]
                whole = True
            else:
                unproven.append(name)
                continue
            for param, sk, count in held:
                # a tensor this rank holds whole (a replicated one at TP > 1: every rank does) adds up over the
                # windows on this rank alone: its parts are named for this process, never added to another rank's
                key = f"{param}@pid{os.getpid()}" if whole else param
                parts.setdefault(name, []).append([key, format_sketch(sk), count])

    def _prove_tensors(
        self, manifest: DeltaManifest, wanted: list[str]
    ) -> tuple[list[str], dict[str, list[list[Any]]], list[str]]:
        """The tensors ``wanted`` of the served version ``manifest``: those held whole that differ, the parts of
        those held in part (for the agent to add up), and those this rank cannot read."""
        pm = self.served.proof_map()
        shadow = self.served.loaded_shadow()
        bad: list[str] = []
        parts: dict[str, list[list[Any]]] = {}
        unproven: list[str] = []
        for name in wanted:
            entry = manifest.tensors[name]
            published = None if entry.sketch is None else parse_sketch(entry.sketch)
            dtype = DTYPES[entry.dtype]  # the published tensor's: the sketch is over its bits
            if pm is not None and name in pm:
                held = pm.sketch_parts(name, dtype)
                whole = pm.read_whole(name) if published is None else None
            elif (t := self._shadow_flat(shadow, name)) is not None:
                held, whole = [("shadow", sketch_range(t), t.numel())], t
            else:
                unproven.append(name)
                continue
            for param, sk, count in held:
                if count == entry.numel:  # this parameter holds all of it
                    if published is not None and sk != published:
                        bad.append(name)
                elif published is not None:
                    parts.setdefault(name, []).append([param, format_sketch(sk), count])
            if published is None:  # a manifest from before the sketch: xxh3 proves what is held whole
                if whole is None or not _matches(whole, entry):
                    (bad if whole is not None else unproven).append(name)
        return bad, parts, unproven

    def _kernel_costs(self) -> dict[str, int]:
        """Each repacked module this rank would read back through its kernel (the whole-state proof), and the
        multiply-adds that costs (an identity of its input size through its GEMM: ``inputs**2 x outputs``)."""
        if self.served.mode == "patches":
            return {}
        refs = self.served.reloader.kernel_refs
        costs = {}
        for qualname, module in kernel_modules(self.served.model):
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or (qualname not in refs and weight.numel()):
                continue  # a plain weight, proven as a tensor: nothing to read back
            k = kernel_inputs(module)  # the columns its read-back reads
            out = int(getattr(module, "output_size_per_partition", 0) or (weight.shape[0] if weight.dim() == 2 else 0))
            costs[qualname] = max(k * k * out, 1)
        return costs

    def _prove_kernels(self, only: Mapping[str, list[tuple[int, int]]] | None = None) -> tuple[list[str], list[str]]:
        """vLLM's CPU build repacks linear weights after loading (the parameter left empty, the kernel holding
        its own copy): read each such module back through its kernel (an identity matrix: one non-zero term per
        output, exact) and compare with the weight its loader built from the proven shadow, recorded right before
        the repacking in blocks of its input columns (:attr:`LayerwiseReloader.kernel_refs`). ``only``: these
        modules, each in its windows of blocks ``(b0, b1)`` (``(0, 0)``: every block). Returns ``(drifted,
        unproven)`` module names."""
        refs = self.served.reloader.kernel_refs if self.served.mode != "patches" else {}
        config_dtype = self.served.model_config.dtype
        dtype = config_dtype if isinstance(config_dtype, torch.dtype) else None
        bad, unproven = [], []
        seen: set[str] = set()
        with torch.no_grad():
            for qualname, module in kernel_modules(self.served.model):
                weight = getattr(module, "weight", None)
                if not isinstance(weight, torch.Tensor) or only is not None and qualname not in only:
                    continue
                seen.add(qualname)
                ref = refs.get(qualname)
                if ref is None:
                    if weight.numel() == 0:  # repacked, never reloaded by deltasync: nothing to compare with
                        unproven.append(f"{qualname} (kernel)")
                    continue
                if ref.digests is None:
                    unproven.append(f"{qualname} (kernel: its weight holds an inf or a NaN, which a read-back hides)")
                    continue
                blocks = len(ref.digests)
                for b0, b1 in (only or {}).get(qualname) or [(0, 0)]:
                    lo, hi = (0, blocks) if (b0, b1) == (0, 0) else (b0, b1)
                    if not 0 <= lo < hi <= blocks:
                        unproven.append(f"{qualname} (kernel blocks [{b0}, {b1}) of {blocks})")
                        continue
                    # a block at a time: each read back is its block's columns, contiguous, as referenced
                    if any(read_block(module, ref, b, dtype) != ref.digests[b] for b in range(lo, hi)):
                        bad.append(f"{qualname} (as its kernel computes)")
                        break
        if only is not None:  # a window naming no module of this rank with a kernel proves nothing: said
            unproven += [f"{q} (kernel: no such module)" for q in sorted(set(only) - seen)]
        return bad, unproven

    def prove_slots(self, worker: Any) -> tuple[list[str], int]:
        """``lora`` mode, after the whole-state proof: every copy of the served adapter vLLM loaded and its slot in
        the layers' buffers, read back as each layer's own ``set_lora`` writes them
        (:func:`~deltasync.vllm.lora_slots.prove_served_slots`); a difference is drift. Returns what differs and
        how many loaded copies were read."""
        from .lora_slots import prove_served_slots

        assert self.adapter.directory is not None
        bad, slots = prove_served_slots(worker, self.adapter.directory, self.adapter.copy)
        if bad:
            self.report_drift(bad, by="this rank")
        return bad, slots

    def report_drift(self, tensors: list[str], *, by: str) -> None:
        """Weights that differ from the served version's published checksums (found by this rank's proof, or by
        the agent adding up the ranks' parts: the ``deltasync_drift`` RPC). The engine drops its version and is
        unhealthy until an anchor restores it; ``status()["drift"]`` says which tensors and when."""
        self.label.report_drift(tensors, by=by)
        logger.warning("deltasync: %s", self.label.detail)
