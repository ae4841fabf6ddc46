"""Optional vLLM worker extension: ``--worker-extension-cls deltasync.vllm.worker_ext.DeltaSyncWorkerExtension``.

Importing it registers the backend (for set-ups without the entry point, e.g. ``VLLM_PLUGINS`` allow-lists),
and it adds named RPCs: ``llm.collective_rpc("deltasync_status")`` or ``POST /collective_rpc
{"method": "deltasync_status"}`` with the engine credential (:mod:`deltasync.vllm.guard`).
"""

from __future__ import annotations

from typing import Any

from .plugin import register

__all__ = ["DeltaSyncWorkerExtension"]

register()


class DeltaSyncWorkerExtension:
    """Mixed into vLLM's worker class."""

    def deltasync_status(self, session: str | None = None) -> dict[str, Any]:
        """This rank's engine: backend class, mode, version, health, its last updates, and whether an update
        session is open (started, not finished: an agent died inside it). ``session``: the owning agent's, which
        this read keeps alive."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and hasattr(engine, "touch"):
            engine.touch(session)
        _track_served_adapter(self, engine)
        active = bool(getattr(self, "_weight_update_active", False))
        if engine is None or not hasattr(engine, "status"):
            return {"engine": None if engine is None else type(engine).__name__, "session_active": active}
        status: dict[str, Any] = engine.status()
        return {**status, "session_active": active}

    def deltasync_prepare(self, update_info: str | dict[str, Any]) -> dict[str, Any]:
        """Read, validate and plan an update before the pause (``inplace`` mode: the scatters are ready when the
        session starts); never raises. ``update_info`` may come as JSON text (vLLM's ``/collective_rpc`` passes
        strings)."""
        if isinstance(update_info, str):
            import json

            update_info = json.loads(update_info)
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "prepare"):
            return {"ok": False, "refused": None, "message": "no deltasync weight-transfer engine"}
        result: dict[str, Any] = engine.prepare(update_info)
        return result

    def deltasync_audit(self, proven: list[str] | None = None) -> dict[str, Any]:
        """Checksums of the last update's tensors read back from the live parameters (``inplace`` mode).
        ``proven``: tensors held in parts whose changes the agent added up over the ranks before the first write."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "audit"):
            return {"ok": True, "checked": 0, "partial": 0, "bad": []}
        result: dict[str, Any] = engine.audit(proven)
        return result

    def deltasync_prove(
        self,
        names: list[str] | None = None,
        windows: list[list[Any]] | None = None,
        extras: bool | None = None,
        kernels: bool = True,
    ) -> dict[str, Any]:
        """Prove what this rank holds against the served version's published checksums (every tensor, or
        ``names``, or a sliced audit's ``windows`` ``[tensor, lo, hi]``); parts of tensors held in part (and every
        window) come back for the agent to add up over the ranks. ``extras`` (default: neither names nor windows):
        also what is beside the tensors (``kernels=False``: not the repacked kernels, read back in windows
        ``["kernel:<module>", 0, 0]`` instead). In ``lora`` mode that is also what vLLM computes with: every loaded copy
        of the served adapter and its slot in the layers' buffers
        (:func:`~deltasync.vllm.lora_slots.prove_served_slots`), read back once the served directory is proven
        (``"slots"``: how many loaded copies were read)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "prove_state"):
            return {"ok": False, "version": None, "reason": "no deltasync weight-transfer engine", "parts": {}}
        spans = None
        if windows is not None:
            try:
                spans = [(str(name), int(lo), int(hi)) for name, lo, hi in windows]
            except (TypeError, ValueError) as exc:
                return {"ok": False, "version": None, "reason": f"windows must be [tensor, lo, hi]: {exc}", "parts": {}}
        extras = (names is None and windows is None) if extras is None else bool(extras)
        result: dict[str, Any] = engine.prove_state(names, spans, extras, bool(kernels))
        if extras and result.get("ok") and _track_served_adapter(self, engine):
            try:
                bad, result["slots"] = engine.prove_slots(self)
            except Exception as exc:  # noqa: BLE001 - a proof that cannot run proves nothing: said, never raised
                return {**result, "ok": False, "reason": f"the served adapter's slots: {type(exc).__name__}: {exc}"}
            if bad:
                result.update(ok=False, bad=bad[:16])
        return result

    def deltasync_drift(self, tensors: list[str], by: str = "the agent") -> dict[str, Any]:
        """The agent found, adding up the ranks' parts, tensors that differ from the published checksums: the
        engine drops its version and waits for an anchor."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "report_drift"):
            return {"ok": False}
        engine.report_drift(list(tensors), by=by)
        return {"ok": True}

    def deltasync_effective(self, checksums: bool = True) -> dict[str, Any]:
        """This rank's effective weights, as the kernels see them, by vLLM module/parameter name.

        vLLM's CPU build repacks linear weights (``weight`` becomes an empty tensor and the GEMM uses a
        packed copy), which ``/weight_checker`` cannot see; here each such layer is read back exactly by
        multiplying an identity matrix through its kernel (one non-zero term per output element). Fused
        layers appear fused (``qkv_proj`` = q, k, v rows) and TP-sliced, as this rank holds them; with LoRA enabled,
        each wrapped layer under its own name (the base weights, not the adapters).

        Args:
            checksums: return ``xxh3_128`` digests (JSON-friendly) instead of tensors.
        """
        import torch

        from ..format import tensor_checksum
        from .plain import kernel_modules, read_through_kernel

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        out: dict[str, Any] = {}
        with torch.no_grad():
            for qualname, module in model.named_modules():
                for pname, p in module.named_parameters(recurse=False):
                    if p.numel():
                        out[f"{qualname}.{pname}"] = p.detach().cpu().clone()
            for qualname, module in kernel_modules(model):
                out[qualname] = read_through_kernel(module)
        # vLLM's LoRA wrappers hold the base layer as ``base_layer``: named as the model's own module
        out = {name.replace(".base_layer.", "."): t for name, t in out.items()}
        out = {name[: -len(".base_layer")] if name.endswith(".base_layer") else name: t for name, t in out.items()}
        if checksums:
            return {name: tensor_checksum(t) for name, t in out.items()}
        return out

    def deltasync_adapter(self) -> dict[str, Any]:
        """Apply mode ``lora``: the adapter this rank serves, ``{"dir": path, "version": int, "checksums": {tensor:
        xxh3_128}}`` of the files vLLM loads it from; ``{}`` in the other modes."""
        engine = getattr(self, "weight_transfer_engine", None)
        adapter = getattr(engine, "adapter", None)
        if adapter is None or not hasattr(adapter, "files"):
            return {}
        files: dict[str, Any] = adapter.files()
        return files

    def deltasync_lora_replace(self, lora_int_id: int, adapter_dir: str) -> dict[str, Any]:
        """Replace the weights of the loaded LoRA adapter ``lora_int_id`` in its slot by the PEFT adapter staged in
        ``adapter_dir`` (:func:`deltasync.vllm.lora_slots.replace_adapter`); never raises: a refusal comes back as
        ``{"ok": False, "refused": message}`` with nothing written, a write that failed part-way as
        ``{"ok": False, "failed": message}`` (the adapter was deactivated)."""
        from .lora_slots import AdapterWriteFailed, replace_adapter

        try:
            return {"ok": True, **replace_adapter(self, int(lora_int_id), str(adapter_dir))}
        except AdapterWriteFailed as exc:  # past the first write: the adapter was deactivated
            return {"ok": False, "failed": f"{type(exc).__name__}: {exc}"[:2000]}
        except Exception as exc:  # noqa: BLE001 - a raising worker desyncs vLLM's executor at TP > 1
            return {"ok": False, "refused": f"{type(exc).__name__}: {exc}"[:2000]}

    def deltasync_lora_buffers(self, lora_int_id: int) -> dict[str, Any]:
        """``xxh3_128`` of every LoRA buffer slot this rank holds for the active adapter ``lora_int_id``
        (:func:`deltasync.vllm.lora_slots.adapter_buffers`); ``{}`` when it is not active."""
        from ..format import tensor_checksum
        from .lora_slots import AdapterRefused, adapter_buffers

        try:
            return {k: tensor_checksum(t) for k, t in adapter_buffers(self, int(lora_int_id)).items()}
        except AdapterRefused:
            return {}


def _track_served_adapter(worker: Any, engine: Any) -> bool:
    """``lora`` mode: make sure this worker records which adapter ids vLLM loads from the served directory (the
    whole-state proof reads them back); whether the engine serves one."""
    adapter = getattr(engine, "adapter", None)
    if adapter is None or not hasattr(adapter, "track"):
        return False
    return bool(adapter.track(worker))
