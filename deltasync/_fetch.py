"""The agent's reads from the store: manifests checked against the registered digest (and the publisher's
signature), shards fetched in parallel, checked (size, sha256), cached by sha256 so that a retried or restarted
fetch resumes, with retries and backoff on store faults and integrity failures."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ._localfs import ensure_dir, link_readable, read_regular, write_new
from .errors import FormatError, IntegrityError, StoreError
from .layout import manifest_key, prefix_of
from .manifest import MAX_MANIFEST_BYTES, DeltaManifest, ShardEntry
from .reader import Trust, check_shard, check_squash_manifest
from .signing import VerifyKey
from .store.base import Store
from .store.local import LocalStore
from .vocab import ObjectKind

__all__ = ["ObjectFetcher"]

logger = logging.getLogger("deltasync.agent")


class ObjectFetcher:
    """Fetches and checks published objects for one agent.

    Args:
        store: where the objects are.
        cache: a directory for verified shards (by sha256). A local store is its own cache: shards read from
            one are not copied there (a retry reads the store again, at the same cost).
        verify_key: require every manifest to be signed by this key.
        retries, backoff_s: attempts after the first, and the first backoff (doubling, capped at 30 s).
        workers: shards fetched in parallel.
        name: the agent's id, for messages.
    """

    def __init__(
        self,
        store: Store,
        cache: Path,
        *,
        verify_key: VerifyKey | None,
        retries: int,
        backoff_s: float,
        workers: int,
        name: str,
    ) -> None:
        self.store, self.cache, self.verify_key = store, cache, verify_key
        self.retries, self.backoff_s, self.workers, self.name = retries, backoff_s, workers, name

    def manifest(
        self, version: int, kind: ObjectKind, checksum: str, base_version: int | None = None
    ) -> tuple[DeltaManifest, bytes]:
        """An object's manifest (and its bytes), whose sha256 must be ``checksum`` (the registered digest). A
        squash (``kind`` ``squash``, with its ``base_version``) comes back as the delta it is, marked as lying at
        the squash's keys.

        Raises:
            IntegrityError: another digest; SignatureError: not signed by the trusted key.
            FormatError: a squash's manifest describes another object than its key.
        """
        key = manifest_key(version, kind, base_version)
        name = f"{self.store.uri}/{key}"

        def get() -> bytes:
            data = self.store.get(key, max_bytes=MAX_MANIFEST_BYTES)
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            if digest != checksum:
                raise IntegrityError(f"{name}: sha256 is {digest}, the coordinator registered {checksum}")
            return data

        data = self._with_retries(get, name)
        if self.verify_key is not None:
            Trust(verify_key=self.verify_key).check(self.store, version, kind, data, base_version)
        manifest = DeltaManifest.from_json(data, name=name)
        if kind == "squash":
            assert base_version is not None  # manifest_key raised otherwise
            manifest = check_squash_manifest(manifest, version, base_version, name=name)
        return manifest, data

    def shards(self, manifests: list[DeltaManifest], skip: list[list[bool]] | None = None) -> list[list[bytes]]:
        """Every shard of every object (``skip[i][j]``: not shard ``j`` of object ``i``, ``b""`` in its place), in
        parallel, each checked against its manifest entry."""
        jobs = [
            (i, j, m, e)
            for i, m in enumerate(manifests)
            for j, e in enumerate(m.shards)
            if skip is None or not skip[i][j]
        ]
        out: list[list[bytes]] = [[b""] * len(m.shards) for m in manifests]

        def fetch(job: tuple[int, int, DeltaManifest, ShardEntry]) -> None:
            i, j, m, entry = job
            out[i][j] = self._shard(prefix_of(m) + entry.file, entry)

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            list(pool.map(fetch, jobs))
        return out

    def link_shard(self, manifest: DeltaManifest, entry: ShardEntry, dst: Path) -> bool:
        """Hard-link a fetched shard's verified bytes at ``dst`` (a new name, no copy): the local store's own file,
        or this fetcher's cached copy. ``False`` when neither can be linked (the caller writes the bytes). Whoever
        reads ``dst`` checks its sha256 again (an engine does, before it decodes)."""
        if isinstance(self.store, LocalStore):
            return self.store.link_to(prefix_of(manifest) + entry.file, dst, entry.bytes)
        return link_readable(self.cache / entry.sha256, dst, entry.bytes)

    def link_unread(self, manifest: DeltaManifest, entry: ShardEntry, dst: Path) -> bool:
        """Hard-link a local store's shard at ``dst`` without reading it (``False``: not a local store, or no link
        can be made). For an engine that hashes every shard against its manifest before it decodes: the file is
        read and hashed once, there, and no copy of a large anchor passes through this process."""
        if not isinstance(self.store, LocalStore):
            return False
        return self.store.link_to(prefix_of(manifest) + entry.file, dst, entry.bytes)

    def _shard(self, key: str, entry: ShardEntry) -> bytes:
        """A shard, size- and sha256-verified; refetched on a mismatch; cached by sha256 so a retry resumes."""
        cached = ensure_dir(self.cache) / entry.sha256
        name = f"{self.store.uri}/{key}"
        if os.path.lexists(cached):
            try:
                data = bytes(read_regular(cached, entry.bytes, "cached shard"))
                check_shard(data, entry, name=str(cached))
                return data
            except FormatError:  # IntegrityError included, and anything planted there that is not a file: refetch it
                _remove(cached)

        def get_checked() -> bytes:
            data = self.store.get(key, max_bytes=entry.bytes)
            check_shard(data, entry, name=name)
            return data

        data = self._with_retries(get_checked, name)
        if not isinstance(self.store, LocalStore):
            write_new(cached, data)
        return data

    def _with_retries(self, fn: Callable[[], bytes], what: str) -> bytes:
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except (StoreError, IntegrityError) as exc:
                if attempt == self.retries:
                    raise
                delay = min(self.backoff_s * 2**attempt, 30.0)
                logger.warning(
                    "agent %s: %s: %s; retry %d/%d in %.1f s",
                    self.name,
                    what,
                    exc,
                    attempt + 1,
                    self.retries,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    def clear(self) -> None:
        """Forget the cached shards (once applied)."""
        for cached in ensure_dir(self.cache).iterdir():
            _remove(cached)


def _remove(path: Path) -> None:
    """Remove a cache entry, whatever was put there: a file or link is unlinked (never followed), a directory
    removed with what it holds (``shutil.rmtree`` never follows the links inside)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
