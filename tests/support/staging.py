"""Objects staged as an agent stages them for an engine that decodes (as fetched), read back as the engine gets them."""

from __future__ import annotations

from pathlib import Path

from deltasync import read_manifest
from deltasync.layout import manifest_key, object_prefix
from deltasync.staging import StagedObject, stage_published
from deltasync.store.base import Store
from deltasync.vocab import Kind


def stage_as_published(store: Store, directory: Path, version: int, kind: Kind = "delta") -> StagedObject:
    """Object ``version``/``kind`` of ``store`` staged in ``directory`` as published (the manifest and the shards as
    fetched), as the message an engine receives over RPC: files only, nothing in memory."""
    m = read_manifest(store, version, kind)
    prefix = object_prefix(version, kind)
    shards = [store.get(prefix + e.file) for e in m.shards]
    staged = stage_published(directory, m, store.get(manifest_key(version, kind)), shards)
    return StagedObject.from_update_info(staged.to_update_info())
