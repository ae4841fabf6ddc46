"""InMemoryTarget: an engine whose weights are a state dict in this process, under the same rules as vLLM's.

It is a real :class:`~deltasync.targets.EngineTarget`, not a test double: the rules are those of the vLLM
engine (one :mod:`deltasync.apply` path: admission before any write, checks of what was decoded, checksums
after), and it serves whoever reads :attr:`InMemoryTarget.weights`: a trainer-side evaluator, a reference
model, a light replica in a load test, or an agent's unit tests.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from .. import apply
from ..apply import Step
from ..errors import ApplyError, RefusalReason, UpdateRefused
from ..format import TensorDelta
from ..manifest import ModelSpec
from ..staging import StagedObject, StagedUpdate, read_staged, read_staged_manifest
from .base import UNHEALTHY_LABEL, EngineClaim, EngineState

__all__ = ["InMemoryTarget"]

logger = logging.getLogger(__name__)


class InMemoryTarget:
    """Weights in host memory, updated by an agent.

    Args:
        spec: the model it serves (name -> dtype, shape); ``None``: the first anchor defines it.
        model_id: the model id it serves, if any.
        staged_files: take updates as staged files (re-read and re-checked), as a vLLM engine does.

    Thread safety: :meth:`apply` holds a lock; readers that must not see a half-applied delta take
    :attr:`lock` too (or copy :attr:`weights` under it).
    """

    def __init__(
        self, *, spec: ModelSpec | None = None, model_id: str | None = None, staged_files: bool = False
    ) -> None:
        self.in_process = not staged_files
        """It runs in the agent's process: the agent hands it verified objects as Python objects, unless
        ``staged_files`` asks for staged files as a vLLM engine gets them (to exercise that path)."""
        self.weights: dict[str, torch.Tensor] | None = None
        self.holding = apply.Holding(spec=spec, model_id=model_id)
        self.label: str | None = None
        self.paused = False
        self.pauses = 0
        self.applied: list[int] = []
        """Every version a session finished at, in order."""
        self.detail = ""
        self.lock = threading.Lock()
        self._raise_errors = True
        self.staging_root: str | None = None
        self.owner: str | None = None
        self.allow_rollback = False

    @property
    def version(self) -> int | None:
        """The version held (``None``: unknown or unhealthy)."""
        return self.holding.version if self.holding.healthy else None

    def state(self) -> EngineState:
        return EngineState.of(self.holding, label=self.label, agent_id=self.owner, detail=self.detail)

    def recover(self) -> None:
        """Nothing outlives an agent here but the label, which is made to say what is held."""
        if not self.holding.healthy:
            self.label = UNHEALTHY_LABEL
        elif self.holding.version is not None:
            self.label = str(self.holding.version)

    def init(self, claim: EngineClaim) -> None:
        """As the vLLM engine: one agent claims it; ``base_version`` only names weights of an unknown version (it
        never relabels a version the engine knows); ``staging_root`` limits where staged files may come from;
        ``mode`` is a vLLM engine's (host memory has one way to apply)."""
        if claim.release:
            if self.owner == claim.agent_id:
                self.owner = None
            return
        refusal = apply.refuse_claim(
            owner=self.owner,
            agent_id=claim.agent_id,
            holding=self.holding,
            run_id=claim.run_id,
            allow_rollback=claim.allow_rollback,
        )  # in one process: no other session to tell apart
        if refusal is not None:
            raise UpdateRefused(refusal, reason=RefusalReason.RUN)
        refusal = apply.refuse_model(
            agent_id=claim.agent_id, wanted=claim.model_fingerprint, served=self.holding.fingerprint, adapter=False
        )
        if refusal is not None:
            raise UpdateRefused(refusal, reason=RefusalReason.MODEL)
        self.owner, self.allow_rollback = claim.agent_id, claim.allow_rollback
        if claim.raise_errors is not None:
            self._raise_errors = claim.raise_errors
        if claim.staging_root is not None:
            self.staging_root = claim.staging_root
        base = claim.base_version
        if base is not None and self.holding.version is None and self.holding.healthy:
            self.holding = dataclasses.replace(self.holding, version=base, high_water=base)
            self.label = str(base)

    def pause(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume(self) -> None:
        self.paused = False

    def apply(self, update: StagedUpdate) -> None:
        """Validate every object of the session, then write them; see :class:`~deltasync.targets.EngineTarget`."""
        with self.lock:
            into = _Weights(self, update.target_version)
            try:
                steps = [self._step(obj) for obj in update.objects]
                holding = apply.apply_update(
                    steps,
                    into,
                    self.holding,
                    target=update.target_version,
                    allow_rollback=self.allow_rollback,
                    read_ahead=True,
                )
            except UpdateRefused as exc:
                if apply.releases_claim(exc.reason, self.holding):
                    self.owner = None  # not this engine's agent: its claim goes
                raise
            except (ValueError, OSError) as exc:  # a malformed staged file: refused before the first write
                raise UpdateRefused(
                    f"{update.objects[0].label}: the staged update is unreadable ({exc})",
                    reason=RefusalReason.MALFORMED,
                ) from exc
            assert holding is not None
            self.weights, self.holding = into.tensors, holding
            self.label = str(update.target_version)
            self.detail = ""
            self.applied.append(update.target_version)

    def _step(self, obj: StagedObject) -> Step:
        """A staged object as the apply sequence takes it: its manifest now (admitted before anything else is
        read), its entries when the sequence reads them."""
        in_process = obj.manifest is not None and obj.deltas is not None  # else its files are read and checked
        manifest = obj.manifest if in_process else read_staged_manifest(obj, root=self.staging_root)
        assert manifest is not None

        def read() -> list[TensorDelta]:
            return read_staged(obj, root=self.staging_root, manifest=manifest)[1]

        return Step(manifest, obj.manifest_path, read)

    def __repr__(self) -> str:
        return f"InMemoryTarget(version={self.version}, label={self.label!r})"


class _Weights(apply.TensorsReceiver):
    """The target's state dict under the apply sequence; a failure past the first write makes it unhealthy."""

    def __init__(self, target: InMemoryTarget, version: int) -> None:
        super().__init__(target.weights, own_anchors=True)  # staged buffers may be reused: own an anchor's
        self.target, self.version = target, version

    def unlabel(self, exc: Exception) -> None:
        t, h = self.target, self.target.holding
        t.holding = apply.Holding(
            healthy=False, spec=h.spec, model_id=h.model_id, run_id=h.run_id, high_water=h.high_water
        )
        t.label = UNHEALTHY_LABEL
        t.detail = f"failed past the first write: {exc}"
        raise ApplyError(f"applying v{self.version}: {exc}; the engine needs an anchor") from exc
