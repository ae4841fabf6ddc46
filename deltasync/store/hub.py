"""HubBucketStore: a store in a Hugging Face Hub bucket (``hf://buckets/<namespace>/<name>[/<prefix>]``).

Built on huggingface_hub's Buckets API (>= 1.5): ``create_bucket``, ``batch_bucket_files`` (uploads and
deletes), ``download_bucket_files``, ``list_bucket_tree`` and ``get_bucket_paths_info``. It behaves like
:class:`~deltasync.store.LocalStore` through the Store protocol: a version's shards go up in one batch and
its manifest in a later one (the commit marker), so readers never see a half-written version.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from ..errors import ObjectExists, ObjectNotFound, ObjectTooLarge, StoreError
from .base import check_key, check_unique_keys

__all__ = ["HubBucketStore", "parse_hub_uri"]

logger = logging.getLogger(__name__)

# Retry jitter from a private generator: never perturbs (or depends on) the process-wide `random` state.
_JITTER = random.Random()


_T = TypeVar("_T")
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
SCHEME = "hf://buckets/"


def parse_hub_uri(uri: str) -> tuple[str, str]:
    """``hf://buckets/ns/name/a/b`` -> (``"ns/name"``, ``"a/b"``).

    Raises:
        ValueError: the URI does not name a bucket.
    """
    if not uri.startswith(SCHEME):
        raise ValueError(f"store URI {uri!r}: a Hub bucket URI looks like hf://buckets/<namespace>/<name>[/<prefix>]")
    parts = [p for p in uri[len(SCHEME) :].split("/") if p]
    if len(parts) < 2:
        raise ValueError(f"store URI {uri!r}: expected hf://buckets/<namespace>/<name>[/<prefix>]")
    prefix = "/".join(parts[2:])
    if prefix:
        check_key(prefix)
    return f"{parts[0]}/{parts[1]}", prefix


def _transient_errors() -> tuple[type[BaseException], ...]:
    """Connection-level errors of the HTTP clients huggingface_hub may use (httpx2 since 2.x, httpx before)."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        try:
            errors.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


_TRANSIENT = _transient_errors()


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


class HubBucketStore:
    """A store in a Hub bucket.

    Auth comes from the standard places (``HF_TOKEN``, ``hf auth login``) and the endpoint from ``HF_ENDPOINT``
    (read only once, at import, by huggingface_hub), unless ``api`` says otherwise:
    ``HubBucketStore("me/run1", api=HfApi(endpoint=..., token=...))``.

    Args:
        bucket_id: ``namespace/name``.
        prefix: a key prefix inside the bucket (one bucket can hold several runs).
        api: the ``HfApi`` to call, with its endpoint and token (default: ``HfApi()``); tests pass a fake.
        private: create the bucket private (the default) if it does not exist, on the first write.
        cache_dir: where downloads land (default: ``$HF_HOME``-style ``~/.cache/deltasync/buckets``);
            files are cached by content hash, so a retried or restarted fetch skips finished files.
        retries: attempts after the first on 408/429/5xx and connection errors.
        backoff_s: first backoff (doubled each attempt, capped at 60 s; ``Retry-After`` wins).

    Example:
        >>> store = open_store("hf://buckets/me/run1")  # doctest: +SKIP
    """

    def __init__(
        self,
        bucket_id: str,
        prefix: str = "",
        *,
        api: Any | None = None,
        private: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        retries: int = 5,
        backoff_s: float = 1.0,
    ) -> None:
        if api is None:
            try:
                from huggingface_hub import HfApi
            except ImportError as exc:
                raise ImportError("HubBucketStore needs huggingface_hub: pip install 'deltasync[hub]'") from exc
            api = HfApi()
        self.api, self.bucket_id, self.prefix = api, bucket_id, prefix.strip("/")
        self.private, self.retries, self.backoff_s = private, retries, backoff_s
        default_cache = Path(os.environ.get("DELTASYNC_CACHE", Path.home() / ".cache" / "deltasync")) / "buckets"
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache / bucket_id.replace("/", "--")
        self._created = False

    def __repr__(self) -> str:
        return f"HubBucketStore({self.uri!r})"

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.bucket_id}" + (f"/{self.prefix}" if self.prefix else "")

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run one Hub call with retries on transient failures; raise StoreError after the last."""
        from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

        for attempt in range(self.retries + 1):
            try:
                return fn()
            except EntryNotFoundError as exc:
                raise ObjectNotFound(f"{self.uri}: {what}: not found ({exc})") from None
            except HfHubHTTPError as exc:
                status = _status(exc)
                if status == 404:
                    raise ObjectNotFound(f"{self.uri}: {what}: not found (HTTP 404)") from None
                if status not in _RETRY_STATUS or attempt == self.retries:
                    raise StoreError(
                        f"{self.uri}: {what} failed after {attempt + 1} attempts: HTTP {status} ({str(exc)[:300]})"
                    ) from exc
                delay = self._delay(attempt, exc)
            except _TRANSIENT as exc:  # connection refused or reset, timeouts
                if attempt == self.retries:
                    raise StoreError(f"{self.uri}: {what} failed after {attempt + 1} attempts ({exc!r})") from exc
                delay = self._delay(attempt, exc)
            logger.warning(
                "%s: %s failed (attempt %d/%d); retrying in %.1f s",
                self.uri,
                what,
                attempt + 1,
                self.retries + 1,
                delay,
            )
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _delay(self, attempt: int, exc: BaseException) -> float:
        response = getattr(exc, "response", None)
        retry_after = getattr(response, "headers", {}).get("Retry-After") if response is not None else None
        if retry_after and str(retry_after).isdigit():
            return float(retry_after)
        delay: float = min(self.backoff_s * 2**attempt, 60.0) * (0.5 + _JITTER.random() / 2)
        return delay

    def _ensure_bucket(self) -> None:
        if not self._created:
            self._call(
                "create bucket", lambda: self.api.create_bucket(self.bucket_id, private=self.private, exist_ok=True)
            )
            self._created = True

    # ------------------------------------------------------------------ writes

    def _refuse_existing(self, keys: list[str]) -> None:
        """Create-only: a bucket has no conditional put, so every key is looked up first (one call) and the
        upload is refused if one exists. Two writers racing inside that gap are kept apart by the
        coordinator's publisher lease, not by the bucket."""
        remotes = [self._path(k) for k in keys]
        try:
            infos = self._call(
                f"stat {remotes[:3]}", lambda: list(self.api.get_bucket_paths_info(self.bucket_id, remotes))
            )
        except ObjectNotFound:  # no bucket yet: nothing exists
            return
        taken = sorted({i.path for i in infos} & set(remotes))
        if taken:
            raise ObjectExists(f"{self.uri}: {taken[:3]} exist; objects are create-only (another writer?)")

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Upload one object (one batch). Raises ObjectExists if the key is taken."""
        self.put_many([(key, bytes(data))])

    def put_many(self, items: Iterable[tuple[str, bytes | bytearray | memoryview]]) -> None:
        """Upload several objects in one batch (a version's shards). Raises ObjectExists, uploading nothing,
        if a key is taken."""
        pairs = [(key, bytes(data)) for key, data in items]
        check_unique_keys(key for key, _ in pairs)
        add: list[tuple[str | Path | bytes, str]] = [(data, self._path(key)) for key, data in pairs]
        if not add:
            return
        self._ensure_bucket()
        self._refuse_existing([k for k, _ in pairs])
        self._call(f"upload {[p for _, p in add][:3]}", lambda: self.api.batch_bucket_files(self.bucket_id, add=add))

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Upload a local file (streamed by huggingface_hub). Raises ObjectExists if the key is taken."""
        remote = self._path(key)
        self._ensure_bucket()
        self._refuse_existing([key])
        self._call(f"upload {remote}", lambda: self.api.batch_bucket_files(self.bucket_id, add=[(str(path), remote)]))

    def delete(self, key: str) -> None:
        """Delete one object."""
        remote = self._path(key)
        if not self.exists(key):
            raise ObjectNotFound(f"{self.uri}: no object {key!r}")
        self._call(f"delete {remote}", lambda: self.api.batch_bucket_files(self.bucket_id, delete=[remote]))

    # ------------------------------------------------------------------ reads

    def _info(self, key: str) -> Any | None:
        remote = self._path(key)
        infos = self._call(f"stat {remote}", lambda: list(self.api.get_bucket_paths_info(self.bucket_id, [remote])))
        return next((i for i in infos if i.path == remote), None)

    def exists(self, key: str) -> bool:
        try:
            return self._info(key) is not None
        except ObjectNotFound:
            return False

    def _fetch(self, key: str, max_bytes: int | None = None) -> Path:
        info = self._info(key)
        if info is None:
            raise ObjectNotFound(f"{self.uri}: no object {key!r}")
        if max_bytes is not None and info.size > max_bytes:
            raise ObjectTooLarge(
                f"{self.uri}: {key!r} is {info.size} bytes, more than the {max_bytes} allowed; not downloaded"
            )
        cached = self.cache_dir / "blobs" / str(info.xet_hash)
        if cached.exists() and cached.stat().st_size == info.size:
            return cached
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".download-")) / uuid.uuid4().hex
        try:
            self._call(
                f"download {info.path}",
                lambda: self.api.download_bucket_files(self.bucket_id, [(info, str(tmp))], raise_on_missing_files=True),
            )
            if not tmp.exists():
                raise ObjectNotFound(f"{self.uri}: {key!r} was listed but not downloaded")
            os.replace(tmp, cached)
        finally:
            if tmp.exists():
                tmp.unlink()
            tmp.parent.rmdir()
        return cached

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        path = self._fetch(key, max_bytes)
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1 if max_bytes is not None else -1)
        if max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLarge(f"{self.uri}: {key!r} is larger than the {max_bytes} bytes allowed")
        return data

    def size(self, key: str) -> int:
        info = self._info(key)
        if info is None:
            raise ObjectNotFound(f"{self.uri}: no object {key!r}")
        return int(info.size)

    def open(self, key: str) -> BinaryIO:
        return open(self._fetch(key), "rb")

    def list(self, prefix: str = "") -> list[str]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must be empty or end with '/'")
        remote = self._path(prefix.rstrip("/")) if prefix else self.prefix
        try:
            tree = self._call(
                "list", lambda: list(self.api.list_bucket_tree(self.bucket_id, prefix=remote or None, recursive=True))
            )
        except ObjectNotFound:
            raise ObjectNotFound(f"{self.uri}: the bucket does not exist") from None
        strip = len(self.prefix) + 1 if self.prefix else 0
        return sorted(f.path[strip:] for f in tree if getattr(f, "type", "file") == "file")
