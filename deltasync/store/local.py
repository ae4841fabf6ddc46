"""LocalStore: a store in a local directory. Create-only atomic writes; bounded reads of regular files only.

Every path is walked one component at a time from a descriptor of the root (``openat`` with
``O_NOFOLLOW``), so no read, write or delete ever follows a symbolic link or leaves the root, whatever
another process does to the tree meanwhile.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import stat
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .._localfs import link_readable
from ..errors import ObjectExists, ObjectNotFound, ObjectTooLarge, StoreError, UnsafeObject
from .base import check_key, check_unique_keys

__all__ = ["MAX_DEPTH", "LocalStore"]

_TMP_PREFIX = ".tmp-"
MAX_DEPTH = 16
"""Directories deeper than this below the root are not listed (deltasync's own keys are 3 deep)."""

logger = logging.getLogger(__name__)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a fifo cannot hang us
_MAX_READ = 0x7FFFF000  # the most one read(2) returns on Linux
_CHUNK = 8 << 20


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a fifo"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


class LocalStore:
    """A store rooted at a local directory (created on the first write).

    Writes go to a hidden temporary file in the target directory, are fsynced, then hard-linked to the key
    (which fails if the key exists: create-only) and the directory is fsynced, so a crash leaves either no
    object or the whole one. Temporary files are invisible to :meth:`list`. Reads open regular files only,
    never through a symlink, and check the size before reading.

    The root itself may be a symlink (an operator's choice, resolved once); nothing below it may.

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

    # ------------------------------------------------------------------ descriptors

    def _root_fd(self, create: bool) -> int:
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise ObjectNotFound(f"{self.uri}: the store directory does not exist") from None
            self.root.mkdir(parents=True, exist_ok=True)
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    @contextmanager
    def _dir(self, parts: builtins.list[str], *, create: bool) -> Iterator[int]:
        """A descriptor of the directory ``root/parts``, walked without following links."""
        fd = self._root_fd(create)
        try:
            for i, part in enumerate(parts):
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise ObjectNotFound(f"{self.uri}: no object under {'/'.join(parts[: i + 1])!r}") from None
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass  # another writer made it
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnsafeObject(
                            f"{self.uri}: {'/'.join(parts[: i + 1])!r} is a symlink or not a directory; "
                            "deltasync never follows links inside a store: remove it"
                        ) from None
                    raise
                os.close(fd)
                fd = nfd
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _split(key: str) -> tuple[builtins.list[str], str]:
        parts = check_key(key).split("/")
        return parts[:-1], parts[-1]

    def _wrap(self, key: str, action: str, exc: OSError) -> StoreError:
        return StoreError(f"{self.uri}: could not {action} {key!r} ({exc})")

    @contextmanager
    def _entry(self, key: str, action: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """The descriptor of the directory that holds ``key`` (made on the way with ``create``) and the key's file
        name there. What fails in the body is told about ``key``: a missing directory or file is ObjectNotFound
        (without ``create``), another OS error a StoreError saying it could not ``action`` it."""
        dirs, name = self._split(key)
        try:
            with self._dir(dirs, create=create) as dfd:
                yield dfd, name
        except ObjectNotFound:
            raise ObjectNotFound(f"{self.uri}: no object {key!r}") from None
        except StoreError:
            raise
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and not create:
                raise ObjectNotFound(f"{self.uri}: no object {key!r}") from None
            raise self._wrap(key, action, exc) from exc

    # ------------------------------------------------------------------ writes

    def _create(self, key: str, write: object) -> None:
        with self._entry(key, "write", create=True) as (dfd, name):
            if self._lexists(dfd, name):
                raise ObjectExists(f"{self.uri}: {key!r} exists; objects are create-only (another writer?)")
            tmp = f"{_TMP_PREFIX}{name}.{uuid.uuid4().hex}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    write(f)  # type: ignore[operator]
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    raise ObjectExists(
                        f"{self.uri}: {key!r} exists; objects are create-only (another writer?)"
                    ) from None
            finally:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except FileNotFoundError:
                    pass
            os.fsync(dfd)

    @staticmethod
    def _lexists(dfd: int, name: str) -> bool:
        try:
            os.stat(name, dir_fd=dfd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Create an object atomically. Raises ObjectExists if the key is taken."""
        self._create(key, lambda f: f.write(data))

    def put_many(self, items: Iterable[tuple[str, bytes | bytearray | memoryview]]) -> None:
        """Create several objects, each atomically; refuses them all if one key is taken."""
        items = list(items)
        check_unique_keys(key for key, _ in items)
        for key, _ in items:
            if self.exists(key) or self._is_link(key):
                raise ObjectExists(f"{self.uri}: {key!r} exists; objects are create-only (another writer?)")
        for key, data in items:
            self.put(key, data)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Copy a local file in atomically. Raises ObjectExists if the key is taken."""

        def copy(dst: BinaryIO) -> None:
            with open(path, "rb") as src:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)

        self._create(key, copy)

    # ------------------------------------------------------------------ reads

    @contextmanager
    def _open_regular(self, key: str) -> Iterator[tuple[int, os.stat_result]]:
        with self._entry(key, "read") as (dfd, name):
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafeObject(
                        f"{self.uri}: {key!r} is a symlink; deltasync reads only regular files: remove it"
                    ) from None
                raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeObject(
                    f"{self.uri}: {key!r} is {_kind(st.st_mode)}; deltasync reads only regular files: remove it"
                )
            os.set_blocking(fd, True)
            yield fd, st
        finally:
            os.close(fd)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Read a whole object; its size is checked against ``max_bytes`` before a byte is read."""
        with self._open_regular(key) as (fd, st):
            if max_bytes is not None and st.st_size > max_bytes:
                raise ObjectTooLarge(
                    f"{self.uri}: {key!r} is {st.st_size} bytes, more than the {max_bytes} allowed; not read"
                )
            limit = st.st_size if max_bytes is None else max_bytes
            chunks, total = [], 0
            try:
                # read at most limit + 1 bytes (a file that grows cannot exhaust memory), in as few calls as the
                # kernel allows: one allocation, no join, for any object under _MAX_READ
                while total <= limit:
                    chunk = os.read(fd, min(_MAX_READ, limit + 1 - total))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    total += len(chunk)
            except OSError as exc:
                raise self._wrap(key, "read", exc) from exc
            if max_bytes is not None and total > max_bytes:
                raise ObjectTooLarge(f"{self.uri}: {key!r} grew past the {max_bytes} bytes allowed while read")
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def link_to(self, key: str, dst: str | os.PathLike[str], size: int) -> bool:
        """Hard-link object ``key`` at ``dst`` (:func:`~deltasync._localfs.link_readable`; no link followed on the
        way to it either). ``False`` when it cannot be."""
        dirs, name = self._split(key)
        try:
            with self._dir(dirs, create=False) as dfd:
                return link_readable(name, dst, size, src_dir_fd=dfd)
        except (OSError, StoreError):
            return False

    def open(self, key: str) -> BinaryIO:
        """Open an object (a regular file, never through a link) for streaming reads."""
        with self._open_regular(key) as (fd, _):
            return os.fdopen(os.dup(fd), "rb")

    def size(self, key: str) -> int:
        """An object's size in bytes."""
        with self._open_regular(key) as (_, st):
            return st.st_size

    def _lstat_mode(self, key: str) -> int | None:
        """The mode of what ``key`` names, without following a final link (``None``: nothing there)."""
        dirs, name = self._split(key)
        try:
            with self._dir(dirs, create=False) as dfd:
                return os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
        except (StoreError, OSError):
            return None

    def _is_link(self, key: str) -> bool:
        mode = self._lstat_mode(key)
        return mode is not None and stat.S_ISLNK(mode)

    def exists(self, key: str) -> bool:
        """Whether a regular file is stored under ``key`` (a symlink there does not count)."""
        mode = self._lstat_mode(key)
        return mode is not None and stat.S_ISREG(mode)

    def list(self, prefix: str = "") -> list[str]:
        """Keys of the regular files under a directory-like ``prefix`` (``""`` or ending in ``/``), sorted.

        Symlinks, devices and hidden names are skipped, and symlinked directories are not entered.

        Raises:
            ObjectNotFound: the store's root directory does not exist.
            UnsafeObject: ``prefix`` itself leads through a symlink.
        """
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must be empty or end with '/'")
        if not self.root.is_dir():
            raise ObjectNotFound(f"{self.uri}: the store directory does not exist")
        parts = check_key(prefix.rstrip("/")).split("/") if prefix else []
        keys: builtins.list[str] = []
        try:
            with self._dir(parts, create=False) as dfd:
                self._walk(dfd, parts, keys)
        except ObjectNotFound:
            return []
        return sorted(keys)

    def _walk(self, dfd: int, parts: builtins.list[str], out: builtins.list[str]) -> None:
        """Regular files below ``dfd``, iteratively (no recursion to exhaust), at most :data:`MAX_DEPTH` deep."""
        stack: builtins.list[tuple[int, builtins.list[str], bool]] = [(dfd, parts, False)]
        while stack:
            fd, where, owned = stack.pop()
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if entry.name.startswith("."):
                            continue
                        if entry.is_dir(follow_symlinks=False):
                            if len(where) + 1 >= MAX_DEPTH:
                                logger.warning(
                                    "%s: %s is deeper than %d levels; not listed", self.uri, "/".join(where), MAX_DEPTH
                                )
                                continue
                            try:
                                sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                            except OSError:
                                continue  # replaced by a link or removed meanwhile: not ours to list
                            stack.append((sub, [*where, entry.name], True))
                        elif entry.is_file(follow_symlinks=False):
                            out.append("/".join([*where, entry.name]))
            finally:
                if owned:
                    os.close(fd)

    # ------------------------------------------------------------------ deletes

    def delete(self, key: str) -> None:
        """Delete a regular file (never a link, never outside the root) and the directories it leaves empty."""
        with self._entry(key, "delete") as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeObject(
                    f"{self.uri}: {key!r} is {_kind(st.st_mode)}; deltasync deletes only regular files it "
                    "wrote, never through a link: remove it by hand"
                )
            os.unlink(name, dir_fd=dfd)
        dirs = self._split(key)[0]
        for depth in range(len(dirs), 0, -1):  # remove emptied directories, innermost first
            try:
                with self._dir(dirs[: depth - 1], create=False) as parent:
                    os.rmdir(dirs[depth - 1], dir_fd=parent)
            except (OSError, StoreError):  # not empty (or raced with a writer): stop climbing
                break
