"""The typed message between an agent and its engine: one verified object, staged for applying.

The agent fetches and authenticates an object and stages it, in a directory the engine can read, one of two ways:

* **as published** (:func:`stage_published`, ``published=True``): the verified ``manifest.json`` and the shards
  exactly as fetched. The engine checks each shard's size and sha256 against the manifest and decodes it against
  what it serves (a ``packed`` delta is coded against the base version's values: the engine reads only the changed
  elements of its own). The agent holds no copy of the model. Engines that can read every tensor they serve say so
  (``decodes`` in their status).
* **decoded** (:func:`stage_object`): the agent decodes the object against its host copy of the model, proves
  the result against the manifest's checksums, and stages the manifest and the object re-encoded ``raw`` (no base
  needed to decode it). For engines whose ranks hold no part of some tensors (pipeline parallel in place).

A :class:`StagedObject` names those files; it crosses vLLM's RPC boundary as ``update_info``
(:meth:`to_update_info` / :meth:`from_update_info`), parsed and validated once. In-process engines take the decoded
entries directly (:attr:`deltas`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._localfs import ensure_dir, inside, read_regular, write_new
from ._shard_header import parse_shard
from .apply import check_decoded
from .errors import FormatError
from .format import BaseValues, TensorDelta, decode_shard, encode_shard_parts
from .layout import MANIFEST_FILE, shard_file
from .manifest import MAX_MANIFEST_BYTES, DeltaManifest, ShardEntry
from .reader import decode_object
from .vocab import DTYPES, KINDS, MAX_VERSION, Kind

__all__ = ["StagedObject", "StagedUpdate", "read_staged", "read_staged_manifest", "stage_object", "stage_published"]

_FIELDS = ("kind", "version", "base_version", "manifest_path", "shard_paths", "published")
_MAX_OBJECTS = 10_000


@dataclass(frozen=True, kw_only=True, slots=True)
class StagedObject:
    """One object ready to apply: a delta ``base_version -> version`` or an anchor at ``version``.

    The engine trusts nothing in this message that it can check: it re-reads and re-validates the staged
    manifest, requires the message's kind and versions to match it, and checks every staged shard against it.
    """

    kind: Kind
    """``delta`` or ``anchor``."""
    version: int
    """The version the object produces."""
    base_version: int | None
    """A delta's base: the engine must hold exactly this version."""
    manifest_path: str
    """The staged, verified ``manifest.json`` (model fingerprint, run, checksums of the result)."""
    shard_paths: tuple[str, ...]
    """The staged shards, local paths every rank can read: the manifest's shards in order (``published``), or one
    ``raw`` shard the agent decoded."""
    published: bool = False
    """The shards are the published ones, as fetched: the engine decodes them against what it serves."""
    manifest: DeltaManifest | None = dataclasses.field(default=None, compare=False)
    """The parsed manifest (in-process engines; not sent over RPC)."""
    deltas: tuple[TensorDelta, ...] | None = dataclasses.field(default=None, compare=False, repr=False)
    """The decoded entries (in-process engines; not sent over RPC)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"staged object: kind must be one of {list(KINDS)}, got {self.kind!r}")
        if type(self.version) is not int or not 0 <= self.version <= MAX_VERSION:
            raise ValueError(f"staged object: version must be an int in [0, {MAX_VERSION}], got {self.version!r}")
        if self.kind == "delta" and (type(self.base_version) is not int or not 0 <= self.base_version < self.version):
            raise ValueError(f"staged object: a delta needs 0 <= base_version < version, got {self.base_version!r}")
        if self.kind == "anchor" and self.base_version is not None:
            raise ValueError(f"staged object: an anchor has no base_version, got {self.base_version!r}")
        if not isinstance(self.manifest_path, str) or not self.manifest_path:
            raise ValueError("staged object: manifest_path must be a path")
        if not all(isinstance(p, str) and p for p in self.shard_paths):
            raise ValueError("staged object: shard_paths must be paths")
        if type(self.published) is not bool:
            raise ValueError(f"staged object: published must be a bool, got {self.published!r}")

    @property
    def label(self) -> str:
        """``delta v3 -> v4`` or ``anchor v4``, for messages."""
        return f"anchor v{self.version}" if self.kind == "anchor" else f"delta v{self.base_version} -> v{self.version}"

    def to_update_info(self) -> dict[str, Any]:
        """The JSON ``update_info`` of vLLM's ``update_weights`` (files only; no tensors cross the RPC)."""
        out = {f: getattr(self, f) for f in _FIELDS}
        out["shard_paths"] = list(self.shard_paths)
        if not self.published:
            del out["published"]  # what an engine from before published staging reads
        return out

    @classmethod
    def from_update_info(cls, info: Mapping[str, Any]) -> StagedObject:
        """Parse and validate an ``update_info``.

        Raises:
            ValueError: a missing, unknown or invalid field (named).
        """
        if not isinstance(info, Mapping):
            raise ValueError(f"update_info must be an object, got {type(info).__name__}")
        unknown = sorted(set(info) - set(_FIELDS))
        missing = sorted({"kind", "version", "manifest_path", "shard_paths"} - set(info))
        if unknown or missing:
            raise ValueError(f"update_info: unknown fields {unknown}, missing fields {missing}")
        paths = info["shard_paths"]
        if not isinstance(paths, list | tuple):
            raise ValueError(f"update_info.shard_paths must be a list, got {type(paths).__name__}")
        return cls(
            kind=info["kind"],
            version=info["version"],
            base_version=info.get("base_version"),
            manifest_path=info["manifest_path"],
            shard_paths=tuple(paths),
            published=info.get("published", False),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StagedUpdate:
    """One update session: the objects of a plan, in apply order, validated together before the first write.

    The engine serves only :attr:`target_version` (the last object's): an anchor below the engine's highest
    served version is fine on the way to a higher target.
    """

    objects: tuple[StagedObject, ...]
    """An anchor first (if any), then deltas, each on the previous one's version. An update carries no policy:
    whether an engine may go back or change runs is the operator's, set when its agent claims it
    (:class:`~deltasync.targets.EngineClaim`)."""

    def __post_init__(self) -> None:
        if not self.objects or len(self.objects) > _MAX_OBJECTS:
            raise ValueError(f"staged update: needs 1 to {_MAX_OBJECTS} objects, got {len(self.objects)}")
        for prev, obj in zip(self.objects, self.objects[1:], strict=False):
            if obj.kind == "delta" and obj.base_version != prev.version:
                raise ValueError(f"staged update: {obj.label} does not follow {prev.label}")
            if obj.kind == "anchor" and obj.version < prev.version:
                raise ValueError(f"staged update: {obj.label} goes back from {prev.label}")

    @property
    def target_version(self) -> int:
        """The version the session finishes at."""
        return self.objects[-1].version

    def to_update_info(self) -> dict[str, Any]:
        """The JSON ``update_info`` of vLLM's ``update_weights``."""
        return {"objects": [o.to_update_info() for o in self.objects]}

    @classmethod
    def from_update_info(cls, info: Mapping[str, Any]) -> StagedUpdate:
        """Parse and validate an ``update_info``.

        Raises:
            ValueError: a missing, unknown or invalid field (named).
        """
        if not isinstance(info, Mapping) or "objects" not in info:
            raise ValueError("update_info must be {'objects': [...]}")
        extra = sorted(str(k) for k in info if k != "objects")
        if extra:
            raise ValueError(
                f"update_info has unknown fields {extra}: an update carries only its objects; the rollback and run "
                "policy is the operator's, set when the agent claims the engine (deltasync agent --allow-rollback)"
            )
        objects = info["objects"]
        if not isinstance(objects, list | tuple) or len(objects) > _MAX_OBJECTS:
            raise ValueError(f"update_info.objects must be a list of at most {_MAX_OBJECTS} objects")
        return cls(objects=tuple(StagedObject.from_update_info(o) for o in objects))


def _staged(manifest: DeltaManifest, manifest_path: str, shard_paths: Sequence[str], **more: Any) -> StagedObject:
    """The staged object of ``manifest``'s object (its kind and versions), at these paths."""
    return StagedObject(
        kind=manifest.kind,
        version=manifest.version,
        base_version=manifest.base_version,
        manifest_path=manifest_path,
        shard_paths=tuple(shard_paths),
        manifest=manifest,
        **more,
    )


def in_memory(manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> StagedObject:
    """A verified object handed to an in-process engine as Python objects: no files are written or read (the
    engine still admits it, and checks its checksums after writing)."""
    return _staged(manifest, f"<in memory: v{manifest.version} {manifest.kind}>", (), deltas=tuple(deltas))


def stage_object(
    directory: str | os.PathLike[str],
    manifest: DeltaManifest,
    manifest_bytes: bytes,
    deltas: Sequence[TensorDelta],
) -> StagedObject:
    """Write a verified object into ``directory`` for an engine: its manifest and one ``raw`` shard.

    Files are written to new temporary names (never through a link) and renamed, so a reader never sees a
    partial file. ``directory`` must be one the caller created (a fresh, unpredictable one: see the agent).
    """
    root = ensure_dir(Path(directory))
    plain = [dataclasses.replace(d, base_values=None) for d in deltas]
    paths: list[str] = []
    if plain:
        data = encode_shard_parts(  # the tensors' bytes written as they are: no joined copy of the shard
            plain,
            kind=manifest.kind,
            encoding="raw",
            target_version=manifest.version,
            base_version=manifest.base_version,
        )
        paths.append(write_new(root / shard_file(0), data))
    return _staged(manifest, write_new(root / MANIFEST_FILE, manifest_bytes), paths, deltas=tuple(deltas))


def stage_published(
    directory: str | os.PathLike[str],
    manifest: DeltaManifest,
    manifest_bytes: bytes,
    shards: Sequence[bytes],
    *,
    link: Callable[[ShardEntry, Path], bool] | None = None,
) -> StagedObject:
    """Write an authenticated object into ``directory`` as it was published: its manifest and its shards (the
    manifest's names, in order), for an engine that decodes them itself. Written as :func:`stage_object` writes;
    ``link(entry, path)`` may instead give a shard's path another name for the same verified bytes (a hard link to
    the fetcher's copy: no copy of a large anchor), returning ``False`` where it cannot."""
    root = ensure_dir(Path(directory))
    if len(shards) != len(manifest.shards):
        raise ValueError(f"stage_published: {len(shards)} shards for a manifest of {len(manifest.shards)}")
    paths = [
        str(root / entry.file)
        if link is not None and link(entry, root / entry.file)
        else write_new(root / entry.file, data)
        for entry, data in zip(manifest.shards, shards, strict=True)
    ]
    return _staged(manifest, write_new(root / MANIFEST_FILE, manifest_bytes), paths, published=True)


def read_staged_manifest(obj: StagedObject, *, root: str | os.PathLike[str] | None) -> DeltaManifest:
    """A staged object's manifest, read and checked against the message: :func:`read_staged`'s first step (an
    engine admits an object by its manifest before it decodes anything against what it serves).

    Raises:
        FormatError: as :func:`read_staged`.
    """
    if root is None:
        raise FormatError(
            f"staged {obj.label}: this receiver has no staging directory (its agent names one at init, "
            "staging_root=...); refusing files an update message names"
        )
    stray = [p for p in (obj.manifest_path, *obj.shard_paths) if not inside(Path(root), p)]
    if stray:
        raise FormatError(
            f"staged {obj.label}: {stray[0]} is not inside the staging directory {root} (or goes through a "
            "symlink); refusing to read it"
        )
    data = bytes(read_regular(obj.manifest_path, MAX_MANIFEST_BYTES, "manifest"))
    manifest = DeltaManifest.from_json(data, name=obj.manifest_path)
    if (manifest.kind, manifest.version, manifest.base_version) != (obj.kind, obj.version, obj.base_version):
        raise FormatError(
            f"{obj.manifest_path}: the staged manifest is {manifest.kind} v{manifest.version} (base "
            f"{manifest.base_version}), the update message says {obj.label}"
        )
    return manifest


def read_staged(
    obj: StagedObject,
    *,
    root: str | os.PathLike[str] | None = None,
    base: Mapping[str, torch.Tensor] | BaseValues | None = None,
    manifest: DeltaManifest | None = None,
) -> tuple[DeltaManifest, list[TensorDelta]]:
    """Read and check a staged object: its manifest, then each shard against it; nothing is applied.

    Objects built in this process (:attr:`StagedObject.deltas`) are returned as they are.

    Args:
        obj: the staged object.
        root: the staging directory the receiver accepts files from (named by its agent at ``init``): every
            path must lie under it with no symbolic link on the way (an update message cannot point anywhere
            else). Required for objects given as files.
        base: what a ``published`` delta's ``packed`` entries are decoded against: the base version's values
            (:func:`~deltasync.reader.decode_object`).
        manifest: the staged manifest as :func:`read_staged_manifest` read it (and the caller admitted it): the
            shards are checked against this one, and the file is not read again.

    Raises:
        FormatError: no ``root`` was named, a file is outside it, unreadable, malformed, or disagrees with the
            manifest or with the message (``IntegrityError``: a published shard's size or sha256 is not the
            manifest's).
        ValueError: a published delta's packed entries need ``base`` and none was given.
    """
    if obj.manifest is not None and obj.deltas is not None:
        return obj.manifest, list(obj.deltas)
    if manifest is None:
        manifest = read_staged_manifest(obj, root=root)
    where = f"{os.path.dirname(obj.manifest_path)}/"
    if obj.published:
        if len(obj.shard_paths) != len(manifest.shards):
            raise FormatError(
                f"{obj.manifest_path}: {len(obj.shard_paths)} staged shards, the manifest has {len(manifest.shards)}"
            )
        # each shard read into its own buffer, hashed against the manifest and decoded in place (decode_object)
        pairs = zip(obj.shard_paths, manifest.shards, strict=True)
        return manifest, decode_object(
            manifest, [read_regular(p, e.bytes, "shard") for p, e in pairs], where=where, base=base
        )
    cap = 1 << 20  # header and alignment
    for entry in manifest.tensors.values():
        cap += entry.nnz * (DTYPES[entry.dtype].itemsize + 8)
    deltas: list[TensorDelta] = []
    for path in obj.shard_paths:
        shard = read_regular(path, cap, "shard")
        header, _ = parse_shard(shard, path)
        got = (header.kind, header.encoding, header.base_version, header.target_version)
        want = (manifest.kind, "raw", manifest.base_version, manifest.version)
        if got != want:
            raise FormatError(f"{path}: staged shard is {got} (kind, encoding, base, target), expected {want}")
        for t, info in header.tensors.items():
            e = manifest.tensors.get(t)
            if e is None or e.shape != info.shape or e.dtype != info.dtype or info.nnz > e.nnz:
                raise FormatError(f"{path}: tensor {t!r} does not match the staged manifest's entry {e}")
        deltas.extend(decode_shard(shard, name=path)[1].values())
    check_decoded(manifest, deltas, where=where)
    return manifest, deltas
