"""One Store conformance suite for LocalStore, HubBucketStore (over an in-process fake of the Hub API) and
S3Store (over moto's real S3 server on 127.0.0.1)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltasync import (
    ObjectExists,
    ObjectNotFound,
    ObjectTooLarge,
    Store,
    StoreError,
    list_versions,
    open_store,
    read_weights,
)
from deltasync.config import PublisherConfig
from deltasync.publisher import Publisher
from deltasync.store import LocalStore
from deltasync.store.hub import HubBucketStore, parse_hub_uri
from deltasync.testing.stream import UpdateStream
from tests.conftest import assert_bit_equal
from tests.fakes import FakeBucketApi

KINDS = ["local", "hub", "s3"]


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "local":
        yield LocalStore(tmp_path / "local")
    elif request.param == "hub":
        yield HubBucketStore("me/run1", "exp", api=FakeBucketApi(), cache_dir=tmp_path / "cache", backoff_s=0.001)
    else:
        yield request.getfixturevalue("s3_store")


def test_is_a_store(store: Store) -> None:
    assert isinstance(store, Store)


def test_put_get_open_exists_list_delete(store: Store, tmp_path: Path) -> None:
    store.put_many([("v00000001/shard-00000.safetensors", b"a" * 10), ("v00000001/shard-00001.safetensors", b"b")])
    store.put("v00000001/manifest.json", memoryview(b"{}"))
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(1 << 20))
    store.put_file("v00000001/anchor/shard-00000.safetensors", big)
    assert store.get("v00000001/shard-00000.safetensors") == b"a" * 10
    with store.open("v00000001/anchor/shard-00000.safetensors") as f:
        assert f.read() == big.read_bytes()
    assert store.list() == [
        "v00000001/anchor/shard-00000.safetensors",
        "v00000001/manifest.json",
        "v00000001/shard-00000.safetensors",
        "v00000001/shard-00001.safetensors",
    ]
    assert store.list("v00000001/anchor/") == ["v00000001/anchor/shard-00000.safetensors"]
    assert store.exists("v00000001/manifest.json") and not store.exists("v00000009/manifest.json")
    assert store.size("v00000001/shard-00000.safetensors") == 10
    store.delete("v00000001/shard-00001.safetensors")
    assert "v00000001/shard-00001.safetensors" not in store.list()


def test_writes_are_create_only(store: Store, tmp_path: Path) -> None:
    """Registered objects are never overwritten: no store ever writes a key that exists."""
    store.put("v00000001/manifest.json", b"{}")
    src = tmp_path / "f"
    src.write_bytes(b"other")
    for write in (
        lambda: store.put("v00000001/manifest.json", b"[]"),
        lambda: store.put_many([("v00000001/new.bin", b"1"), ("v00000001/manifest.json", b"[]")]),
        lambda: store.put_file("v00000001/manifest.json", src),
    ):
        with pytest.raises(ObjectExists, match="create-only"):
            write()
    assert store.get("v00000001/manifest.json") == b"{}"
    assert not store.exists("v00000001/new.bin")  # a refused batch writes none of its objects


def test_put_many_refuses_a_key_that_comes_twice_before_writing_any(store: Store) -> None:
    """The same key twice in one batch is refused (ValueError naming it) and nothing is written."""
    batch = [("v00000001/a.bin", b"1"), ("v00000001/dup.bin", b"2"), ("v00000001/dup.bin", b"3")]
    with pytest.raises(ValueError, match="'v00000001/dup.bin' comes twice in one put_many batch"):
        store.put_many(batch)
    assert not store.exists("v00000001/a.bin") and not store.exists("v00000001/dup.bin")


def test_reads_are_bounded_before_reading(store: Store) -> None:
    store.put("big", b"x" * 1000)
    assert store.get("big", max_bytes=1000) == b"x" * 1000
    with pytest.raises(ObjectTooLarge, match=r"'big' is 1000 bytes, more than the 999 allowed"):
        store.get("big", max_bytes=999)


def test_missing_objects_are_errors(store: Store) -> None:
    store.put("a", b"1")
    for call in (store.get, store.open, store.delete):
        with pytest.raises(ObjectNotFound, match="no object 'missing'"):
            call("missing")


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", ".hidden"])
def test_bad_keys_are_refused(store: Store, key: str) -> None:
    with pytest.raises(ValueError, match="store key"):
        store.put(key, b"x")


def test_publish_and_rebuild_through_the_store(store: Store, update_stream: UpdateStream) -> None:
    truth = {}
    with Publisher(store, config=PublisherConfig(anchor_every=3)) as pub:
        for step in range(6):
            weights = update_stream.bf16() if step == 0 else update_stream.step()
            truth[pub.publish(weights, step)] = weights
    assert [x.version for x in list_versions(store)] == list(range(6))
    for version, weights in truth.items():
        assert_bit_equal(read_weights(store, version), weights)


def test_readers_ignore_versions_without_a_manifest(store: Store, update_stream: UpdateStream) -> None:
    with Publisher(store) as pub:
        pub.publish(update_stream.bf16(), 0)
    store.put("v00000001/shard-00000.safetensors", b"uploaded, never committed")  # a writer that crashed
    assert [x.version for x in list_versions(store)] == [0]


# ---------------------------------------------------------------- Hub specifics (over the fake)


def test_the_fake_mirrors_the_installed_huggingface_hub() -> None:
    from huggingface_hub import HfApi

    for name in (
        "create_bucket",
        "batch_bucket_files",
        "download_bucket_files",
        "list_bucket_tree",
        "get_bucket_paths_info",
        "delete_bucket",
    ):
        real = inspect.signature(getattr(HfApi, name))
        fake = inspect.signature(getattr(FakeBucketApi, name))
        assert [(p.name, p.kind, p.default) for p in fake.parameters.values()] == [
            (p.name, p.kind, p.default) for p in real.parameters.values()
        ], name


def hub(tmp_path: Path, api: FakeBucketApi, retries: int = 3) -> HubBucketStore:
    return HubBucketStore("me/run1", api=api, cache_dir=tmp_path / "cache", retries=retries, backoff_s=0.001)


def test_buckets_are_created_private_and_shards_go_up_in_one_batch(tmp_path: Path, update_stream: UpdateStream) -> None:
    api = FakeBucketApi()
    store = hub(tmp_path, api)
    with Publisher(store, config=PublisherConfig(max_shard_bytes=4096)) as pub:
        pub.publish(update_stream.bf16(), 0)
    assert api.private["me/run1"] is True
    shards = [k for k in store.list() if "shard-" in k]
    # the store's run record once (run.json), then per object all shards in one batch, then the manifest
    assert len(shards) > 1 and api.calls["batch_bucket_files"] == 3


def test_429_then_success(tmp_path: Path) -> None:
    api = FakeBucketApi()
    store = hub(tmp_path, api)
    store.put("k", b"v")
    api.calls.clear()
    api.fail["get_bucket_paths_info"].extend([429, 429])
    assert store.get("k") == b"v"
    assert api.calls["get_bucket_paths_info"] == 3


def test_500_forever_gives_a_clear_error_after_the_retries(tmp_path: Path) -> None:
    api = FakeBucketApi()
    store = hub(tmp_path, api, retries=2)
    store.put("k", b"v")
    api.fail_forever = 500
    with pytest.raises(StoreError, match=r"hf://buckets/me/run1: stat \['k2'\] failed after 3 attempts: HTTP 500"):
        store.put("k2", b"w")
    assert api.calls["get_bucket_paths_info"] == 1 + 3 and api.calls["batch_bucket_files"] == 1


def test_a_missing_file_is_an_error_not_a_warning(tmp_path: Path) -> None:
    api = FakeBucketApi()
    store = hub(tmp_path, api)
    store.put("k", b"v")
    original = api.get_bucket_paths_info
    api.get_bucket_paths_info = lambda bucket_id, paths, token=None: iter(  # listed, then gone on download
        [api._file(p, b"v") for p in paths]
    )
    api.buckets["me/run1"].clear()
    with pytest.raises(ObjectNotFound, match="not found"):
        store.get("k")
    assert api.warnings == []
    api.get_bucket_paths_info = original


def test_downloads_are_cached_by_content(tmp_path: Path) -> None:
    api = FakeBucketApi()
    store = hub(tmp_path, api)
    store.put("k", b"v" * 100)
    assert store.get("k") == store.get("k") == b"v" * 100
    assert api.calls["download_bucket_files"] == 1
    assert len(list((tmp_path / "cache" / "blobs").iterdir())) == 1


def test_uris() -> None:
    assert parse_hub_uri("hf://buckets/me/run1") == ("me/run1", "")
    assert parse_hub_uri("hf://buckets/me/run1/a/b/") == ("me/run1", "a/b")
    with pytest.raises(ValueError, match="expected hf://buckets/<namespace>/<name>"):
        parse_hub_uri("hf://buckets/me")
    with pytest.raises(ValueError, match="store key"):
        parse_hub_uri("hf://buckets/me/run1/../x")
    s = open_store("hf://buckets/me/run1/exp")
    assert isinstance(s, HubBucketStore) and s.uri == "hf://buckets/me/run1/exp" and s.prefix == "exp"
    assert isinstance(open_store("/tmp/x"), LocalStore)
