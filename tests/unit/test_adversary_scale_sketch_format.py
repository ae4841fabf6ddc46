"""Adversarial review (scale round): the sketch from the changed elements far into huge tensors, NaN through the
decoder, the fetcher's checked bytes, staged files, raw anchors between packed deltas through the agent.

Each test tries to break one promise. The two holes it found are fixed and tested here: a directory read as a staged
shard (a FormatError now, and no leaked descriptor) and a directory planted in the shard cache (removed, refetched).
"""

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
from deltasync.sketch import add_sketches, sketch_at, sketch_change, sketch_range, sub_sketches
from tests.conftest import assert_bit_equal

pytestmark = pytest.mark.usefixtures("kernel_modes")  # the compiled loops and the numpy code alike

_M64 = (1 << 64) - 1
_CHUNK = 1 << 16


# --- 1. the sketch from the changed elements, against an independent vectorized reference ---------------------


def _sm(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _ref(words: np.ndarray, word_idx: np.ndarray) -> tuple[int, int, int, int]:
    """``sum_i words[i] * (W[i mod 2**16] + V[i // 2**16]) mod 2**64`` straight from docs/FORMAT.md's definition,
    one weight per word (no histograms, no chunk table)."""
    i = word_idx.astype(np.uint64)
    k = np.arange(4, dtype=np.uint64)
    with np.errstate(over="ignore"):
        w = (
            _sm((i % np.uint64(_CHUNK))[:, None] * np.uint64(4) + k + (np.uint64(1) << np.uint64(56))) >> np.uint64(45)
        ) | np.uint64(1)
        v = (
            _sm((i // np.uint64(_CHUNK))[:, None] * np.uint64(4) + k + (np.uint64(2) << np.uint64(56))) >> np.uint64(45)
        ) & ~np.uint64(1)
        lanes = (words.astype(np.int64).astype(np.uint64)[:, None] * (w + v)).sum(0, dtype=np.uint64)
    a, b, c, d = (int(x) & _M64 for x in lanes)
    return a, b, c, d


def _words(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).contiguous().view(torch.uint16).numpy().astype(np.int64)


def _word_idx(idx: np.ndarray, per: int) -> np.ndarray:
    return (idx[:, None] * per + np.arange(per)).reshape(-1) if per > 1 else idx


def _bits_random(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(ints).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    "where",
    [
        "one-element",
        "two-chunks-apart",
        "straddles-the-table-cap",  # first chunk below 2**16 chunks, last beyond: the table and computed offsets
        "far-beyond-the-table-cap",
        "dense-run-across-a-chunk-edge-far-away",
    ],
)
def test_sketch_change_and_sketch_at_far_into_huge_tensors_match_the_definition(dtype: torch.dtype, where: str) -> None:
    """``_weighted`` reads chunk offsets from a table capped at 2**16 chunks and computes the rest: the changed
    elements of a tensor far larger than memory (indices only), in either order, known increasing or not, with
    negative differences (any bits), must move the sketch exactly as the definition says."""
    g = torch.Generator().manual_seed(hash((str(dtype), where)) & 0xFFFF)
    per = dtype.itemsize // 2
    cap_elements = (_CHUNK << 16) // per  # the first element whose words lie past the table's last chunk
    idx = {
        "one-element": np.array([cap_elements + 12_345]),
        "two-chunks-apart": np.array([65_535 // per, 3 * _CHUNK // per + 1]),
        "straddles-the-table-cap": np.array(
            [cap_elements - 3 * _CHUNK // per - 1, cap_elements - 1, cap_elements, cap_elements + 70_000]
        ),
        "far-beyond-the-table-cap": np.sort(
            np.unique(np.array([2**34 + 5, 2**34 + _CHUNK, 2**34 + 3 * _CHUNK + 9, 2**34 + 7 * _CHUNK]))
        ),
        "dense-run-across-a-chunk-edge-far-away": np.arange(2**35 - 500, 2**35 + 700),
    }[where].astype(np.int64)
    n = idx.size
    new, old = _bits_random(n, dtype, g), _bits_random(n, dtype, g)
    at = torch.from_numpy(idx)
    wi = _word_idx(idx, per)
    want_change = _ref(_words(new) - _words(old), wi)
    for increasing in (False, True):
        assert sketch_change(new, old, at, increasing=increasing) == want_change, increasing
    perm = torch.randperm(n, generator=g)
    assert sketch_change(new[perm], old[perm], at[perm]) == want_change  # unsorted: the scatter path
    assert sketch_at(new, at) == _ref(_words(new), wi)
    assert sub_sketches(sketch_at(new[perm], at[perm]), sketch_at(old, at)) == want_change
    if where.startswith("dense-run"):  # a contiguous run: sketch_range (per-chunk offsets, no table) agrees
        assert add_sketches(sketch_range(old, int(idx[0])), want_change) == sketch_range(new, int(idx[0]))


def test_sketch_change_of_nothing_and_of_no_change_is_zero_anywhere() -> None:
    """Empty, and a 'change' to the same bits at indices past the table cap, move nothing."""
    for dtype in (torch.bfloat16, torch.float32):
        empty = torch.empty(0, dtype=dtype)
        assert sketch_change(empty, empty, torch.empty(0, dtype=torch.int64), increasing=True) == (0, 0, 0, 0)
        same = _bits_random(5, dtype, torch.Generator().manual_seed(1))
        at = torch.tensor([3, 2**20, 2**33, 2**33 + 1, 2**33 + 5 * 2**16])
        assert sketch_change(same, same.clone(), at, increasing=True) == (0, 0, 0, 0)


# --- 2. NaN through the decoder: every bf16/fp16 NaN bit pattern, raw and packed -----------------------------------


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


# --- 3. the fetcher's checked bytes ------------------------------------------------------------------------------


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


# --- 4. staged files are exactly what was verified ----------------------------------------------------------------


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


# --- 5. raw anchors between packed deltas, through the agent ------------------------------------------------------


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
