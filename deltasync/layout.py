"""Where a published object lives in a store: the one place that spells its keys.

::

    v00000012/shard-00000.safetensors            delta 11 -> 12: shards first,
    v00000012/manifest.sig                       the publisher's signature (optional), then
    v00000012/manifest.json                      the manifest, LAST: the commit marker
    v00000012/anchor/...                         the same for the anchor at 12
    v00000012/squash-00000004/...                the same for the squash 4 -> 12 (a delta over several versions)
"""

from __future__ import annotations

import re
from typing import Protocol

from .vocab import MAX_VERSION, Kind, ObjectKind

__all__ = [
    "MANIFEST_FILE",
    "SIGNATURE_FILE",
    "manifest_key",
    "object_prefix",
    "parse_manifest_key",
    "parse_squash_key",
    "prefix_of",
    "shard_file",
    "signature_key",
    "version_of_key",
]

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "manifest.sig"

_MANIFEST_KEY = re.compile(r"v(\d{8})/(anchor/)?manifest\.json")
_VERSION_DIR = re.compile(r"v(\d{8})/")
_SQUASH_DIR = re.compile(r"v(\d{8})/squash-(\d{8})/")


def _check_version(version: int, what: str = "version") -> None:
    if type(version) is not int or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"{what} must be an int in [0, {MAX_VERSION}], got {version!r}")


def object_prefix(version: int, kind: ObjectKind, base_version: int | None = None) -> str:
    """Key prefix of a published object: ``v00000012/`` (delta), ``v00000012/anchor/``, or
    ``v00000012/squash-00000004/`` (the squash ``4 -> 12``: it needs ``base_version``).

    Raises:
        ValueError: ``version`` is outside ``[0, MAX_VERSION]``, or a squash's base is not below it.
    """
    _check_version(version)
    if kind == "squash":
        if base_version is None:
            raise ValueError(f"a squash to v{version} needs its base_version")
        _check_version(base_version, "base_version")
        if base_version >= version:
            raise ValueError(f"a squash needs base_version < version, got {base_version} -> {version}")
        return f"v{version:08d}/squash-{base_version:08d}/"
    return f"v{version:08d}/" + ("anchor/" if kind == "anchor" else "")


class _Located(Protocol):
    """What :func:`prefix_of` reads of a :class:`~deltasync.manifest.DeltaManifest` (the layout sits beside the
    manifest, below it in no way)."""

    @property
    def version(self) -> int: ...
    @property
    def kind(self) -> Kind: ...
    @property
    def base_version(self) -> int | None: ...
    @property
    def squash(self) -> bool: ...


def prefix_of(manifest: _Located) -> str:
    """Key prefix of the object a manifest describes: its kind's, or a squash's when it was read from (or is
    written to) a squash's keys (:attr:`~deltasync.manifest.DeltaManifest.squash`)."""
    if manifest.squash:
        return object_prefix(manifest.version, "squash", manifest.base_version)
    return object_prefix(manifest.version, manifest.kind)


def manifest_key(version: int, kind: ObjectKind, base_version: int | None = None) -> str:
    """Key of an object's manifest (its commit marker)."""
    return object_prefix(version, kind, base_version) + MANIFEST_FILE


def signature_key(version: int, kind: ObjectKind, base_version: int | None = None) -> str:
    """Key of an object's detached manifest signature."""
    return object_prefix(version, kind, base_version) + SIGNATURE_FILE


def shard_file(index: int) -> str:
    """File name of shard ``index`` (relative to the object's prefix)."""
    return f"shard-{index:05d}.safetensors"


def parse_manifest_key(key: str) -> tuple[int, Kind] | None:
    """``(version, kind)`` of a delta's or an anchor's manifest key, or ``None`` if ``key`` is not one (a squash's
    manifest key is :func:`parse_squash_key`'s: a reader that lists versions never takes it for the delta)."""
    m = _MANIFEST_KEY.fullmatch(key)
    if m is None:
        return None
    return int(m.group(1)), "anchor" if m.group(2) else "delta"


def parse_squash_key(key: str) -> tuple[int, int] | None:
    """``(version, base_version)`` of any key under a squash's prefix, or ``None``."""
    m = _SQUASH_DIR.match(key)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2))


def version_of_key(key: str) -> int | None:
    """The version directory a key lies in (committed or not), or ``None``."""
    m = _VERSION_DIR.match(key)
    return int(m.group(1)) if m else None
