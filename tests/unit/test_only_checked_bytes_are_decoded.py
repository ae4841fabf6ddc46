"""What is decoded is what was checked: no NaN bit pattern passes the decoder, raw or packed; a store's buffer
that can change after the check is hashed again; a directory, a link or wrong bytes planted in the shard cache is
refetched past and never decoded (and a directory read as a staged shard is a FormatError that leaks no
descriptor); a staged raw anchor is its own bytes whatever the host copy does next; raw anchors between packed
deltas stay bit-exact through the agent."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from deltasync import LocalStore, write_anchor
from deltasync.errors import FormatError, IntegrityError
from deltasync.format import TensorDelta, decode_shard, encode_shard, tensor_checksum
from deltasync.reader import decode_object
from tests.conftest import assert_bit_equal

pytestmark = pytest.mark.usefixtures("kernel_modes")  # the compiled loops and the numpy code alike


# --- NaN through the decoder: every bf16/fp16 NaN bit pattern, raw and packed -----------------------------------


def _nan_patterns(dtype: torch.dtype) -> list[int]:
    exp, mant = {torch.bfloat16: (0x7F80, 127), torch.float16: (0x7C00, 1023)}[dtype]
    return [sign | exp | m for sign in (0, 0x8000) for m in range(1, mant + 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_nan_bit_pattern_in_a_raw_shard_is_a_format_error(dtype: torch.dtype) -> None:
    """A raw sparse delta and a raw dense anchor whose last stored value is patched to each NaN pattern (the value
    bytes are the file's last two: entries are ordered by item size) are refused with a FormatError naming NaN."""
    base = torch.randn(40).to(dtype)
    sparse = TensorDelta(
        ckpt_name="w",
        shape=(40,),
        dtype=dtype,
        indices=torch.tensor([3, 17, 39]),
        values=base[[3, 17, 39]],
        checksum=tensor_checksum(base),
    )
    dense = TensorDelta(
        ckpt_name="w", shape=(5, 8), dtype=dtype, indices=None, values=base.view(5, 8), checksum=tensor_checksum(base)
    )
    shards = [
        encode_shard([sparse], kind="delta", encoding="raw", base_version=0, target_version=1),
        encode_shard([dense], kind="anchor", encoding="raw", target_version=1),
    ]
    for shard in shards:
        decode_shard(shard, name="ok")  # the placeholder decodes
        buf = bytearray(shard)
        for p in _nan_patterns(dtype):
            buf[-2:] = struct.pack("<H", p)
            for data in (bytes(buf), bytearray(buf), memoryview(bytes(buf))):  # read-only and writable paths
                with pytest.raises(FormatError, match="is NaN"):
                    decode_shard(data, name="nan")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_packed_delta_that_decodes_to_nan_on_another_base_is_refused(dtype: torch.dtype) -> None:
    """``ordinal-delta`` values are ``base + difference``: a receiver's base that differs from the publisher's can
    turn a valid shard into NaN (or any bits). Every such NaN (both signs, quiet and signalling, at every position
    of a vectorized loop) must be refused with a FormatError, never returned."""
    from deltasync import _codec

    ints = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    n = 37
    old = torch.randn(n).abs().to(dtype)  # positive: +3 bit steps is +3 ordinals everywhere
    new = old.clone()
    new.view(ints)[:] += 3
    d = TensorDelta(
        ckpt_name="w",
        shape=(n,),
        dtype=dtype,
        indices=torch.arange(n),
        values=new.clone(),
        base_values=old.clone(),
        checksum=tensor_checksum(new),
    )
    shard = encode_shard([d], kind="delta", encoding="packed", base_version=0, target_version=1)
    _, ok = decode_shard(shard, name="ok", base={"w": old})
    assert torch.equal(ok["w"].values.view(ints), new.view(ints))
    if dtype == torch.float32:
        targets = [0x7F800001, 0x7FC00000, 0x7FFFFFFF, -0x1000, -0x400000, -0x7FFFFF]
    else:
        targets = [p - 0x10000 if p >= 0x8000 else p for p in _nan_patterns(dtype)[::13]]
    np_int = {2: np.int16, 4: np.int32}[dtype.itemsize]
    # the most negative ordinals (-NaN of the largest payloads) are not 3 above any pattern: left out
    lowest = np.iinfo(np_int).min
    targets = [t for t in targets if int(_codec.to_ordinal(np.array([t], dtype=np_int))[0]) - 3 >= lowest]
    assert len(targets) >= 6
    refused = 0
    for pos in (0, 1, 15, 16, 17, 31, 32, n - 1):
        for t in targets:
            # the receiver's base at pos: the pattern 3 ordinals below the NaN pattern t
            ordinal = _codec.to_ordinal(np.array([t], dtype=np_int)).astype(np.int64) - 3
            evil = old.clone()
            evil.view(ints)[pos] = int(_codec.from_ordinal(ordinal.astype(np_int))[0])
            with pytest.raises(FormatError, match=f"value {pos} is NaN"):
                decode_shard(shard, name="evil", base={"w": evil})
            refused += 1
    assert refused == 8 * len(targets)


# --- the fetcher's checked bytes ------------------------------------------------------------------------------


def test_a_store_returning_a_buffer_it_corrupts_after_the_check_is_hashed_again(
    tmp_path: Path, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    """``decode_object(checked=True)`` skips the second sha256 only for immutable ``bytes``: a store handing out
    a ``bytearray`` that it changes after the fetcher's check is caught at decode."""
    from deltasync._fetch import ObjectFetcher

    store = LocalStore(tmp_path / "store")
    m = write_anchor(store, tiny_state_dict, version=0)
    handed: list[bytearray] = []
    real_get = store.get

    def get(key: str, *, max_bytes: int | None = None) -> bytearray:
        data = bytearray(real_get(key, max_bytes=max_bytes))
        handed.append(data)
        return data

    store.get = get  # type: ignore[method-assign]
    fetcher = ObjectFetcher(store, tmp_path / "cache", verify_key=None, retries=0, backoff_s=0.0, workers=2, name="a")
    blobs = fetcher.shards([m])[0]
    assert all(isinstance(b, bytearray) for b in blobs)
    decode_object(m, blobs, where="ok/", checked=True)  # untouched: decodes
    handed[0][-1] ^= 0x01  # the store changes a byte it handed out
    with pytest.raises(IntegrityError, match="sha256"):
        decode_object(m, blobs, where="evil/", checked=True)
    # and a bytes of another size than the manifest's is hashed too (never trusted by type alone)
    with pytest.raises(IntegrityError, match="size"):
        decode_object(m, [bytes(handed[0]) + b"\0"] + list(blobs[1:]), where="long/", checked=True)


def test_a_store_returning_a_memoryview_is_checked_and_decoded(
    tmp_path: Path, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    """A store whose ``get`` hands back a read-only ``memoryview`` (of bytes it may still hold): checked at
    fetch, hashed again at decode, decoded."""
    from deltasync._fetch import ObjectFetcher

    store = LocalStore(tmp_path / "store")
    m = write_anchor(store, tiny_state_dict, version=0)
    real_get = store.get
    store.get = lambda key, *, max_bytes=None: memoryview(real_get(key, max_bytes=max_bytes))  # type: ignore[method-assign]
    fetcher = ObjectFetcher(store, tmp_path / "cache", verify_key=None, retries=0, backoff_s=0.0, workers=2, name="a")
    blobs = fetcher.shards([m])[0]
    deltas = decode_object(m, blobs, where="mv/", checked=True)
    assert {d.ckpt_name for d in deltas} == set(tiny_state_dict)


def test_a_directory_planted_in_the_shard_cache_is_refetched_past(
    tmp_path: Path, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    from deltasync._fetch import ObjectFetcher

    store = LocalStore(tmp_path / "store")
    m = write_anchor(store, tiny_state_dict, version=0)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / m.shards[0].sha256).mkdir()  # planted (a regular file there is checked and refetched past: fine)
    fetcher = ObjectFetcher(store, cache, verify_key=None, retries=0, backoff_s=0.0, workers=1, name="a")
    blobs = fetcher.shards([m])[0]
    assert hashlib.sha256(blobs[0]).hexdigest() == m.shards[0].sha256
    fetcher.clear()


def test_read_regular_refuses_a_directory_with_a_format_error_and_leaks_no_descriptor(tmp_path: Path) -> None:
    import os

    from deltasync._localfs import read_regular

    target = tmp_path / "dir"
    target.mkdir()
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(20):
        with pytest.raises(FormatError, match="not a regular file"):
            read_regular(target, 1 << 20, "shard")
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before


def test_a_planted_cache_file_symlink_or_wrong_bytes_is_never_decoded(
    tmp_path: Path, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    """A file at ``<cache>/<sha256>`` with other bytes (same size), or a link to a file holding the right bytes
    elsewhere, is never returned: the fetcher reads the store again and returns the published bytes."""
    from deltasync._fetch import ObjectFetcher

    store = LocalStore(tmp_path / "store")
    m = write_anchor(store, tiny_state_dict, version=0)
    entry = m.shards[0]
    good = store.get(_key(m, entry))
    cache = tmp_path / "cache"
    cache.mkdir()
    wrong = bytearray(good)
    wrong[-1] ^= 0xFF
    (cache / entry.sha256).write_bytes(bytes(wrong))
    fetcher = ObjectFetcher(store, cache, verify_key=None, retries=0, backoff_s=0.0, workers=1, name="a")
    assert fetcher.shards([m])[0][0] == good
    assert not (cache / entry.sha256).exists()  # the wrong file was removed (a local store is not copied back)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(bytes(wrong))
    (cache / entry.sha256).symlink_to(elsewhere)
    assert fetcher.shards([m])[0][0] == good
    assert elsewhere.read_bytes() == bytes(wrong)  # never written through the link


def _key(m, entry) -> str:  # type: ignore[no-untyped-def]
    from deltasync.layout import object_prefix

    return object_prefix(m.version, m.kind) + entry.file


# --- staged files are exactly what was verified ----------------------------------------------------------------


def test_a_staged_raw_anchor_is_its_own_bytes_whatever_the_host_copy_does_next(tmp_path: Path) -> None:
    """``stage_object`` writes an anchor's entries straight from the tensors' memory (which the agent's host copy
    then keeps and updates in place): the file must hold the values at staging time, and a staged shard one byte
    short or one byte long is refused by the reader."""
    from deltasync.manifest import DeltaManifest
    from deltasync.reader import fetch_object
    from deltasync.staging import read_staged, stage_object

    weights = {"a": torch.randn(300, 7).to(torch.bfloat16), "b": torch.randn(70_001).to(torch.float32)}
    store = LocalStore(tmp_path / "store")
    m: DeltaManifest = write_anchor(store, weights, version=4)
    data = store.get(f"{_manifest_key(m)}")
    deltas = decode_object(m, fetch_object(store, m), where="s/")
    truth = {d.ckpt_name: d.values.clone() for d in deltas}
    root = tmp_path / "staging"
    root.mkdir()
    obj = dataclasses.replace(stage_object(root, m, data, deltas), deltas=None)
    for d in deltas:  # the host copy moves on (a later delta, in place)
        d.values.view(-1)[:5] = 0
    _, back = read_staged(obj, root=root)
    for d in back:
        assert torch.equal(d.values.view(torch.uint8), truth[d.ckpt_name].view(torch.uint8)), d.ckpt_name
    shard = Path(obj.shard_paths[0])
    full = shard.read_bytes()
    for bad in (full[:-1], full + b"\0", full + full[-8:]):
        shard.write_bytes(bad)
        with pytest.raises(FormatError):
            read_staged(obj, root=root)
    shard.write_bytes(full)
    assert_bit_equal({d.ckpt_name: d.values.reshape(d.shape) for d in read_staged(obj, root=root)[1]}, weights)


def _manifest_key(m) -> str:  # type: ignore[no-untyped-def]
    from deltasync.layout import manifest_key

    return manifest_key(m.version, m.kind)


# --- raw anchors between packed deltas, through the agent ------------------------------------------------------


@pytest.mark.parametrize("staged_files", [True, False], ids=["files", "in-process"])
def test_raw_anchors_between_packed_deltas_through_the_agent_are_bit_exact(
    tmp_path: Path, tiny_state_dict: dict[str, torch.Tensor], staged_files: bool
) -> None:
    """A raw anchor's decoded values are views of the shard's buffer, which becomes the agent's host copy (not
    cloned when staging to files); the packed deltas after it decode against that copy and update it in place.
    A fresh agent (raw anchor, then packed deltas in one plan) and one that already holds an older version (packed
    deltas across the raw anchor's version) both serve every version bit-exact."""
    from deltasync.targets import InMemoryTarget
    from tests.support.world import world

    with world(tmp_path, tiny_state_dict) as w:
        pub = w.publisher
        old = w.agent("agent-old", target=InMemoryTarget(staged_files=staged_files))
        old.sync()  # holds v0 (a packed anchor)
        object.__setattr__(pub.writer, "anchor_encoding", "raw")
        pub.step()
        pub.step(anchor=True)  # v2: a raw anchor (and its packed delta)
        pub.step()
        pub.step()
        from deltasync.reader import read_manifest

        assert read_manifest(w.store, 2, "anchor").encoding == "raw"
        assert read_manifest(w.store, 3, "delta").encoding == "packed"
        fresh = w.agent("agent-fresh", target=InMemoryTarget(staged_files=staged_files))
        for agent in (fresh, old):
            result = agent.sync()
            assert result.to_version == 4
            assert_bit_equal(agent.target.weights, pub.truth[4])
            assert agent.host is not None
            assert_bit_equal(agent.host, pub.truth[4])
        pub.step()
        for agent in (fresh, old):
            agent.sync()
            assert_bit_equal(agent.target.weights, pub.truth[5])
