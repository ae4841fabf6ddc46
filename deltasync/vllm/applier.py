"""The ``deltasync`` engine's update sessions (:class:`Applier`): an update read, validated and planned before the
pause (``prepare``), written in the session (``receive``) in the engine's apply mode, and served when the session
finishes (``finish``). The order of the steps and the failure rule are :func:`deltasync.apply.apply_update`'s.

Failure semantics: the whole update is validated before the first write: each staged file against its manifest,
each manifest against what this engine serves (model fingerprint, run, base version, health, the highest version
served), and in ``inplace`` mode the planned writes against the published checksums. A refusal leaves weights,
health and label untouched. A failure past the first write unlabels the engine (``version`` unknown): only an
anchor is accepted until one restores it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import apply
from ..errors import ApplyError, RefusalReason, UpdateRefused
from ..format import BaseValues, TensorDelta
from ..manifest import DeltaManifest
from ..staging import StagedUpdate, read_staged, read_staged_manifest
from .adapter import ServedAdapter
from .claim import Claim
from .label import Label
from .model import ServedModel
from .proof import Prover, Written
from .receivers import MapWrites, PatchWrites, ShadowWrites
from .served import ServedValues

__all__ = ["Applier", "read_update"]

logger = logging.getLogger("vllm.deltasync.engine")

Checked = list[tuple[DeltaManifest, list[TensorDelta]]]


def read_update(
    update: StagedUpdate,
    *,
    root: str | None,
    admit: Callable[[list[DeltaManifest]], None],
    source: Callable[[], BaseValues] | None = None,
) -> Checked:
    """Each staged object read and checked; nothing is written. Where the update holds a published delta, every
    manifest is read and ``admit``-ted first, so a delta on another base is never decoded against what this engine
    serves; then ``source()`` gives what published objects decode against (later objects of the session against
    what the earlier ones give: :meth:`~deltasync.vllm.served.ServedValues.advance`).

    Raises:
        UpdateRefused: a staged file is malformed (reason ``malformed``), or ``admit`` refused a manifest.
    """
    base = None
    admitted: list[DeltaManifest | None] = [None] * len(update.objects)
    if source is not None and any(obj.published and obj.kind == "delta" for obj in update.objects):
        try:
            admitted = [read_staged_manifest(o, root=root) for o in update.objects]
        except (ValueError, OSError) as exc:
            raise UpdateRefused(f"deltasync: {exc}", reason=RefusalReason.MALFORMED) from exc
        admit([m for m in admitted if m is not None])
        base = source()
    try:
        out = []
        for obj, known in zip(update.objects, admitted, strict=True):  # the admitted manifests, not read again
            manifest, deltas = read_staged(obj, root=root, base=base, manifest=known)
            if isinstance(base, ServedValues):
                base.advance(deltas)
            out.append((manifest, deltas))
    except (ValueError, OSError) as exc:
        raise UpdateRefused(f"deltasync: {exc}", reason=RefusalReason.MALFORMED) from exc
    return out


@dataclass
class _Prepared:
    """An update read, admitted and planned before the pause (and, in place, proven)."""

    key: str
    checked: Checked
    ops: list[Any] | None


class Applier:
    """One engine's update sessions.

    Args:
        served: the served model (mode, map, shadow, reloader).
        label: the engine's label.
        claim: the claim's policy (rollback, staging root).
        prover: the proofs before the first write.
        adapter: ``lora`` mode's served adapter.
    """

    def __init__(self, served: ServedModel, label: Label, claim: Claim, prover: Prover, adapter: ServedAdapter) -> None:
        self.served, self.label, self.claim, self.prover, self.adapter = served, label, claim, prover, adapter
        self.stats: dict[str, Any] = {}
        """The open (or last) session's figures."""
        self.history: list[dict[str, Any]] = []
        """Every finished session's figures."""
        self.written = Written()
        """The last session's writes, for the audit after the pause."""
        self.pending: set[str] = set()
        """Checkpoint tensors written to the shadow this session, whose modules the session's end reloads."""
        self._prepared: _Prepared | None = None
        self._last_prepare: dict[str, float] = {}  # the last prepare's stages, kept for the next session's stats

    # ------------------------------------------------------------------ the session

    def start(self) -> None:
        """A session starts (vLLM's ``start_weight_update``). No layerwise reload here (it would move every layer to
        the meta device): the session's end reloads only the modules it touched."""
        if self.label.staged is not None or self.pending:
            # a session that wrote the shadow and never finished: the shadow is ahead of the model
            self.label.mark_unhealthy("the previous update session wrote the shadow and never finished")
        self.pending.clear()
        self.label.staged = None
        self.label.clear_outcome()
        self.stats = {"mode": self.served.mode, "objects": 0, "tensors": 0, "values": 0, "t0": time.perf_counter()}
        self.stats["prepare"], self._last_prepare = self._last_prepare, {}

    def prepare(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Read, validate and plan an update before the pause (the ``deltasync_prepare`` RPC); the next
        :meth:`receive` of the same objects then only re-checks admission and writes. With TP > 1 the answer
        carries this rank's changes to the tensors it holds in part (``changes``), which the agent adds up over the
        ranks before the pause.

        Raises:
            UpdateRefused: refused before any write (nothing prepared).
            Exception: anything else that stops the work (the session repeats it and reports it).
        """
        t0 = time.perf_counter()
        self._prepared = None
        update = StagedUpdate.from_update_info(update_info)
        checked, reads = self._read(update)
        self._admit_manifests([m for m, _ in checked], update)
        read_s = time.perf_counter() - t0
        session = _Session(self, update.target_version, reads=reads, fallback=False)
        session.check(checked)
        plan_s = session.planned_at - t0 - read_s
        prove_s = time.perf_counter() - session.planned_at
        self._prepared = _Prepared(_key(update_info), checked, session.ops)
        self._last_prepare = {"read_s": round(read_s, 4), "plan_s": round(plan_s, 4), "prove_s": round(prove_s, 4)}
        out: dict[str, Any] = {"ok": True, "prepare_s": round(time.perf_counter() - t0, 4)}
        if session.ops is not None and session.changes:  # TP > 1: the agent adds them up before the pause
            out["changes"] = session.changes
        return out

    def receive(self, objects: list[dict[str, Any]]) -> None:
        """Validate the whole update, then write it (in place, to the shadow, or as patches), in one
        :func:`~deltasync.apply.apply_update`.

        Raises:
            UpdateRefused: refused before any write (``VersionGapError`` for a wrong base).
            ApplyError: a failure after the first write; the engine needs an anchor.
            Exception: a malformed update, before any write.
        """
        t0 = time.perf_counter()
        info = {"objects": objects}
        prepared, self._prepared = self._prepared, None
        update = StagedUpdate.from_update_info(info)
        target = update.target_version
        if prepared is not None and prepared.key == _key(info):
            checked, session = prepared.checked, _Session(self, target, reads={}, fallback=True, ops=prepared.ops)
        else:
            try:
                checked, reads = self._read(update)
            except ApplyError as exc:  # what is served could not be read: nothing is written yet
                raise UpdateRefused(f"deltasync: {type(exc).__name__}: {exc}", reason=RefusalReason.MALFORMED) from exc
            session = _Session(self, target, reads=reads, fallback=True)
        steps = [
            apply.Step.of(m, ds, f"deltasync {obj.label}") for (m, ds), obj in zip(checked, update.objects, strict=True)
        ]
        holding = apply.apply_update(
            steps,
            session,
            self._admitting(),  # again: the engine may have moved since it was prepared
            target=update.target_version,
            allow_rollback=self.claim.allow_rollback,
            read_ahead=True,
        )
        assert holding is not None
        self._log_rollback(update)
        self.label.stage(holding, checked[-1][0])
        ops = session.ops
        last_ops = list(ops[-1]) if self.served.mode == "inplace" and ops else []
        was_prepared = prepared is not None and ops is prepared.ops
        self.written = Written(last_ops, {d.ckpt_name for _, ds in checked for d in ds}, was_prepared)
        s = self.stats
        s["objects"] = s.get("objects", 0) + len(checked)
        s["tensors"] = s.get("tensors", 0) + sum(len(d) for _, d in checked)
        s["values"] = s.get("values", 0) + sum(x.nnz for _, d in checked for x in d)
        s["prepared"] = was_prepared
        t1 = session.first_write_at or time.perf_counter()
        s["read_s"] = s.get("read_s", 0.0) + (t1 - t0)
        s["apply_s"] = s.get("apply_s", 0.0) + (time.perf_counter() - t1)
        if session.map_writes is not None:
            s["written"] = s.get("written", 0) + session.map_writes.written

    def finish(self) -> None:
        """The session ends (vLLM's ``finish_weight_update``): the modules written to the shadow are reloaded (or,
        in ``lora`` mode, the adapter is served), and what the session staged is served. Never raises: vLLM would
        keep its session flag set, and with TP > 1 desync its executor; a failure unlabels the engine."""
        t0 = time.perf_counter()
        mode = self.served.mode
        try:
            if self.pending and mode == "lora":
                self.adapter.publish()
            elif self.pending and mode in ("reload", "inplace"):  # inplace: the modules the map cannot hold
                self.served.reloader.reload(self.pending)
                self.stats.update(self.served.reloader.stats)
        except Exception as exc:  # noqa: BLE001 - the model may be half reloaded: never served as a known version
            self.label.fail_unhealthy(f"{'serving the adapter' if mode == 'lora' else 'the reload'} failed ({exc})")
            logger.warning("deltasync: %s", self.label.detail)
        finally:
            self.pending.clear()
        held = self.label.serve_staged()
        if held is not None:
            self.served.adopt_spec(held.spec)
        s = self.stats
        s["finish_s"] = time.perf_counter() - t0
        s["total_s"] = time.perf_counter() - s.pop("t0", t0)
        s["version"] = self.label.version
        self.history.append(dict(s))
        logger.info("deltasync: now at v%s: %s", self.label.version, s)

    def take_written(self) -> Written:
        """The last session's writes, once (the audit reads them back)."""
        written, self.written = self.written, Written()
        return written

    # ------------------------------------------------------------------ reading and admitting

    def holding(self) -> apply.Holding:
        """What this engine holds, for admission (its base's weights' digest as far as it was read: the first
        admission reads it, a claim never waits on it)."""
        lora = self.served.mode == "lora"
        label = self.label
        return apply.Holding(
            adapter_base=(self.served.base_fingerprint() or "unknown") if lora else None,
            adapter=self.adapter.served_entry() if lora else None,
            adapter_base_content=self.served.base_content(read=False) if lora else None,
            version=label.version,
            healthy=label.healthy,
            spec=self.served.spec(),
            fingerprint=self.served.fingerprint(),
            model_id=label.model_id,
            run_id=label.run_id,
            high_water=label.high_water,
        )

    def _admitting(self) -> apply.Holding:
        """What an update is admitted against: the open session's staged holding, else :meth:`holding`, with (``lora``
        mode) the base's weights' digest read first, once per engine."""
        if self.label.staged is None and self.served.mode == "lora":
            self.served.base_content()
        return self.label.staged or self.holding()

    def _read(self, update: StagedUpdate) -> tuple[Checked, dict[str, Any]]:
        """:func:`read_update` with this engine's admission and what it serves; also returns what decoding the
        session's published objects read of the served values (the proof before the first write reuses them)."""
        mode = self.served.mode
        sources: list[ServedValues] = []

        def source() -> ServedValues:
            # tensor parallel in place: each rank decodes the elements it holds
            holds = self.served.holds if mode == "inplace" and self.served.tensor_parallel else None
            values = ServedValues(self.served.served_values, holds)
            if mode == "inplace":
                try:  # built here, once, before the decoder's threads read through it
                    self.served.patch_map()
                except ApplyError:
                    pass  # said in status ("map_error"): this engine reloads, from its shadow
            sources.append(values)
            return values

        checked = read_update(
            update, root=self.claim.staging_root, admit=lambda ms: self._admit_manifests(ms, update), source=source
        )
        return checked, sources[0].served if sources else {}

    def _admit_manifests(self, manifests: list[DeltaManifest], update: StagedUpdate) -> None:
        if self.served.mode == "lora":
            self.adapter.refuse_unloadable(manifests)
        apply.admit_all(
            ((m, f"deltasync {obj.label}") for m, obj in zip(manifests, update.objects, strict=True)),
            self._admitting(),
            target=update.target_version,
            allow_rollback=self.claim.allow_rollback,
        )
        self._log_rollback(update)

    def _log_rollback(self, update: StagedUpdate) -> None:
        high = (self.label.staged or self.label).high_water
        if self.claim.allow_rollback and high is not None and update.target_version < high:
            logger.warning("deltasync: rolling back to v%d on the operator's request", update.target_version)


class _Session(apply.Receiver):
    """The engine's storage for one session, under the apply sequence: its own refusals and plan before the first
    write (:meth:`check`), then the receiver of its mode (chosen once the plan says whether the map holds).

    Args:
        applier: the engine's sessions.
        target: the version the session ends at.
        reads: what decoding read of the served values (the proof reuses them).
        fallback: a map that cannot be built makes this session reload instead (``False``: it refuses the plan,
            as ``prepare`` does, and the session repeats the work).
        ops: the writes planned (and proven) before the pause, if any.
    """

    def __init__(
        self,
        applier: Applier,
        target: int,
        *,
        reads: dict[str, Any],
        fallback: bool,
        ops: list[Any] | None = None,
    ) -> None:
        self.applier, self.target, self.reads, self.fallback, self.ops = applier, target, reads, fallback, ops
        self.prepared = ops is not None
        self.changes: dict[str, Any] = {}
        """TP > 1: this rank's changes to the tensors it holds in part, as sketches (:func:`prove_update`)."""
        self.planned_at = 0.0
        self.first_write_at = 0.0
        self.map_writes: MapWrites | None = None
        self._into: apply.Receiver | None = None

    def check(self, objects: Sequence[tuple[DeltaManifest, Sequence[TensorDelta]]]) -> None:
        a = self.applier
        checked = [(m, list(ds)) for m, ds in objects]
        a.served.refuse_unsupported(checked)
        if a.served.mode == "lora":
            a.adapter.refuse_unservable(checked)
        if a.served.mode == "inplace" and not self.prepared:
            try:
                pm = a.served.patch_map()
                # index bounds: a sparse index past a tensor's end was refused by the staged file's checks already;
                # the map holds only in-range runs
                self.ops = [pm.plan([d for d in deltas if d.ckpt_name in pm]) for _, deltas in checked]
            except ApplyError:
                if not self.fallback:
                    raise
                self.ops = None  # no map (said in status): this update, and the next ones, reload
            self.planned_at = time.perf_counter()
            if self.ops is not None:
                self.changes = a.prover.prove_update(checked, self.ops, self.reads)
        self.planned_at = self.planned_at or time.perf_counter()

    def _receiver(self) -> apply.Receiver:
        a = self.applier
        mode = a.served.mode
        if mode in ("reload", "lora"):
            return ShadowWrites(a.served.shadow(), a.pending)
        if mode == "patches":
            return PatchWrites(a.served.model, a.served.device)
        pm = a.served.patch_map()
        unmapped = ShadowWrites(a.served.shadow(), a.pending) if pm.unmapped else None
        self.map_writes = MapWrites(pm, self.ops or [], unmapped)
        return self.map_writes

    def write(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        if self._into is None:  # at the first write: a receiver that cannot be made then fails past it
            self.first_write_at = time.perf_counter()
            self._into = self._receiver()
        self._into.write(manifest, deltas)

    def verify(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        assert self._into is not None
        self._into.verify(manifest, deltas)

    def unlabel(self, exc: Exception) -> None:
        label = self.applier.label
        label.mark_unhealthy(f"applying v{self.target} failed part-way ({exc})")
        raise ApplyError(f"deltasync: {label.detail}") from exc


def _key(info: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()
