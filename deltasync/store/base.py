"""The Store protocol: where shards and manifests live (a local directory, a Hub bucket, ...)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import BinaryIO, Protocol, runtime_checkable

__all__ = ["MAX_KEY_CHARS", "Store", "check_key", "check_unique_keys"]

_KEY_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
MAX_KEY_CHARS = 1024


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe store key, else raise ``ValueError`` naming it.

    A key is a relative ``/``-separated path of segments made of letters, digits, ``.``, ``_``
    and ``-``, each starting with a letter or digit: no absolute paths, no ``..``, no
    backslashes, no empty segments, no hidden names. This rules out path traversal everywhere.
    """
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        raise ValueError(f"store key {key!r} must be a non-empty string of at most {MAX_KEY_CHARS} characters")
    for seg in key.split("/"):
        if not _KEY_SEGMENT.fullmatch(seg):
            raise ValueError(
                f"store key {key!r} has an invalid segment {seg!r}: expected letters, digits, '.', '_' "
                "or '-', starting with a letter or digit (no '..', no absolute paths)"
            )
    return key


def check_unique_keys(keys: Iterable[str]) -> None:
    """Raise ``ValueError`` naming the first key that comes twice in one batch (``put_many`` writes none then:
    the second write of a key would either fail after the first landed, or replace it)."""
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"store key {key!r} comes twice in one put_many batch; nothing was written")
        seen.add(key)


@runtime_checkable
class Store(Protocol):
    """Object storage for published versions.

    Keys are relative paths (see :func:`check_key`). Writes are **create-only**: a key, once written, is
    never written again (``ObjectExists``), so a registered object's bytes can never change. Each write is
    atomic: a reader sees the whole object or none of it. Reads are bounded: ``get`` checks an object's size
    before reading it. Implementations are safe to call from several threads.
    """

    @property
    def uri(self) -> str:
        """The URI that :func:`deltasync.open_store` maps back to this store."""
        ...

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Create an object atomically. Raises ObjectExists if the key is taken."""
        ...

    def put_many(self, items: Iterable[tuple[str, bytes | bytearray | memoryview]]) -> None:
        """Create several objects (a version's shards): one batch where the store has batches. Raises
        ObjectExists, before writing any, if a key is taken, and ValueError, before writing any, if a key
        comes twice in the batch."""
        ...

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Create an object atomically from a local file, streaming. Raises ObjectExists if the key is taken."""
        ...

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Read a whole object.

        Raises:
            ObjectNotFound: there is none.
            ObjectTooLarge: it is larger than ``max_bytes`` (checked before reading).
            UnsafeObject: the key leads to something that is not a regular file.
        """
        ...

    def open(self, key: str) -> BinaryIO:
        """Open an object for streaming reads. Raises ObjectNotFound if there is none."""
        ...

    def size(self, key: str) -> int:
        """An object's size in bytes, without reading it. Raises ObjectNotFound if there is none."""
        ...

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (a directory-like prefix ending in ``/``, or ``""``), sorted."""
        ...

    def delete(self, key: str) -> None:
        """Delete an object. Raises ObjectNotFound if there is none."""
        ...
