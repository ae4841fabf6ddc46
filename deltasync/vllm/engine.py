"""The ``deltasync`` weight-transfer engine: applies verified objects to a running vLLM, bit-exact.

One instance per vLLM worker (per TP/PP rank), registered by :mod:`deltasync.vllm.plugin`. ``update_info`` is a
:class:`~deltasync.staging.StagedUpdate`: the objects of a plan, staged by the agent as verified manifests plus
shards in checkpoint names; every rank reads the same files.

The engine holds its parts, each with one job; what ``self`` holds is these and vLLM's own fields:

* :class:`~deltasync.vllm.claim.Claim`: the agent that claimed it, its session, and the policy its claim fixed;
* :class:`~deltasync.vllm.label.Label`: what it serves (version, health, run, highest version, drift) and the
  outcome of its last call;
* :class:`~deltasync.vllm.model.ServedModel`: the served model's spec and apply mode, the shadow, the reloader and
  the patch map's lifecycle;
* :class:`~deltasync.vllm.adapter.ServedAdapter`: ``lora`` mode's served directories;
* :class:`~deltasync.vllm.proof.Prover`: the proofs (before the first write, the audit, the whole state, drift);
* :class:`~deltasync.vllm.applier.Applier`: the update sessions (prepare, receive in each mode, finish).

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
  names the directory it is served from, its requests' ``lora_path``): :mod:`deltasync.vllm.adapter`. Objects
  for another base model or another adapter (rank, alpha, target modules) are refused before the first write; a
  model's own weights are never taken in this mode, nor an adapter's in the others.

Failure semantics (the one rule of :mod:`deltasync.apply`; :mod:`deltasync.vllm.applier`): a refusal leaves
weights, health and label untouched and is recorded as a structured outcome (``deltasync_status``); a failure
past the first write marks the engine unhealthy, and only an anchor restores it. With
``init_info.raise_errors=False`` (the agent sets it for TP > 1, where a raising worker desyncs vLLM's executor,
vLLM #49972) failures are only recorded, never raised; ``finish_weight_update`` never raises after a failure, so
vLLM never keeps a dangling session.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from .. import apply
from .._cpus import format_cpu_list, use_cpus, work_cpus
from .._heap import keep_scratch
from .._kernels import use_compiled
from .._kernels import warm as warm_kernels
from ..errors import ApplyError, RefusalReason, UpdateRefused
from ..staging import StagedUpdate
from .adapter import ServedAdapter
from .applier import Applier
from .claim import Claim
from .config import EngineConfig
from .label import Label
from .messages import DeltaSyncInitInfo, DeltaSyncUpdateInfo
from .model import ServedModel
from .proof import Prover

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["DeltaSyncInitInfo", "DeltaSyncUpdateInfo", "DeltaSyncWeightTransferEngine"]

# The engine's one logger, in each of its modules: vLLM configures the "vllm" logger tree in its processes; a
# "deltasync.*" logger would be silent there.
logger = logging.getLogger("vllm.deltasync.engine")


class DeltaSyncWeightTransferEngine(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    """The ``deltasync`` backend. Not thread-safe: vLLM drives it from the worker's RPC loop.

    Args:
        config: vLLM's weight-transfer configuration.
        vllm_config: vLLM's configuration of this worker.
        device: where the model's parameters live.
        model: the live model.
        settings: the engine's settings (default: read from the environment, :meth:`EngineConfig.from_env`).
    """

    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
        settings: EngineConfig | None = None,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.settings = EngineConfig.from_env() if settings is None else settings
        """The engine's settings, read once here (a bad one stops vLLM's start, not the first update)."""
        self.claim = Claim()
        self.label = Label()
        self.served = ServedModel(model, device, vllm_config, self.settings, self.label)
        self.adapter = ServedAdapter(self.served, self.label, vllm_config.lora_config)
        self.prover = Prover(self.served, self.label, self.adapter)
        self.applier = Applier(self.served, self.label, self.claim, self.prover, self.adapter)
        self.keeps_scratch = keep_scratch(self.settings.keep_mib)
        """Whether this worker's malloc keeps an update's freed scratch memory for the next (:mod:`deltasync._heap`)."""
        use_compiled(self.settings.kernels == "numba")
        self.kernels = "numba" if warm_kernels() else "numpy"
        """What decodes and proves an update before the pause: deltasync's compiled loops (compiled or loaded here,
        at the start, not in the first update) or the numpy code (:mod:`deltasync._kernels`)."""
        use_cpus(self.settings.cpus)
        self.cpus = format_cpu_list(work_cpus())
        """The cores the decode's and the proof's threads run on (:mod:`deltasync._cpus`)."""
        if self.settings.map_at_start and vllm_config.lora_config is None:
            self.served.map_at_start()

    # ------------------------------------------------------------------ the claim

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        """An agent's claim (:class:`~deltasync.targets.EngineClaim`). A refused claim changes nothing and is only
        recorded (``status()["outcome"]``; the agent reads it): a raising worker desyncs vLLM's executor."""
        if init_info.release:
            self.claim.release(init_info.agent_id, init_info.session)
            return
        refused = self._refuse_claim(init_info)
        if refused is not None:
            reason, message = refused
            self.label.record(reason, message)
            logger.warning("%s", message)
            return
        self.claim.take(init_info)
        if init_info.mode is not None:
            self.served.requested = init_info.mode
        if init_info.mode == "lora" and init_info.adapter_dir is not None:
            self.adapter.serve_from(init_info.adapter_dir)
        if init_info.base_path is not None:
            self.served.set_source(init_info.base_path)
        if init_info.reprocess_tied is not None:
            self.served.reloader.reprocess_tied = init_info.reprocess_tied
        if init_info.model_id is not None:
            self.label.model_id = init_info.model_id
        if init_info.base_version is not None:
            self.label.assume(init_info.base_version)
        self.label.clear_outcome()
        logger.info(
            "deltasync: agent %s: mode=%s version=%s raise_errors=%s allow_rollback=%s",
            self.claim.owner,
            self.served.mode,
            self.label.version,
            self.claim.raise_errors,
            self.claim.allow_rollback,
        )

    def _refuse_claim(self, info: DeltaSyncInitInfo) -> tuple[RefusalReason, str] | None:
        """Why the claim must be refused, for which reason: its agent or run (:meth:`Claim.refusal`), its model
        (:func:`~deltasync.apply.refuse_model`, against the model served in the claimed mode), or a mode this vLLM
        cannot serve."""
        refusal = self.claim.refusal(info, self.applier.holding())
        if refusal is not None:
            return RefusalReason.RUN, refusal
        lora = (info.mode or self.served.requested) == "lora"
        served = self.served.base_fingerprint() if lora else self.served.fingerprint()
        refusal = apply.refuse_model(agent_id=info.agent_id, wanted=info.model_fingerprint, served=served, adapter=lora)
        if refusal is not None:
            return RefusalReason.MODEL, refusal
        if info.mode == "lora" and self.vllm_config.lora_config is None:
            return RefusalReason.UNSUPPORTED, (
                f"deltasync: agent {info.agent_id!r} claims this engine in apply mode lora, but vLLM was started "
                "without LoRA (--enable-lora): nothing was changed (start vLLM with --enable-lora, or point the agent "
                "at an engine that serves adapters)"
            )
        return None

    def touch(self, session: str | None) -> None:
        """The owner's session is alive (its agent read the status)."""
        self.claim.touch(session)

    # ------------------------------------------------------------------ the session (vLLM's lifecycle)

    def start_weight_update(self) -> None:
        self.applier.start()

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltaSyncUpdateInfo:
        """vLLM's parse, after deltasync's own check (which names what an update may carry)."""
        StagedUpdate.from_update_info(update_dict)
        return super().parse_update_info(update_dict)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch.
        try:
            info = self.parse_update_info(update_info)
        except ValueError as exc:  # unknown fields (a message that tries to carry policy): refused, recorded
            self._fail(UpdateRefused(f"deltasync: {exc}", reason=RefusalReason.MALFORMED))
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
        try:
            return self.applier.prepare(update_info)
        except UpdateRefused as exc:  # recorded as a refused update is (the agent stops here, before the pause)
            outcome = self.label.record(exc.reason, str(exc))
            logger.warning("deltasync: %s", exc)
            self.claim.release_unadmitted(exc.reason, self.applier.holding())
            return outcome
        except Exception as exc:  # noqa: BLE001 - update_weights repeats the work and reports it
            return {"ok": False, "refused": None, "message": f"{type(exc).__name__}: {exc}"}

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        """Validate the whole update, then write it (in place, to the shadow, or as patches).

        Raises (unless ``raise_errors`` is off; the outcome is recorded either way):
            UpdateRefused: refused before any write (``VersionGapError`` for a wrong base).
            ApplyError: a failure after the first write; the engine needs an anchor.
        """
        try:
            self.applier.receive(update_info.objects)
        except (UpdateRefused, ApplyError) as exc:
            self._fail(exc)
        except Exception as exc:  # FormatError included: a malformed staged file; nothing is written yet
            self._fail(UpdateRefused(f"deltasync: {type(exc).__name__}: {exc}", reason=RefusalReason.MALFORMED))

    def finish_weight_update(self) -> None:
        self.applier.finish()

    def shutdown(self) -> None:
        self.served.drop_shadow()

    def _fail(self, exc: UpdateRefused | ApplyError) -> None:
        """Record a failed update's outcome; raise it unless the claim turned ``raise_errors`` off."""
        refused = exc.reason if isinstance(exc, UpdateRefused) else None
        self.label.record(refused, str(exc))
        logger.warning("deltasync: %s", exc)
        if refused is not None:
            self.claim.release_unadmitted(refused, self.applier.holding())
        if self.claim.raise_errors:
            raise exc

    # ------------------------------------------------------------------ proofs

    def audit(self, proven: list[str] | None = None) -> dict[str, Any]:
        """The last update read back (the ``deltasync_audit`` RPC): :meth:`Prover.audit`."""
        return self.prover.audit(self.applier.take_written(), proven)

    def prove_state(
        self,
        names: list[str] | None = None,
        windows: list[tuple[str, int, int]] | None = None,
        extras: bool | None = None,
        kernels: bool = True,
    ) -> dict[str, Any]:
        """What this rank serves, proven against the published checksums (the ``deltasync_prove`` RPC), whole or
        in a sliced audit's windows: :meth:`Prover.prove_state`. Never raises."""
        return self.prover.prove_state(names, windows, extras, kernels)

    def prove_slots(self, worker: Any) -> tuple[list[str], int]:
        """``lora`` mode: the served adapter's slots in vLLM's LoRA buffers (:meth:`Prover.prove_slots`)."""
        return self.prover.prove_slots(worker)

    def report_drift(self, tensors: list[str], *, by: str) -> None:
        """Tensors the agent found to differ, adding up the ranks' parts (the ``deltasync_drift`` RPC)."""
        self.prover.report_drift(tensors, by=by)

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """What the worker extension reports (``deltasync_status``)."""
        label, served = self.label, self.served
        pm = served.built_map
        return {
            "engine": type(self).__name__,
            "mode": served.mode,
            "version": label.version,
            "healthy": label.healthy,
            "run_id": label.run_id,
            "high_water": label.high_water,
            "fingerprint": served.fingerprint(),
            "model_id": label.model_id,
            "agent": self.claim.owner,
            "allow_rollback": self.claim.allow_rollback,
            "outcome": dict(label.outcome),
            "map": None if pm is None else pm.summary(),
            "kernels": self.kernels,
            "cpus": self.cpus,
            "map_error": served.map_error,
            "decodes": served.decodes(),
            "adapter": self.adapter.status(),
            "detail": label.detail,
            "drift": label.drift,
            "proofs": dict(self.prover.proofs),
            "history": self.applier.history[-8:],
            "memory": None if (m := _memory()) is None else {**m, "keeps_scratch": self.keeps_scratch},
        }


def _memory() -> dict[str, float] | None:
    """This worker's resident memory and its peak so far, in MiB (Linux ``/proc``; ``None`` elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        rss, peak = (int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))
        return {"rss_mib": rss, "peak_mib": peak, "pid": os.getpid()}
    except (OSError, KeyError, ValueError):
        return None
