from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync import (
    FormatError,
    TensorDelta,
    UnsupportedFormatVersion,
    decode_shard,
    encode_shard,
    tensor_checksum,
)
from deltasync._safetensors import SafetensorsEntry, encode_safetensors
from deltasync.format import encode_shard_parts, has_nan
from tests.conftest import bits

CHECKSUM = "xxh3_128:" + "0" * 32


def _delta(name: str, full: torch.Tensor, idx: list[int] | None, base: torch.Tensor | None = None) -> TensorDelta:
    flat = full.reshape(-1)
    if idx is None:
        return TensorDelta(
            ckpt_name=name,
            shape=tuple(full.shape),
            dtype=full.dtype,
            indices=None,
            values=full,
            base_values=base,
            checksum=tensor_checksum(full),
        )
    i = torch.tensor(idx, dtype=torch.int64)
    return TensorDelta(
        ckpt_name=name,
        shape=tuple(full.shape),
        dtype=full.dtype,
        indices=i,
        values=flat[i],
        base_values=None if base is None else base.reshape(-1)[i],
        checksum=tensor_checksum(full),
    )


def _assert_same(decoded: TensorDelta, expected: TensorDelta) -> None:
    assert decoded.ckpt_name == expected.ckpt_name
    assert decoded.shape == expected.shape and decoded.dtype == expected.dtype
    assert decoded.checksum == expected.checksum and decoded.span == expected.span
    assert (decoded.indices is None) == (expected.indices is None)
    if expected.indices is not None:
        assert torch.equal(decoded.indices, expected.indices)
    assert torch.equal(bits(decoded.values), bits(expected.values))


# ---------------------------------------------------------------- round trips


@st.composite
def _deltas(draw: st.DrawFn) -> tuple[list[TensorDelta], dict[str, torch.Tensor]]:
    n_tensors = draw(st.integers(0, 4))
    out, base = [], {}
    for k in range(n_tensors):
        dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
        numel = int(np.prod(shape)) if shape else 1
        seed = draw(st.integers(0, 2**16))
        g = torch.Generator().manual_seed(seed)
        old = (torch.randn(shape, generator=g) * 10 ** draw(st.integers(-3, 3))).to(dtype)
        new = old.clone()
        picked = sorted(draw(st.sets(st.integers(0, numel - 1), max_size=numel)))
        layout = draw(st.sampled_from(["sparse", "dense", "all"]))
        flat = new.reshape(-1)
        for i in picked:
            flat[i] = draw(st.floats(-1e4, 1e4, allow_nan=False, width=16 if dtype != torch.float32 else 32))
        name = f"model.layers.{k}.w"
        base[name] = old
        if layout == "dense":
            out.append(_delta(name, new, None, old if draw(st.booleans()) else None))
        else:
            idx = list(range(numel)) if layout == "all" else picked
            out.append(_delta(name, new, idx, old if draw(st.booleans()) else None))
    return out, base


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_deltas(), encoding=st.sampled_from(["raw", "packed"]), writable=st.booleans())
def test_round_trip(case: tuple[list[TensorDelta], dict[str, torch.Tensor]], encoding: str, writable: bool) -> None:
    deltas, base = case
    buf = encode_shard(deltas, kind="delta", encoding=encoding, base_version=3, target_version=4)
    assert encode_shard(deltas, kind="delta", encoding=encoding, base_version=3, target_version=4) == buf
    header, decoded = decode_shard(bytearray(buf) if writable else buf, name="x.safetensors", base=base)
    assert (header.kind, header.encoding, header.base_version, header.target_version) == (
        "delta",
        encoding,
        3,
        4,
    )
    assert list(decoded) == sorted(d.ckpt_name for d in deltas) or set(decoded) == {d.ckpt_name for d in deltas}
    for d in deltas:
        _assert_same(decoded[d.ckpt_name], d)


def test_empty_delta_and_empty_anchor() -> None:
    for kind, base in (("delta", 0), ("anchor", None)):
        for encoding in ("raw", "packed"):
            buf = encode_shard([], kind=kind, encoding=encoding, base_version=base, target_version=1)
            header, decoded = decode_shard(buf, name="e")
            assert decoded == {} and header.tensors == {}


def test_int64_indices_for_huge_tensors_without_allocating_them() -> None:
    numel = 2**31 + 10
    idx = torch.tensor([0, 2**31 - 1, 2**31 + 9], dtype=torch.int64)
    d = TensorDelta(
        ckpt_name="huge",
        shape=(numel,),
        dtype=torch.bfloat16,
        indices=idx,
        values=torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16),
        checksum=CHECKSUM,
    )
    for encoding in ("raw", "packed"):
        buf = encode_shard([d], kind="delta", encoding=encoding, base_version=0, target_version=1)
        _, out = decode_shard(buf, name="h")
        _assert_same(out["huge"], d)
    raw = safetensors.torch.load(encode_shard([d], kind="delta", encoding="raw", base_version=0, target_version=1))
    assert raw["huge:indices"].dtype == torch.int64


def test_raw_is_readable_by_safetensors_and_a_raw_anchor_is_a_checkpoint() -> None:
    w = torch.randn(4, 3).to(torch.bfloat16)
    sparse = _delta("a.weight", w, [1, 5])
    buf = encode_shard([sparse], kind="delta", encoding="raw", base_version=1, target_version=2)
    loaded = safetensors.torch.load(buf)
    assert loaded["a.weight:indices"].tolist() == [1, 5] and loaded["a.weight:indices"].dtype == torch.int32
    assert torch.equal(bits(loaded["a.weight:values"]), bits(w.reshape(-1)[[1, 5]]))
    anchor = encode_shard([_delta("a.weight", w, None)], kind="anchor", encoding="raw", target_version=2)
    assert torch.equal(bits(safetensors.torch.load(anchor)["a.weight"]), bits(w))


def test_spans_cover_part_of_a_tensor() -> None:
    w = torch.randn(6, 4).to(torch.bfloat16)
    part = TensorDelta(
        ckpt_name="w",
        shape=(6, 4),
        dtype=torch.bfloat16,
        indices=None,
        values=w.reshape(-1)[8:16],
        span=(8, 16),
        checksum=tensor_checksum(w, (8, 16)),
    )
    sparse = TensorDelta(
        ckpt_name="v",
        shape=(6, 4),
        dtype=torch.bfloat16,
        indices=torch.tensor([9, 15]),
        values=w.reshape(-1)[[9, 15]],
        span=(8, 16),
        checksum=CHECKSUM,
    )
    for encoding in ("raw", "packed"):
        buf = encode_shard([part, sparse], kind="delta", encoding=encoding, base_version=0, target_version=1)
        _, out = decode_shard(buf, name="s")
        _assert_same(out["w"], part)
        _assert_same(out["v"], sparse)
    outside = dataclasses.replace(sparse, indices=torch.tensor([7, 9]))
    buf = encode_shard([outside], kind="delta", encoding="raw", base_version=0, target_version=1)
    with pytest.raises(FormatError, match=r"s: tensor 'v': indices must lie in \[8, 16\), found 7..9"):
        decode_shard(buf, name="s")


def test_packed_codes_small_steps_in_about_a_bit() -> None:
    g = torch.Generator().manual_seed(0)
    old = (torch.randn(200_000, generator=g) * 0.02).to(torch.bfloat16)
    idx = torch.randperm(old.numel(), generator=g)[:4000].sort().values
    new = old.clone()
    step = bits(new)
    step[idx] += torch.where(torch.rand(idx.numel(), generator=g) < 0.5, 1, -1).to(torch.int16)
    d = _delta("w", new, idx.tolist(), old)
    packed = encode_shard([d], kind="delta", encoding="packed", base_version=0, target_version=1)
    raw = encode_shard([d], kind="delta", encoding="raw", base_version=0, target_version=1)
    assert len(packed) / idx.numel() < 1.6 < 6 <= len(raw) / idx.numel()
    _, out = decode_shard(packed, name="p", base={"w": old})
    _assert_same(out["w"], d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_has_nan_finds_every_nan_pattern_anywhere(dtype: torch.dtype) -> None:
    """``has_nan`` is one max reduction: it must see a NaN of any payload and sign, at any position of the
    vectorized loop (head, body, tail) and of any size."""
    ints = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    patterns = {
        torch.bfloat16: [0x7FC0, 0x7F81, -0x40, -0x7F, 0x7FFF, -1],  # quiet, signalling, negative (0xFFC0...)
        torch.float16: [0x7E00, 0x7C01, -0x3FF, -1],
        torch.float32: [0x7FC00000, 0x7F800001, -1, 0x7FFFFFFF],
    }[dtype]
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 7, 31, 64, 1000, 65_537):
        values = torch.randn(n, generator=g).to(dtype)
        values[0] = float("inf")  # infinities are not NaN
        assert not has_nan(values)
        for pos in {0, n // 2, n - 1}:
            for bits_ in patterns:
                probe = values.clone()
                probe.view(ints)[pos] = bits_
                assert has_nan(probe) and has_nan(probe.reshape(1, -1)), (n, pos, hex(bits_))
    assert not has_nan(torch.empty(0, dtype=dtype)) and not has_nan(torch.arange(5))


def test_encode_shard_parts_are_the_shard_without_a_copy() -> None:
    w = torch.randn(64, 8).to(torch.bfloat16)
    d = TensorDelta(
        ckpt_name="w", shape=(64, 8), dtype=torch.bfloat16, indices=None, values=w, checksum=tensor_checksum(w)
    )
    parts = encode_shard_parts([d], kind="anchor", encoding="raw", target_version=3)
    assert b"".join(parts) == encode_shard([d], kind="anchor", encoding="raw", target_version=3)
    data = parts[-1]
    assert isinstance(data, memoryview) and data.obj is not None and data.nbytes == w.numel() * 2
    w[0, 0] = 7.0  # the part is the tensor's own memory
    assert bytes(data[:2]) == w[:1, :1].contiguous().view(torch.uint8).numpy().tobytes()


def test_encode_refuses_bad_entries() -> None:
    w = torch.zeros(3, dtype=torch.bfloat16)
    good = _delta("w", w, [0])
    with pytest.raises(ValueError, match="values contain NaN"):
        encode_shard(
            [dataclasses.replace(good, values=torch.tensor([float("nan")], dtype=torch.bfloat16))],
            kind="delta",
            encoding="raw",
            base_version=0,
            target_version=1,
        )
    with pytest.raises(ValueError, match="checksum is missing"):
        encode_shard(
            [dataclasses.replace(good, checksum=None)],
            kind="delta",
            encoding="raw",
            base_version=0,
            target_version=1,
        )
    with pytest.raises(ValueError, match="checkpoint names must have 1 to 1024 characters, no ':'"):
        encode_shard(
            [dataclasses.replace(good, ckpt_name="a:b")],
            kind="delta",
            encoding="raw",
            base_version=0,
            target_version=1,
        )
    with pytest.raises(ValueError, match="an anchor holds dense entries only"):
        encode_shard([good], kind="anchor", encoding="raw", target_version=1)
    with pytest.raises(ValueError, match="a delta needs 0 <= base_version < target_version"):
        encode_shard([good], kind="delta", encoding="raw", base_version=2, target_version=1)
    with pytest.raises(ValueError, match="dtype torch.int32 is not supported"):
        encode_shard(
            [dataclasses.replace(good, dtype=torch.int32, values=torch.zeros(1, dtype=torch.int32))],
            kind="delta",
            encoding="raw",
            base_version=0,
            target_version=1,
        )


def test_packed_needs_the_base_to_decode_ordinal_deltas() -> None:
    old = torch.zeros(4, dtype=torch.bfloat16)
    new = old.clone()
    new[1] = 1
    buf = encode_shard([_delta("w", new, [1], old)], kind="delta", encoding="packed", base_version=0, target_version=1)
    with pytest.raises(ValueError, match="1 tensors are coded against base version 0; pass base="):
        decode_shard(buf, name="p")
    with pytest.raises(FormatError) as exc:
        decode_shard(buf, name="p", base={"w": torch.zeros(5, dtype=torch.bfloat16)})
    assert str(exc.value) == (
        "p: tensor 'w': the shard expects BF16 [4], the base holds BF16 [5] (a delta for another model?)"
    )
    with pytest.raises(FormatError) as exc:
        decode_shard(buf, name="p", base={})
    assert str(exc.value) == "p: tensor 'w' is coded against the base version, but the base has no such tensor"


# ---------------------------------------------------------------- one exact message per FormatError case


def _meta(infos: dict, **over: str | None) -> dict[str, str]:
    meta = {
        "deltasync.format_version": "1.0",
        "deltasync.kind": "delta",
        "deltasync.encoding": "raw",
        "deltasync.base_version": "1",
        "deltasync.target_version": "2",
        "deltasync.tensors": json.dumps(infos),
    }
    for k, v in over.items():
        if v is None:
            meta.pop(f"deltasync.{k}")
        else:
            meta[f"deltasync.{k}"] = v
    return meta


def _info(**over: object) -> dict:
    info = {"shape": [4], "dtype": "BF16", "layout": "sparse", "nnz": 2, "checksum": CHECKSUM}
    info.update(over)
    return {k: v for k, v in info.items() if v is not None}


def _entries(idx: list[int], vals: list[float], idx_dtype: str = "I32") -> list[SafetensorsEntry]:
    i = np.array(idx, dtype=np.int32 if idx_dtype == "I32" else np.int64)
    v = torch.tensor(vals, dtype=torch.bfloat16).view(torch.int16).numpy()
    return [
        SafetensorsEntry(key="w:indices", dtype=idx_dtype, shape=(len(idx),), data=memoryview(i).cast("B")),
        SafetensorsEntry(key="w:values", dtype="BF16", shape=(len(vals),), data=memoryview(v).cast("B")),
    ]


def _file(meta: dict[str, str], entries: list[SafetensorsEntry] | None = None) -> bytes:
    return encode_safetensors(_entries([0, 3], [1.0, 2.0]) if entries is None else entries, meta)


def _header_file(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _valid_packed() -> bytes:
    w = torch.zeros(4, dtype=torch.bfloat16)
    w[3] = 1
    return encode_shard([_delta("w", w, [3])], kind="delta", encoding="packed", base_version=1, target_version=2)


def _swap_blob(buf: bytes, key: str, blob: bytes) -> bytes:
    n = struct.unpack("<Q", buf[:8])[0]
    header = json.loads(buf[8 : 8 + n])
    meta = header.pop("__metadata__")
    data = buf[8 + n :]
    entries = []
    for k, info in header.items():
        b = blob if k == key else data[info["data_offsets"][0] : info["data_offsets"][1]]
        entries.append(SafetensorsEntry(key=k, dtype="U8", shape=(len(b),), data=memoryview(b)))
    return encode_safetensors(entries, meta)


SAFETENSORS_CASES = [
    ("short", b"1234", "f: expected at least 8 bytes, found 4"),
    (
        "header cap",
        struct.pack("<Q", 100 * 1024 * 1024 + 1),
        "f: header length 104857601 exceeds the cap of 104857600 bytes",
    ),
    ("overrun", struct.pack("<Q", 50) + b"{}", "f: header length 50 overruns the 10-byte file"),
    (
        "not json",
        struct.pack("<Q", 2) + b"{x",
        "f: header is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
    ),
    ("not object", _header_file([1]), "f: header must be a JSON object, found list"),
    ("metadata", _header_file({"__metadata__": {"a": 1}}), "f: __metadata__ must map str to str"),
    (
        "info keys",
        _header_file({"t": {"dtype": "U8"}}),
        "f: tensor 't' must have exactly dtype, shape and data_offsets",
    ),
    (
        "dtype",
        _header_file({"t": {"dtype": "Q8", "shape": [1], "data_offsets": [0, 1]}}, b"x"),
        "f: tensor 't' has unknown dtype 'Q8'",
    ),
    (
        "shape",
        _header_file({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"x"),
        "f: tensor 't' has an invalid shape [-1]",
    ),
    (
        "offsets",
        _header_file({"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 2]}}, b"x"),
        "f: tensor 't' has data_offsets [0, 2] outside the data",
    ),
    (
        "size",
        _header_file({"t": {"dtype": "I32", "shape": [1], "data_offsets": [0, 1]}}, b"x"),
        "f: tensor 't' of shape [1] and dtype I32 needs 4 bytes but data_offsets span 1",
    ),
    (
        "hole",
        _header_file({"t": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, b"xy"),
        "f: tensor 't' starts at byte 1, expected 0 (hole or overlap)",
    ),
    (
        "tail",
        _header_file({"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"xy"),
        "f: tensors cover 1 of the 2 data bytes",
    ),
]


@pytest.mark.parametrize(("case", "buf", "message"), SAFETENSORS_CASES, ids=[c[0] for c in SAFETENSORS_CASES])
def test_container_errors(case: str, buf: bytes, message: str) -> None:
    with pytest.raises(FormatError) as exc:
        decode_shard(buf, name="f")
    assert str(exc.value) == message + "; the file is not a valid safetensors file, re-publish it"


T = {"w": _info()}
HEADER_CASES = [
    (
        "no format",
        _file(_meta(T, format_version=None)),
        "f: metadata deltasync.format_version is missing; this is not a deltasync shard",
    ),
    (
        "bad format",
        _file(_meta(T, format_version="one")),
        "f: metadata deltasync.format_version must be 'major.minor', found 'one'",
    ),
    (
        "kind",
        _file(_meta(T, kind="diff")),
        "f: metadata deltasync.kind must be one of ['delta', 'anchor'], found 'diff'",
    ),
    (
        "encoding",
        _file(_meta(T, encoding="gzip")),
        "f: metadata deltasync.encoding must be one of ['raw', 'packed'], found 'gzip'",
    ),
    (
        "target",
        _file(_meta(T, target_version="-2")),
        "f: metadata deltasync.target_version must be a decimal version number, found '-2'",
    ),
    (
        "base missing",
        _file(_meta(T, base_version=None)),
        "f: metadata deltasync.base_version must be a decimal version number, found None",
    ),
    (
        "base order",
        _file(_meta(T, base_version="2")),
        "f: base_version 2 must be lower than target_version 2",
    ),
    ("anchor base", _file(_meta(T, kind="anchor")), "f: an anchor has no deltasync.base_version, found '1'"),
    (
        "tensors json",
        _file(_meta(T, tensors="{")),
        "f: metadata deltasync.tensors is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
    ),
    (
        "tensors type",
        _file(_meta(T, tensors="[]")),
        "f: metadata deltasync.tensors must be a JSON object, found list",
    ),
    ("info type", _file(_meta({"w": 3})), "f: tensor 'w': info must be a JSON object, found int"),
    (
        "info keys",
        _file(_meta({"w": _info(nnz=None)})),
        "f: tensor 'w': info must have the keys ['checksum', 'dtype', 'layout', 'nnz', 'shape'] (and optionally span), found ['checksum', 'dtype', 'layout', 'shape']",
    ),
    (
        "shape",
        _file(_meta({"w": _info(shape=[4.0])})),
        "f: tensor 'w': shape must be a list of at most 16 non-negative ints, found [4.0]",
    ),
    (
        "numel cap",
        _file(_meta({"w": _info(shape=[2**30, 2**30])})),
        "f: tensor 'w': shape [1073741824, 1073741824] has 1152921504606846976 elements, more than the cap of 1099511627776",
    ),
    (
        "dtype",
        _file(_meta({"w": _info(dtype="F64")})),
        "f: tensor 'w': dtype must be one of ['BF16', 'F16', 'F32'], found 'F64'",
    ),
    (
        "span",
        _file(_meta({"w": _info(span=[3, 3])})),
        "f: tensor 'w': span must be [start, stop] with 0 <= start < stop <= 4, found [3, 3]",
    ),
    (
        "layout",
        _file(_meta({"w": _info(layout="coo")})),
        "f: tensor 'w': layout must be 'sparse' or 'dense' in a delta, found 'coo'",
    ),
    (
        "anchor layout",
        _file(_meta({"w": _info()}, kind="anchor", base_version=None)),
        "f: tensor 'w': layout must be 'dense' in a anchor, found 'sparse'",
    ),
    ("nnz", _file(_meta({"w": _info(nnz=5)})), "f: tensor 'w': nnz must be an int in [0, 4], found 5"),
    (
        "dense nnz",
        _file(_meta({"w": _info(layout="dense", nnz=2)})),
        "f: tensor 'w': nnz must be 4 (dense), found 2",
    ),
    (
        "checksum",
        _file(_meta({"w": _info(checksum="md5:00")})),
        "f: tensor 'w': checksum must be 'xxh3_128:' and 32 hex digits, found 'md5:00'",
    ),
    (
        "entries",
        _file(_meta({"w": _info(), "v": _info()})),
        "f: entries do not match deltasync.tensors: missing ['v:indices', 'v:values'], unexpected []",
    ),
    (
        "entry shape",
        _file(_meta({"w": _info(nnz=1)})),
        "f: entry 'w:values' must be BF16 of shape [1], found BF16 of shape [2]",
    ),
    (
        "indices range",
        _file(_meta(T), _entries([0, 4], [1.0, 2.0])),
        "f: tensor 'w': indices must lie in [0, 4), found 0..4",
    ),
    (
        "indices order",
        _file(_meta(T), _entries([3, 0], [1.0, 2.0])),
        "f: tensor 'w': indices must be strictly increasing, found 0 after 3 at position 1",
    ),
    (
        "indices unique",
        _file(_meta(T), _entries([2, 2], [1.0, 2.0], "I64")),
        "f: tensor 'w': indices must be strictly increasing, found 2 after 2 at position 1",
    ),
    (
        "nan",
        _file(_meta(T), _entries([0, 1], [1.0, float("nan")])),
        "f: tensor 'w': value 1 is NaN; NaN is vLLM's 'unchanged' sentinel and never valid in a delta",
    ),
    (
        "coding",
        _file(_meta({"w": _info(value_coding="lz4", value_planes=1, index_planes=1)}, encoding="packed")),
        "f: tensor 'w': value_coding must be 'ordinal-delta' or 'bits', found 'lz4'",
    ),
    (
        "value planes",
        _file(_meta({"w": _info(value_coding="bits", value_planes=3, index_planes=1)}, encoding="packed")),
        "f: tensor 'w': value_planes must be an int in [0, 2], found 3",
    ),
    (
        "index planes",
        _file(_meta({"w": _info(value_coding="bits", value_planes=2, index_planes=5)}, encoding="packed")),
        "f: tensor 'w': index_planes must be an int in [0, 4], found 5",
    ),
    (
        "zstd frame",
        _swap_blob(_valid_packed(), "w:packed_values", b"garbage!"),
        "f: tensor 'w': not a zstd frame (error when determining content size)",
    ),
    (
        "zstd size",
        _swap_blob(
            _valid_packed(),
            "w:packed_indices",
            __import__("zstandard").ZstdCompressor().compress(b"\x00\x00"),
        ),
        "f: tensor 'w': zstd frame declares 2 bytes, expected 1",
    ),
]


@pytest.mark.parametrize(("case", "buf", "message"), HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_header_and_data_errors(case: str, buf: bytes, message: str) -> None:
    with pytest.raises(FormatError) as exc:
        decode_shard(buf, name="f", base={"w": torch.zeros(4, dtype=torch.bfloat16)})
    assert str(exc.value) == message


def test_unknown_major_version() -> None:
    with pytest.raises(UnsupportedFormatVersion) as exc:
        decode_shard(_file(_meta(T, format_version="2.0")), name="f")
    assert str(exc.value) == "f: format_version 2.0 is not supported; this reader knows 1.x (upgrade deltasync)"
    _, out = decode_shard(_file(_meta(T, format_version="1.7")), name="f")  # a newer minor version reads
    assert out["w"].indices.tolist() == [0, 3]


def test_ordinal_out_of_range_is_corrupt() -> None:
    old = torch.zeros(4, dtype=torch.bfloat16)
    new = old.clone()
    new[3] = 1
    buf = encode_shard([_delta("w", new, [3], old)], kind="delta", encoding="packed", base_version=1, target_version=2)
    big = torch.full((4,), 3.0e38, dtype=torch.bfloat16)
    with pytest.raises(FormatError) as exc:
        decode_shard(buf, name="f", base={"w": big})
    assert str(exc.value) == "f: tensor 'w': a coded value falls outside the BF16 range; the shard is corrupt"


def _packed_gaps_file(numel: int, gaps: list[int], planes: int) -> bytes:
    import zstandard

    g = np.array(gaps, dtype=np.uint64)
    idx_blob = zstandard.ZstdCompressor().compress(g.view(np.uint8).reshape(-1, 8)[:, :planes].T.tobytes())
    val_blob = zstandard.ZstdCompressor().compress(b"\x01" * len(gaps))
    info = _info(shape=[numel], nnz=len(gaps), value_coding="ordinal-delta", value_planes=1, index_planes=planes)
    entries = [
        SafetensorsEntry(key="w:packed_indices", dtype="U8", shape=(len(idx_blob),), data=memoryview(idx_blob)),
        SafetensorsEntry(key="w:packed_values", dtype="U8", shape=(len(val_blob),), data=memoryview(val_blob)),
    ]
    return encode_safetensors(entries, _meta({"w": info}, encoding="packed"))


def test_gap_coded_indices_cannot_wrap_or_overflow() -> None:
    # uint64 gaps (tensors over 2**32 elements) can wrap around 2**64: the reader must notice
    with pytest.raises(FormatError) as exc:
        decode_shard(_packed_gaps_file(2**33, [2**64 - 1, 5], 8), name="f", base={})
    assert (
        str(exc.value)
        == "f: tensor 'w': indices must be strictly increasing, found 5 after 18446744073709551615 at position 1"
    )
    # a uint32-gap index above 2**63 must not pass as a negative int64
    with pytest.raises(FormatError) as exc:
        decode_shard(_packed_gaps_file(4, [2**32 - 1], 4), name="f", base={})
    assert str(exc.value) == "f: tensor 'w': indices must lie in [0, 4), found 4294967295..4294967295"


# ---------------------------------------------------------------- fuzz: random and mutated bytes only raise FormatError


def _valid_shards() -> list[tuple[bytes, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    old = torch.randn(8, 9, generator=g).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[[1, 5, 40]] += 1
    out = []
    for encoding in ("raw", "packed"):
        for d in (_delta("w", new, [1, 5, 40], old), _delta("w", new, None, old)):
            out.append(
                (
                    encode_shard([d], kind="delta", encoding=encoding, base_version=1, target_version=2),
                    {"w": old},
                )
            )
    return out


VALID = _valid_shards()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_random_bytes(data: bytes) -> None:
    try:
        decode_shard(data, name="fuzz", base=VALID[0][1])
    except FormatError:
        pass


@settings(max_examples=500, deadline=None)
@given(
    which=st.integers(0, len(VALID) - 1),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.integers(0, 10**6),
)
def test_fuzz_mutated_shards(which: int, edits: list[tuple[int, int]], cut: int) -> None:
    buf, base = VALID[which]
    data = bytearray(buf)
    for pos, byte in edits:
        data[pos % len(data)] = byte
    if cut % 3 == 0:
        data = data[: cut % len(data)]
    try:
        decode_shard(bytes(data), name="fuzz", base=base)
    except FormatError:
        pass


def test_the_checksum_of_no_elements_is_the_digest_of_no_bytes() -> None:
    """An empty tensor (or span) of any dtype hashes as zero bytes; torch cannot view it as bytes, which raised."""
    import xxhash

    empty = "xxh3_128:" + xxhash.xxh3_128_hexdigest(b"")
    for dtype in (torch.int32, torch.bfloat16, torch.float32, torch.int64):
        assert tensor_checksum(torch.zeros(0, dtype=dtype)) == empty
        assert tensor_checksum(torch.ones(3, 4, dtype=dtype), (5, 5)) == empty
    assert tensor_checksum(torch.ones(3, dtype=torch.int32)) != empty
