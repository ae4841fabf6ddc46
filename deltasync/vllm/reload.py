"""vLLM's layerwise reload, limited to the modules an update touched (the ``reload`` apply mode).

vLLM's CPU build repacks linear weights into oneDNN buffers after loading, so a live parameter cannot be
patched; instead the affected modules are reloaded from the shadow (every checkpoint tensor of each: q+k+v,
gate+up), which re-runs ``process_weights_after_loading``, and modules sharing a parameter with a reloaded one
(a tied ``lm_head``) are re-processed too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import ApplyError
from .plain import KERNEL_BLOCK_MACS, KernelRef, kernel_reference
from .shadow import Shadow

__all__ = ["LayerwiseReloader"]

logger = logging.getLogger("vllm.deltasync.reload")


class LayerwiseReloader:
    """Maps checkpoint names to the modules they land in, and reloads those modules from the shadow.

    Args:
        model: the live model.
        model_config: vLLM's model config (for ``finalize_layerwise_reload``).
        shadow: returns the shadow holding the checkpoint tensors.
        reprocess_tied: re-run post-load processing of modules tied to a reloaded one.
        block_macs: the multiply-adds of one block of a repacked module's reference
            (:func:`~deltasync.vllm.plain.kernel_reference`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        shadow: Callable[[], Shadow],
        *,
        reprocess_tied: bool = True,
        block_macs: int = KERNEL_BLOCK_MACS,
    ) -> None:
        self.model, self.model_config, self.shadow = model, model_config, shadow
        self.block_macs = block_macs
        self.reprocess_tied = reprocess_tied
        self._module_of_name: dict[str, str | None] = {}
        self.stats: dict[str, Any] = {}
        self.kernel_refs: dict[str, KernelRef] = {}
        """Module -> the ``xxh3_128`` digests of the weight its loader built from the shadow, in blocks of its input
        columns (:func:`~deltasync.vllm.plain.kernel_reference`), taken right before vLLM's post-load processing
        repacked it: what its kernel must compute with (the engine's proof reads it back)."""

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load: Callable[[Iterable[tuple[str, torch.Tensor]]], object] = getattr(self.model, "load_weights")  # noqa: B009
        load(weights)

    def _swap_loaders(self, recorder_for: Callable[[str], Callable[..., None]]) -> Callable[[], None]:
        """Replace every parameter's weight_loader; returns the function that restores them."""
        from vllm.model_executor.parameter import BasevLLMParameter

        missing = object()
        saved: list[tuple[Any, str, Any]] = []
        for pname, p in self.model.named_parameters():
            if isinstance(p, BasevLLMParameter):
                saved.append((p, "prop", p._weight_loader))
            else:
                saved.append((p, "attr", p.__dict__.get("weight_loader", missing)))
            p.weight_loader = recorder_for(pname)  # type: ignore[attr-defined]

        def restore() -> None:
            for p, kind, orig in saved:
                if kind == "prop":
                    p._weight_loader = orig
                elif orig is missing:
                    del p.weight_loader
                else:
                    p.weight_loader = orig

        return restore

    def modules_of(self, names: Iterable[str]) -> dict[str, str | None]:
        """Checkpoint name -> qualified name of the module its values land in (``None``: unknown).

        A dry run of ``model.load_weights`` with recording loaders: generic over name mapping,
        stacked/fused parameters and tied-weight skipping. Cached.
        """
        names = list(names)
        todo = [n for n in names if n not in self._module_of_name]
        if todo:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            shadow = self.shadow()
            current: list[str] = [""]
            hits: dict[str, set[str]] = {}

            def recorder_for(pname: str) -> Callable[..., None]:
                def record(*args: Any, **kwargs: Any) -> None:
                    hits.setdefault(current[0], set()).add(pname.rpartition(".")[0])

                return record

            restore = self._swap_loaders(recorder_for)
            try:
                with disable_mtp_completeness_check(), torch.no_grad():
                    for n in todo:
                        current[0] = n
                        self._load_weights([(n, shadow.get(n))])
            finally:
                restore()
            for n in todo:
                mods = hits.get(n, set())
                self._module_of_name[n] = next(iter(mods)) if len(mods) == 1 else None
        return {n: self._module_of_name[n] for n in names}

    def reload(self, pending: set[str]) -> None:
        """Reload every module ``pending`` checkpoint names feed (whole model if one maps to no single module).

        Not transactional: a failure part-way leaves modules half reloaded.
        """
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        shadow = self.shadow()
        t0 = time.perf_counter()
        mapping = self.modules_of(pending)
        unmapped = sorted(n for n, m in mapping.items() if m is None)
        if unmapped:
            logger.warning(
                "deltasync: %d names map to no single module (%s): reloading the whole model",
                len(unmapped),
                unmapped[:3],
            )
            names, targets = shadow.names(), {"": self.model}
        else:
            affected = set(mapping.values())
            every = self.modules_of(shadow.names())
            names = [n for n, m in every.items() if m in affected]  # siblings too: q, k, v / gate, up
            targets = {q: self.model.get_submodule(q) for q in sorted(m for m in affected if m is not None)}
        t1 = time.perf_counter()
        for module in targets.values():
            initialize_layerwise_reload(module)
        unwatch = self._watch_processing(targets)
        try:
            with disable_mtp_completeness_check(), torch.no_grad():
                self._load_weights((n, shadow.get(n)) for n in names)
        finally:
            partial = [
                q
                for q, m in targets.items()
                if q and get_layerwise_info(m).can_load() and get_layerwise_info(m).load_numel > 0
            ]
            for module in targets.values():
                finalize_layerwise_reload(module, self.model_config)  # type: ignore[no-untyped-call]
            unwatch()
        if partial:
            raise ApplyError(f"deltasync: modules reloaded with partial data: {partial[:5]}")
        tied = self._reprocess_tied(targets) if self.reprocess_tied and not unmapped else 0
        self.stats = dict(
            reload_modules=len(targets),
            reload_tensors=len(names),
            tied_reprocessed=tied,
            map_s=t1 - t0,
            reload_s=time.perf_counter() - t1,
        )

    def _watch_processing(self, targets: dict[str, torch.nn.Module]) -> Callable[[], None]:
        """Until the returned function is called, record each processed module's freshly loaded weight
        (:attr:`kernel_refs`) before vLLM's post-load processing runs on it."""
        inside = [q for q in targets]
        names: dict[int, str] = {}
        methods: dict[int, Any] = {}
        for qualname, module in self.model.named_modules():
            if not any(q == "" or qualname == q or qualname.startswith(q + ".") for q in inside):
                continue
            method = getattr(module, "quant_method", None)
            if method is None or not hasattr(method, "process_weights_after_loading"):
                continue
            self.kernel_refs.pop(qualname, None)
            names[id(module)] = qualname
            methods.setdefault(id(method), method)
        originals = {key: m.process_weights_after_loading for key, m in methods.items()}

        def watched(original: Callable[..., Any]) -> Callable[..., Any]:
            def process(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                weight = getattr(layer, "weight", None)
                if id(layer) in names and isinstance(weight, torch.Tensor) and weight.numel():
                    self.kernel_refs[names[id(layer)]] = kernel_reference(weight, self.block_macs)
                return original(layer, *args, **kwargs)

            return process

        for key, method in methods.items():
            try:
                method.process_weights_after_loading = watched(originals[key])
            except AttributeError:  # a slotted method object: its modules stay unproven (the engine says so)
                continue

        def unwatch() -> None:
            for method in methods.values():
                method.__dict__.pop("process_weights_after_loading", None)

        return unwatch

    def _reprocess_tied(self, targets: dict[str, torch.nn.Module]) -> int:
        """Modules sharing a parameter with a reloaded one (a tied lm_head) keep derived state, such as the
        CPU build's packed copy in ``lm_head.cpu_linear``; re-run their post-load processing."""
        reloaded = {id(p) for m in targets.values() for p in m.parameters(recurse=False)}
        target_ids = {id(m) for m in targets.values()}
        count = 0
        for qualname, module in self.model.named_modules():
            own = list(module.parameters(recurse=False))
            if id(module) in target_ids or not any(id(p) in reloaded for p in own):
                continue
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
                weight = getattr(module, "weight", None)
                if isinstance(weight, torch.Tensor) and weight.numel():
                    self.kernel_refs[qualname] = kernel_reference(weight, self.block_macs)
                quant_method.process_weights_after_loading(module)
                count += 1
                logger.debug("deltasync: re-processed tied module %s", qualname)
        return count
