"""The reader side of :class:`~deltasync.store.s3.S3Store`: HEADs, reads pinned to one ETag (whole, ranged, in
parallel, streamed), and listings that skip keys deltasync did not write."""

from __future__ import annotations

import builtins
import concurrent.futures
import io
import logging
import os
from typing import Any, BinaryIO, cast

from ...errors import ObjectNotFound, ObjectTooLarge, StoreError
from ..base import check_key
from ._requests import S3Requests, Truncated, UnparsableKey, capture, first_error, first_line, status

__all__ = ["S3Reader"]

logger = logging.getLogger(__name__)

_UNCONFIRMED_BYTES = 64 << 20  # the most get() allocates on a HEAD's word alone, before a GET confirms the size


class S3Reader(S3Requests):
    """The reads of :class:`~deltasync.store.s3.S3Store` (its sizes are its ``transfer``'s)."""

    def __init__(self) -> None:
        super().__init__()
        self._skipped: set[str] = set()  # keys already warned about (see _skip)
        self._bucket_seen = False  # set once a listing has shown the bucket exists (see _check_bucket)
        self._boto3: Any = None

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
        One listing request, once per store: a bucket seen once is not asked about again. A key in that
        listing that obstore cannot parse (written by something else) shows the bucket exists: it is skipped
        with a warning, as :meth:`list` skips it."""
        import obstore

        if self._bucket_seen:
            return
        try:
            self._call("list", "", lambda: next(iter(obstore.list(self._store, None, chunk_size=1)), None))
        except UnparsableKey as exc:  # the listing came back: the bucket is there
            if exc.key is not None:
                self._skip(exc.key, "not a deltasync key")
            else:  # at most once per store: this listing is not asked again
                logger.warning("%s", exc)
        except StoreError as exc:  # obstore's listing says 404 (NoSuchBucket) as a GenericError
            cause = exc.__cause__ or exc
            if not isinstance(exc, ObjectNotFound) and status(cause) != 404 and "NoSuchBucket" not in str(cause):
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
                raise Truncated(f"{key!r}: {got} of {end - start} bytes arrived before the connection ended")

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
        if total < self.transfer.parallel_bytes and total <= _UNCONFIRMED_BYTES:
            buf = bytearray(total)
            self._read_range(key, 0, total, total, etag, memoryview(buf))
            return bytes(buf)
        # A HEAD's size alone is not trusted with a large allocation: the first range's answer confirms it
        # (its Content-Range carries the total) before the whole buffer is allocated.
        first = bytearray(min(total, self.transfer.part_bytes, _UNCONFIRMED_BYTES))
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
        if total < self.transfer.parallel_bytes:
            self._read_range(key, len(first), total, total, etag, view[len(first) :])
            return bytes(buf)
        starts = range(len(first), total, self.transfer.part_bytes)

        def part(s: int) -> BaseException | None:
            end = min(s + self.transfer.part_bytes, total)
            return capture(lambda: self._read_range(key, s, end, total, etag, view[s:end]))

        with concurrent.futures.ThreadPoolExecutor(min(self.transfer.max_concurrency, len(starts))) as pool:
            first_error(list(pool.map(part, starts)))
        return bytes(buf)

    def open(self, key: str) -> BinaryIO:
        """Open an object for streaming reads: ranged GETs pinned to one ETag, each retried, never short.

        Raises:
            ObjectNotFound: there is none.
        """
        total, etag = self._pin(key)
        return cast(
            BinaryIO, io.BufferedReader(_RangeReader(self, key, total, etag), buffer_size=self.transfer.part_bytes)
        )

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Keys under a directory-like ``prefix`` (``""`` or ending in ``/``), relative to the store's prefix,
        sorted. Keys that fail :func:`check_key` (hidden, ``..``, ``a//b``, folder markers ``x/``, odd
        characters: written by something else) are skipped, with one warning per key.

        On S3 the listing is boto3's, which returns keys as stored: obstore refuses a whole listing over one key
        it cannot parse, and lists the folder marker ``x/`` as a key ``x`` that cannot be read.

        Raises:
            ObjectNotFound: the bucket does not exist.
            StoreError: on ``gs://`` and ``az://`` (listed by obstore), the container holds a key obstore cannot
                parse (``a//b``, ``../x``): it names the key, to be deleted.
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

        def listing() -> builtins.list[str]:
            batches = obstore.list(self._store, sub.rstrip("/") or None, chunk_size=1000)
            return [m["path"] for batch in batches for m in batch]

        try:
            return self._call("list", sub or "/", listing)
        except UnparsableKey as exc:  # a plain StoreError to callers (and in the CLI): the subclass is internal
            raise StoreError(str(exc)) from exc

    def _list_s3(self, sub: str) -> builtins.list[str]:
        try:
            import boto3
            import boto3.session
            from botocore.config import Config
        except ImportError as exc:
            raise ImportError("S3Store lists with boto3: pip install 'deltasync[s3]'") from exc
        with self._lock:
            if self._boto3 is None:
                region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                config = Config(
                    retries={"max_attempts": self.transfer.retries + 1, "mode": "standard"},
                    connect_timeout=10,
                    read_timeout=60,
                )
                # A session of its own: boto3.client() shares the process's default session, which keeps the
                # first credentials it resolved, so a second store (another user's keys) would list as the first.
                self._boto3 = boto3.session.Session().client(
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
                f"{self.uri}: listing {root!r} failed after {self.transfer.retries + 1} attempts ({first_line(exc)}); "
                "check the endpoint, the credentials and the bucket policy"
            ) from exc
        return keys


class _RangeReader(io.RawIOBase):
    """A raw reader over ranged GETs of one object version (the ETag its HEAD gave)."""

    def __init__(self, store: S3Reader, key: str, total: int, etag: str) -> None:
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
            buf = bytearray(min(self._total - self._pos, self._store.transfer.part_bytes))
            parts.append(bytes(buf[: self.readinto(buf)]))
        return b"".join(parts)
