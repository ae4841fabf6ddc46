"""S3Store: a store in an S3 bucket (``s3://bucket/prefix``: AWS, R2, MinIO, ...), on obstore; ``gs://`` and
``az://`` through the same class.

Library choice, measured with ``benchmarks/bench_store.py`` against moto's S3 server on 127.0.0.1 (2 cores
shared with other work, load 2-7; three runs, MB/s, whole-object fetch)::

                                     100 MB anchor       12 MB delta
    obstore, one GET                 241 / 391 / 162    781 / 514 / 400
    obstore, ranged GETs (8 threads)  53 /  76 /  33    177 / 189 / 151
    s3fs cat_file                     61 / 145 /  51    238 / 243 / 188
    boto3 get_object                 373 / 348 / 176    451 / 280 / 303
    boto3 download_fileobj (8 thr.)   47 /  74 /  38    200 / 131 / 125
    upload, one PUT: obstore (create-only) 113 / 115 / 86, s3fs 97 / 77 / 63, boto3 116 / 97 / 73

obstore (Rust ``object_store``) and boto3's plain GET are level on the anchor and obstore is ahead on the
delta; both are 2-3x s3fs. obstore is chosen because it does its I/O without the GIL (the publisher uploads
from a thread next to the training loop; boto3 reads bodies in Python), it has create-only puts
(``If-None-Match: *``) and a create-only copy, and the same API gives GCS and Azure. boto3 only lists (see
Keys). moto is one Python process, so parallel ranged GETs lose to one GET here (3x on the anchor); on S3,
where one connection gives ~100 MB/s, they are the standard way to fill a link, so objects of at least
``parallel_bytes`` (64 MiB) are fetched in ranges: that default rests on S3's guidance, not on a figure
measured here. Through this class (put_many + get, same objects, two runs): s3:// put 54 / 69 MB/s on the
anchor, 103 / 63 on the delta; get 62 / 73 (ranged) or 178 / 111 (one GET) on the anchor, 188 / 112 on the
delta; a local directory store: put 229 / 142 and 187 / 130, get 1204 / 497 and 2523 / 2847.

Guarantees, and how:

* **Create-only.** Objects below ``multipart_bytes`` go up in one ``PUT`` with ``If-None-Match: *``; larger
  ones as a parallel multipart upload to a hidden staging key (``.uploads/``, never listed), then a copy that
  completes only if the key is still free (``If-None-Match`` on ``CompleteMultipartUpload``), then the staging
  object is deleted. A 412 is :class:`ObjectExists`. A service that ignores ``If-None-Match`` is detected on the
  first write (a hidden probe object written twice; for the copy, on the first large write, a probe copied
  twice); then those writes fall back to HEAD-then-PUT, and two writers
  racing between the HEAD and the PUT can overwrite each other: the coordinator's publisher lease (one
  publisher per run) is what keeps them apart there. A retried put that meets a 412 reads the object back:
  if its bytes are ours (the first attempt landed, its answer was lost) the put succeeded.
  Racing writers are only as safe as the service's conditional writes are atomic. S3 decides the condition and
  the write in one step. moto (the test server) does not: its PUT and ``CompleteMultipartUpload`` check
  ``If-None-Match`` and then write, with no lock between, so several concurrent create-only writes of one key
  can all "succeed" there, the last one's bytes winning; the probe cannot see this (it writes twice in
  sequence). The race tests therefore forward one write at a time (``FaultProxy(serialize_writes=True)``), as
  S3 decides them. A check after the copy is not done: obstore's copy returns no ETag to compare with a HEAD,
  and reading the object back would only narrow the window, not close it. On such a service, the coordinator's
  publisher lease (one publisher per run) is what keeps writers apart.
* **Not an authenticity boundary.** Anyone who can write to the bucket can plant a well-formed version; the
  store only guarantees an object is not changed once written. Readers that must know who wrote a version
  verify it against the coordinator (``--coordinator``) or a signature (``--public-key``).
* **Never truncated, never mixed.** Every read is a ranged ``GET`` pinned to the ETag of a ``HEAD`` (a ``HEAD``
  without one is refused): ``If-Match`` is sent, and each answer's ETag and total size (``Content-Range``) are
  compared with the pinned ones, so a service or proxy that drops ``If-Match`` cannot hand back the bytes of an
  object deleted and re-written mid-read. The answer must be exactly the bytes asked for, or it is retried (a
  cut connection) or refused (a size or ETag that disagrees; a whole object sent for a range).
* **Bounded.** ``get(max_bytes=)`` checks the ``HEAD`` size first; a body is never read past the size asked, and
  no more than 64 MiB is allocated on a ``HEAD``'s word before the first ``GET`` confirms the size.
* **Retries.** 408/429/5xx, 409 (S3's ``ConditionalRequestConflict``, two conditional writes at once: the
  retry gets the 412) and transport errors (reset, refused, timeout, cut mid-body) are retried with
  exponential backoff and jitter, ``transfer.retries`` times, then raise :class:`StoreError` naming the bucket
  and key. obstore's own retries are off, so a create-only put is never re-sent behind our back.
* **Keys.** Every key passes :func:`check_key`; listed keys that do not (written by something else) are
  skipped, with one warning per key. S3 listings go through boto3 (also in the ``[s3]`` extra), which returns
  keys as stored: obstore aborts a whole listing over one key it cannot parse (``a//b``, ``../x``: one hostile
  key would hide every version), and lists a folder marker ``x/`` (what consoles' "create folder" writes) as
  a key ``x``. The one obstore listing left on S3, the bucket check after a HEAD's 404, takes such a key as
  proof that the bucket exists and skips it with the same warning (the read is ObjectNotFound, as without it);
  on ``gs://`` and ``az://``, which list through obstore, ``list()`` raises StoreError naming the key (issue
  21). No request lets an obstore exception out: each is translated into ObjectNotFound, ObjectExists or
  StoreError, naming the store, the request and the key.

GCS and Azure: opened with obstore's ``GCSStore`` / ``AzureStore`` and the standard environment
(``GOOGLE_APPLICATION_CREDENTIALS``; ``AZURE_STORAGE_ACCOUNT_NAME`` and a key or token). Only their
construction is tested here (no emulator on this machine); their create-only writes are native (GCS
``ifGenerationMatch=0``, Azure ``If-None-Match``).

The class is layered by job: :mod:`._requests` (one request: retries, errors), :mod:`._read` (HEADs, pinned
reads, listings), :mod:`._probe` (the create-only probes), and this module (construction and writes).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import os
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

from ...errors import ObjectExists, StoreError, UnsafeObject
from .._s3_uri import BUCKET_NAME, SCHEMES, check_endpoint, parse_bucket_uri, with_s3_endpoint
from ..base import check_key, check_unique_keys
from ._probe import probe_copy, probe_put
from ._read import S3Reader
from ._requests import S3Transfer, capture, first_error, first_line

__all__ = ["S3Store", "S3Transfer", "parse_bucket_uri", "with_s3_endpoint"]

logger = logging.getLogger(__name__)

_STAGING = ".uploads"


class S3Store(S3Reader):
    """A store in a bucket, under a key prefix (one bucket can hold several runs).

    Credentials come from the standard places (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_SESSION_TOKEN``, profiles, instance roles: obstore's chain). The endpoint is ``endpoint``, else
    ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, else AWS; the region ``AWS_REGION``, else
    ``AWS_DEFAULT_REGION``. Thread-safe: one instance serves every thread.

    Args:
        bucket: the bucket (the container, for ``az``).
        prefix: a key prefix inside it.
        endpoint: an S3-compatible endpoint (``http://127.0.0.1:9000``, ``https://<account>.r2.cloudflarestorage.com``);
            given here (or as ``?endpoint=`` in the URI), it is part of :attr:`uri`.
        scheme: ``"s3"`` (default), ``"gs"`` or ``"az"``.
        conditional_writes: ``None`` (default): probe on the first write whether the service honours
            ``If-None-Match``; ``True``: trust that it does; ``False``: HEAD-then-PUT (see the module docstring).
        transfer: retries, request timeout, multipart and ranged-read sizes, concurrency (:class:`S3Transfer`).

    Example:
        >>> store = open_store("s3://my-bucket/run1", s3_endpoint="http://127.0.0.1:9000")  # doctest: +SKIP
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        scheme: str = "s3",
        conditional_writes: bool | None = None,
        transfer: S3Transfer | None = None,
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
        if endpoint is not None and scheme != "s3":
            raise ValueError(f"endpoint applies to s3 only, got scheme {scheme!r}")
        if endpoint is not None:
            check_endpoint(endpoint)
        if not BUCKET_NAME.fullmatch(bucket):
            raise ValueError(f"bucket {bucket!r} must be 3+ lowercase letters, digits, '.', '_' or '-'")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.scheme, self.bucket, self.prefix, self.endpoint = scheme, bucket, prefix, endpoint
        self.transfer = transfer or S3Transfer()
        super().__init__()
        self._conditional = True if scheme != "s3" else conditional_writes
        self._conditional_copy = True if scheme != "s3" else conditional_writes
        self._store = self._open_backend()

    def _conditional_writes(self) -> bool:
        """Whether the service honours ``If-None-Match: *`` (probed once, on the first write)."""
        with self._lock:
            if self._conditional is None:
                self._conditional = probe_put(self)
            return self._conditional

    def _conditional_copies(self) -> bool:
        """Whether the service honours ``If-None-Match`` on ``CompleteMultipartUpload`` (the create-only copy
        that commits a large object), probed once, on the first large write."""
        with self._lock:
            if self._conditional_copy is None:
                self._conditional_copy = probe_copy(self, self.transfer.multipart_bytes)
            return self._conditional_copy

    def _create(self, key: str, source: bytes | memoryview | Path) -> None:
        path = self._path(key)
        size = source.stat().st_size if isinstance(source, Path) else len(source)
        conditional = self._conditional_writes() and (
            size < self.transfer.multipart_bytes or self._conditional_copies()
        )
        if not conditional and self.exists(key):
            raise ObjectExists(f"{self.uri}: {key!r} exists; objects are create-only (another writer?)")
        attempts = [0]

        def retried() -> None:
            attempts[0] += 1

        try:
            if size < self.transfer.multipart_bytes:
                mode = "create" if conditional else "overwrite"
                self._call(
                    "put",
                    key,
                    lambda: self._store.put(path, source, mode=mode, use_multipart=False),
                    on_retry=retried,
                )
            else:
                self._call("put", key, lambda: self._put_multipart(path, source, conditional), on_retry=retried)
        except ObjectExists:
            if attempts[0] and self._holds(key, source, size):
                logger.info("%s: %r: a retried put found its own earlier attempt landed", self.uri, key)
                return
            raise

    def _put_multipart(self, path: str, source: bytes | memoryview | Path, conditional: bool) -> None:
        import obstore

        staging = f"{_STAGING}/{uuid.uuid4().hex}" if conditional else path
        try:
            with _reader(source) as f:  # streamed: parts are read as they go up
                self._store.put(
                    staging,
                    f,
                    use_multipart=True,
                    chunk_size=self.transfer.part_bytes,
                    max_concurrency=self.transfer.max_concurrency,
                )
            if not conditional:
                return
            obstore.copy(self._store, staging, path, overwrite=False)
        finally:
            try:
                if conditional:
                    obstore.delete(self._store, staging)
            except Exception as exc:  # a staging object left behind is hidden and never listed; say so
                logger.warning("%s: could not delete staging object %s (%s)", self.uri, staging, first_line(exc))

    def _holds(self, key: str, source: bytes | memoryview | Path, size: int) -> bool:
        """Whether the object under ``key`` has exactly the bytes of ``source``."""
        try:
            if self.size(key) != size:
                return False
            with self.open(key) as remote, _reader(source) as local:
                while chunk := local.read(self.transfer.part_bytes):
                    if remote.read(len(chunk)) != chunk:
                        return False
            return True
        except StoreError:
            return False

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Create an object atomically (one conditional PUT, or a multipart upload and a conditional copy).

        Raises:
            ObjectExists: the key is taken; nothing was written.
        """
        self._create(key, data if isinstance(data, bytes) else memoryview(data).cast("B"))

    def put_many(self, items: Iterable[tuple[str, bytes | bytearray | memoryview]]) -> None:
        """Create several objects in parallel, each atomically. Refuses them all (ObjectExists) if a key is
        taken when the batch starts; a writer racing the batch makes one of its puts raise ObjectExists.
        Not transactional: an error mid-batch can leave some objects written (a manifest, written last, is
        what commits a version)."""
        pairs = [(self._path(key), data) for key, data in items]
        check_unique_keys(k for k, _ in pairs)
        if not pairs:
            return
        with concurrent.futures.ThreadPoolExecutor(min(self.transfer.max_concurrency, len(pairs))) as pool:
            taken = [
                k for (k, _), there in zip(pairs, pool.map(lambda p: self.exists(p[0]), pairs), strict=True) if there
            ]
            if taken:
                raise ObjectExists(f"{self.uri}: {taken[:3]} exist; objects are create-only (another writer?)")
            first_error(list(pool.map(lambda p: capture(lambda: self.put(p[0], p[1])), pairs)))

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Create an object from a local file: from ``multipart_bytes`` on, streamed as a parallel multipart
        upload (parts of ``part_bytes``); below it, one conditional PUT (read whole, at most ``multipart_bytes``).

        Raises:
            ObjectExists: the key is taken.
            UnsafeObject: ``path`` is not a regular file (a device, a FIFO, a directory): nothing is read.
        """
        self._path(key)
        file = Path(path)
        with _open_regular(file) as (f, size):
            if size >= self.transfer.multipart_bytes:
                data = None  # streamed below, by _put_multipart, at most `size` bytes
            else:
                data = f.read(size + 1)
                if len(data) != size:
                    raise StoreError(f"{file}: it changed while it was read ({size} bytes, then {len(data)}); not put")
        self._create(key, file if data is None else data)

    def delete(self, key: str) -> None:
        """Delete one object. Raises ObjectNotFound if there is none."""
        import obstore

        path = self._path(key)
        self._head(key)  # S3 deletes are idempotent: ask first, to say ObjectNotFound
        self._call("delete", key, lambda: obstore.delete(self._store, path))


def _reader(source: bytes | memoryview | Path) -> BinaryIO:
    if not isinstance(source, Path):
        return io.BytesIO(source)
    with _open_regular(source) as (f, size):
        return cast(BinaryIO, io.BufferedReader(_BoundedFile(source, os.dup(f.fileno()), size), 1 << 20))


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[tuple[BinaryIO, int]]:
    """``path`` opened for reading, and its size, if it is a regular file, else UnsafeObject: a device
    (``/dev/zero``) or a FIFO would be read without end. Opened non-blocking, so a FIFO does not wait for a
    writer before it is refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeObject(f"{path}: not a regular file (mode {stat.filemode(st.st_mode)}); only files are put")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb") as f:
        yield f, st.st_size


class _BoundedFile(io.RawIOBase):
    """Exactly ``size`` bytes of an open file: never more (a file that grows), and an error if fewer arrive."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self._path, self._fd, self._left, self._size = path, fd, size, size

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")[: self._left]
        if not view:
            return 0
        n = os.readv(self._fd, [view])
        if n == 0:
            raise StoreError(
                f"{self._path}: it shrank while it was read (ended {self._left} bytes short of {self._size})"
            )
        self._left -= n
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()
