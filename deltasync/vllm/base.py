"""The ``deltasync`` engine's state: its init and update messages, the agent's claim, what it serves, its status.

The base of :class:`~deltasync.vllm.engine.DeltaSyncWeightTransferEngine` (see :mod:`deltasync.vllm.engine` for
the modes and the failure semantics); the proofs are in :mod:`deltasync.vllm.proof`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .. import apply
from .._cpus import format_cpu_list, work_cpus
from .._heap import keep_scratch
from .._kernels import warm as warm_kernels
from ..errors import ApplyError, RefusalReason
from ..format import TensorDelta
from ..manifest import AdapterEntry, DeltaManifest, model_fingerprint
from ..vocab import DTYPES
from .patch_map import MapCorruption, PatchMap, build_map
from .plain import plain_parameters
from .reload import LayerwiseReloader
from .shadow import Shadow, spec_from_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["MODES", "DeltaSyncInitInfo", "DeltaSyncUpdateInfo", "EngineBase"]

# The engine's one logger, in each of its modules: vLLM configures the "vllm" logger tree in its processes; a
# "deltasync.*" logger would be silent there.
logger = logging.getLogger("vllm.deltasync.engine")

MODES = ("auto", "inplace", "patches", "reload", "lora")

MAP_AT_START_ENV = "DELTASYNC_MAP_AT_START"
"""``0``: learn the patch map at the first update instead of while vLLM starts (:meth:`EngineBase._map_at_start`)."""


@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine({"init_info": {...}})``: all optional; only the fields given change."""

    mode: str | None = None
    """``auto`` (the default), ``inplace``, ``patches``, ``reload``, or ``lora`` (the engine serves a LoRA
    adapter's versions on its base model, served from ``adapter_dir``)."""
    base_version: int | None = None
    """The version the served weights are (the agent's ``assume_version``); ignored if one is known."""
    base_path: str | None = None
    """Checkpoint directory for the reload shadow (default: the served model's path)."""
    reprocess_tied: bool | None = None
    """Re-run post-load processing of modules tied to a reloaded one (``lm_head``); default on."""
    raise_errors: bool | None = None
    """Raise refusals and failures from the RPCs (the default), or only record them (TP > 1)."""
    model_id: str | None = None
    """The model id this engine serves; objects naming another are refused."""
    staging_root: str | None = None
    """Accept staged files only from under this directory, with no symlink on the way (the agent's staging)."""
    agent_id: str | None = None
    """The claiming agent (required): the engine obeys the first agent that claims it, and that agent only."""
    run_id: str | None = None
    """The run the claiming agent follows: a claim for another run than the one served is refused."""
    allow_rollback: bool | None = None
    """The operator's permission to go below the highest version served, or to another run (fixed at the claim;
    no update message carries it)."""
    session: str | None = None
    """The claiming agent process's session: another process with the same agent id is refused while it lives."""
    ttl_s: float | None = None
    """How long a silent session stays alive."""
    adapter_dir: str | None = None
    """``lora`` mode: the absolute directory the adapter is served from (its requests' ``lora_path``): the engine
    keeps the served version there (vLLM loads it again from there after an eviction)."""
    model_fingerprint: str | None = None
    """The model the claiming agent's run publishes (its newest anchor's fingerprint; for an adapter run, its
    base's): a claim for another model than the one this engine serves is refused before anything changes."""
    release: bool | None = None
    """The claiming agent gives its claim up (its run is not this engine's); honoured only from the owner's own
    session."""

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"init_info.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "lora" and (not isinstance(self.adapter_dir, str) or not os.path.isabs(self.adapter_dir)):
            raise ValueError(
                f"init_info: mode lora needs adapter_dir, the absolute directory the adapter is served from (its "
                f"requests' lora_path), got {self.adapter_dir!r}"
            )


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights({"update_info": {...}})``: a :class:`~deltasync.staging.StagedUpdate` as JSON."""

    objects: list[dict[str, Any]]
    """The staged objects, in apply order (an update carries no policy: see :class:`DeltaSyncInitInfo`)."""


class EngineBase(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    """What one engine is: its state (set up here, in one place), the claim, what it serves, its patch map
    and shadow, and its status; :class:`~deltasync.vllm.engine.DeltaSyncWeightTransferEngine` builds on it."""

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._mode = "auto"
        self.base_path: str | None = None
        self.staging_root: str | None = None
        self.raise_errors = True
        self.version: int | None = None
        self.healthy = True
        self.run_id: str | None = None
        self.high_water: int | None = None
        self.model_id: str | None = None
        self.detail = ""
        self.owner: str | None = None
        """The agent that claimed this engine."""
        self._session: str | None = None
        self._session_seen = 0.0
        self._session_ttl_s = 90.0
        self.allow_rollback = False
        self.outcome: dict[str, Any] = {"ok": True, "refused": None, "message": ""}
        self._shadow: Shadow | None = None
        self._spec: dict[str, tuple[str, tuple[int, ...]]] | None = None
        self._fingerprint_of: object = None
        self._fingerprint_value = ""
        self._reloader = LayerwiseReloader(model, self.model_config, self._get_shadow)
        self._pending: set[str] = set()
        self._staged: apply.Holding | None = None
        self.stats: dict[str, Any] = {}
        self._last_prepare: dict[str, float] = {}
        """The stages of the last ``prepare`` (read, plan, prove), kept for the next session's stats."""
        self.history: list[dict[str, Any]] = []
        self._map: PatchMap | None = None
        self._map_failed: str | None = None
        self._moe_on_cpu: bool | None = None
        self._prepared: tuple[str, list[tuple[DeltaManifest, list[TensorDelta]]], list[Any]] | None = None
        self._readback: list[Any] = []  # the last session's writes, read back by the audit after the pause
        self._served_reads: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """What decoding the session's published objects read of the served values (the proof reuses them)."""
        self._decodes_of: int | None = None
        self._decodes_value = False
        self._manifest: DeltaManifest | None = None  # the served version's: its published checksums
        self._staged_manifest: DeltaManifest | None = None
        self._touched: set[str] = set()  # the last session's tensors, proven in parts after the pause
        self.drift: dict[str, Any] | None = None
        """The last drift found (tensor, version, when): cleared when an anchor restores the engine."""
        self.change_parts: dict[str, Any] = {}
        """TP > 1: the last prepared update's changes to the tensors this rank holds in part (per parameter, as
        sketches), for the agent to add up over the ranks before the first write."""
        self.proofs: dict[str, Any] = {}
        """The last whole-state proof: when, how long, how many tensors."""
        self.adapter_dir: str | None = None
        self.adapter_copy: str | None = None
        """``lora`` mode: this worker's private copy of the served version, which vLLM's loads of the served
        adapter read (written with the served directory, at each session's end)."""
        self._base_fingerprint: str | None = None
        self.keeps_scratch = keep_scratch()
        """Whether this worker's malloc keeps an update's freed scratch memory for the next (:mod:`deltasync._heap`)."""
        self.kernels = "numba" if warm_kernels() else "numpy"
        """What decodes and proves an update before the pause: deltasync's compiled loops (compiled or loaded here,
        at the start, not in the first update) or the numpy code (:mod:`deltasync._kernels`)."""
        self.cpus = format_cpu_list(work_cpus())
        """The cores the decode's and the proof's threads run on (:mod:`deltasync._cpus`); a bad
        ``DELTASYNC_CPUS`` stops the start here, not the first update."""
        if os.environ.get(MAP_AT_START_ENV, "1") != "0" and vllm_config.lora_config is None:
            self._map_at_start()

    def _map_at_start(self) -> None:
        """Learn the patch map while vLLM starts, right after it loads the model and before it serves: the first
        update (often a cold replica's anchor) then pays none of it, and no request waits on it later (a map
        built by an update's ``prepare`` stalls the worker's steps meanwhile). Never raises: a map that cannot
        be built is said in ``status()["map_error"]``, as it would be at the first update. ``lora`` servers
        (``--enable-lora``) and ``DELTASYNC_MAP_AT_START=0`` build it at the first use instead."""
        t0 = time.perf_counter()
        try:
            self.patch_map()
        except ApplyError as exc:  # an unknown checkpoint, or a map that cannot be built (recorded)
            logger.info("deltasync: no patch map at start (%s)", exc)
        except Exception as exc:  # noqa: BLE001 - vLLM must start: the failure is recorded (status "map_error")
            self._map_failed = f"{type(exc).__name__}: {exc}"
            logger.warning("deltasync: no patch map at start (%s); this engine reloads instead", self._map_failed)
        try:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the build's stand-ins: free before vLLM sizes its KV cache
        except Exception as exc:  # noqa: BLE001 - only memory left cached
            logger.info("deltasync: could not free the map build's cached memory (%s)", exc)
        if self._map is not None:
            logger.info("deltasync: patch map built at start in %.1f s", time.perf_counter() - t0)

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        """An agent's claim (:class:`~deltasync.targets.EngineClaim`). A refused claim changes nothing and is only
        recorded (``status()["outcome"]``; the agent reads it): a raising worker desyncs vLLM's executor."""
        if init_info.release:
            if self.owner == init_info.agent_id and self._session == init_info.session:
                logger.warning("deltasync: agent %s gave up its claim (its run is not this engine's)", self.owner)
                self.owner, self._session = None, None
            return
        silent_s = time.monotonic() - self._session_seen
        refusal = apply.refuse_claim(
            owner=self.owner,
            agent_id=init_info.agent_id,
            holding=self.holding(),
            run_id=init_info.run_id,
            allow_rollback=bool(init_info.allow_rollback),
            owner_alive_s=silent_s if self._session is not None and silent_s < self._session_ttl_s else None,
            same_session=init_info.session == self._session,
        )
        reason = RefusalReason.RUN
        if refusal is None:
            refusal, reason = self._refuse_model(init_info), RefusalReason.MODEL
        if refusal is None and init_info.mode == "lora" and self.vllm_config.lora_config is None:
            refusal, reason = (
                f"deltasync: agent {init_info.agent_id!r} claims this engine in apply mode lora, but vLLM was started "
                "without LoRA (--enable-lora): nothing was changed (start vLLM with --enable-lora, or point the agent "
                "at an engine that serves adapters)",
                RefusalReason.UNSUPPORTED,
            )
        if refusal is not None:
            self.outcome = {"ok": False, "refused": reason.value, "message": refusal}
            logger.warning("%s", refusal)
            return
        self.owner, self._session = init_info.agent_id, init_info.session
        self._session_seen = time.monotonic()
        if init_info.ttl_s is not None:
            self._session_ttl_s = init_info.ttl_s
        if init_info.allow_rollback is not None:
            self.allow_rollback = init_info.allow_rollback
        if init_info.mode is not None:
            self._mode = init_info.mode
        if init_info.mode == "lora" and init_info.adapter_dir != self.adapter_dir:
            self.adapter_dir = self.base_path = init_info.adapter_dir
            self._shadow, self._spec, self.adapter_copy = None, None, None
        if init_info.base_path is not None:
            self.base_path, self._shadow, self._spec = init_info.base_path, None, None
        if init_info.reprocess_tied is not None:
            self._reloader.reprocess_tied = init_info.reprocess_tied
        if init_info.raise_errors is not None:
            self.raise_errors = init_info.raise_errors
        if init_info.model_id is not None:
            self.model_id = init_info.model_id
        if init_info.staging_root is not None:
            self.staging_root = init_info.staging_root
        if init_info.base_version is not None and self.version is None and self.healthy:
            self.version = self.high_water = init_info.base_version
        self.outcome = {"ok": True, "refused": None, "message": ""}
        logger.info(
            "deltasync: agent %s: mode=%s version=%s raise_errors=%s allow_rollback=%s",
            self.owner,
            self.mode,
            self.version,
            self.raise_errors,
            self.allow_rollback,
        )

    def _refuse_model(self, init_info: DeltaSyncInitInfo) -> str | None:
        """:func:`~deltasync.apply.refuse_model` for this claim, against the model served in the claimed mode."""
        lora = (init_info.mode or self._mode) == "lora"
        spec = None if lora else self.served_spec()
        served = self.base_fingerprint() if lora else (None if spec is None else self._fingerprint(spec))
        return apply.refuse_model(
            agent_id=init_info.agent_id, wanted=init_info.model_fingerprint, served=served, adapter=lora
        )

    def release_unadmitted(self, reason: RefusalReason) -> None:
        """The claiming agent's update was refused (:func:`~deltasync.apply.releases_claim`): its claim is
        released at once, so that the engine's own agent takes it."""
        if self.owner is not None and apply.releases_claim(reason, self.holding()):
            logger.warning(
                "deltasync: agent %s's objects are for another model or run than this engine serves: its claim is "
                "released",
                self.owner,
            )
            self.owner, self._session = None, None

    @property
    def mode(self) -> str:
        """The apply mode in use (``auto`` resolved)."""
        if self._mode == "inplace" and self._map_failed:
            return "reload"  # said in status()["map_error"]
        if self._mode == "lora":
            return "lora"
        if self._mode != "auto":
            return self._mode
        if self.vllm_config.quant_config is not None or self._map_failed:
            return "reload"
        return "inplace" if plain_parameters(self.model)[0] else "reload"

    def _untrusted(self, param: str) -> str | None:
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

    def patch_map(self) -> PatchMap:
        """The engine's map (built on first use: one probe pass through the model's loader, outside any pause
        when the agent prepares its first update)."""
        if self._map is None:
            spec = self.served_spec()
            if spec is None:
                raise ApplyError("deltasync: the served model's checkpoint names are unknown; send an anchor first")
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            load = getattr(self.model, "load_weights")  # noqa: B009

            def load_probe(weights: Any) -> None:
                with disable_mtp_completeness_check(), torch.no_grad():
                    load(weights)

            try:
                self._map = build_map(self.model, spec, load_probe, self._untrusted)
            except Exception as exc:
                self._map_failed = f"{type(exc).__name__}: {exc}"
                logger.warning("deltasync: no patch map (%s); this engine reloads instead", self._map_failed)
                if isinstance(exc, MapCorruption):  # probing changed live weights: never serve them
                    self._mark_unhealthy(str(exc))
                raise ApplyError(f"deltasync: the patch map could not be built ({self._map_failed})") from exc
        return self._map

    def decodes(self) -> bool:
        """Whether this engine decodes published objects against what it serves (its agent then stages them as
        fetched and keeps no copy of the model). Reload mode reads its shadow; in place, each rank reads its live
        parameters: one rank must hold every tensor whole, and with tensor parallelism each rank decodes the
        elements it holds (the ranks' changes are added up before the first write: :meth:`_prove`). Without a map
        yet (built by the first update, whose anchor needs no base) this is a promise :meth:`_undecodable` keeps
        per tensor. Pipeline parallel ranks hold no part of some tensors: their agent decodes."""
        if self.mode in ("reload", "lora"):
            return True
        if self.mode != "inplace" or self.vllm_config.parallel_config.pipeline_parallel_size != 1:
            return False
        spec = self.served_spec()
        if self._map is None or spec is None:
            return True
        if self._decodes_of != id(self._map):  # status is polled several times a sync: judged once per map
            self._decodes_of = id(self._map)
            self._decodes_value = all(self._undecodable(n) is None for n in spec)
        return self._decodes_value

    def _undecodable(self, name: str) -> str | None:
        """Why this engine cannot read what it serves of checkpoint tensor ``name`` (``None``: it can)."""
        spec = self.served_spec()
        if spec is None or name not in spec:
            return "not a tensor of the served model"
        if self.mode in ("reload", "lora"):
            return None if name in self._get_shadow() else "not in the shadow"
        if self.mode != "inplace":
            return f"apply mode {self.mode}"
        pm = self.patch_map()
        if name in pm:
            dtype, shape = spec[name]
            if not self._tensor_parallel() and not pm.holds_whole(name, math.prod(shape)):
                return "this engine's one rank holds it in part"
            if any(pm.param(p).dtype != DTYPES[dtype] for p in pm.params_of(name)):
                return f"its parameters are not {dtype}"
            return None
        # modules the map cannot hold are reloaded from the shadow, which every update then keeps current
        return None if pm.unmapped and name in self._get_shadow() else "the patch map does not hold it"

    def _tensor_parallel(self) -> bool:
        return int(self.vllm_config.parallel_config.tensor_parallel_size) > 1

    def _holds(self, name: str, indices: torch.Tensor) -> torch.Tensor | None:
        """Which of checkpoint tensor ``name``'s sorted flat ``indices`` this rank holds in place (a bool tensor),
        or ``None`` where it holds the whole tensor (or reads it from its shadow). A rank that holds part of a
        tensor always answers a mask, even one that holds every element asked for: its changes are then added
        up with the other ranks' (:meth:`_prove`), never taken as a whole tensor's."""
        pm, spec = self._map, self.served_spec()
        if pm is None or spec is None or name not in pm or pm.holds_whole(name, math.prod(spec[name][1])):
            return None
        mask = torch.zeros(indices.numel(), dtype=torch.bool)
        for r in pm.runs[name]:
            mask |= r.locate(indices)[0]
        return mask

    def _get_shadow(self) -> Shadow:
        if self._shadow is None:
            self._shadow = Shadow(self.base_path or self.model_config.model)
        return self._shadow

    def served_spec(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """What this engine serves (checkpoint name -> dtype, shape): from the served checkpoint's headers, an
        applied anchor, or, for a checkpoint-less (dummy) engine, its architecture; ``None`` if unknown."""
        if self._spec is None:
            if self.mode == "lora" and self.version is None:
                # the adapter in the directory is a placeholder until the first anchor (vLLM casts adapters to its
                # own dtype, so PEFT's float32 files serve as well): its configuration is checked, not its spec
                return None
            shadow = self._get_shadow()
            if not shadow.empty:
                self._spec = shadow.spec()
            elif self.mode == "lora":
                return None  # no adapter served yet: the first anchor defines it
            else:
                dtype = self.model_config.dtype
                self._spec = spec_from_config(
                    self.model_config.hf_config, dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
                )
        return self._spec

    def _fingerprint(self, spec: dict[str, tuple[str, tuple[int, ...]]]) -> str:
        if self._fingerprint_of is not spec:  # computed once per spec object (status is polled every sync)
            self._fingerprint_of, self._fingerprint_value = spec, model_fingerprint(spec)
        return self._fingerprint_value

    def base_fingerprint(self) -> str | None:
        """The fingerprint of the base model this engine serves (``lora`` mode serves adapters on it): from its
        checkpoint's headers or, without one, its architecture; ``None`` if unknown."""
        if self._base_fingerprint is None:
            shadow = Shadow(self.model_config.model)
            if not shadow.empty:
                spec: dict[str, tuple[str, tuple[int, ...]]] | None = shadow.spec()
            else:
                dtype = self.model_config.dtype
                spec = spec_from_config(
                    self.model_config.hf_config, dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
                )
            self._base_fingerprint = None if spec is None else model_fingerprint(spec)
        return self._base_fingerprint

    def served_adapter(self) -> AdapterEntry | None:
        """``lora`` mode: the adapter served (the last applied object's, or the one in ``adapter_dir`` at the
        claim); ``None``: none yet (the first anchor defines it) or not ``lora`` mode."""
        if self.mode != "lora":
            return None
        if self._manifest is not None and self._manifest.adapter is not None:
            return self._manifest.adapter
        base = self.base_fingerprint()
        if self.adapter_dir is None or base is None:
            return None
        from .lora_slots import read_adapter_config

        return read_adapter_config(self.adapter_dir, base)

    def holding(self) -> apply.Holding:
        """What this engine holds, for admission."""
        spec = self.served_spec()
        lora = self.mode == "lora"
        return apply.Holding(
            adapter_base=(self.base_fingerprint() or "unknown") if lora else None,
            adapter=self.served_adapter() if lora else None,
            version=self.version,
            healthy=self.healthy,
            spec=spec,
            fingerprint=None if spec is None else self._fingerprint(spec),
            model_id=self.model_id,
            run_id=self.run_id,
            high_water=self.high_water,
        )

    def touch(self, session: str | None) -> None:
        """The owner's session is alive (its agent read the status)."""
        if session is not None and session == self._session:
            self._session_seen = time.monotonic()

    def status(self) -> dict[str, Any]:
        """What the worker extension reports (``deltasync_status``)."""
        spec = self.served_spec()
        return {
            "engine": type(self).__name__,
            "mode": self.mode,
            "version": self.version,
            "healthy": self.healthy,
            "run_id": self.run_id,
            "high_water": self.high_water,
            "fingerprint": None if spec is None else self._fingerprint(spec),
            "model_id": self.model_id,
            "agent": self.owner,
            "allow_rollback": self.allow_rollback,
            "outcome": dict(self.outcome),
            "map": None if self._map is None else self._map.summary(),
            "kernels": self.kernels,
            "cpus": self.cpus,
            "map_error": self._map_failed,
            "decodes": self.decodes(),
            "adapter": None
            if self.mode != "lora"
            else {
                "dir": self.adapter_dir,
                "base_fingerprint": self.base_fingerprint(),
                "served": None if (a := self.served_adapter()) is None else a.to_dict(),
            },
            "detail": self.detail,
            "drift": self.drift,
            "proofs": dict(self.proofs),
            "history": self.history[-8:],
            "memory": None if (m := _memory()) is None else {**m, "keeps_scratch": self.keeps_scratch},
        }

    def _mark_unhealthy(self, why: str) -> None:
        self.healthy, self.version, self._staged, self._manifest = False, None, None, None
        self.detail = f"unhealthy: {why}; only an anchor restores this engine"

    def _fail_unhealthy(self, why: str) -> None:
        """:meth:`_mark_unhealthy`, recorded as the outcome (``status()["outcome"]``): a failure no RPC raises."""
        self._mark_unhealthy(why)
        self.outcome = {"ok": False, "refused": None, "message": self.detail}


def _memory() -> dict[str, float] | None:
    """This worker's resident memory and its peak so far, in MiB (Linux ``/proc``; ``None`` elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        rss, peak = (int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))
        return {"rss_mib": rss, "peak_mib": peak, "pid": os.getpid()}
    except (OSError, KeyError, ValueError):
        return None
