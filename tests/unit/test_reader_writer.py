from __future__ import annotations

import dataclasses

import pytest
import torch

from deltasync import (
    FormatError,
    IntegrityError,
    LocalStore,
    ObjectExists,
    ObjectNotFound,
    ObjectWriter,
    compute_delta,
    list_versions,
    read_manifest,
    read_weights,
    write_anchor,
    write_delta,
)
from deltasync.layout import manifest_key
from deltasync.reader import read_chain
from deltasync.sketch import tensor_sketch
from deltasync.testing.stream import UpdateStream
from deltasync.vocab import Kind
from tests.conftest import assert_bit_equal, overwrite, remove


def _publish_stream(store: LocalStore, stream: UpdateStream, steps: int, *, encoding: str, anchor_every: int):
    """Publish v0 (anchor) and `steps` deltas; return the trainer's weights at every version."""
    curr = stream.bf16()
    truth = {0: {k: v.clone() for k, v in curr.items()}}
    prev = {k: v.clone() for k, v in curr.items()}
    base = write_anchor(store, curr, version=0, encoding=encoding)
    for v in range(1, steps + 1):
        curr = stream.step()
        changes = compute_delta(prev, curr, update_prev=True)
        base = write_delta(store, changes, state=curr, version=v, base=base, encoding=encoding)
        if v % anchor_every == 0:
            write_anchor(store, curr, version=v, encoding=encoding)
        truth[v] = curr
    return truth


@pytest.mark.parametrize("encoding", ["raw", "packed"])
def test_twenty_step_stream_rebuilds_bit_exact_at_every_version(
    local_store: LocalStore, update_stream: UpdateStream, encoding: str
) -> None:
    truth = _publish_stream(local_store, update_stream, 20, encoding=encoding, anchor_every=5)
    listing = list_versions(local_store)
    assert [x.version for x in listing] == list(range(21))
    assert [x.version for x in listing if x.anchor] == [0, 5, 10, 15, 20]
    assert all(x.delta for x in listing[1:]) and not listing[0].delta
    fractions = []
    for v, expected in truth.items():
        assert_bit_equal(read_weights(local_store, v), expected)
        if v:
            m = read_manifest(local_store, v)
            fractions.append(m.nnz / m.numel)
    # the stream is realistic: after Adam's warm-up step about 0.3-5% of the elements change
    assert all(0.003 < f < 0.05 for f in fractions[1:]), fractions
    assert [m.version for m in read_chain(local_store, 13)] == [10, 11, 12, 13]
    assert [m.kind for m in read_chain(local_store, 15)] == ["anchor"]


def test_uncommitted_versions_are_invisible(local_store: LocalStore, update_stream: UpdateStream) -> None:
    _publish_stream(local_store, update_stream, 2, encoding="packed", anchor_every=100)
    local_store.put("v00000003/shard-00000.safetensors", b"partial upload")  # no manifest: not committed
    assert [x.version for x in list_versions(local_store)] == [0, 1, 2]
    with pytest.raises(ObjectNotFound, match=r"version 3 is not committed$"):
        read_weights(local_store, 3)
    local_store.delete(manifest_key(1, "delta"))
    with pytest.raises(ObjectNotFound, match=r"version 1 is not committed \(needed to rebuild v2\)"):
        read_weights(local_store, 2)


def test_corrupt_shards_are_detected(local_store: LocalStore, update_stream: UpdateStream) -> None:
    _publish_stream(local_store, update_stream, 2, encoding="packed", anchor_every=100)
    key = "v00000002/shard-00000.safetensors"
    data = bytearray(local_store.get(key))
    data[len(data) // 2] ^= 0x01
    overwrite(local_store, key, bytes(data))
    with pytest.raises(IntegrityError, match=r"shard-00000.safetensors: sha256 is [0-9a-f]{64}, the manifest says"):
        read_weights(local_store, 2)
    overwrite(local_store, key, bytes(data[:-3]))
    with pytest.raises(IntegrityError, match=r"size is \d+ bytes, the manifest says \d+; refetch it"):
        read_weights(local_store, 2)
    remove(local_store, key)
    with pytest.raises(ObjectNotFound, match="no object 'v00000002/shard-00000.safetensors'"):
        read_weights(local_store, 2)


def test_decode_checked_skips_only_a_second_hash_of_immutable_bytes(
    local_store: LocalStore, update_stream: UpdateStream
) -> None:
    """``decode_object(checked=True)``: the caller fetched and hashed these exact ``bytes``. A mutable buffer, or
    bytes of another size, is hashed all the same: a flipped byte in either is an IntegrityError."""
    from deltasync.reader import decode_object, fetch_object

    _publish_stream(local_store, update_stream, 1, encoding="packed", anchor_every=100)
    m = read_manifest(local_store, 0, "anchor")
    blobs = fetch_object(local_store, m)
    assert decode_object(m, blobs, where="s/", checked=True)  # the fetched bytes, as they are
    flipped = bytearray(blobs[0])
    flipped[len(flipped) // 2] ^= 0x01
    for data in (flipped, bytes(flipped) + b"x"):
        with pytest.raises(IntegrityError):
            decode_object(m, [data, *blobs[1:]], where="s/", checked=True)  # type: ignore[list-item]
    with pytest.raises(IntegrityError, match="sha256"):
        decode_object(m, [bytes(flipped), *blobs[1:]], where="s/")


def test_checksums_prove_the_rebuilt_weights(local_store: LocalStore, update_stream: UpdateStream) -> None:
    _publish_stream(local_store, update_stream, 1, encoding="raw", anchor_every=100)
    m = read_manifest(local_store, 1)
    name = next(n for n, t in m.tensors.items() if t.nnz)
    entry = m.tensors[name]
    wrong = dataclasses.replace(entry, checksums=((0, entry.numel, "xxh3_128:" + "0" * 32),))
    overwrite(
        local_store, manifest_key(1, "delta"), dataclasses.replace(m, tensors={**m.tensors, name: wrong}).to_json()
    )
    with pytest.raises(IntegrityError, match=rf"v1: 1 tensors differ from the published checksums: {name}\[0:"):
        read_weights(local_store, 1)
    assert read_weights(local_store, 1, verify=False)[name].shape == entry.shape


def test_manifest_in_the_wrong_place(local_store: LocalStore, update_stream: UpdateStream) -> None:
    _publish_stream(local_store, update_stream, 2, encoding="raw", anchor_every=100)
    overwrite(local_store, manifest_key(2, "delta"), local_store.get(manifest_key(1, "delta")))
    with pytest.raises(FormatError, match="manifest describes delta v1, expected delta v2"):
        read_weights(local_store, 2)


def test_delta_for_another_model_is_refused(local_store: LocalStore) -> None:
    a = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    base = write_anchor(local_store, a, version=0)
    b = {"w": torch.ones(5, dtype=torch.bfloat16)}
    changes = compute_delta({"w": torch.zeros(5, dtype=torch.bfloat16)}, b)
    with pytest.raises(ValueError, match=r"tensor 'w' \(BF16 \[5\]\) does not match base v0 \(\['BF16', \[4\]\]\)"):
        write_delta(local_store, changes, state=b, version=1, base=base)
    # the same bytes forged into the store are refused on read
    other = LocalStore(local_store.root.parent / "other")
    other_base = write_anchor(other, {"w": torch.zeros(5, dtype=torch.bfloat16)}, version=0)
    write_delta(other, changes, state=b, version=1, base=other_base, encoding="raw")
    for key in other.list("v00000001/"):
        local_store.put(key, other.get(key))
    with pytest.raises(FormatError, match=r"delta v1 is for another model than anchor v0 .* the chain mixes"):
        read_weights(local_store, 1)


def test_empty_delta(local_store: LocalStore) -> None:
    a = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    base = write_anchor(local_store, a, version=0, encoding="raw")
    m = write_delta(local_store, compute_delta(a, a), state=a, version=1, base=base)
    assert m.shards == () and m.nnz == 0
    assert_bit_equal(read_weights(local_store, 1), a)


def test_shards_are_split_by_size(local_store: LocalStore, tiny_state_dict: dict[str, torch.Tensor]) -> None:
    m = write_anchor(
        ObjectWriter(store=local_store, encoding="raw", max_shard_bytes=64 << 10), tiny_state_dict, version=0
    )
    assert len(m.shards) > 3
    assert_bit_equal(read_weights(local_store, 0), tiny_state_dict)


def test_a_version_is_never_written_twice(local_store: LocalStore) -> None:
    """Registered objects are never overwritten: writes are create-only, so a second writer (or a retry of a
    failed publish) can never change a committed object's bytes."""
    a = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    write_anchor(local_store, a, version=0)
    before = {k: local_store.get(k) for k in local_store.list()}
    with pytest.raises(ObjectExists, match=r"'v00000000/anchor/shard-00000.safetensors' exist.*create-only"):
        write_anchor(local_store, {"w": torch.ones(4, dtype=torch.bfloat16)}, version=0)
    assert {k: local_store.get(k) for k in local_store.list()} == before
    assert_bit_equal(read_weights(local_store, 0), a)


def test_write_anchor_and_write_delta_give_every_tensors_sketch(
    local_store: LocalStore, update_stream: UpdateStream
) -> None:
    truth = _publish_stream(local_store, update_stream, 4, encoding="packed", anchor_every=2)
    objects: list[tuple[int, Kind]] = [(0, "anchor"), (1, "delta"), (2, "delta"), (2, "anchor"), (3, "delta")]
    objects += [(4, "delta"), (4, "anchor")]
    for v, kind in objects:
        expected = truth[v]
        m = read_manifest(local_store, v, kind)
        assert {n: e.sketch for n, e in m.tensors.items()} == {n: tensor_sketch(t) for n, t in expected.items()}


def test_a_delta_on_a_base_without_sketches_computes_them_from_state(
    local_store: LocalStore, update_stream: UpdateStream
) -> None:
    """A base written before format 1.2 has no sketches: the delta takes the unchanged tensors' from ``state``."""
    prev = update_stream.bf16()
    m0 = write_anchor(local_store, prev, version=0)
    old = dataclasses.replace(
        m0, format_version="1.1", tensors={n: dataclasses.replace(e, sketch=None) for n, e in m0.tensors.items()}
    )
    curr = {n: t.clone() for n, t in prev.items()}
    changed = sorted(curr)[0]
    curr[changed].view(-1)[:3] += 1
    changes = compute_delta(prev, curr)
    assert list(changes) == [changed]
    m1 = write_delta(local_store, changes, state=curr, version=1, base=old)
    assert {n: e.sketch for n, e in m1.tensors.items()} == {n: tensor_sketch(t) for n, t in curr.items()}
    other = sorted(curr)[1]
    with pytest.raises(ValueError) as exc:
        write_delta(local_store, changes, state={changed: curr[changed]}, version=2, base=old)
    assert str(exc.value) == (
        f"tensor {other!r} has no sketch in base v0 (written before format 1.2) and state does not hold it; "
        "pass every tensor in state, or publish an anchor"
    )
