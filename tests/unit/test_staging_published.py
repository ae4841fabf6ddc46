"""Objects staged as published (the engine decodes them against what it serves): decoding against read values
equals decoding against the base's whole tensors, for dense, empty, fp32 and one-element tensors and FSDP span
shards; a catch-up decodes each object against the ones before it and, after an anchor (whole or in spans), reads
nothing the engine serves; a staged object that is not the published one (altered shards, another version or
kind, links, paths outside its directory, FIFOs, a shard grown to gigabytes, a delta on another base) is refused
before any served value is read; the engine decodes only the manifest it admitted; the overlay of earlier objects
never mutates their values."""

from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import (
    FormatError,
    IntegrityError,
    LocalStore,
    compute_delta,
    read_manifest,
    tensor_checksum,
    write_anchor,
    write_delta,
)
from deltasync._sharding import TensorView, dense_entries, globalize
from deltasync.apply import Holding, admit_all, write
from deltasync.errors import RefusalReason, UpdateRefused
from deltasync.format import TensorDelta
from deltasync.manifest import DeltaManifest, TensorEntry
from deltasync.sketch import tensor_sketch
from deltasync.staging import StagedObject, StagedUpdate, read_staged, read_staged_manifest
from deltasync.testing.stream import UpdateStream
from deltasync.vllm.served import ServedValues, merge_changes
from deltasync.vocab import DTYPE_NAMES, Kind
from deltasync.writer import ObjectWriter
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


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for n in a:
        assert a[n].shape == b[n].shape and a[n].dtype == b[n].dtype, n
        assert torch.equal(_bits(a[n]), _bits(b[n])), f"{n} differs"


def _step(state: dict[str, torch.Tensor], frac: float, gen: torch.Generator, names: set[str] | None = None):
    out = {}
    for k, v in state.items():
        if names is not None and k not in names:
            out[k] = v.clone()
            continue
        mask = torch.rand(v.shape, generator=gen) < frac
        out[k] = torch.where(mask, v + (torch.randn(v.shape, generator=gen) * 1e-2).to(v.dtype), v)
    return out


def _publish_spans(
    store: LocalStore,
    prev: dict[str, torch.Tensor] | None,
    curr: dict[str, torch.Tensor],
    *,
    version: int,
    base_version: int | None,
    kind: str,
    world: int = 2,
) -> DeltaManifest:
    """What FSDP ranks publish (RankCommit, without torch.distributed): each rank its rows of every tensor, as one
    shard per rank; tensors split across shards as dense spans (anchor) or span deltas (sparse or dense)."""
    writer = ObjectWriter(store=store, encoding="packed")
    shards, nnz, parts = [], collections.Counter(), {}
    for rank in range(world):
        deltas = []
        for name, t in curr.items():
            rows = t.shape[0]
            row = t.numel() // rows
            r0, r1 = rank * rows // world, (rank + 1) * rows // world
            span = (r0 * row, r1 * row)
            parts.setdefault(name, []).append((*span, tensor_checksum(t, span)))
            view = TensorView(tuple(t.shape), span, True)
            new = t[r0:r1].clone()
            if kind == "anchor":
                deltas += dense_entries({name: new}, {name: view})
            else:
                assert prev is not None
                ch = compute_delta({name: prev[name][r0:r1].clone()}, {name: new}, dense_fraction=0.5)
                if name in ch:
                    deltas.append(globalize(ch[name], new, view)[0])
        for d in deltas:
            nnz[d.ckpt_name] += d.nnz
        s = writer.encode(
            deltas, kind=kind, version=version, base_version=base_version, first_index=rank, grouped=False
        )
        writer.put_shards(version, kind, s)
        shards += s
    tensors = {
        n: TensorEntry(
            shape=tuple(t.shape),
            dtype=DTYPE_NAMES[t.dtype],
            nnz=nnz[n],
            shards=(),
            checksums=tuple(parts[n]),
            sketch=tensor_sketch(t),
        )
        for n, t in curr.items()
    }
    m = writer.manifest(
        kind=kind,
        version=version,
        base_version=base_version,
        shards=[(s.entry, list(s.tensors)) for s in shards],
        tensors=tensors,
    )
    writer.commit(m)
    return m


def _stage_in(store: LocalStore, root: Path, version: int, kind: str = "delta", sub: str = "") -> StagedObject:
    return stage_as_published(store, root / f"{sub}v{version}-{kind}", version, kind)  # type: ignore[arg-type]


class _Live:
    """What an engine serves, read at sorted flat indices; every read recorded."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.reads: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def __call__(self, name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        with self.lock:
            self.reads.append((name, indices.numel()))
        t = self.tensors[name]
        assert t.dtype == dtype
        return t.reshape(-1).index_select(0, indices)


def _refuses(name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    raise FormatError(f"tensor {name!r}: this engine cannot read what it serves (not a tensor of the served model)")


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def mixed(tmp_path: Path) -> tuple[LocalStore, dict[int, dict[str, torch.Tensor]]]:
    """A packed chain v0 (anchor) .. v4 over bf16 matrices, a float32 tensor, a 1-element and a 0-d tensor:
    v1 sparse, v2 dense-layout (most elements changed) plus the tiny tensors, v3 empty, v4 sparse over all."""
    gen = torch.Generator().manual_seed(0)
    s0 = {
        "a": (torch.randn(64, 48, generator=gen) * 0.02).bfloat16(),
        "f": torch.randn(33, generator=gen),
        "one": torch.randn(1, generator=gen).bfloat16(),
        "sc": torch.randn((), generator=gen).bfloat16(),
    }
    store = LocalStore(tmp_path / "store")
    truth = {0: s0}
    base = write_anchor(store, s0, version=0, encoding="packed")
    prev = {k: v.clone() for k, v in s0.items()}
    plan = {1: (0.05, None), 2: (0.95, {"a", "one", "sc"}), 3: (0.0, set()), 4: (0.3, None)}
    for v, (frac, names) in plan.items():
        curr = _step(truth[v - 1], frac, gen, names)
        base = write_delta(
            store, compute_delta(prev, curr, update_prev=True), state=curr, version=v, base=base, encoding="packed"
        )
        truth[v] = curr
    return store, truth


@pytest.fixture
def spans(tmp_path: Path) -> tuple[LocalStore, dict[int, dict[str, torch.Tensor]]]:
    """FSDP-style objects (2 ranks, one shard each): anchor v1 in dense spans, v2 mostly changed (dense spans),
    v3 sparse spans; a bf16 matrix and a float32 matrix."""
    gen = torch.Generator().manual_seed(1)
    s0 = {"a": (torch.randn(64, 48, generator=gen) * 0.02).bfloat16(), "f": torch.randn(10, 3, generator=gen)}
    store = LocalStore(tmp_path / "store")
    truth = {0: s0, 1: _step(s0, 0.05, gen)}
    truth[2] = _step(truth[1], 0.9, gen)
    truth[3] = _step(truth[2], 0.1, gen)
    _publish_spans(store, None, truth[1], version=1, base_version=None, kind="anchor")
    _publish_spans(store, truth[1], truth[2], version=2, base_version=1, kind="delta")
    _publish_spans(store, truth[2], truth[3], version=3, base_version=2, kind="delta")
    return store, truth


# ---------------------------------------------------------------------------------------------- exact


def test_exact_catch_up_over_dense_empty_f32_and_one_element_tensors(mixed, tmp_path: Path) -> None:
    store, truth = mixed
    m2 = read_manifest(store, 2)
    assert m2.tensors["a"].nnz > 0.9 * m2.tensors["a"].numel  # dense layout
    assert read_manifest(store, 3).shards == ()  # the empty delta
    live = _Live({k: v.clone() for k, v in truth[0].items()})
    source = ServedValues(live)
    state = {k: v.clone() for k, v in truth[0].items()}
    for v in (1, 2, 3, 4):
        m, deltas = read_staged(_stage_in(store, tmp_path / "stg", v), root=tmp_path / "stg", base=source)
        source.advance(deltas)
        state = dict(write(state, m, deltas))
        _assert_bit_equal(state, truth[v])
    # what was recorded as read from the engine equals the served values (never the session's overlay)
    for name, parts in source.served.items():
        for at, values in parts:
            assert torch.equal(_bits(values), _bits(truth[0][name].reshape(-1)[at]))


def test_exact_fsdp_span_shards_decoded_against_served_values(spans, tmp_path: Path) -> None:
    store, truth = spans
    assert len(read_manifest(store, 2).shards) == 2 and read_manifest(store, 2).tensors["a"].shards == (0, 1)
    live = _Live({k: v.clone() for k, v in truth[1].items()})
    source = ServedValues(live)
    state = {k: v.clone() for k, v in truth[1].items()}
    for v in (2, 3):
        m, deltas = read_staged(_stage_in(store, tmp_path / "stg", v), root=tmp_path / "stg", base=source)
        source.advance(deltas)
        state = dict(write(state, m, deltas))
        _assert_bit_equal(state, truth[v])
    for name, parts in source.served.items():  # one part per span shard of v2, read from the engine
        assert len(parts) == 2
        for at, values in parts:
            assert torch.equal(_bits(values), _bits(truth[1][name].reshape(-1)[at]))


def test_exact_span_anchor_then_deltas(spans, tmp_path: Path) -> None:
    store, truth = spans
    stale = {k: torch.zeros_like(v) for k, v in truth[0].items()}  # whatever is served is overwritten
    source = ServedValues(_Live(stale))
    state = None
    for v, kind in ((1, "anchor"), (2, "delta"), (3, "delta")):
        m, deltas = read_staged(_stage_in(store, tmp_path / "stg", v, kind), root=tmp_path / "stg", base=source)
        source.advance(deltas)
        state = dict(write(state, m, deltas))
        _assert_bit_equal(state, truth[v])
    assert source.served == {}


def test_span_anchor_then_delta_reads_nothing_the_engine_serves(spans, tmp_path: Path) -> None:
    store, truth = spans
    source = ServedValues(_refuses)
    for v, kind in ((1, "anchor"), (2, "delta")):
        _, deltas = read_staged(_stage_in(store, tmp_path / "stg", v, kind), root=tmp_path / "stg", base=source)
        source.advance(deltas)


def test_whole_anchor_then_delta_reads_nothing_the_engine_serves(mixed, tmp_path: Path) -> None:
    store, truth = mixed
    write_anchor(store, truth[3], version=3, encoding="packed")
    source = ServedValues(_refuses)
    for v, kind in ((3, "anchor"), (4, "delta")):
        _, deltas = read_staged(_stage_in(store, tmp_path / "stg", v, kind), root=tmp_path / "stg", base=source)
        source.advance(deltas)
    assert source.served == {}


# ---------------------------------------------------------------------------------------------- nothing else


def _refused(obj: StagedObject, root: Path, base: Any, match: str, exc: type = FormatError) -> None:
    with pytest.raises(exc, match=match):
        read_staged(obj, root=root, base=base)


def test_altered_shards_are_refused_before_any_served_value_is_read(spans, tmp_path: Path) -> None:
    store, truth = spans
    root = tmp_path / "stg"
    obj = _stage_in(store, root, 3)
    other = _stage_in(store, root, 2)
    live = _Live(truth[2])
    base = ServedValues(live)
    s0 = Path(obj.shard_paths[0])
    good = s0.read_bytes()

    def with_shard0(data: bytes) -> None:
        s0.write_bytes(data)
        _refused(obj, root, base, "size|sha256|more than")
        s0.write_bytes(good)

    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x10
    with_shard0(bytes(flipped))
    with_shard0(good[:-1])  # truncated
    with pytest.raises(FormatError, match="more than"):
        s0.write_bytes(good + b"\0")  # extended: refused by its size, before it is read
        read_staged(obj, root=root, base=base)
    s0.write_bytes(good)
    with_shard0(Path(other.shard_paths[0]).read_bytes())  # another version's shard
    # the shards listed in another order, another object's shards, fewer or more paths than the manifest
    for paths in (
        obj.shard_paths[::-1],
        other.shard_paths,
        obj.shard_paths[:1],
        (*obj.shard_paths, obj.shard_paths[0]),
    ):
        bad = dataclasses.replace(obj, shard_paths=tuple(paths))
        _refused(bad, root, base, "size|sha256|staged shards|more than")
    assert live.reads == []
    # shard 0 twice: refused too, but only after shard 0 was decoded against served values (shards are checked
    # one at a time, each just before it is decoded; nothing is returned, so nothing decoded is used)
    _refused(dataclasses.replace(obj, shard_paths=(obj.shard_paths[0],) * 2), root, base, "size|sha256|more than")
    read_staged(obj, root=root, base=base)  # the intact object still decodes


def test_manifest_of_another_version_or_kind_is_refused(mixed, tmp_path: Path) -> None:
    store, truth = mixed
    root = tmp_path / "stg"
    write_anchor(store, truth[4], version=4, encoding="packed")
    obj = _stage_in(store, root, 4)
    anchor = _stage_in(store, root, 4, "anchor")
    older = _stage_in(store, root, 2)
    for info in (
        {**obj.to_update_info(), "manifest_path": older.manifest_path},  # v2's manifest for a v3 -> v4 message
        {**obj.to_update_info(), "manifest_path": anchor.manifest_path},  # the anchor's manifest for the delta
        {**anchor.to_update_info(), "manifest_path": obj.manifest_path},
        {**obj.to_update_info(), "base_version": 2},
        {**obj.to_update_info(), "version": 5},
    ):
        bad = StagedObject.from_update_info(info)
        with pytest.raises(FormatError, match="the update message says"):
            read_staged_manifest(bad, root=root)


def test_links_paths_outside_directories_and_fifos_are_refused(mixed, tmp_path: Path) -> None:
    store, truth = mixed
    root = tmp_path / "stg"
    obj = _stage_in(store, root, 1)
    base = ServedValues(_refuses)
    shard = Path(obj.shard_paths[0])
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(shard, outside / shard.name)
    shutil.copy(obj.manifest_path, outside / "manifest.json")
    link_file = root / "link.safetensors"
    link_file.symlink_to(shard)
    link_dir = root / "linkdir"
    link_dir.symlink_to(outside)
    (root / "adir").mkdir()
    fifo = root / "fifo"
    os.mkfifo(fifo)
    for shard_path in (
        str(outside / shard.name),
        f"{root}/../outside/{shard.name}",
        str(link_file),
        str(link_dir / shard.name),
        str(root / "adir"),
        str(fifo),
        str(root / "missing"),
        "relative/path",
    ):
        bad = dataclasses.replace(obj, shard_paths=(shard_path,))
        with pytest.raises(FormatError, match="not inside|not a regular file|cannot read"):
            read_staged(bad, root=root, base=base)
    for manifest_path in (
        str(outside / "manifest.json"),
        str(root / "adir"),
        str(fifo),
        str(link_dir / "manifest.json"),
    ):
        bad = dataclasses.replace(obj, manifest_path=manifest_path)
        with pytest.raises(FormatError, match="not inside|not a regular file|cannot read"):
            read_staged(bad, root=root, base=base)
    with pytest.raises(FormatError, match="no staging directory"):
        read_staged(obj, root=None, base=base)


@pytest.mark.parametrize("value", [1, 0, "true", None, [True], 1.0])
def test_published_of_a_wrong_type_is_refused(value: Any) -> None:
    info = {
        "kind": "delta",
        "version": 2,
        "base_version": 1,
        "manifest_path": "/s/m",
        "shard_paths": ["/s/x"],
        "published": value,
    }
    with pytest.raises(ValueError, match="published must be a bool"):
        StagedUpdate.from_update_info({"objects": [info]})


@pytest.mark.parametrize(
    "patch",
    [
        {"version": True},
        {"version": 2.0},
        {"base_version": "1"},
        {"shard_paths": "/s/x"},
        {"shard_paths": [b"/s/x"]},
        {"shard_paths": [""]},
        {"manifest_path": ""},
        {"kind": "Delta"},
        {"extra": 1},
    ],
)
def test_malformed_messages_are_refused(patch: dict[str, Any]) -> None:
    info = {"kind": "delta", "version": 2, "base_version": 1, "manifest_path": "/s/m", "shard_paths": ["/s/x"]}
    with pytest.raises(ValueError):
        StagedObject.from_update_info({**info, "published": True, **patch})


def test_a_shard_grown_to_gigabytes_is_refused_by_its_size_without_reading(mixed, tmp_path: Path) -> None:
    store, truth = mixed
    root = tmp_path / "stg"
    obj = _stage_in(store, root, 1)
    shard = Path(obj.shard_paths[0])
    with open(shard, "r+b") as f:
        f.truncate(8 << 30)  # a sparse 8 GiB file: reading it would allocate 8 GiB
    t0 = time.perf_counter()
    with pytest.raises(FormatError, match="more than"):
        read_staged(obj, root=root, base=ServedValues(_refuses))
    assert time.perf_counter() - t0 < 5


# ---------------------------------------------------------------------------------------------- the engine


def _engine_read(root: Path, holding: Holding, live: Any, objects: list[StagedObject]) -> Any:
    """The engine's read of an update (:func:`deltasync.vllm.applier.read_update`): its manifests admitted against
    ``holding`` before anything is decoded against what it serves (``live``)."""
    from deltasync.vllm.applier import read_update

    update = StagedUpdate(objects=tuple(objects))

    def admit(manifests: list[DeltaManifest]) -> None:
        where = [(m, f"deltasync {o.label}") for m, o in zip(manifests, update.objects, strict=True)]
        admit_all(where, holding, target=update.target_version)

    return read_update(update, root=str(root), admit=admit, source=lambda: ServedValues(live))


def test_engine_refuses_a_delta_on_another_base_before_reading_served_values(mixed, tmp_path: Path) -> None:
    store, truth = mixed
    root = tmp_path / "stg"
    m0 = read_manifest(store, 0, "anchor")
    live = _Live(truth[1])
    holding = Holding(version=1, spec=m0.spec)
    for objects in ([_stage_in(store, root, 4)], [_stage_in(store, root, 3), _stage_in(store, root, 4)]):
        with pytest.raises(UpdateRefused) as caught:
            _engine_read(root, holding, live, objects)
        assert caught.value.reason == RefusalReason.BASE
    assert live.reads == []
    # the right base is read (only the changed elements) and decodes exactly
    ((m, deltas),) = _engine_read(root, holding, live, [_stage_in(store, root, 2)])
    _assert_bit_equal(dict(write({k: v.clone() for k, v in truth[1].items()}, m, deltas)), truth[2])
    assert sum(n for _, n in live.reads) == m.nnz


def test_engine_decodes_only_the_manifest_it_admitted(mixed, tmp_path: Path, monkeypatch) -> None:
    store, truth = mixed
    root = tmp_path / "stg"
    obj = _stage_in(store, root, 2)
    # another model's delta v1 -> v2 (another tensor set), as published to another store
    gen = torch.Generator().manual_seed(7)
    foreign = {"z": (torch.randn(40, 40, generator=gen) * 0.02).bfloat16()}
    other = LocalStore(tmp_path / "other")
    b = write_anchor(other, foreign, version=0)
    prev = {k: v.clone() for k, v in foreign.items()}
    f1 = _step(foreign, 0.1, gen)
    b = write_delta(other, compute_delta(prev, f1, update_prev=True), state=f1, version=1, base=b)
    f2 = _step(f1, 0.1, gen)
    write_delta(other, compute_delta(prev, f2, update_prev=True), state=f2, version=2, base=b)
    foreign_obj = _stage_in(other, tmp_path / "foreign", 2)

    import deltasync.vllm.applier as applier_mod

    admitted = applier_mod.read_staged_manifest

    def then_swap(o: StagedObject, *, root: Any) -> DeltaManifest:
        m = admitted(o, root=root)
        # what a writer of the staging directory does right after the engine admitted the object
        os.replace(shutil.copy(foreign_obj.manifest_path, Path(o.manifest_path).with_suffix(".x")), o.manifest_path)
        for src, dst in zip(foreign_obj.shard_paths, o.shard_paths, strict=True):
            os.replace(shutil.copy(src, dst + ".x"), dst)
        return m

    monkeypatch.setattr(applier_mod, "read_staged_manifest", then_swap)
    m0 = read_manifest(store, 0, "anchor")
    reads: list[str] = []

    def live(name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        reads.append(name)
        if name not in truth[1]:
            return torch.zeros(indices.numel(), dtype=dtype)
        return truth[1][name].reshape(-1).index_select(0, indices)

    try:
        _engine_read(root, Holding(version=1, spec=m0.spec), live, [obj])
    except (UpdateRefused, ValueError):
        pass
    assert "z" not in reads, "a tensor of a manifest the engine never admitted was read from what it serves"


# ---------------------------------------------------------------------------------------------- the overlay

_D = TensorDelta(ckpt_name="t", shape=(64,), dtype=torch.bfloat16, indices=None, values=torch.zeros(64).bfloat16())
"""A template entry of tensor ``t``."""


def test_overlay_never_mutates_earlier_objects_values_and_records_only_live_reads() -> None:
    n = 64
    live_t = {"t": torch.arange(n, dtype=torch.float32).bfloat16()}
    live = _Live(live_t)
    src = ServedValues(live)

    def delta(idx, vals, span=None):
        return dataclasses.replace(
            _D,
            indices=None if idx is None else torch.tensor(idx, dtype=torch.int64),
            values=torch.tensor(vals, dtype=torch.float32).bfloat16(),
            span=span,
        )

    d1 = delta([1, 5, 9], [100.0, 500.0, 900.0])
    got = src.values_at("t", (n,), torch.bfloat16, torch.tensor([1, 5, 9]))
    assert torch.equal(got, live_t["t"][[1, 5, 9]])
    src.advance([d1])
    d2 = delta(None, list(range(1000, 1000 + n)))  # written whole
    src.advance([d2])
    keep2 = d2.values.clone()
    d3 = delta(None, [7.0] * 8, span=(8, 16))  # a dense span on top of a whole tensor
    src.advance([d3])
    d4 = delta([0, 63], [-1.0, -2.0])
    src.advance([d4])
    assert torch.equal(_bits(d2.values), _bits(keep2)), "the whole tensor of an earlier object was changed"
    got = src.values_at("t", (n,), torch.bfloat16, torch.tensor([0, 8, 20, 63]))
    assert got.tolist() == [-1.0, 7.0, 1020.0, -2.0]
    got = src.values_at("t", (n,), torch.bfloat16, torch.arange(n))
    assert torch.equal(_bits(d2.values), _bits(keep2))
    # only the first read (before any overlay) was recorded, with the live values
    assert list(src.served) == ["t"] and len(src.served["t"]) == 1
    assert torch.equal(src.served["t"][0][1], live_t["t"][[1, 5, 9]])
    assert live.reads == [("t", 3)]


def test_overlay_sparse_then_sparse_reads_live_without_recording_and_merges() -> None:
    live_t = {"t": torch.arange(32, dtype=torch.float32).bfloat16()}
    src = ServedValues(_Live(live_t))
    first = dataclasses.replace(
        _D, shape=(32,), indices=torch.tensor([2, 4]), values=torch.tensor([-2.0, -4.0]).bfloat16()
    )
    src.advance([first])
    then = dataclasses.replace(
        _D, shape=(32,), indices=torch.tensor([4, 6]), values=torch.tensor([40.0, 60.0]).bfloat16()
    )
    src.advance([then])
    keep = first.values.clone()
    got = src.values_at("t", (32,), torch.bfloat16, torch.tensor([2, 3, 4, 6]))
    assert got.tolist() == [-2.0, 3.0, 40.0, 60.0]
    assert torch.equal(first.values, keep)
    assert src.served == {}  # overlay reads are never recorded as served values
    assert live_t["t"][4].item() == 4.0  # the live tensor itself untouched


def test_concurrent_values_at_records_every_first_read() -> None:
    names = [f"t{i}" for i in range(64)]
    tensors = {n: torch.randn(256).bfloat16() for n in names}
    barrier = threading.Barrier(8)

    def live(name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        time.sleep(0.0005)
        return tensors[name].index_select(0, indices)

    src = ServedValues(live)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            barrier.wait()
            for rep in range(4):
                for n in names[k::8]:
                    idx = torch.arange(rep, 256, 7)
                    got = src.values_at(n, (256,), torch.bfloat16, idx)
                    assert torch.equal(_bits(got), _bits(tensors[n][idx]))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(src.served) == sorted(names) and all(len(p) == 4 for p in src.served.values())
