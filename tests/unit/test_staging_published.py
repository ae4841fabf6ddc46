"""Objects staged as published (the engine decodes them against what it serves): decoding against read values
equals decoding against the base's whole tensors; a catch-up decodes each object against the ones before it; a
staged shard that is not the published one is refused before anything is decoded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltasync import FormatError, IntegrityError, LocalStore, compute_delta, write_anchor, write_delta
from deltasync.apply import write
from deltasync.staging import StagedObject, StagedUpdate, read_staged
from deltasync.testing.stream import UpdateStream
from deltasync.vllm.served import ServedValues, merge_changes
from deltasync.vocab import Kind
from tests.conftest import assert_bit_equal
from tests.support.staging import stage_as_published


def _publish(store: LocalStore, stream: UpdateStream, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    curr = stream.bf16()
    truth = {0: {k: v.clone() for k, v in curr.items()}}
    prev = {k: v.clone() for k, v in curr.items()}
    base = write_anchor(store, curr, version=0, encoding="packed")
    for v in range(1, steps + 1):
        curr = stream.step()
        base = write_delta(
            store, compute_delta(prev, curr, update_prev=True), state=curr, version=v, base=base, encoding="packed"
        )
        truth[v] = {k: t.clone() for k, t in curr.items()}
    return truth


def _stage(store: LocalStore, root: Path, version: int, kind: Kind = "delta") -> StagedObject:
    return stage_as_published(store, root / f"v{version}-{kind}", version, kind)


class _Served:
    """What an engine serves, read element by element (each read recorded)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.reads = tensors, 0

    def __call__(self, name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        self.reads += indices.numel()
        assert self.tensors[name].dtype == dtype
        return self.tensors[name].reshape(-1).index_select(0, indices)


def _refuses_reads(name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    raise AssertionError(f"{name}: read from what the engine serves, where the session's own values were due")


def _apply(held: dict[str, torch.Tensor], objects: list[tuple]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in held.items()}
    for manifest, deltas in objects:
        out = dict(write(out, manifest, deltas))
    return out


def test_a_published_delta_decodes_against_read_values_as_against_the_base(
    local_store: LocalStore, update_stream: UpdateStream, tmp_path: Path
) -> None:
    truth = _publish(local_store, update_stream, 2)
    obj = _stage(local_store, tmp_path, 2)
    assert obj.published and obj.to_update_info()["published"] is True
    served = _Served(truth[1])
    source = ServedValues(served)
    m, deltas = read_staged(obj, root=tmp_path, base=source)
    m_ref, ref = read_staged(obj, root=tmp_path, base=truth[1])
    for d, r in zip(deltas, ref, strict=True):
        assert torch.equal(d.indices, r.indices) and torch.equal(d.values.view(torch.int16), r.values.view(torch.int16))
    assert_bit_equal(_apply(truth[1], [(m, deltas)]), truth[2])
    # only the changed elements were read, and each read is kept for the proof, at the decoded indices
    assert served.reads == m.nnz
    for d in deltas:
        ((at, values),) = source.served[d.ckpt_name]
        assert at.data_ptr() == d.indices.data_ptr()
        assert torch.equal(values, truth[1][d.ckpt_name].reshape(-1)[d.indices])


def test_a_catch_up_decodes_each_delta_against_the_ones_before_it(
    local_store: LocalStore, update_stream: UpdateStream, tmp_path: Path
) -> None:
    truth = _publish(local_store, update_stream, 4)
    served = _Served(truth[1])
    source = ServedValues(served)
    objects = []
    for v in (2, 3, 4):
        objects.append(read_staged(_stage(local_store, tmp_path, v), root=tmp_path, base=source))
        source.advance(objects[-1][1])
    assert_bit_equal(_apply(truth[1], objects), truth[4])
    # what was read from the served values is recorded for the first delta that changed each tensor only
    first = {d.ckpt_name: d for d in objects[0][1]}
    for name, parts in source.served.items():
        assert len(parts) == 1
        if name in first:
            assert parts[0][0].data_ptr() == first[name].indices.data_ptr()


def test_after_an_anchor_a_session_reads_nothing_it_serves(
    local_store: LocalStore, update_stream: UpdateStream, tmp_path: Path
) -> None:
    truth = _publish(local_store, update_stream, 2)
    write_anchor(local_store, truth[1], version=1, encoding="packed")
    source = ServedValues(_refuses_reads)
    objects = []
    for v, kind in ((1, "anchor"), (2, "delta")):
        objects.append(read_staged(_stage(local_store, tmp_path, v, kind), root=tmp_path, base=source))
        source.advance(objects[-1][1])
    assert source.served == {}
    # the anchor's own values are written as they are: decoding the delta after it changed a copy
    assert_bit_equal({d.ckpt_name: d.values for d in objects[0][1]}, truth[1])
    assert_bit_equal(_apply({}, objects), truth[2])


def test_a_staged_shard_other_than_the_published_one_is_refused(
    local_store: LocalStore, update_stream: UpdateStream, tmp_path: Path
) -> None:
    truth = _publish(local_store, update_stream, 1)
    obj = _stage(local_store, tmp_path, 1)
    shard = Path(obj.shard_paths[0])
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        read_staged(obj, root=tmp_path, base=truth[0])
    fewer = StagedObject.from_update_info({**obj.to_update_info(), "shard_paths": []})
    with pytest.raises(FormatError, match="0 staged shards, the manifest has 1"):
        read_staged(fewer, root=tmp_path, base=truth[0])
    with pytest.raises(FormatError, match="not inside the staging directory"):
        read_staged(obj, root=tmp_path / "elsewhere", base=truth[0])
    with pytest.raises(ValueError, match="pass base="):
        read_staged(_stage(local_store, tmp_path / "again", 1), root=tmp_path)


def test_the_published_flag_crosses_the_rpc_and_old_messages_mean_decoded(tmp_path: Path) -> None:
    info = {"kind": "delta", "version": 2, "base_version": 1, "manifest_path": "m", "shard_paths": ["s"]}
    assert StagedObject.from_update_info(info).published is False
    assert "published" not in StagedObject.from_update_info(info).to_update_info()
    assert StagedUpdate.from_update_info({"objects": [{**info, "published": True}]}).objects[0].published
    with pytest.raises(ValueError, match="published must be a bool"):
        StagedObject.from_update_info({**info, "published": "yes"})


def test_merge_changes_keeps_the_later_value_once_per_element() -> None:
    first = (torch.tensor([1, 4, 7]), torch.tensor([10.0, 40.0, 70.0]))
    then = (torch.tensor([0, 4, 8]), torch.tensor([0.5, 44.0, 80.0]))
    idx, values = merge_changes(first, then)
    assert idx.tolist() == [0, 1, 4, 7, 8]
    assert values.tolist() == [0.5, 10.0, 44.0, 70.0, 80.0]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_fetched_shard_is_staged_by_a_hard_link_and_still_proven(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """The agent stages a fetched object as published under another name for its verified bytes (the local store's
    own file, or the fetcher's cached copy of a remote store's shard): no copy of the anchor is written. What the
    engine reads is still hashed against the manifest: a linked file changed in place afterwards is refused."""
    import hashlib
    import os

    from deltasync._fetch import ObjectFetcher
    from deltasync.layout import manifest_key, object_prefix
    from deltasync.staging import stage_published

    store = LocalStore(tmp_path / "store") if where == "local" else request.getfixturevalue("s3_store")
    truth = _publish(store, UpdateStream.from_shapes({"w": (64, 32), "b": (32,)}, seed=0), 1)
    fetcher = ObjectFetcher(
        store, tmp_path / "staging" / "cache", verify_key=None, retries=0, backoff_s=0.0, workers=2, name="t"
    )
    (m0, data0), (m1, data1) = (
        fetcher.manifest(v, k, "sha256:" + hashlib.sha256(store.get(manifest_key(v, k))).hexdigest())
        for v, k in ((0, "anchor"), (1, "delta"))
    )
    blobs0, blobs1 = fetcher.shards([m0, m1])
    staged0 = stage_published(
        tmp_path / "staging" / "a0", m0, data0, blobs0, link=lambda e, p: fetcher.link_shard(m0, e, p)
    )
    staged1 = stage_published(
        tmp_path / "staging" / "d1", m1, data1, blobs1, link=lambda e, p: fetcher.link_shard(m1, e, p)
    )
    source = (
        (lambda m, e: tmp_path / "store" / (object_prefix(m.version, m.kind) + e.file))
        if where == "local"
        else (lambda m, e: tmp_path / "staging" / "cache" / e.sha256)
    )
    for m, staged in ((m0, staged0), (m1, staged1)):
        for entry, path in zip(m.shards, staged.shard_paths, strict=True):
            assert os.path.samefile(path, source(m, entry)), "a copy was written, not a link"
    root = tmp_path / "staging"
    message = lambda o: StagedObject.from_update_info(o.to_update_info())  # noqa: E731 - as over RPC
    _, anchor = read_staged(message(staged0), root=root)
    state = dict(write(None, m0, anchor))
    _, deltas = read_staged(message(staged1), root=root, base=state)
    assert_bit_equal(dict(write(state, m1, deltas)), truth[1])
    # the linked bytes changed in place after the agent verified them: the engine's own hash refuses them
    path = Path(staged1.shard_paths[0])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    with open(path, "r+b") as f:  # in place: the link and its source change together
        f.write(data)
    with pytest.raises((IntegrityError, FormatError), match="sha256"):
        read_staged(message(staged1), root=root, base=state)
    # where no link can be made (the fetcher says so), the bytes are written
    copied = stage_published(root / "copy", m1, data1, blobs1, link=lambda e, p: False)
    assert not os.path.samefile(copied.shard_paths[0], staged1.shard_paths[0])


def test_a_local_store_shard_is_linked_unread_and_the_engine_hashes_it(tmp_path: Path) -> None:
    """An agent that stages for an engine that decodes links a local store's shards without reading them (no copy
    of an anchor passes through it); the engine's hash is then the only one, and a corrupt store file is refused
    there, before anything is decoded. A remote store's shards are fetched (and hashed) as before."""
    import hashlib
    import os

    from deltasync._fetch import ObjectFetcher
    from deltasync.layout import manifest_key, object_prefix
    from deltasync.staging import stage_published

    class CountingStore(LocalStore):
        gets: list[str] = []

        def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
            self.gets.append(key)
            return super().get(key, max_bytes=max_bytes)

    store = CountingStore(tmp_path / "store")
    truth = _publish(store, UpdateStream.from_shapes({"w": (64, 32), "b": (32,)}, seed=0), 1)
    fetcher = ObjectFetcher(
        store, tmp_path / "staging" / "cache", verify_key=None, retries=0, backoff_s=0.0, workers=2, name="t"
    )
    m1, data1 = fetcher.manifest(
        1, "delta", "sha256:" + hashlib.sha256(store.get(manifest_key(1, "delta"))).hexdigest()
    )
    root = tmp_path / "staging"
    (root / "d1").mkdir(parents=True)
    store.gets.clear()
    done = [fetcher.link_unread(m1, e, root / "d1" / e.file) for e in m1.shards]
    assert done == [True] * len(m1.shards)
    assert fetcher.shards([m1], skip=[done]) == [[b""] * len(m1.shards)] and store.gets == []  # nothing read
    staged = stage_published(root / "d1", m1, data1, [b""] * len(m1.shards), link=lambda e, p: True)
    shard = tmp_path / "store" / (object_prefix(1, "delta") + m1.shards[0].file)
    assert os.path.samefile(staged.shard_paths[0], shard)
    message = StagedObject.from_update_info(staged.to_update_info())
    _, deltas = read_staged(message, root=root, base=truth[0])
    assert_bit_equal(dict(write({k: v.clone() for k, v in truth[0].items()}, m1, deltas)), truth[1])
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    with open(shard, "r+b") as f:  # the store's file corrupted in place: the staged link sees it
        f.write(data)
    with pytest.raises((IntegrityError, FormatError), match="sha256"):
        read_staged(message, root=root, base=truth[0])
    # fetched where it cannot be linked unread (another store kind): read and hashed by the fetcher itself
    with pytest.raises(IntegrityError, match="sha256"):
        fetcher.shards([m1], skip=[[False] * len(m1.shards)])
