from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from deltasync import LocalStore, ObjectExists, ObjectNotFound, Store, StoreError, open_store, register_store_scheme
from deltasync.store import check_key


def test_conforms_to_the_protocol(local_store: LocalStore) -> None:
    assert isinstance(local_store, Store)


def test_deleting_every_object_leaves_no_empty_directories(local_store: LocalStore, tmp_path: Path) -> None:
    """Local only: the basic operations are in test_store_conformance.py, run against LocalStore too."""
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(3 << 20))
    local_store.put("v00000001/shard-00000.safetensors", b"abc")
    local_store.put_file("v00000001/anchor/shard-00000.safetensors", src)
    with local_store.open("v00000001/anchor/shard-00000.safetensors") as f:
        assert f.read() == src.read_bytes()
    for key in local_store.list():
        local_store.delete(key)
    assert local_store.list() == [] and list(local_store.root.iterdir()) == []


def test_missing_objects(local_store: LocalStore) -> None:
    with pytest.raises(ObjectNotFound, match="the store directory does not exist"):
        local_store.list()
    local_store.put("a", b"")
    for call in (local_store.get, local_store.open, local_store.delete):
        with pytest.raises(ObjectNotFound) as exc:
            call("b")
        assert str(exc.value) == f"{local_store.uri}: no object 'b'"
        assert isinstance(exc.value, FileNotFoundError)


@pytest.mark.parametrize("key", ["", "/abs", "../up", "a/../../b", "a//b", ".hidden", "a\\b", "a/./b", "a\x00b", "é"])
def test_path_traversal_and_odd_keys_are_refused(local_store: LocalStore, key: str) -> None:
    with pytest.raises(ValueError, match="store key"):
        local_store.put(key, b"x")
    with pytest.raises(ValueError):
        check_key(key)


def test_temporary_files_are_invisible_and_cleaned_on_failure(local_store: LocalStore) -> None:
    local_store.put("v00000001/manifest.json", b"x")
    (local_store.root / "v00000001" / ".tmp-manifest.json.123").write_bytes(b"partial")

    def failing_write() -> None:
        local_store._create("v00000001/shard-00000.safetensors", lambda f: (_ for _ in ()).throw(OSError("disk")))

    with pytest.raises(StoreError, match="could not write 'v00000001/shard-00000.safetensors' \\(disk\\)"):
        failing_write()
    assert local_store.list() == ["v00000001/manifest.json"]
    assert sorted(p.name for p in (local_store.root / "v00000001").iterdir()) == [
        ".tmp-manifest.json.123",
        "manifest.json",
    ]


def test_concurrent_writers_one_wins_whole_and_the_others_are_refused(local_store: LocalStore) -> None:
    """Two writers: create-only means exactly one writer gets a key; the rest get ObjectExists
    and the object is never a mix, nor replaced later."""
    payloads = [bytes([i]) * (1 << 20) for i in range(8)]
    outcomes: list[str] = []

    def write(p: bytes) -> None:
        try:
            local_store.put("k", p)
            outcomes.append("ok")
        except ObjectExists:
            outcomes.append("exists")

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["exists"] * 7 + ["ok"]
    assert local_store.get("k") in payloads


def test_open_store(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    s = open_store(tmp_path.as_uri())
    assert isinstance(s, LocalStore) and s.root == tmp_path
    assert open_store(s.uri).root == tmp_path
    with pytest.raises(ValueError, match="no store for scheme 'gopher'"):
        open_store("gopher://bucket/x")
    with pytest.raises(ValueError, match="file:// URIs must name a local path"):
        open_store("file://remotehost/x")
    register_store_scheme("mem", lambda uri: LocalStore(tmp_path / uri.split("://")[1]))
    try:
        assert open_store("mem://x").root == tmp_path / "x"
    finally:
        from deltasync.store import _SCHEMES

        del _SCHEMES["mem"]
