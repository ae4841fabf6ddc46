"""Where a published object lives in a store: the one place that spells its keys.

::

    v00000012/shard-00000.safetensors            delta 11 -> 12: shards first,
    v00000012/manifest.sig                       the publisher's signature (optional), then
    v00000012/manifest.json                      the manifest, LAST: the commit marker
    v00000012/anchor/...                         the same for the anchor at 12
"""

from __future__ import annotations

import re

from .vocab import MAX_VERSION, Kind

__all__ = [
    "MANIFEST_FILE",
    "SIGNATURE_FILE",
    "manifest_key",
    "object_prefix",
    "parse_manifest_key",
    "shard_file",
    "signature_key",
    "version_of_key",
]

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "manifest.sig"

_MANIFEST_KEY = re.compile(r"v(\d{8})/(anchor/)?manifest\.json")
_VERSION_DIR = re.compile(r"v(\d{8})/")


def object_prefix(version: int, kind: Kind) -> str:
    """Key prefix of a published object: ``v00000012/`` (delta) or ``v00000012/anchor/``.

    Raises:
        ValueError: ``version`` is outside ``[0, MAX_VERSION]``.
    """
    if type(version) is not int or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version must be an int in [0, {MAX_VERSION}], got {version!r}")
    return f"v{version:08d}/" + ("anchor/" if kind == "anchor" else "")


def manifest_key(version: int, kind: Kind) -> str:
    """Key of an object's manifest (its commit marker)."""
    return object_prefix(version, kind) + MANIFEST_FILE


def signature_key(version: int, kind: Kind) -> str:
    """Key of an object's detached manifest signature."""
    return object_prefix(version, kind) + SIGNATURE_FILE


def shard_file(index: int) -> str:
    """File name of shard ``index`` (relative to the object's prefix)."""
    return f"shard-{index:05d}.safetensors"


def parse_manifest_key(key: str) -> tuple[int, Kind] | None:
    """``(version, kind)`` of a manifest key, or ``None`` if ``key`` is not one."""
    m = _MANIFEST_KEY.fullmatch(key)
    if m is None:
        return None
    return int(m.group(1)), "anchor" if m.group(2) else "delta"


def version_of_key(key: str) -> int | None:
    """The version directory a key lies in (committed or not), or ``None``."""
    m = _VERSION_DIR.match(key)
    return int(m.group(1)) if m else None
