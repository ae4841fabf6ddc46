"""The agent's work before its engine is paused: fetch a plan's objects, authenticate and admit them, and stage
them for the engine; for an engine that does not decode, the host copy of the model they are decoded against.

No engine call is made here: the engine's state comes in as read by the agent (:mod:`deltasync.agent`, which owns
the version state machine and the pause), and a :class:`~deltasync.staging.StagedUpdate` goes out.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import apply
from ._fetch import ObjectFetcher
from ._localfs import ensure_dir
from .client import SyncPlan
from .config import AgentConfig
from .errors import DeltaSyncError, IntegrityError
from .format import TensorDelta
from .layout import prefix_of
from .manifest import DeltaManifest, ShardEntry
from .reader import Trust, decode_object, read_weights
from .signing import VerifyKey
from .staging import StagedObject, StagedUpdate, in_memory, stage_object, stage_published
from .store.base import Store
from .targets.base import EngineState

__all__ = ["Stager"]

logger = logging.getLogger("deltasync.agent")


class Stager:
    """Turns a sync plan into a staged update for one agent's engine, and keeps the agent's host copy.

    An engine that decodes published objects against what it serves gets them as fetched (the agent keeps no
    copy of the model); for another, each object is decoded against the host copy, proven against its
    manifest's checksums, and staged decoded.

    Args:
        store: where the objects are.
        staging: the agent's staging root (resolved: engines accept files only from under it).
        config: the agent's id, retries, fetch workers, rollback permission and integrity fallback.
        verify_key: require every manifest to be signed by this key.
        in_process: the engine runs in this process and takes the decoded objects themselves.
    """

    def __init__(
        self, store: Store, staging: Path, config: AgentConfig, *, verify_key: VerifyKey | None, in_process: bool
    ) -> None:
        self.store, self.staging, self.config, self.in_process = store, staging, config, in_process
        self.fetcher = ObjectFetcher(
            store,
            staging / "cache",
            verify_key=verify_key,
            retries=config.retries,
            backoff_s=config.backoff_s,
            workers=config.fetch_workers,
            name=config.agent_id,
        )
        self.host: dict[str, torch.Tensor] | None = None
        """The agent's copy of the engine's weights (``packed`` deltas decode against it)."""
        self.host_version: int | None = None
        self.integrity_failures = 0
        """Consecutive integrity failures rebuilding the host copy (the anchor route after enough of them)."""

    def forget_host(self) -> None:
        """The host copy no longer matches the engine (a failed or refused update, drift): rebuilt when needed."""
        self.host, self.host_version = None, None

    def stages_published(self, st: EngineState) -> bool:
        """Whether objects go to the engine as fetched (it decodes them against what it serves, and this agent
        keeps no copy of the model), or decoded against this agent's host copy."""
        return st.decodes and not self.in_process

    def rebuild_host(self, held: int, trust: Trust) -> bool:
        """The engine's version ``held`` in host memory (the delta route needs it), authenticated by ``trust``;
        False when it cannot be read now, or failed its checks ``integrity_fallback_after`` times in a row (the
        caller catches up from an anchor instead).

        Raises:
            IntegrityError: it failed its checks fewer times than that (the sync is retried).
        """
        try:
            self.host = read_weights(self.store, held, trust=trust)
            self.host_version = held
            self.integrity_failures = 0
            return True
        except IntegrityError as exc:
            self.integrity_failures += 1
            if self.integrity_failures < self.config.integrity_fallback_after:
                raise
            logger.warning(
                "agent %s: v%d cannot be rebuilt from the store (%s; %d times): catching up from an anchor",
                self.config.agent_id,
                held,
                exc,
                self.integrity_failures,
            )
        except (DeltaSyncError, OSError) as exc:
            logger.warning(
                "agent %s: cannot rebuild v%d on the host (%s): catching up from an anchor",
                self.config.agent_id,
                held,
                exc,
            )
        self.forget_host()
        return False

    def prepare(self, plan: SyncPlan, st: EngineState, timings: dict[str, float]) -> tuple[StagedUpdate, list[Path]]:
        """Fetch, authenticate, admit, then stage: as fetched for an engine that decodes, otherwise decoded into
        the host copy and checked against the manifest's checksums. Returns the update and the directories to
        remove (:meth:`cleanup`) once the engine has applied it.

        Raises:
            UpdateRefused: an object for another model, or one the engine's state does not admit (before a
                single shard is fetched).
        """
        t0 = time.perf_counter()
        manifests = [
            self.fetcher.manifest(step.version, step.kind, step.checksum, step.base_version) for step in plan.steps
        ]
        self._admit([m for m, _ in manifests], plan, st)
        if self.stages_published(st):
            return self._stage_published(manifests, timings, t0)
        return self._stage_decoded(manifests, timings, t0)

    def _admit(self, manifests: list[DeltaManifest], plan: SyncPlan, st: EngineState) -> None:
        """Refuse another model's or run's objects, and any the engine's state does not admit in turn."""
        apply.admit_all(
            ((m, f"{self.store.uri}/{prefix_of(m)}") for m in manifests),
            st.holding(),
            target=plan.to_version,
            allow_rollback=self.config.allow_rollback,
        )

    def _stage_published(
        self, manifests: list[tuple[DeltaManifest, bytes]], timings: dict[str, float], t0: float
    ) -> tuple[StagedUpdate, list[Path]]:
        """The objects as fetched, for an engine that decodes them against what it serves."""
        self.forget_host()  # the engine decodes against what it serves
        objects: list[StagedObject] = []
        # a local store's shards are linked unread: the engine hashes each against the manifest before decoding
        dirs = [self._staging_dir(m) for m, _ in manifests]
        try:
            linked = [
                [self.fetcher.link_unread(m, e, d / e.file) for e in m.shards]
                for (m, _), d in zip(manifests, dirs, strict=True)
            ]
            shards = self.fetcher.shards([m for m, _ in manifests], skip=linked)
            t1 = time.perf_counter()
            for (m, data), blobs, d, done in zip(manifests, shards, dirs, linked, strict=True):
                objects.append(stage_published(d, m, data, blobs, link=self._linker(m, done)))
        except BaseException:  # a fetch that failed: nothing of this update stays staged
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
            raise
        timings.update(fetch=t1 - t0, decode=0.0, stage=time.perf_counter() - t1)
        return StagedUpdate(objects=tuple(objects)), dirs

    def _stage_decoded(
        self, manifests: list[tuple[DeltaManifest, bytes]], timings: dict[str, float], t0: float
    ) -> tuple[StagedUpdate, list[Path]]:
        """The objects decoded against the host copy, each proven against its manifest's checksums there."""
        shards = self.fetcher.shards([m for m, _ in manifests])
        t1 = time.perf_counter()
        into = _HostCopy(self)
        steps = []
        for (m, data), blobs in zip(manifests, shards, strict=True):
            where = f"{self.store.uri}/{prefix_of(m)}"
            into.manifest_bytes[m.version, m.kind] = data

            def read(m: DeltaManifest = m, blobs: list[bytes] = blobs, where: str = where) -> list[TensorDelta]:
                # the fetcher checked each shard's size and sha256 as it fetched (ObjectFetcher._shard)
                return decode_object(m, blobs, where=where, base=into.tensors, checked=True)

            steps.append(apply.Step(m, where, read))
        try:
            apply.apply_update(steps, into)  # admitted before any shard was fetched (_admit)
        except BaseException:
            self.forget_host()  # partly updated, or not proven: rebuilt on the next sync
            raise
        self.host, self.host_version = into.tensors, steps[-1].manifest.version if steps else self.host_version
        timings.update(fetch=t1 - t0, decode=time.perf_counter() - t1 - into.stage_s, stage=into.stage_s)
        return StagedUpdate(objects=tuple(into.objects)), into.dirs

    def _linker(self, m: DeltaManifest, done: list[bool]) -> Callable[[ShardEntry, Path], bool]:
        """How :func:`stage_published` names object ``m``'s shards: linked already (``done``, by position), else a
        link to the fetched, verified bytes (the fetcher's cached copy), else ``False`` (it writes them)."""
        position = {e.file: k for k, e in enumerate(m.shards)}

        def link(entry: ShardEntry, path: Path) -> bool:
            return done[position[entry.file]] or self.fetcher.link_shard(m, entry, path)

        return link

    def _staging_dir(self, m: DeltaManifest) -> Path:
        """A fresh directory of this agent's own (unpredictable name): nothing planted can redirect its writes."""
        name = f"v{m.version:08d}" + (
            "-anchor-" if m.kind == "anchor" else f"-squash-{m.base_version}-" if m.squash else "-"
        )
        directory = Path(tempfile.mkdtemp(prefix=name, dir=ensure_dir(self.staging)))
        directory.chmod(0o755)  # the engine may run as another user
        return directory

    def cleanup(self, dirs: list[Path]) -> None:
        """Remove an applied (or abandoned) update's staging directories and the fetcher's cached shards."""
        for directory in dirs:
            shutil.rmtree(directory, ignore_errors=True)
        self.fetcher.clear()


class _HostCopy(apply.TensorsReceiver):
    """The agent's copy of its engine's weights under the apply sequence: each object, once proven there, is
    staged for the engine (as Python objects for an engine in this process, else as files)."""

    def __init__(self, stager: Stager) -> None:
        # an engine in this process takes the anchor's entries themselves: the host copy must own its own
        super().__init__(stager.host, own_anchors=stager.in_process)
        self.stager = stager
        self.manifest_bytes: dict[tuple[int, str], bytes] = {}
        self.objects: list[StagedObject] = []
        self.dirs: list[Path] = []
        self.stage_s = 0.0

    def done(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        ts = time.perf_counter()
        if self.stager.in_process:
            self.objects.append(in_memory(manifest, deltas))
        else:
            directory = self.stager._staging_dir(manifest)
            data = self.manifest_bytes[manifest.version, manifest.kind]
            # files only: the host copy (whose tensors an anchor's entries are) moves on with later objects
            self.objects.append(dataclasses.replace(stage_object(directory, manifest, data, deltas), deltas=None))
            self.dirs.append(directory)
        self.stage_s += time.perf_counter() - ts
