"""Committing one object from one or many trainer ranks: each rank writes its own shards, rank 0 writes the
manifest last and registers it under the run's publisher lease, which a thread keeps renewed."""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist

from ._sharding import TensorView
from .client import CoordinatorClient, Lease
from .errors import LeaseError, ObjectNotFound, StoreError, VersionTaken
from .format import TensorDelta
from .layout import MANIFEST_FILE, SIGNATURE_FILE, prefix_of
from .manifest import ChecksumPart, DeltaManifest, TensorEntry
from .schemas import VersionCreate
from .sketch import Sketch, add_sketches, format_sketch, parse_sketch
from .vocab import MAX_VERSION, ObjectKind
from .writer import ObjectWriter

__all__ = ["LeaseKeeper", "RankCommit", "first_free_version", "taken_versions"]

logger = logging.getLogger("deltasync.publisher")

_VERSION_KEY = re.compile(r"v(\d{8})(?:/|$)")  # a key under a version's directory, or a file in its place


def taken_versions(keys: Iterable[str]) -> set[int]:
    """The versions under whose directory ``keys`` hold something (committed, left by a crash, or planted)."""
    return {int(m.group(1)) for m in map(_VERSION_KEY.match, keys) if m is not None}


def first_free_version(taken: set[int], at_least: int) -> int | None:
    """The first version at or above ``at_least`` that holds no key, or ``None`` past the last version."""
    version = at_least
    while version in taken:
        version += 1
    return version if version <= MAX_VERSION else None


class LeaseKeeper:
    """Holds the run's publisher lease and renews it every third of its TTL, on a daemon thread.

    A lost lease (another publisher took the run, or renewals failed past the TTL) is kept as :attr:`error`
    and raised by :meth:`check` before the next registration: a fenced publisher never registers again.
    """

    def __init__(self, client: CoordinatorClient, lease: Lease, ttl_s: float) -> None:
        self.client, self.lease, self.ttl_s = client, lease, ttl_s
        self.error: LeaseError | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltasync-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.refresh()
            except LeaseError:
                logger.error("the publisher lease is lost: %s", self.error)
                return
            except Exception as exc:  # noqa: BLE001 - the coordinator may be down: retried next round, fenced if too late
                logger.warning("renewing the publisher lease failed (%s); retrying", exc)

    def refresh(self) -> None:
        """Renew the lease now (before each commit): proves this publisher still holds the run.

        Raises:
            LeaseError: it is lost (and stays lost).
        """
        with self._lock:
            self.check()
            try:
                self.lease = self.client.renew_lease(self.lease, ttl_s=self.ttl_s)
            except LeaseError as exc:
                self.error = exc
                raise

    def check(self) -> None:
        """Raise LeaseError if the lease is lost."""
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Stop renewing and release the lease (so the next publisher need not wait for it to expire)."""
        self._stop.set()
        self._thread.join(5)
        if self.error is None:
            try:
                self.client.release_lease(self.lease)
            except Exception as exc:  # noqa: BLE001 - it will expire on its own
                logger.warning("releasing the publisher lease failed (%s); it expires on its own", exc)


class RankCommit:
    """Writes this rank's part of an object and, on rank 0, commits and registers the whole.

    Args:
        writer: the store writer (encoding, signing, model and run ids).
        coordinator: where rank 0 registers; ``None`` to only write the store.
        lease: rank 0's lease keeper (``None`` without a coordinator).
        rank, world: this rank and the number of ranks.
        group: the gloo group for metadata (``None`` in one process).
    """

    def __init__(
        self,
        writer: ObjectWriter,
        coordinator: CoordinatorClient | None,
        lease: LeaseKeeper | None,
        *,
        rank: int,
        world: int,
        group: Any,
    ) -> None:
        self.writer, self.coordinator, self.lease = writer, coordinator, lease
        self.rank, self.world, self.group = rank, world, group
        self.parts: dict[str, list[ChecksumPart]] = {}
        """Rank 0: the checksum parts of every tensor at the last committed version (spans from every rank)."""
        self.sketches: dict[str, dict[tuple[int, int], Sketch]] = {}
        """Rank 0: the sketch of every span of every tensor at the last committed version; a tensor's sketch is
        their sum, so an unchanged span is carried forward and never recomputed."""
        self.published: list[DeltaManifest] = []
        self.squashes: list[DeltaManifest] = []
        """Rank 0: the squashes committed so far (deltas over several versions, beside the chain)."""

    def publish(
        self,
        version: int,
        kind: ObjectKind,
        deltas: list[TensorDelta],
        *,
        base_version: int | None,
        views: Mapping[str, TensorView],
        dtype_name: str,
        timings: dict[str, float] | None = None,
    ) -> int:
        """Write this rank's shards; rank 0 writes the manifest last and registers. Returns the object's bytes.

        ``timings``: where the seconds of each stage are added (``encode``, ``write``, ``register``: the ranks'
        metadata, the lease proof, the manifest and the registration).

        A ``squash`` is a delta ``base_version -> version`` written at the squash's keys and registered as one: a
        taken key skips it (``VersionTaken`` without ``next_free``), never the version.

        Raises:
            RuntimeError: rank 0 could not commit (every rank raises it).
            LeaseError: the publisher was fenced (rank 0; every rank raises it).
        """
        t0 = time.perf_counter()
        shards = self.writer.encode(
            deltas,
            kind="delta" if kind == "squash" else kind,
            version=version,
            base_version=base_version,
            first_index=self.rank,
            grouped=self.world == 1,
        )
        t1 = time.perf_counter()
        taken: tuple[str, str] | None = None
        try:
            # this rank's shards in one batch; rank 0 commits later
            self.writer.put_shards(version, kind, shards, base_version=base_version)
        except VersionTaken as exc:  # every rank must hear of it: rank 0 decides for all
            taken = (str(exc), exc.key)
        t2 = time.perf_counter()
        meta = {
            "entries": [(s.index, s.entry, list(s.tensors)) for s in shards],
            "tensors": {n: t for s in shards for n, t in s.tensors.items()},
            "taken": taken,
        }
        metas: list[Any] = [meta]
        if self.group is not None:
            metas = [None] * self.world
            dist.all_gather_object(metas, meta, group=self.group)
        status: list[Any] = [None]
        if self.rank == 0:
            try:
                first = next((m["taken"] for m in metas if m["taken"] is not None), None)
                if first is not None:
                    raise VersionTaken(first[0], key=first[1], version=version)
                status = [("ok", self._commit(version, kind, base_version, metas, views, dtype_name))]
            except VersionTaken as exc:
                decided = self._decide(exc) if kind != "squash" else exc  # a squash is skipped, never moved
                status = [("taken", (str(decided), decided.key, decided.next_free))]
                if self.group is None:
                    raise decided from None
            except BaseException as exc:
                status = [("error", f"{type(exc).__name__}: {exc}")]
                if self.group is None:
                    raise
        if self.group is not None:
            dist.broadcast_object_list(status, src=0, group=self.group)
        if timings is not None:
            for stage, seconds in (("encode", t1 - t0), ("write", t2 - t1), ("register", time.perf_counter() - t2)):
                timings[stage] = timings.get(stage, 0.0) + seconds
        outcome, detail = status[0]
        if outcome == "taken":
            message, key, next_free = detail
            raise VersionTaken(message, key=key, version=version, next_free=next_free)
        if outcome != "ok":
            raise RuntimeError(f"rank 0 could not commit {kind} v{version}: {detail}")
        return int(detail)

    def _decide(self, exc: VersionTaken) -> VersionTaken:
        """Rank 0: what a publisher does about a taken key of the version it was publishing.

        Holding the run's lease, this publisher is the run's only writer, and the ledger (which allows gaps)
        registers what it commits: whatever took the key is no object of the run (planted, or left by a writer
        that lost the lease), so the version is skipped for the first one whose keys are all free. Without a
        lease nothing tells a planted object from a second publisher writing the same store: it stops, saying so.
        """
        version = exc.version
        where = f"v{version:08d}/"
        if self.lease is None:
            return VersionTaken(
                f"{exc}. Without a coordinator this publisher cannot tell a planted object from a second "
                f"publisher writing this store, so it stops; nothing of v{version} is committed. See what is under "
                f"{where} (deltasync ls STORE), then start a new Publisher: it starts above every key in the "
                "store, this one included; or publish with a coordinator (its lease keeps one publisher per run, "
                "and a publisher holding it skips a taken version)",
                key=exc.key,
                version=version,
            )
        if self.lease.error is not None:
            return VersionTaken(
                f"{exc}; and this publisher lost the run's lease: {self.lease.error}", key=exc.key, version=version
            )
        try:
            taken = taken_versions(self.writer.store.list(""))
        except StoreError as err:  # the next version is tried; if it is taken too, this comes back here
            logger.warning("%s: not listed (%s); trying v%d", self.writer.store.uri, err, version + 1)
            taken = set()
        free = first_free_version(taken, version + 1)
        if free is None:
            return VersionTaken(
                f"{exc}; no version above v{version} is free (the last is v{MAX_VERSION}): publish this run to a "
                "fresh store prefix",
                key=exc.key,
                version=version,
            )
        return VersionTaken(
            f"{exc}; this publisher holds the run's lease, so no writer of the run put it there (a planted object, "
            f"or a fenced writer's leftover)",
            key=exc.key,
            version=version,
            next_free=free,
        )

    def _commit(
        self,
        version: int,
        kind: ObjectKind,
        base_version: int | None,
        metas: list[dict[str, Any]],
        views: Mapping[str, TensorView],
        dtype_name: str,
    ) -> int:
        shards = sorted((index, entry, names) for m in metas for index, entry, names in m["entries"])
        nnz: dict[str, int] = collections.Counter()
        for m in metas:
            for name, (count, part, sketch) in m["tensors"].items():
                nnz[name] += count
                kept = [p for p in self.parts.get(name, []) if (p[0], p[1]) != (part[0], part[1])]
                self.parts[name] = sorted([*kept, tuple(part)])
                assert sketch is not None, f"{kind} v{version}: the entry of {name!r} has no sketch"
                self.sketches.setdefault(name, {})[(part[0], part[1])] = parse_sketch(sketch)
        tensors = {
            name: TensorEntry(
                shape=view.shape,
                dtype=dtype_name,
                nnz=nnz.get(name, 0),
                shards=(),
                checksums=tuple(self.parts[name]),
                sketch=format_sketch(add_sketches(*self.sketches[name].values())),
            )
            for name, view in views.items()
        }
        manifest = self.writer.manifest(
            kind="delta" if kind == "squash" else kind,
            version=version,
            base_version=base_version,
            shards=[(entry, names) for _, entry, names in shards],
            tensors=tensors,
        )
        if kind == "squash":
            manifest = dataclasses.replace(manifest, squash=True)
        # a fenced publisher never commits into another's run: the lease is proven at the last moment before
        # the commit marker, and an object committed while the lease moved on is withdrawn (its epoch, older
        # than the next publisher's recorded one, makes readers refuse it and gc delete it if this process
        # dies before the withdrawal)
        fence = self.lease.refresh if self.lease is not None else None
        try:
            data = self.writer.commit(manifest, fence=fence)
        except LeaseError:
            self._withdraw(manifest, committed=False)
            raise
        if self.coordinator is not None:
            lease = self.lease.lease if self.lease is not None else None
            try:
                self.coordinator.register_version(VersionCreate.for_manifest(manifest, data), lease=lease)
            except LeaseError:
                self._withdraw(manifest, committed=True)
                raise
        (self.squashes if manifest.squash else self.published).append(manifest)
        return manifest.total_bytes

    def _withdraw(self, manifest: DeltaManifest, *, committed: bool) -> None:
        """Take back a fenced commit: the manifest (the commit marker) first, then its signature."""
        store, what = self.writer.store, f"{manifest.kind} v{manifest.version}"
        prefix = prefix_of(manifest)
        keys = [prefix + MANIFEST_FILE] if committed else []
        keys.append(prefix + SIGNATURE_FILE)
        for key in keys:
            try:
                store.delete(key)
            except ObjectNotFound:
                pass
            except Exception as exc:  # noqa: BLE001 - readers and gc still refuse it by its epoch
                logger.warning("fenced: could not withdraw %s (%s: %s)", key, type(exc).__name__, exc)
        logger.error(
            "fenced: another publisher took the run; %s was %s", what, "withdrawn" if committed else "not committed"
        )
