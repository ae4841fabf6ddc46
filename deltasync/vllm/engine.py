"""The ``deltasync`` weight-transfer engine: applies verified deltas to a running vLLM, bit-exact.

One instance per vLLM worker (per TP/PP rank). ``update_info`` names shard files the agent has already
fetched, verified and staged locally in the ``raw`` encoding (docs/FORMAT.md); every rank reads the same
files, in checkpoint coordinates, and the model's own loader does name mapping, TP slicing and fusion.

Modes:

* ``reload`` (vLLM's CPU build, quantized models): a host shadow of the checkpoint, in checkpoint names,
  receives the delta (after full validation); ``finish_weight_update`` then re-runs vLLM's layerwise reload
  for the affected modules only, feeding every checkpoint tensor of each (q+k+v, gate+up), which re-runs
  ``process_weights_after_loading`` (the CPU repack), and re-processes modules that share a parameter with a
  reloaded one (a tied ``lm_head``). The shadow starts lazily from the model's safetensors, or from an anchor.
* ``inplace`` (GPU, unquantized): vLLM's ``load_checkpoint_weight_patches`` writes the values into the live
  parameters through the model's own loader.
* ``auto``: ``reload`` on CPU, with a quantization config, or when a parameter was repacked away; else
  ``inplace``.

A delta whose ``base_version`` is not this engine's version is refused before anything is written.
Failure semantics: validation errors leave the weights untouched; an error after the first write marks the
engine unhealthy (``version`` becomes unknown) and raises ``ApplyError``: resync from an anchor.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..errors import ApplyError, FormatError, IntegrityError, VersionGapError
from ..format import TensorDelta, decode_shard, tensor_checksum
from ..versions import assemble_anchor

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["DeltaSyncInitInfo", "DeltaSyncUpdateInfo", "DeltaSyncWeightTransferEngine"]

# vLLM configures the "vllm" logger tree in its processes; a "deltasync.*" logger would be silent there.
logger = logging.getLogger("vllm.deltasync.engine")

MODES = ("auto", "inplace", "reload")


@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine({"init_info": {...}})``: all optional."""

    mode: str = "auto"
    """``auto``, ``inplace`` or ``reload``."""
    base_version: int | None = None
    """The version the served weights hold now (``None``: unknown, the first update must be an anchor)."""
    base_path: str | None = None
    """Checkpoint directory for the reload shadow (default: the served model's path)."""
    reprocess_tied: bool = True
    """Re-run post-load processing of modules tied to a reloaded one (``lm_head``)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"init_info.mode must be one of {MODES}, got {self.mode!r}")


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights({"update_info": {...}})``: one published object, staged as raw shard files."""

    files: list[str]
    """Local paths of the staged shard files (raw encoding)."""
    kind: str
    """``delta`` or ``anchor``."""
    target_version: int
    """The version the object produces."""
    base_version: int | None = None
    """A delta's base: the engine must hold exactly this version."""
    checksums: dict[str, list[list[Any]]] = field(default_factory=dict)
    """Per tensor ``[[start, stop, digest], ...]`` of the target version, checked after applying."""

    def __post_init__(self) -> None:
        if self.kind not in ("delta", "anchor"):
            raise ValueError(f"update_info.kind must be 'delta' or 'anchor', got {self.kind!r}")
        if self.kind == "delta" and self.base_version is None:
            raise ValueError("update_info.base_version is required for a delta")
        if not self.files and self.kind == "anchor":
            raise ValueError("update_info.files is empty: an anchor has at least one shard")


class _Shadow:
    """Host copy of the checkpoint in checkpoint names: lazily read from safetensors, copy-on-write."""

    def __init__(self, path: str | None) -> None:
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        if path is None or not os.path.isdir(path):
            return
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = [os.path.join(path, x) for x in sorted(set(json.load(f)["weight_map"].values()))]
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        from safetensors import safe_open

        for file in files:
            handle = self._handles[file] = safe_open(file, framework="pt", device="cpu")
            for key in handle.keys():  # type: ignore[no-untyped-call]
                self._where[key] = file

    def names(self) -> list[str]:
        return sorted(set(self._where) | set(self.tensors))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self._where

    def get(self, name: str) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            t = self._handles[self._where[name]].get_tensor(name)
        return t

    def materialize(self, name: str) -> torch.Tensor:
        """A writable tensor owned by the shadow."""
        t = self.tensors.get(name)
        if t is None:
            t = self.tensors[name] = self.get(name).clone()
        return t

    def replace_all(self, tensors: dict[str, torch.Tensor]) -> None:
        """Become exactly ``tensors`` (an anchor)."""
        self._handles, self._where, self.tensors = {}, {}, tensors


class DeltaSyncWeightTransferEngine(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    """The ``deltasync`` backend. Not thread-safe: vLLM drives it from the worker's RPC loop."""

    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.opts = DeltaSyncInitInfo()
        self.version: int | None = None
        self.healthy = True
        self._shadow: _Shadow | None = None
        self._module_of_name: dict[str, str | None] = {}
        self._pending: set[str] = set()
        self._staged: int | None = None
        self.stats: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ lifecycle

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        self.opts = init_info
        self.version = init_info.base_version
        self.healthy = True
        self._shadow = None
        logger.info("deltasync: mode=%s base_version=%s", self.mode, self.version)

    @property
    def mode(self) -> str:
        """The apply mode in use (``auto`` resolved)."""
        if self.opts.mode != "auto":
            return self.opts.mode
        from vllm.platforms import current_platform

        if current_platform.is_cpu() or self.vllm_config.quant_config is not None:
            return "reload"
        if any(p.numel() == 0 for p in self.model.parameters()):
            return "reload"
        return "inplace"

    def status(self) -> dict[str, Any]:
        """What the worker extension reports."""
        return {
            "engine": type(self).__name__,
            "mode": self.mode,
            "version": self.version,
            "healthy": self.healthy,
            "history": self.history[-8:],
        }

    def start_weight_update(self) -> None:
        # No layerwise reload here (it would move every layer to the meta device): reload mode
        # runs it in finish_weight_update, for the affected modules only.
        if self._staged is not None or self._pending:
            # a session that applied something and never finished (an update failed and vLLM dropped
            # the session): the shadow is ahead of the model, so only an anchor can be trusted now
            logger.warning("deltasync: the previous update session never finished; an anchor is needed")
            self._mark_unhealthy()
        self._pending.clear()
        self._staged = None
        self.stats = {"mode": self.mode, "objects": 0, "tensors": 0, "values": 0, "t0": time.perf_counter()}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        """Validate the object completely, then apply it (to the shadow, or in place).

        Raises:
            VersionGapError: a delta's base is not the version this engine holds (nothing written).
            FormatError: a file is malformed or for another model (nothing written).
            ApplyError: a failure after the first write; the engine must be resynced from an anchor.
        """
        info = update_info
        held = self._staged if self._staged is not None else self.version
        if info.kind == "delta" and (held is None or held != info.base_version):
            raise VersionGapError(
                f"deltasync: delta v{info.base_version} -> v{info.target_version} refused: this engine holds "
                f"{'an unknown version' if held is None else f'v{held}'}; apply an anchor or the right delta"
            )
        if not self.healthy and info.kind != "anchor":
            raise ApplyError("deltasync: this engine is unhealthy after a failed update; apply an anchor")
        t0 = time.perf_counter()
        deltas = self._read(info)
        t1 = time.perf_counter()
        if self.mode == "reload":
            self._check_against_shadow(deltas, info)
        try:
            if self.mode == "reload":
                self._apply_to_shadow(deltas, info)
            else:
                self._apply_inplace(deltas)
        except (FormatError, ValueError, RuntimeError, KeyError) as exc:
            self._mark_unhealthy()
            raise ApplyError(
                f"deltasync: applying v{info.target_version} failed part-way ({exc}); the engine needs an anchor"
            ) from exc
        self._staged = info.target_version
        s = self.stats
        s["objects"] += 1
        s["tensors"] += len(deltas)
        s["values"] += sum(d.nnz for d in deltas)
        s["read_s"] = s.get("read_s", 0.0) + (t1 - t0)
        s["apply_s"] = s.get("apply_s", 0.0) + (time.perf_counter() - t1)

    def finish_weight_update(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.mode == "reload" and self._pending:
                self._reload_pending()
        except Exception as exc:  # the model may be half reloaded: never serve it as a known version
            self._mark_unhealthy()
            raise ApplyError(f"deltasync: reload failed ({exc}); the engine needs an anchor") from exc
        finally:
            self._pending.clear()
        if self._staged is not None:
            self.version = self._staged
            self._staged = None
        s = self.stats
        s["finish_s"] = time.perf_counter() - t0
        s["total_s"] = time.perf_counter() - s.pop("t0", t0)
        s["version"] = self.version
        self.history.append(dict(s))
        logger.info("deltasync: now at v%s: %s", self.version, s)

    def shutdown(self) -> None:
        self._shadow = None

    def _mark_unhealthy(self) -> None:
        self.healthy = False
        self.version = None
        self._staged = None

    # ------------------------------------------------------------------ reading

    def _read(self, info: DeltaSyncUpdateInfo) -> list[TensorDelta]:
        out: list[TensorDelta] = []
        for path in info.files:
            try:
                with open(path, "rb") as f:
                    data = bytearray(f.read())
            except OSError as exc:
                raise FormatError(f"{path}: cannot read the staged shard ({exc})") from exc
            header, deltas = decode_shard(data, name=path)
            got = (header.kind, header.base_version, header.target_version)
            want = (info.kind, info.base_version, info.target_version)
            if header.encoding != "raw" or got != want:
                raise FormatError(f"{path}: shard is {header.encoding} {got}, update_info says raw {want}")
            out.extend(deltas.values())
        return out

    # ------------------------------------------------------------------ reload mode

    def _get_shadow(self) -> _Shadow:
        if self._shadow is None:
            self._shadow = _Shadow(self.opts.base_path or self.model_config.model)
        return self._shadow

    def _check_against_shadow(self, deltas: list[TensorDelta], info: DeltaSyncUpdateInfo) -> None:
        if info.kind == "anchor":
            return
        shadow = self._get_shadow()
        for d in deltas:
            if d.ckpt_name not in shadow:
                raise FormatError(
                    f"deltasync: tensor {d.ckpt_name!r} is not in the served checkpoint (a delta for another model?)"
                )
            held = shadow.get(d.ckpt_name)
            if tuple(held.shape) != d.shape or held.dtype != d.dtype:
                raise FormatError(
                    f"deltasync: tensor {d.ckpt_name!r} is {held.dtype} {list(held.shape)} here, the "
                    f"delta has {d.dtype} {list(d.shape)} (a delta for another model?)"
                )

    def _apply_to_shadow(self, deltas: list[TensorDelta], info: DeltaSyncUpdateInfo) -> None:
        shadow = self._get_shadow()
        if info.kind == "anchor":
            full = assemble_anchor(deltas)
            shadow.replace_all(full)
            self._pending.update(full)
        else:
            for d in deltas:
                t = shadow.materialize(d.ckpt_name).view(-1)
                if d.indices is not None:
                    t[d.indices] = d.values
                elif d.span is not None:
                    t[d.span[0] : d.span[1]] = d.values
                else:
                    t.copy_(d.values.reshape(-1))
                self._pending.add(d.ckpt_name)
        bad = [
            name
            for name, parts in info.checksums.items()
            if name in shadow and any(tensor_checksum(shadow.get(name), (a, b)) != digest for a, b, digest in parts)
        ]
        if bad:
            raise IntegrityError(
                f"deltasync: after v{info.target_version} the shadow differs from the published "
                f"checksums for {bad[:5]} ({len(bad)} tensors)"
            )

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

    def _modules_of(self, names: Iterable[str]) -> dict[str, str | None]:
        """Checkpoint name -> qualified name of the module its values land in (``None``: unknown).

        A dry run of ``model.load_weights`` with recording loaders: generic over name mapping,
        stacked/fused parameters and tied-weight skipping. Cached.
        """
        names = list(names)
        todo = [n for n in names if n not in self._module_of_name]
        if todo:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            shadow = self._get_shadow()
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

    def _reload_pending(self) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        shadow = self._get_shadow()
        t0 = time.perf_counter()
        mapping = self._modules_of(self._pending)
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
            every = self._modules_of(shadow.names())
            names = [n for n, m in every.items() if m in affected]  # siblings too: q, k, v / gate, up
            targets = {q: self.model.get_submodule(q) for q in sorted(m for m in affected if m is not None)}
        t1 = time.perf_counter()
        for module in targets.values():
            initialize_layerwise_reload(module)
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
        if partial:
            raise ApplyError(f"deltasync: modules reloaded with partial data: {partial[:5]}")
        tied = self._reprocess_tied(targets) if self.opts.reprocess_tied and not unmapped else 0
        self.stats.update(
            reload_modules=len(targets),
            reload_tensors=len(names),
            tied_reprocessed=tied,
            map_s=t1 - t0,
            reload_s=time.perf_counter() - t1,
        )

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
                quant_method.process_weights_after_loading(module)
                count += 1
                logger.debug("deltasync: re-processed tied module %s", qualname)
        return count

    # ------------------------------------------------------------------ inplace mode

    def _apply_inplace(self, deltas: list[TensorDelta]) -> None:
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
