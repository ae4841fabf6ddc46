"""LocalStore: a store in a local directory, with atomic writes (temp file, fsync, rename)."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from ..errors import ObjectNotFound, StoreError
from .base import check_key

__all__ = ["LocalStore"]

_TMP_PREFIX = ".tmp-"


class LocalStore:
    """A store rooted at a local directory (created on the first write).

    Writes go to a hidden temporary file in the target directory, are fsynced, renamed over the
    key and the directory is fsynced, so a crash leaves either the old object or the new one.
    Temporary files are invisible to :meth:`list`.

    Example:
        >>> store = LocalStore("/tmp/run1")  # doctest: +SKIP
        >>> store.put("v00000001/manifest.json", b"{}")  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    @property
    def uri(self) -> str:
        """``file://`` URI of the root."""
        return self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _write_atomic(self, key: str, write: object) -> None:
        target = self._path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.parent / f"{_TMP_PREFIX}{target.name}.{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    write(f)  # type: ignore[operator]
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                raise
            dir_fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StoreError(f"{self.uri}: could not write {key!r} ({exc})") from exc

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Write an object atomically, replacing any object under ``key``."""
        self._write_atomic(key, lambda f: f.write(data))

    def put_many(self, items: Iterable[tuple[str, bytes | bytearray | memoryview]]) -> None:
        """Write several objects, each atomically."""
        for key, data in items:
            self.put(key, data)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Copy a local file in atomically."""

        def copy(dst: BinaryIO) -> None:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, dst, 8 << 20)

        self._write_atomic(key, copy)

    def get(self, key: str) -> bytes:
        """Read a whole object."""
        with self.open(key) as f:
            return f.read()

    def open(self, key: str) -> BinaryIO:
        """Open an object for streaming reads."""
        path = self._path(key)
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.uri}: no object {key!r}") from None
        except OSError as exc:
            raise StoreError(f"{self.uri}: could not read {key!r} ({exc})") from exc

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        """Keys under a directory-like ``prefix`` (``""`` or ending in ``/``), sorted.

        Raises:
            ObjectNotFound: the store's root directory does not exist.
        """
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must be empty or end with '/'")
        if not self.root.is_dir():
            raise ObjectNotFound(f"{self.uri}: the store directory does not exist")
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root)
            keys.extend("/".join((*rel.parts, f)) for f in filenames if not f.startswith("."))
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Delete an object and any directories it leaves empty."""
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.uri}: no object {key!r}") from None
        except OSError as exc:
            raise StoreError(f"{self.uri}: could not delete {key!r} ({exc})") from exc
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:  # not empty (or raced with a writer): stop climbing
                break
            parent = parent.parent
