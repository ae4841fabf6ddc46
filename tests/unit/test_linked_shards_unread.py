"""A local store's shards linked into staging unread (a hard link, not a copy) are still the published bytes when
they are decoded: a store file changed in place after linking, replaced before linking (a symlink, a FIFO, a
directory, another size, a hard link to other bytes), or a staged name swapped for a symlink out of the staging
root, is refused, never decoded."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from deltasync import LocalStore, compute_delta, read_manifest, write_anchor, write_delta
from deltasync._fetch import ObjectFetcher
from deltasync.errors import FormatError
from deltasync.layout import manifest_key, object_prefix
from deltasync.staging import read_staged, stage_published
from deltasync.testing.stream import UpdateStream


@pytest.fixture()
def world(tmp_path: Path):
    store = LocalStore(tmp_path / "store")
    stream = UpdateStream.from_shapes({"w": (64, 32), "v": (64, 32)}, seed=1, lr=3e-5)
    s0 = stream.bf16()
    m0 = write_anchor(store, s0, version=0)
    s1 = stream.step()
    prev = {k: t.clone() for k, t in s0.items()}
    write_delta(store, compute_delta(prev, s1, update_prev=True), state=s1, version=1, base=m0)
    fetcher = ObjectFetcher(store, tmp_path / "cache", verify_key=None, retries=0, backoff_s=0.0, workers=2, name="t")
    return tmp_path, store, fetcher, s0


def _store_file(tmp: Path, m, entry) -> Path:
    return tmp / "store" / (object_prefix(m.version, m.kind) + entry.file)


def _stage(tmp: Path, store, fetcher, version: int, kind: str):
    """As the agent stages for a decoding engine: link unread, fetch the rest, stage."""
    m = read_manifest(store, version, kind)
    data = store.get(manifest_key(version, kind))
    root = tmp / "staging"
    d = root / f"v{version}-{kind}"
    d.mkdir(parents=True, exist_ok=True)
    linked = [fetcher.link_unread(m, e, d / e.file) for e in m.shards]
    blobs = fetcher.shards([m], skip=[linked])[0]
    obj = stage_published(d, m, data, blobs, link=lambda e, p: linked[[x.file for x in m.shards].index(e.file)])
    return m, obj, root, linked


def _base(s0):
    return {k: v.clone() for k, v in s0.items()}


def test_linked_unread_shard_decodes(world) -> None:
    """Baseline: a linked shard of an intact store decodes (the link is a real hard link, not a copy)."""
    tmp, store, fetcher, s0 = world
    m, obj, root, linked = _stage(tmp, store, fetcher, 1, "delta")
    assert all(linked)
    assert os.stat(obj.shard_paths[0]).st_ino == os.stat(_store_file(tmp, m, m.shards[0])).st_ino
    read_staged(obj, root=root, base=_base(s0))


@pytest.mark.parametrize("how", ["flip", "truncate", "extend", "rewrite_same_size"])
def test_store_file_changed_in_place_after_linking_is_refused(world, how: str) -> None:
    """The store's file (same inode as the staged link) changed after linking: refused before any decode."""
    tmp, store, fetcher, s0 = world
    m, obj, root, _ = _stage(tmp, store, fetcher, 1, "delta")
    path = _store_file(tmp, m, m.shards[0])
    with open(path, "r+b") as f:
        if how == "flip":
            f.seek(m.shards[0].bytes - 1)
            last = f.read(1)
            f.seek(m.shards[0].bytes - 1)
            f.write(bytes([last[0] ^ 1]))
        elif how == "truncate":
            f.truncate(m.shards[0].bytes - 1)
        elif how == "extend":
            f.seek(0, 2)
            f.write(b"\0")
        else:
            f.seek(200)
            f.write(os.urandom(m.shards[0].bytes - 200))
    with pytest.raises(FormatError):  # IntegrityError is a FormatError
        read_staged(obj, root=root, base=_base(s0))


@pytest.mark.parametrize("how", ["symlink", "fifo", "directory", "truncated", "extended"])
def test_store_file_not_the_published_bytes_is_never_linked(world, how: str) -> None:
    """The store's shard replaced before linking by a symlink, a FIFO, a directory, or another size: never linked;
    the fetch then refuses it (or the engine does)."""
    tmp, store, fetcher, s0 = world
    m = read_manifest(store, 1, "delta")
    path = _store_file(tmp, m, m.shards[0])
    good = path.read_bytes()
    path.unlink()
    if how == "symlink":
        (tmp / "elsewhere").write_bytes(good)
        os.chmod(tmp / "elsewhere", 0o644)
        path.symlink_to(tmp / "elsewhere")
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "directory":
        path.mkdir()
    elif how == "truncated":
        path.write_bytes(good[:-1])
    else:
        path.write_bytes(good + b"\0")
    d = tmp / "staging" / "x"
    d.mkdir(parents=True)
    assert fetcher.link_unread(m, m.shards[0], d / m.shards[0].file) is False
    assert not os.path.lexists(d / m.shards[0].file)


def test_store_file_hardlinked_to_other_bytes_is_refused(world) -> None:
    """The store's shard replaced by a hard link to another file of the same size (other bytes): linked, but the
    engine refuses it by sha256 before decoding."""
    tmp, store, fetcher, s0 = world
    m = read_manifest(store, 1, "delta")
    path = _store_file(tmp, m, m.shards[0])
    other = tmp / "other"
    other.write_bytes(os.urandom(m.shards[0].bytes))
    os.chmod(other, 0o644)
    path.unlink()
    os.link(other, path)
    m, obj, root, linked = _stage(tmp, store, fetcher, 1, "delta")
    assert linked[0]
    with pytest.raises(FormatError):
        read_staged(obj, root=root, base=_base(s0))


def test_staged_link_swapped_for_symlink_outside_root_is_refused(world) -> None:
    """After staging, the staged name is replaced by a symlink to the (good) store file outside the root: refused
    (nothing outside the staging root is read)."""
    tmp, store, fetcher, s0 = world
    m, obj, root, _ = _stage(tmp, store, fetcher, 1, "delta")
    staged = Path(obj.shard_paths[0])
    staged.unlink()
    staged.symlink_to(_store_file(tmp, m, m.shards[0]))
    with pytest.raises(FormatError):
        read_staged(obj, root=root, base=_base(s0))


def test_staged_directory_symlinked_is_refused(world) -> None:
    """The staged object's directory replaced by a symlink to a copy elsewhere: refused."""
    tmp, store, fetcher, s0 = world
    m, obj, root, _ = _stage(tmp, store, fetcher, 1, "delta")
    d = Path(obj.manifest_path).parent
    shutil.copytree(d, tmp / "copy")
    shutil.rmtree(d)
    d.symlink_to(tmp / "copy")
    with pytest.raises(FormatError):
        read_staged(obj, root=root, base=_base(s0))
