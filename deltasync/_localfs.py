"""Local files an agent writes and an engine reads (staging, the shard cache), handled without ever following a
symbolic link: whoever else can write into those directories cannot redirect a write or a read elsewhere."""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import FormatError, UnsafeObject

__all__ = ["ensure_dir", "inside", "link_readable", "read_regular", "write_new"]

_CHUNK = 8 << 20


def ensure_dir(path: Path) -> Path:
    """``path`` as a real directory (created if missing). Raises UnsafeObject if it is a link or not a directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        path.mkdir(parents=True, exist_ok=True)
        st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeObject(f"{path} is a symlink or not a directory; deltasync never writes through links: remove it")
    return path


def inside(root: Path, path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lies under ``root`` with no symbolic link on the way (its real path is its own)."""
    absolute = os.path.abspath(path)
    return os.path.realpath(absolute) == absolute and absolute.startswith(os.path.realpath(root) + os.sep)


def write_new(path: Path, data: bytes | Sequence[bytes | memoryview]) -> str:
    """Write ``data`` (bytes, or buffers written one after the other) to ``path`` atomically: a new temporary file
    (exclusive, never through a link) renamed over ``path`` (a rename replaces a link there instead of following
    it). Returns ``str(path)``."""
    ensure_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in (data,) if isinstance(data, bytes | bytearray) else data:
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return str(path)


def link_readable(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], size: int, *, src_dir_fd: int | None = None
) -> bool:
    """Hard-link ``src`` at ``dst`` (which must not exist): another name for the same bytes, no copy, when ``src`` is
    a regular file of ``size`` bytes that every user may read (as a written copy would be: an engine of another
    user reads it), reached without following a final link. ``False`` when it cannot be (another filesystem, links
    not allowed, not that file); ``dst`` is then left absent."""
    try:
        st = os.stat(src, dir_fd=src_dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or not st.st_mode & stat.S_IROTH:
            return False
        os.link(src, dst, src_dir_fd=src_dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def read_regular(path: str | os.PathLike[str], max_bytes: int, what: str) -> memoryview:
    """A regular file (never through a final link, never a fifo or device) of at most ``max_bytes``, checked
    before reading, read into one writable buffer (not zeroed first: a first pass over a fresh gigabyte costs
    as much as reading it).

    Raises:
        FormatError: unreadable, not a regular file, or too large.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the {what} ({exc})") from None
    try:  # checked before the fd is wrapped: a directory opens, and fdopen would refuse it with the fd left open
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: the {what} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb", buffering=0) as f:
        if st.st_size > max_bytes:
            raise FormatError(f"{path}: the {what} is {st.st_size} bytes, more than the {max_bytes} allowed")
        view, n = memoryview(np.empty(st.st_size, dtype=np.uint8).data), 0
        while n < st.st_size:
            got = f.readinto(view[n : n + _CHUNK])
            if not got:
                raise FormatError(f"{path}: the {what} shrank while read ({n} of {st.st_size} bytes)")
            n += got
        return view
