"""The write path of a store: encode an object's shards, create them, then sign and commit its manifest.

:class:`ObjectWriter` is the one writer: :func:`write_anchor` / :func:`write_delta` use it in one process,
and the :class:`~deltasync.publisher.Publisher` uses it on every rank (each rank writes its own shards, rank 0
commits). Every write is create-only, so a key that was committed (or left behind by a crash) is never
overwritten; the manifest goes last and is the commit marker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .errors import ObjectExists, ObjectNotFound, StoreError, UnsafeObject, VersionTaken
from .format import DEFAULT_ZSTD_LEVEL, TensorDelta, encode_shard, tensor_checksum
from .layout import MANIFEST_FILE, SIGNATURE_FILE, object_prefix, prefix_of, shard_file
from .manifest import AdapterEntry, ChecksumPart, DeltaManifest, ShardEntry, TensorEntry
from .signing import SigningKey
from .sketch import tensor_sketch
from .store.base import Store
from .vocab import DTYPE_NAMES, Encoding, Kind, ObjectKind

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "EncodedShard",
    "ObjectWriter",
    "group_by_size",
    "write_anchor",
    "write_delta",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 1 << 30
"""Tensors are grouped into shards of about this many raw bytes (a tensor is never split)."""


def group_by_size(deltas: list[TensorDelta], max_shard_bytes: int) -> list[list[TensorDelta]]:
    """Split entries, in order, into groups of about ``max_shard_bytes`` raw bytes (never splitting one)."""
    groups: list[list[TensorDelta]] = [[]]
    size = 0
    for d in deltas:
        n = d.nnz * (d.values.element_size() + (0 if d.indices is None else 4))
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(d)
        size += n
    return groups if groups[0] else []


@dataclass(frozen=True, kw_only=True, slots=True)
class EncodedShard:
    """One encoded shard of an object, not yet written."""

    index: int
    """Its index (``shard-{index:05d}.safetensors``; a rank's own index under FSDP)."""
    entry: ShardEntry
    """Its manifest entry (file, bytes, sha256)."""
    data: bytes
    """Its bytes."""
    tensors: dict[str, tuple[int, ChecksumPart, str | None]]
    """Per tensor it holds: (stored elements, (span start, span stop, checksum of the span after applying),
    sketch of the span after applying)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectWriter:
    """Encodes and writes objects to one store.

    Args:
        store: where objects go.
        encoding: ``packed`` (the default) or ``raw``.
        anchor_encoding: the anchors' encoding, if not ``encoding``: ``raw`` anchors cost ~1.4x the bytes of
            ``packed`` ones (bf16) and decode at memory speed (a cold replica's first sync), ``packed`` ones take
            ~4 s per GB of bf16 to decode on one core (``benchmarks/bench_apply.py --anchor-encoding``).
        zstd_level: zstd level of ``packed``.
        max_shard_bytes: tensors are grouped into shards of about this size.
        signing_key: sign every manifest (``manifest.sig``, written before the manifest).
        model_id: the model id each manifest names.
        run_id: the run (coordinator ledger identity) each manifest names.
        lease_epoch: the publisher lease epoch each manifest names (readers refuse a fenced epoch's writes).
        adapter: the LoRA adapter each manifest says its tensors are (``None``: a model's own weights).
    """

    store: Store
    encoding: Encoding = "packed"
    anchor_encoding: Encoding | None = None
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    signing_key: SigningKey | None = None
    model_id: str | None = None
    run_id: str | None = None
    lease_epoch: int | None = None
    adapter: AdapterEntry | None = None

    def encoding_of(self, kind: Kind) -> Encoding:
        """The encoding of an object of ``kind``."""
        return self.anchor_encoding if kind == "anchor" and self.anchor_encoding is not None else self.encoding

    def encode(
        self,
        deltas: list[TensorDelta],
        *,
        kind: Kind,
        version: int,
        base_version: int | None,
        first_index: int = 0,
        grouped: bool = True,
    ) -> list[EncodedShard]:
        """Encode entries into shards (grouped by size, or all in one with ``grouped=False``)."""
        groups = group_by_size(deltas, self.max_shard_bytes) if grouped else ([deltas] if deltas else [])
        out = []
        for i, group in enumerate(groups):
            data = encode_shard(
                group,
                kind=kind,
                encoding=self.encoding_of(kind),
                target_version=version,
                base_version=base_version,
                zstd_level=self.zstd_level,
            )
            index = first_index + i
            entry = ShardEntry(file=shard_file(index), bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
            tensors = {d.ckpt_name: (d.nnz, (*d.bounds, str(d.checksum)), d.sketch) for d in group}
            out.append(EncodedShard(index=index, entry=entry, data=data, tensors=tensors))
        return out

    def put_shards(
        self, version: int, kind: ObjectKind, shards: list[EncodedShard], *, base_version: int | None = None
    ) -> None:
        """Create the shard files (one batch where the store has batches); a squash's need its ``base_version``.

        Raises:
            VersionTaken: a shard's key is taken (nothing of the object is committed).
        """
        prefix = object_prefix(version, kind, base_version if kind == "squash" else None)
        items = [(prefix + s.entry.file, s.data) for s in shards]
        try:
            self.store.put_many(items)
        except (ObjectExists, UnsafeObject) as exc:
            raise self._taken(version, kind, [key for key, _ in items], exc) from None

    def _taken(self, version: int, kind: ObjectKind, keys: list[str], exc: StoreError) -> VersionTaken:
        """The error for a create-only write that found one of ``keys`` taken, naming the key that is."""
        key = keys[0]
        for k in keys:
            try:
                if self.store.exists(k):
                    key = k
                    break
            except StoreError:  # a file where a directory of the key goes (a local store): that key is taken
                key = k
                break
        found = f"{key!r} exists; objects are create-only" if isinstance(exc, ObjectExists) else str(exc)
        return VersionTaken(
            f"{self.store.uri}/{key}: taken by an object this writer did not write, before it committed {kind} "
            f"v{version} ({found})",
            key=key,
            version=version,
        )

    def manifest(
        self,
        *,
        kind: Kind,
        version: int,
        base_version: int | None,
        shards: list[tuple[ShardEntry, list[str]]],
        tensors: dict[str, TensorEntry],
    ) -> DeltaManifest:
        """The manifest of an object whose shards are ``shards`` (entry, tensor names), in order."""
        where: dict[str, list[int]] = {}
        for i, (_, names) in enumerate(shards):
            for n in names:
                where.setdefault(n, []).append(i)
        tensors = {n: dataclasses.replace(e, shards=tuple(where.get(n, ()))) for n, e in sorted(tensors.items())}
        return DeltaManifest(
            kind=kind,
            version=version,
            base_version=base_version,
            encoding=self.encoding_of(kind),
            shards=tuple(e for e, _ in shards),
            tensors=tensors,
            model_id=self.model_id,
            run_id=self.run_id,
            lease_epoch=self.lease_epoch,
            adapter=self.adapter,
        )

    def commit(self, manifest: DeltaManifest, *, fence: Callable[[], None] | None = None) -> bytes:
        """Validate the manifest, write its signature (with a key) and then the manifest itself: the commit.

        Args:
            manifest: what to commit.
            fence: called at the last moment before the manifest is written (a publisher proves it still
                holds the run's lease there); what it raises aborts the commit.

        Returns:
            The manifest's bytes (register their sha256 with the coordinator).

        Raises:
            VersionTaken: the signature's or the manifest's key is taken (another writer, or a planted object):
                nothing was committed, and this writer's signature is taken back.
        """
        data = manifest.to_json()
        DeltaManifest.from_json(data, name=f"{manifest.kind} v{manifest.version}")  # never commit what readers refuse
        version, kind = manifest.version, manifest.kind
        prefix = prefix_of(manifest)  # a squash's own keys, never its version's delta's
        sig_key, key = prefix + SIGNATURE_FILE, prefix + MANIFEST_FILE
        if self.signing_key is not None:
            try:
                self.store.put(sig_key, self.signing_key.sign(data))
            except (ObjectExists, UnsafeObject) as exc:
                raise self._taken(version, kind, [sig_key], exc) from None
        if fence is not None:
            fence()
        try:
            self.store.put(key, data)
        except (ObjectExists, UnsafeObject) as exc:
            if self.signing_key is not None:
                self._take_back(sig_key)
            raise self._taken(version, kind, [key], exc) from None
        return data

    def _take_back(self, key: str) -> None:
        """Delete this writer's signature of a manifest it could not commit: a signature without its manifest
        must never meet a manifest someone else puts at that key."""
        try:
            self.store.delete(key)
        except ObjectNotFound:
            pass
        except StoreError as exc:  # it stays: it verifies only the manifest this writer never committed
            logger.warning("%s/%s: could not take back this writer's signature (%s)", self.store.uri, key, exc)

    def write(
        self,
        deltas: list[TensorDelta],
        tensors: dict[str, TensorEntry],
        *,
        kind: Kind,
        version: int,
        base_version: int | None,
    ) -> DeltaManifest:
        """Encode, write and commit a whole object in this process."""
        t0 = time.perf_counter()
        shards = self.encode(deltas, kind=kind, version=version, base_version=base_version)
        self.put_shards(version, kind, shards)
        totals: dict[str, int] = {}
        for s in shards:
            for n, (nnz, _, _) in s.tensors.items():
                totals[n] = totals.get(n, 0) + nnz
        tensors = {n: dataclasses.replace(e, nnz=totals.get(n, 0)) for n, e in tensors.items()}
        manifest = self.manifest(
            kind=kind,
            version=version,
            base_version=base_version,
            shards=[(s.entry, list(s.tensors)) for s in shards],
            tensors=tensors,
        )
        self.commit(manifest)
        logger.info(
            "published %s v%d: %d tensors, nnz=%d, %.2f MiB, %.0f ms",
            kind,
            version,
            len(deltas),
            manifest.nnz,
            manifest.total_bytes / 2**20,
            (time.perf_counter() - t0) * 1e3,
        )
        return manifest


def write_anchor(
    store: Store | ObjectWriter,
    state: Mapping[str, torch.Tensor],
    *,
    version: int,
    encoding: Encoding = "packed",
) -> DeltaManifest:
    """Publish a full snapshot of ``state`` as the anchor of ``version`` (shards first, manifest last).

    Args:
        store: a store, or an :class:`ObjectWriter` (to sign, name the model or the run, or set zstd).
        state: every tensor, by checkpoint name.
        version: the version.
        encoding: used when ``store`` is a plain store.
    """
    writer = store if isinstance(store, ObjectWriter) else ObjectWriter(store=store, encoding=encoding)
    deltas, tensors = [], {}
    for name, t in state.items():
        t = t.detach().contiguous()
        checksum = tensor_checksum(t)
        deltas.append(
            TensorDelta(ckpt_name=name, shape=tuple(t.shape), dtype=t.dtype, indices=None, values=t, checksum=checksum)
        )
        tensors[name] = TensorEntry(
            shape=tuple(t.shape),
            dtype=DTYPE_NAMES.get(t.dtype, str(t.dtype)),
            nnz=t.numel(),
            shards=(),
            checksums=((0, t.numel(), checksum),),
            sketch=tensor_sketch(t),
        )
    return writer.write(deltas, tensors, kind="anchor", version=version, base_version=None)


def write_delta(
    store: Store | ObjectWriter,
    changes: Mapping[str, TensorDelta],
    *,
    state: Mapping[str, torch.Tensor],
    version: int,
    base: DeltaManifest,
    encoding: Encoding = "packed",
) -> DeltaManifest:
    """Publish the delta ``base.version -> version``.

    Args:
        store: a store, or an :class:`ObjectWriter`.
        changes: the changed tensors, as :func:`deltasync.diff.compute_delta` returns them.
        state: the new weights (used for the checksums and sketches of the changed tensors, and for the
            sketches a base written before format 1.2 lacks).
        version: the new version, greater than ``base.version``.
        base: the manifest of the base version (delta or anchor): unchanged tensors keep its
            checksums and sketches, and the model must have the same names, shapes and dtypes.
        encoding: used when ``store`` is a plain store.

    Raises:
        ValueError: ``changes`` names a tensor the base lacks or with another shape or dtype, or ``state``
            lacks a tensor whose sketch the base does not list.
    """
    writer = store if isinstance(store, ObjectWriter) else ObjectWriter(store=store, encoding=encoding)
    if version <= base.version:
        raise ValueError(f"version {version} must be greater than the base version {base.version}")
    tensors = {n: dataclasses.replace(e, nnz=0, shards=()) for n, e in base.tensors.items()}
    deltas = []
    for name, d in changes.items():
        entry = tensors.get(name)
        if entry is None or entry.shape != d.shape or entry.dtype != DTYPE_NAMES.get(d.dtype):
            raise ValueError(
                f"tensor {name!r} ({DTYPE_NAMES.get(d.dtype)} {list(d.shape)}) does not match base "
                f"v{base.version} ({entry and [entry.dtype, list(entry.shape)]}); publish an anchor"
            )
        checksum = tensor_checksum(state[name])
        sketch = tensor_sketch(state[name])
        tensors[name] = dataclasses.replace(entry, checksums=((0, entry.numel, checksum),), sketch=sketch)
        deltas.append(dataclasses.replace(d, checksum=checksum))
    for name in [n for n, e in tensors.items() if e.sketch is None]:  # a base written before format 1.2
        if name not in state:
            raise ValueError(
                f"tensor {name!r} has no sketch in base v{base.version} (written before format 1.2) and "
                "state does not hold it; pass every tensor in state, or publish an anchor"
            )
        tensors[name] = dataclasses.replace(tensors[name], sketch=tensor_sketch(state[name]))
    return writer.write(deltas, tensors, kind="delta", version=version, base_version=base.version)
