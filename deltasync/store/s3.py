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
  exponential backoff and jitter, ``retries`` times, then raise :class:`StoreError` naming the bucket and key.
  obstore's own retries are off, so a create-only put is never re-sent behind our back.
* **Keys.** Every key passes :func:`check_key`; listed keys that do not (written by something else) are
  skipped. S3 listings go through boto3 (also in the ``[s3]`` extra), which returns keys as stored: obstore
  aborts a whole listing over one key it cannot parse (``a//b``, ``../x``: one hostile key would hide every
  version), and lists a folder marker ``x/`` (what consoles' "create folder" writes) as a key ``x``.

GCS and Azure: opened with obstore's ``GCSStore`` / ``AzureStore`` and the standard environment
(``GOOGLE_APPLICATION_CREDENTIALS``; ``AZURE_STORAGE_ACCOUNT_NAME`` and a key or token). Only their
construction is tested here (no emulator on this machine); their create-only writes are native (GCS
``ifGenerationMatch=0``, Azure ``If-None-Match``).
"""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import io
import logging
import os
import random
import re
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

from ..errors import ObjectExists, ObjectNotFound, ObjectTooLarge, StoreError, UnsafeObject
from ._s3_uri import BUCKET_NAME, SCHEMES, check_endpoint, format_uri, parse_bucket_uri, with_s3_endpoint
from .base import check_key, check_unique_keys

__all__ = ["S3Store", "parse_bucket_uri", "with_s3_endpoint"]

logger = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})  # 409: S3's ConditionalRequestConflict
_STATUS = re.compile(r"status code: (\d{3})")
_JITTER = random.Random()  # private: never perturbs (or depends on) the process-wide `random` state
_UNCONFIRMED_BYTES = 64 << 20  # the most get() allocates on a HEAD's word alone, before a GET confirms the size
_MAX_S3_KEY_BYTES = 1024  # S3's limit on a whole key, prefix included
_STAGING = ".uploads"
_PROBE = ".deltasync-probe"
_T = TypeVar("_T")


class _Truncated(Exception):
    """A body shorter than its range (a connection cut mid-body): retried like a transport error."""


class S3Store:
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
        retries: attempts after the first on 408/409/429/5xx and transport errors.
        backoff_s: first backoff (doubled each attempt, capped at 20 s, with jitter).
        multipart_bytes: objects at least this big go up as a parallel multipart upload.
        parallel_bytes: objects at least this big are fetched as parallel ranged GETs of ``part_bytes``.
        part_bytes: the multipart part and fetch range size.
        max_concurrency: parallel requests of one ``put_many``, one multipart upload or one fetch.
        request_timeout_s: the limit of one request, connect to last byte.

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
        retries: int = 5,
        backoff_s: float = 0.2,
        multipart_bytes: int = 256 << 20,
        parallel_bytes: int = 64 << 20,
        part_bytes: int = 16 << 20,
        max_concurrency: int = 8,
        request_timeout_s: float = 120.0,
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
        if endpoint is not None and scheme != "s3":
            raise ValueError(f"endpoint applies to s3 only, got scheme {scheme!r}")
        if endpoint is not None:
            check_endpoint(endpoint)
        if not BUCKET_NAME.fullmatch(bucket):
            raise ValueError(f"bucket {bucket!r} must be 3+ lowercase letters, digits, '.', '_' or '-'")
        for name, value in (("retries", retries), ("max_concurrency", max_concurrency - 1)):
            if value < 0:
                raise ValueError(f"{name} must be >= {0 if name == 'retries' else 1}, got {value}")
        if part_bytes < 5 << 20:
            raise ValueError(f"part_bytes must be >= 5 MiB (S3's smallest part), got {part_bytes}")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.scheme, self.bucket, self.prefix, self.endpoint = scheme, bucket, prefix, endpoint
        self.retries, self.backoff_s = retries, backoff_s
        self.multipart_bytes, self.parallel_bytes, self.part_bytes = multipart_bytes, parallel_bytes, part_bytes
        self.max_concurrency = max_concurrency
        self._conditional = True if scheme != "s3" else conditional_writes
        self._conditional_copy = True if scheme != "s3" else conditional_writes
        self._lock = threading.Lock()
        self._skipped: set[str] = set()
        self._bucket_seen = False  # set once a listing has shown the bucket exists (see _check_bucket)
        self._boto3: Any = None
        self._store = self._open_backend(request_timeout_s)

    def _open_backend(self, request_timeout_s: float) -> Any:
        try:
            from obstore.store import AzureStore, GCSStore
            from obstore.store import S3Store as _ObstoreS3
        except ImportError as exc:
            raise ImportError("S3Store needs obstore: pip install 'deltasync[s3]'") from exc
        client = {"timeout": timedelta(seconds=request_timeout_s), "connect_timeout": timedelta(seconds=10)}
        retry = {"max_retries": 0}  # ours, below: obstore would re-send a create-only PUT behind our back
        prefix = self.prefix or None
        if self.scheme == "gs":
            return GCSStore(self.bucket, prefix=prefix, client_options=client, retry_config=retry)  # type: ignore[arg-type]
        if self.scheme == "az":
            account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
            if not account:
                raise ValueError(f"{self.uri}: set AZURE_STORAGE_ACCOUNT_NAME (and a key or token) for az:// stores")
            return AzureStore(
                self.bucket,
                prefix=prefix,
                account_name=account,
                client_options=client,  # type: ignore[arg-type]
                retry_config=retry,  # type: ignore[arg-type]
            )
        endpoint = self._resolved_endpoint()
        config: dict[str, Any] = {"copy_if_not_exists": "multipart"}
        if endpoint:
            config["endpoint"] = endpoint
            config["allow_http"] = endpoint.startswith("http://")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            config["region"] = region
        return _ObstoreS3(self.bucket, prefix=prefix, client_options=client, retry_config=retry, **config)  # type: ignore[arg-type]

    def _resolved_endpoint(self) -> str | None:
        return self.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r})"

    @property
    def uri(self) -> str:
        """``s3://bucket/prefix`` (with ``?endpoint=`` when the endpoint was given explicitly)."""
        return format_uri(self.scheme, self.bucket, self.prefix, self.endpoint)

    def _path(self, key: str) -> str:
        check_key(key)  # relative to the prefix: obstore adds it
        full = f"{self.prefix}/{key}" if self.prefix else key
        if len(full.encode()) > _MAX_S3_KEY_BYTES:
            raise ValueError(
                f"store key {key!r}: under the prefix {self.prefix!r} it is {len(full.encode())} bytes, more "
                f"than the {_MAX_S3_KEY_BYTES} an S3 key may have; use a shorter prefix"
            )
        return key

    # ------------------------------------------------------------------ retries and errors

    def _call(self, what: str, key: str, fn: Callable[[], _T], *, on_retry: Callable[[], None] | None = None) -> _T:
        """Run one request with retries on throttling and transport errors; translate obstore's errors."""
        from obstore.exceptions import (
            AlreadyExistsError,
            GenericError,
            NotFoundError,
            PermissionDeniedError,
            PreconditionError,
            UnauthenticatedError,
        )

        for attempt in range(self.retries + 1):
            error: BaseException
            try:
                return fn()
            except (NotFoundError, FileNotFoundError):  # obstore raises either
                if what in ("put", "probe"):  # a write answered 404: the bucket is not there
                    raise StoreError(
                        f"{self.uri}: {what} {key!r}: the bucket {self.bucket!r} does not exist; create it first"
                    ) from None
                raise ObjectNotFound(f"{self.uri}: no object {key!r}") from None
            except (AlreadyExistsError, FileExistsError) as exc:
                if not _is_conflict(exc):  # a 412: the key is taken
                    raise ObjectExists(
                        f"{self.uri}: {key!r} exists; objects are create-only (another writer?)"
                    ) from None
                error = exc  # obstore maps S3's 409 ConditionalRequestConflict here too: retried
            except PreconditionError as exc:
                raise StoreError(
                    f"{self.uri}: {key!r} changed while it was read (its ETag is not the one its HEAD gave); "
                    "objects are create-only, so another writer deleted and re-wrote it: check who writes here"
                ) from exc
            except (PermissionDeniedError, UnauthenticatedError) as exc:
                raise StoreError(
                    f"{self.uri}: {what} {key!r} was refused ({_first_line(exc)}); check the credentials "
                    "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and the bucket policy"
                ) from exc
            except (GenericError, _Truncated, ConnectionError, TimeoutError) as exc:
                if "non-partial response" in str(exc):  # a 200 to a ranged GET: retrying cannot help
                    raise StoreError(
                        f"{self.uri}: {what} {key!r}: asked for a byte range, the service answered with the whole "
                        "object (it, or something between here and it, ignores Range); not read"
                    ) from exc
                status = _status(exc)
                if status is not None and status not in _RETRY_STATUS:
                    raise StoreError(f"{self.uri}: {what} {key!r} failed: HTTP {status} ({_first_line(exc)})") from exc
                error = exc
            status = _status(error)
            if attempt == self.retries:
                raise StoreError(
                    f"{self.uri}: {what} {key!r} failed after {attempt + 1} attempts "
                    f"({'HTTP ' + str(status) if status else 'transport error'}: {_first_line(error)}); "
                    f"the service at {self._resolved_endpoint() or 'AWS'} is throttling or unreachable: "
                    "retry later, or raise retries/backoff_s"
                ) from error
            delay = min(self.backoff_s * 2**attempt, 20.0) * (0.5 + _JITTER.random() / 2)
            logger.warning(
                "%s: %s %r failed (%s; attempt %d/%d); retrying in %.2f s",
                self.uri,
                what,
                key,
                f"HTTP {status}" if status else "transport error",
                attempt + 1,
                self.retries + 1,
                delay,
            )
            time.sleep(delay)
            if on_retry is not None:
                on_retry()
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ writes

    def _conditional_writes(self) -> bool:
        """Whether the service honours ``If-None-Match: *`` (probed once, on the first write)."""
        with self._lock:
            if self._conditional is None:
                self._conditional = self._probe()
            return self._conditional

    def _probe(self) -> bool:
        from obstore.exceptions import AlreadyExistsError, NotSupportedError

        # Each attempt of the first PUT writes a fresh key: a retry after a lost answer must not meet its own
        # first attempt (a 412 there would say nothing about the service, and name a hidden key).
        keys: builtins.list[str] = []

        def first() -> None:
            keys.append(f"{_PROBE}/{uuid.uuid4().hex}")
            self._store.put(keys[-1], b"", mode="create", use_multipart=False)

        def second() -> bool:
            try:
                self._store.put(keys[-1], b"", mode="create", use_multipart=False)
                return False
            except AlreadyExistsError as exc:
                if _is_conflict(exc):
                    raise  # a 409: retried by _call
                return True

        try:
            # a failure here (credentials, an outage) is raised, not cached: the write would fail anyway
            self._call("probe", _PROBE, first)
        except StoreError as exc:
            if _status(exc.__cause__ or exc) not in (400, 501):
                raise
            honoured = False  # the service rejects the header (NotImplemented)
        except NotSupportedError:
            honoured = False
        else:
            honoured = self._call("probe", keys[-1], second)
        finally:
            self._delete_probes(keys)
        if not honoured:
            logger.warning(
                "%s: the service ignores If-None-Match: writes fall back to HEAD-then-PUT, and two writers racing "
                "on one key can overwrite each other (the coordinator's publisher lease keeps them apart)",
                self.uri,
            )
        return honoured

    def _delete_probes(self, keys: builtins.list[str]) -> None:
        import obstore

        if not keys:
            return
        try:
            obstore.delete(self._store, keys)  # S3 deletes of absent keys succeed
        except Exception as exc:  # a probe left behind is harmless (hidden, never listed): say so, go on
            logger.warning("%s: could not delete the probe objects %s (%s)", self.uri, keys, _first_line(exc))

    def _conditional_copies(self) -> bool:
        """Whether the service honours ``If-None-Match`` on ``CompleteMultipartUpload`` (the create-only copy
        that commits a large object), probed once, on the first large write."""
        with self._lock:
            if self._conditional_copy is None:
                self._conditional_copy = self._probe_copy()
            return self._conditional_copy

    def _probe_copy(self) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotSupportedError

        probe = f"{_PROBE}/{uuid.uuid4().hex}"
        keys = [probe]

        def first() -> None:  # a fresh target per attempt, as in _probe
            keys.append(f"{probe}.copy-{uuid.uuid4().hex[:8]}")
            obstore.copy(self._store, probe, keys[-1], overwrite=False)

        def second() -> bool:
            try:
                obstore.copy(self._store, probe, keys[-1], overwrite=False)
                return False
            except AlreadyExistsError as exc:
                if _is_conflict(exc):
                    raise  # a 409: retried by _call
                return True

        try:
            self._call("probe", probe, lambda: self._store.put(probe, b"", use_multipart=False))
            self._call("probe", probe, first)
            honoured = self._call("probe", keys[-1], second)
        except NotSupportedError:
            honoured = False
        finally:
            self._delete_probes(keys)
        if not honoured:
            logger.warning(
                "%s: the service ignores If-None-Match on CompleteMultipartUpload: objects of %d bytes or more fall "
                "back to HEAD-then-upload, and two writers racing on one key can overwrite each other",
                self.uri,
                self.multipart_bytes,
            )
        return honoured

    def _create(self, key: str, source: bytes | memoryview | Path) -> None:
        path = self._path(key)
        size = source.stat().st_size if isinstance(source, Path) else len(source)
        conditional = self._conditional_writes() and (size < self.multipart_bytes or self._conditional_copies())
        if not conditional and self.exists(key):
            raise ObjectExists(f"{self.uri}: {key!r} exists; objects are create-only (another writer?)")
        attempts = [0]

        def retried() -> None:
            attempts[0] += 1

        try:
            if size < self.multipart_bytes:
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
                    staging, f, use_multipart=True, chunk_size=self.part_bytes, max_concurrency=self.max_concurrency
                )
            if not conditional:
                return
            obstore.copy(self._store, staging, path, overwrite=False)
        finally:
            try:
                if conditional:
                    obstore.delete(self._store, staging)
            except Exception as exc:  # a staging object left behind is hidden and never listed; say so
                logger.warning("%s: could not delete staging object %s (%s)", self.uri, staging, _first_line(exc))

    def _holds(self, key: str, source: bytes | memoryview | Path, size: int) -> bool:
        """Whether the object under ``key`` has exactly the bytes of ``source``."""
        try:
            if self.size(key) != size:
                return False
            with self.open(key) as remote, _reader(source) as local:
                while chunk := local.read(self.part_bytes):
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
        with concurrent.futures.ThreadPoolExecutor(min(self.max_concurrency, len(pairs))) as pool:
            taken = [
                k for (k, _), there in zip(pairs, pool.map(lambda p: self.exists(p[0]), pairs), strict=True) if there
            ]
            if taken:
                raise ObjectExists(f"{self.uri}: {taken[:3]} exist; objects are create-only (another writer?)")
            _first_error(list(pool.map(lambda p: _capture(lambda: self.put(p[0], p[1])), pairs)))

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
            if size >= self.multipart_bytes:
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

    # ------------------------------------------------------------------ reads

    def _head(self, key: str) -> tuple[int, str | None]:
        import obstore

        path = self._path(key)
        try:
            meta = self._call("head", key, lambda: obstore.head(self._store, path))
        except ObjectNotFound:
            self._check_bucket()
            raise
        return int(meta["size"]), meta["e_tag"]

    def _check_bucket(self) -> None:
        """After a 404 to a HEAD (which has no body to say why): raise StoreError if the bucket is missing.
        One listing request, once per store: a bucket seen once is not asked about again."""
        import obstore

        if self._bucket_seen:
            return
        try:
            self._call("list", "", lambda: next(iter(obstore.list(self._store, None, chunk_size=1)), None))
        except StoreError as exc:  # obstore's listing says 404 (NoSuchBucket) as a GenericError
            cause = exc.__cause__ or exc
            if not isinstance(exc, ObjectNotFound) and _status(cause) != 404 and "NoSuchBucket" not in str(cause):
                raise
            raise StoreError(
                f"{self.uri}: the bucket {self.bucket!r} does not exist; create it first (or check the endpoint)"
            ) from None
        self._bucket_seen = True

    def _pin(self, key: str) -> tuple[int, str]:
        """An object's size and ETag, for reads pinned to that one version of it."""
        total, etag = self._head(key)
        if not etag:
            raise StoreError(
                f"{self.uri}: {key!r}: its HEAD carries no ETag, so its reads cannot be pinned to one version of "
                "it (the service, or something between here and it, strips ETags); not read"
            )
        return total, etag

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``. Raises StoreError if the bucket does not exist."""
        try:
            self._head(key)
            return True
        except ObjectNotFound:
            return False

    def size(self, key: str) -> int:
        """An object's size in bytes (one HEAD). Raises ObjectNotFound if there is none."""
        return self._head(key)[0]

    def _read_range(self, key: str, start: int, end: int, total: int, etag: str, out: memoryview) -> None:
        """Bytes ``[start, end)`` of the object of ``total`` bytes and ETag ``etag`` into ``out``, exactly, or raise.

        Each answer's ETag and total size (``Content-Range``) must be the pinned ones: ``If-Match`` alone is not
        enough, since a proxy or a service that drops it would hand back another version's bytes."""
        import obstore

        path = self._path(key)

        def once() -> None:
            options: dict[str, Any] = {"if_match": etag}
            if end > start:
                options["range"] = (start, end)
            result = obstore.get(self._store, path, options=options)  # type: ignore[arg-type]
            if result.meta["e_tag"] != etag:
                raise StoreError(
                    f"{self.uri}: {key!r} changed while it was read (its HEAD gave ETag {etag}, a GET answered "
                    f"{result.meta['e_tag']}, so something between here and the store ignores If-Match); objects "
                    "are create-only, so another writer deleted and re-wrote it: check who writes here"
                )
            if int(result.meta["size"]) != total:
                raise StoreError(
                    f"{self.uri}: {key!r}: its HEAD said {total} bytes but its GET says {result.meta['size']}; "
                    "the object changed, or something between here and the store rewrites sizes: not read"
                )
            if end > start and tuple(result.range) != (start, end):
                raise StoreError(
                    f"{self.uri}: {key!r}: asked for bytes [{start}, {end}), the store answered {result.range}: "
                    "something between here and the store ignores ranges; not read"
                )
            got = 0
            for chunk in result.stream(min_chunk_size=1 << 20):
                n = len(chunk)
                if got + n > end - start:
                    raise StoreError(f"{self.uri}: {key!r}: the store sent more than the {end - start} bytes asked")
                out[got : got + n] = memoryview(chunk)
                got += n
            if got != end - start:
                raise _Truncated(f"{key!r}: {got} of {end - start} bytes arrived before the connection ended")

        self._call("get", key, once)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Read a whole object; its size is checked (one HEAD) before a byte is read, and confirmed by the first
        GET before more than 64 MiB is allocated. Every GET is pinned to the HEAD's ETag (and checked against it).

        Raises:
            ObjectNotFound: there is none.
            ObjectTooLarge: it is larger than ``max_bytes``.
            StoreError: retries ran out, or the object's size or ETag changed while read.
        """
        total, etag = self._pin(key)
        if max_bytes is not None and total > max_bytes:
            raise ObjectTooLarge(f"{self.uri}: {key!r} is {total} bytes, more than the {max_bytes} allowed; not read")
        if total < self.parallel_bytes and total <= _UNCONFIRMED_BYTES:
            buf = bytearray(total)
            self._read_range(key, 0, total, total, etag, memoryview(buf))
            return bytes(buf)
        # A HEAD's size alone is not trusted with a large allocation: the first range's answer confirms it
        # (its Content-Range carries the total) before the whole buffer is allocated.
        first = bytearray(min(total, self.part_bytes, _UNCONFIRMED_BYTES))
        self._read_range(key, 0, len(first), total, etag, memoryview(first))
        if len(first) == total:
            return bytes(first)
        try:
            buf = bytearray(total)
        except MemoryError:
            raise StoreError(
                f"{self.uri}: {key!r} is {total} bytes, more than this process can hold; read it with open()"
            ) from None
        buf[: len(first)] = first
        view = memoryview(buf)
        if total < self.parallel_bytes:
            self._read_range(key, len(first), total, total, etag, view[len(first) :])
            return bytes(buf)
        starts = range(len(first), total, self.part_bytes)
        with concurrent.futures.ThreadPoolExecutor(min(self.max_concurrency, len(starts))) as pool:
            _first_error(
                list(
                    pool.map(
                        lambda s: _capture(
                            lambda: self._read_range(
                                key, s, min(s + self.part_bytes, total), total, etag, view[s : s + self.part_bytes]
                            )
                        ),
                        starts,
                    )
                )
            )
        return bytes(buf)

    def open(self, key: str) -> BinaryIO:
        """Open an object for streaming reads: ranged GETs pinned to one ETag, each retried, never short.

        Raises:
            ObjectNotFound: there is none.
        """
        total, etag = self._pin(key)
        return cast(BinaryIO, io.BufferedReader(_RangeReader(self, key, total, etag), buffer_size=self.part_bytes))

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Keys under a directory-like ``prefix`` (``""`` or ending in ``/``), relative to the store's prefix,
        sorted. Keys that fail :func:`check_key` (hidden, ``..``, ``a//b``, folder markers ``x/``, odd
        characters: written by something else) are skipped.

        On S3 the listing is boto3's, which returns keys as stored: obstore refuses a whole listing over one key
        it cannot parse, and lists the folder marker ``x/`` as a key ``x`` that cannot be read.

        Raises:
            ObjectNotFound: the bucket does not exist.
        """
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must be empty or end with '/'")
        sub = check_key(prefix.rstrip("/")) + "/" if prefix else ""
        paths = self._list_s3(sub) if self.scheme == "s3" else self._list_obstore(sub)
        return sorted(p for p in paths if p.startswith(sub) and self._valid(p))

    def _valid(self, key: str) -> bool:
        try:
            check_key(key)
        except ValueError:
            self._skip(key, "not a deltasync key")
            return False
        return True

    def _skip(self, key: str, why: str) -> None:
        with self._lock:
            first = key not in self._skipped
            self._skipped.add(key)
        if first:  # once per key: a store is listed again and again
            logger.warning("%s: skipping listed key %r: %s", self.uri, key, why)

    def _list_obstore(self, sub: str) -> builtins.list[str]:
        import obstore
        from obstore.exceptions import InvalidPathError

        def listing() -> builtins.list[str]:
            batches = obstore.list(self._store, sub.rstrip("/") or None, chunk_size=1000)
            return [m["path"] for batch in batches for m in batch]

        try:
            return self._call("list", sub, listing)
        except InvalidPathError as exc:
            raise StoreError(
                f"{self.uri}: the container holds a key that cannot be listed ({_first_line(exc)}), written by "
                "something other than deltasync: delete it"
            ) from exc

    def _list_s3(self, sub: str) -> builtins.list[str]:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise ImportError("S3Store lists with boto3: pip install 'deltasync[s3]'") from exc
        with self._lock:
            if self._boto3 is None:
                region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                config = Config(
                    retries={"max_attempts": self.retries + 1, "mode": "standard"},
                    connect_timeout=10,
                    read_timeout=60,
                )
                self._boto3 = boto3.client(
                    "s3", endpoint_url=self._resolved_endpoint(), region_name=region, config=config
                )
            client = self._boto3
        base = f"{self.prefix}/" if self.prefix else ""
        root = base + sub
        keys: builtins.list[str] = []
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root):
                for obj in page.get("Contents", []):
                    if obj["Key"].startswith(root):
                        keys.append(obj["Key"][len(base) :])
                    else:  # a service (or proxy) that ignores Prefix: never strip characters blindly
                        self._skip(obj["Key"], f"outside the prefix {root!r}")
        except Exception as exc:  # botocore's errors are their own tree: name the bucket and what it said
            code = getattr(exc, "response", {}).get("Error", {}).get("Code")
            if code == "NoSuchBucket":
                raise ObjectNotFound(f"{self.uri}: the bucket {self.bucket!r} does not exist") from None
            raise StoreError(
                f"{self.uri}: listing {root!r} failed after {self.retries + 1} attempts ({_first_line(exc)}); "
                "check the endpoint, the credentials and the bucket policy"
            ) from exc
        return keys


class _RangeReader(io.RawIOBase):
    """A raw reader over ranged GETs of one object version (the ETag its HEAD gave)."""

    def __init__(self, store: S3Store, key: str, total: int, etag: str) -> None:
        self._store, self._key, self._total, self._etag, self._pos = store, key, total, etag, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._total}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        end = min(self._pos + len(view), self._total)
        if end <= self._pos:
            return 0
        self._store._read_range(self._key, self._pos, end, self._total, self._etag, view[: end - self._pos])
        n = end - self._pos
        self._pos = end
        return n

    def readall(self) -> bytes:
        # in parts, each confirmed by its answer: never one allocation of what the HEAD claimed
        parts: list[bytes] = []
        while self._pos < self._total:
            buf = bytearray(min(self._total - self._pos, self._store.part_bytes))
            parts.append(bytes(buf[: self.readinto(buf)]))
        return b"".join(parts)


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


def _is_conflict(exc: BaseException) -> bool:
    """Whether an obstore ``AlreadyExistsError`` is S3's 409 ``ConditionalRequestConflict`` (two conditional
    writes in flight: retry) rather than a 412 ``PreconditionFailed`` (the key is taken)."""
    return _status(exc) == 409 or "ConditionalRequestConflict" in str(exc)


def _status(exc: BaseException) -> int | None:
    match = _STATUS.search(str(exc))
    return int(match.group(1)) if match else None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def _capture(fn: Callable[[], None]) -> BaseException | None:
    try:
        fn()
        return None
    except BaseException as exc:  # handed back to the caller thread by _first_error, which raises it
        return exc


def _first_error(errors: Sequence[BaseException | None]) -> None:
    for exc in errors:
        if exc is not None:
            raise exc
