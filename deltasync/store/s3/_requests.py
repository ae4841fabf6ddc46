"""One request to an object store: the backend obstore opens, the key's path, retries with backoff and jitter,
and obstore's errors translated into deltasync's (naming the store, the request and the key)."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from ...errors import ObjectExists, ObjectNotFound, StoreError
from .._s3_uri import format_uri
from ..base import check_key

__all__ = [
    "S3Requests",
    "S3Transfer",
    "Truncated",
    "UnparsableKey",
    "capture",
    "first_error",
    "first_line",
    "is_conflict",
    "status",
]

logger = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})  # 409: S3's ConditionalRequestConflict
_STATUS = re.compile(r"status code: (\d{3})")
_INVALID_PATH = re.compile(r'Path "(.*?)"(?=: | contained )')  # how obstore's InvalidPathError names the key
_JITTER = random.Random()  # private: never perturbs (or depends on) the process-wide `random` state
_MAX_S3_KEY_BYTES = 1024  # S3's limit on a whole key, prefix included
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class S3Transfer:
    """How an :class:`~deltasync.store.s3.S3Store` moves bytes: its requests' limits and retries, and when and how
    objects are split into parts.

    Example:
        >>> store = S3Store("my-bucket", "run1", transfer=S3Transfer(max_concurrency=16))  # doctest: +SKIP
    """

    retries: int = 5
    """Attempts after the first on 408/409/429/5xx and transport errors."""
    backoff_s: float = 0.2
    """First backoff (doubled each attempt, capped at 20 s, with jitter)."""
    request_timeout_s: float = 120.0
    """The limit of one request, connect to last byte."""
    multipart_bytes: int = 256 << 20
    """Objects at least this big go up as a parallel multipart upload."""
    parallel_bytes: int = 64 << 20
    """Objects at least this big are fetched as parallel ranged GETs of ``part_bytes``."""
    part_bytes: int = 16 << 20
    """The multipart part and fetch range size (S3's smallest part is 5 MiB)."""
    max_concurrency: int = 8
    """Parallel requests of one ``put_many``, one multipart upload or one fetch."""

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.part_bytes < 5 << 20:
            raise ValueError(f"part_bytes must be >= 5 MiB (S3's smallest part), got {self.part_bytes}")


class Truncated(Exception):
    """A body shorter than its range (a connection cut mid-body): retried like a transport error."""


class UnparsableKey(StoreError):
    """A listing met a key obstore cannot parse (``a//b``, ``../x``: written by something other than deltasync).

    obstore aborts the whole listing over it. ``key`` is that key relative to the store's prefix (as stored
    when it lies outside it; ``None`` when obstore's message did not name it). Internal: the bucket check
    branches on it; ``list()`` raises it on as a plain StoreError."""

    def __init__(self, message: str, key: str | None) -> None:
        super().__init__(message)
        self.key = key


class S3Requests:
    """The request layer of :class:`~deltasync.store.s3.S3Store`: its configuration attributes are set by
    ``S3Store.__init__`` before this layer's ``__init__`` runs."""

    scheme: str
    bucket: str
    prefix: str
    endpoint: str | None
    transfer: S3Transfer
    _store: Any  # obstore's store, rooted at the prefix

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def _open_backend(self) -> Any:
        try:
            from obstore.store import AzureStore, GCSStore
            from obstore.store import S3Store as _ObstoreS3
        except ImportError as exc:
            raise ImportError("S3Store needs obstore: pip install 'deltasync[s3]'") from exc
        client = {
            "timeout": timedelta(seconds=self.transfer.request_timeout_s),
            "connect_timeout": timedelta(seconds=10),
        }
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
        return f"{type(self).__name__}({self.uri!r})"

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

    def _call(self, what: str, key: str, fn: Callable[[], _T], *, on_retry: Callable[[], None] | None = None) -> _T:
        """Run one request with retries on throttling and transport errors; translate obstore's errors.

        No obstore exception leaves here but a probe's NotSupportedError (the probe's answer): each is an
        ObjectNotFound, ObjectExists or StoreError (UnparsableKey for a listing that met a key obstore cannot
        parse). ``fn``'s other exceptions (a StoreError of a check, ValueError) pass through."""
        from obstore.exceptions import (
            AlreadyExistsError,
            BaseError,
            GenericError,
            InvalidPathError,
            NotFoundError,
            NotSupportedError,
            PermissionDeniedError,
            PreconditionError,
            UnauthenticatedError,
        )

        for attempt in range(self.transfer.retries + 1):
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
                if not is_conflict(exc):  # a 412: the key is taken
                    raise ObjectExists(
                        f"{self.uri}: {key!r} exists; objects are create-only (another writer?)"
                    ) from None
                error = exc  # obstore maps S3's 409 ConditionalRequestConflict here too: retried
            except InvalidPathError as exc:  # only a listing parses keys it did not send: one planted by another
                raise self._unparsable(what, key, exc) from exc
            except PreconditionError as exc:
                raise StoreError(
                    f"{self.uri}: {key!r} changed while it was read (its ETag is not the one its HEAD gave); "
                    "objects are create-only, so another writer deleted and re-wrote it: check who writes here"
                ) from exc
            except (PermissionDeniedError, UnauthenticatedError) as exc:
                raise StoreError(
                    f"{self.uri}: {what} {key!r} was refused ({first_line(exc)}); check the credentials "
                    "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and the bucket policy"
                ) from exc
            except (GenericError, Truncated, ConnectionError, TimeoutError) as exc:
                if "non-partial response" in str(exc):  # a 200 to a ranged GET: retrying cannot help
                    raise StoreError(
                        f"{self.uri}: {what} {key!r}: asked for a byte range, the service answered with the whole "
                        "object (it, or something between here and it, ignores Range); not read"
                    ) from exc
                code = status(exc)
                if code is not None and code not in _RETRY_STATUS:
                    raise StoreError(f"{self.uri}: {what} {key!r} failed: HTTP {code} ({first_line(exc)})") from exc
                error = exc
            except NotSupportedError as exc:
                if what == "probe":
                    raise  # the probe's answer: this service cannot send the condition
                raise StoreError(f"{self.uri}: {what} {key!r}: not supported here ({first_line(exc)})") from exc
            except BaseError as exc:  # any other obstore error: named, never raw
                raise StoreError(f"{self.uri}: {what} {key!r} failed ({first_line(exc)})") from exc
            code = status(error)
            if attempt == self.transfer.retries:
                raise StoreError(
                    f"{self.uri}: {what} {key!r} failed after {attempt + 1} attempts "
                    f"({'HTTP ' + str(code) if code else 'transport error'}: {first_line(error)}); "
                    f"the service at {self._resolved_endpoint() or 'AWS'} is throttling or unreachable: "
                    "retry later, or raise S3Transfer(retries=, backoff_s=)"
                ) from error
            delay = min(self.transfer.backoff_s * 2**attempt, 20.0) * (0.5 + _JITTER.random() / 2)
            logger.warning(
                "%s: %s %r failed (%s; attempt %d/%d); retrying in %.2f s",
                self.uri,
                what,
                key,
                f"HTTP {code}" if code else "transport error",
                attempt + 1,
                self.transfer.retries + 1,
                delay,
            )
            time.sleep(delay)
            if on_retry is not None:
                on_retry()
        raise AssertionError("unreachable")

    def _unparsable(self, what: str, key: str, exc: BaseException) -> UnparsableKey:
        match = _INVALID_PATH.search(first_line(exc))
        found = None if match is None else match.group(1)
        if found is not None and self.prefix and found.startswith(self.prefix + "/"):
            found = found[len(self.prefix) + 1 :]
        named = f"the key {found!r}" if found is not None else f"a key ({first_line(exc)})"
        return UnparsableKey(
            f"{self.uri}: {what} {key!r} met {named}, which is not a valid object path (an empty segment, '.' or "
            "'..'): something other than deltasync wrote it; delete it",
            found,
        )


def is_conflict(exc: BaseException) -> bool:
    """Whether an obstore ``AlreadyExistsError`` is S3's 409 ``ConditionalRequestConflict`` (two conditional
    writes in flight: retry) rather than a 412 ``PreconditionFailed`` (the key is taken)."""
    return status(exc) == 409 or "ConditionalRequestConflict" in str(exc)


def status(exc: BaseException) -> int | None:
    """The HTTP status an obstore error's message names, if any."""
    match = _STATUS.search(str(exc))
    return int(match.group(1)) if match else None


def first_line(exc: BaseException) -> str:
    """An error's first line, at most 300 characters (obstore's messages go on with a debug dump)."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def capture(fn: Callable[[], None]) -> BaseException | None:
    """Run ``fn`` in a worker thread; return what it raised, for :func:`first_error` to raise in the caller."""
    try:
        fn()
        return None
    except BaseException as exc:  # handed back to the caller thread by first_error, which raises it
        return exc


def first_error(errors: Sequence[BaseException | None]) -> None:
    """Raise the first error :func:`capture` handed back, if any."""
    for exc in errors:
        if exc is not None:
            raise exc
