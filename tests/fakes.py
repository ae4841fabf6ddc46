"""Test fakes, only for what cannot be reached from here."""

from __future__ import annotations

import collections
import hashlib
import threading
from pathlib import Path
from typing import Any, Literal

from huggingface_hub._buckets import BucketFile, BucketFolder
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError


class FakeBucketApi:
    """A FAKE of the Hugging Face Hub Buckets API (the ``HfApi`` methods HubBucketStore calls), in memory.

    The live Hub cannot be reached from this machine or CI, so the Store conformance suite runs
    ``HubBucketStore`` against this fake. Its method signatures are those of the installed
    huggingface_hub (``tests/unit/test_store_conformance.py`` compares them with ``inspect.signature``), and it
    answers like the Hub does: ``BucketFile`` objects, ``EntryNotFoundError`` only when asked to raise on
    missing files (else a skip), ``HfHubHTTPError`` with an HTTP response for faults.

    Fault injection: ``fail`` maps a method name to a queue of HTTP statuses to raise on its next calls
    (``"*"`` for any method); ``fail_forever`` makes every call fail with that status.
    """

    def __init__(self) -> None:
        self.buckets: dict[str, dict[str, bytes]] = {}
        self.private: dict[str, bool] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.fail: dict[str, collections.deque[int]] = collections.defaultdict(collections.deque)
        self.fail_forever: int | None = None
        self.warnings: list[str] = []
        self._lock = threading.Lock()

    def _fault(self, method: str) -> None:
        import httpx2

        self.calls[method] += 1
        status = self.fail_forever
        for key in (method, "*"):
            if status is None and self.fail[key]:
                status = self.fail[key].popleft()
        if status is not None:
            request = httpx2.Request("POST", f"https://huggingface.co/api/buckets/fake/{method}")
            headers = {"Retry-After": "0"} if status == 429 else {}
            raise HfHubHTTPError(
                f"{status} Server Error (fake)", response=httpx2.Response(status, request=request, headers=headers)
            )

    def _bucket(self, bucket_id: str) -> dict[str, bytes]:
        if bucket_id not in self.buckets:
            import httpx2

            request = httpx2.Request("GET", f"https://huggingface.co/api/buckets/{bucket_id}")
            raise HfHubHTTPError("404 bucket not found (fake)", response=httpx2.Response(404, request=request))
        return self.buckets[bucket_id]

    @staticmethod
    def _file(path: str, data: bytes) -> BucketFile:
        return BucketFile(type="file", path=path, size=len(data), xetHash=hashlib.sha256(data).hexdigest())

    def create_bucket(
        self,
        bucket_id: str,
        *,
        private: bool | None = None,
        visibility: Literal["public", "private"] | None = None,
        resource_group_id: str | None = None,
        region: Any = None,
        exist_ok: bool = False,
        token: bool | str | None = None,
    ) -> Any:
        self._fault("create_bucket")
        with self._lock:
            if bucket_id in self.buckets and not exist_ok:
                raise ValueError(f"bucket {bucket_id} exists (fake)")
            self.buckets.setdefault(bucket_id, {})
            self.private.setdefault(bucket_id, bool(private) or visibility == "private")
        return f"https://huggingface.co/buckets/{bucket_id}"

    def batch_bucket_files(
        self,
        bucket_id: str,
        *,
        add: list[tuple[str | Path | bytes, str]] | None = None,
        copy: list[tuple[str, str, str, str]] | None = None,
        delete: list[str] | None = None,
        token: str | bool | None = None,
    ) -> None:
        self._fault("batch_bucket_files")
        with self._lock:
            bucket = self._bucket(bucket_id)
            staged = {remote: src if isinstance(src, bytes) else Path(src).read_bytes() for src, remote in add or []}
            bucket.update(staged)  # a batch lands whole
            for path in delete or []:
                bucket.pop(path, None)

    def download_bucket_files(
        self,
        bucket_id: str,
        files: list[tuple[str | BucketFile, str | Path]],
        *,
        raise_on_missing_files: bool = False,
        token: str | bool | None = None,
    ) -> None:
        self._fault("download_bucket_files")
        bucket = self._bucket(bucket_id)
        missing = [
            src if isinstance(src, str) else src.path
            for src, _ in files
            if (src if isinstance(src, str) else src.path) not in bucket
        ]
        if missing and raise_on_missing_files:
            raise EntryNotFoundError(f"{len(missing)} file(s) not found in bucket '{bucket_id}': {', '.join(missing)}")
        self.warnings.extend(missing)
        for src, dest in files:
            path = src if isinstance(src, str) else src.path
            if path in bucket:
                Path(dest).parent.mkdir(parents=True, exist_ok=True)
                Path(dest).write_bytes(bucket[path])

    def list_bucket_tree(
        self,
        bucket_id: str,
        prefix: str | None = None,
        *,
        recursive: bool | None = None,
        token: str | bool | None = None,
    ) -> Any:
        self._fault("list_bucket_tree")
        bucket = self._bucket(bucket_id)
        base = (prefix.rstrip("/") + "/") if prefix else ""
        out: list[Any] = []
        folders: set[str] = set()
        for path, data in sorted(bucket.items()):
            if not path.startswith(base):
                continue
            rest = path[len(base) :]
            if recursive or "/" not in rest:
                out.append(self._file(path, data))
            else:
                folders.add(base + rest.split("/")[0])
        out.extend(BucketFolder(type="directory", path=f) for f in sorted(folders))
        return iter(out)

    def get_bucket_paths_info(self, bucket_id: str, paths: Any, *, token: str | bool | None = None) -> Any:
        self._fault("get_bucket_paths_info")
        bucket = self._bucket(bucket_id)
        return iter([self._file(p, bucket[p]) for p in paths if p in bucket])

    def delete_bucket(self, bucket_id: str, *, missing_ok: bool = False, token: bool | str | None = None) -> None:
        self._fault("delete_bucket")
        with self._lock:
            if bucket_id not in self.buckets and not missing_ok:
                self._bucket(bucket_id)
            self.buckets.pop(bucket_id, None)
