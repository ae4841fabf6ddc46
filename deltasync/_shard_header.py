"""The deltasync header of a shard: per-tensor info and its validating parser (no tensor data is read)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._safetensors import SafetensorsFile, parse_safetensors
from .errors import FormatError, UnsupportedFormatVersion
from .vocab import (
    CHECKPOINT_NAME,
    DTYPES,
    ENCODINGS,
    FORMAT_VERSION,
    KINDS,
    MAX_TENSOR_NUMEL,
    META_PREFIX,
    Encoding,
    Kind,
    Layout,
    bits_dtype,
    wide_dtypes,
)

__all__ = [
    "EntrySpec",
    "ShardHeader",
    "TensorInfo",
    "expected_entries",
    "info_to_json",
    "parse_shard",
    "read_shard_header",
]

MAX_NDIM = 16
"""The most dimensions a tensor may have (torch allows 64; no checkpoint needs more than a few)."""

_IMPLIED_MAX = 1 << 16
"""Format 1.0 allowed zero byte planes (values all implied); such an entry may hold at most this many elements."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorInfo:
    """What a shard header says about one tensor's entry."""

    shape: tuple[int, ...]
    """Full shape of the tensor."""
    dtype: str
    """safetensors dtype name: ``BF16``, ``F16`` or ``F32``."""
    layout: Layout
    """Sparse (indices + values) or dense (every element of the span)."""
    nnz: int
    """Stored elements: changed ones if sparse, the span's length if dense."""
    checksum: str
    """Checksum of the span of the tensor after this shard is applied."""
    span: tuple[int, int] | None = None
    """Flat element range ``[start, stop)`` this entry covers; ``None``: the whole tensor."""
    index_planes: int = 0
    """``packed`` sparse only: byte planes of each position gap."""
    value_planes: int = 0
    """``packed`` only: byte planes of each coded value."""
    value_coding: Literal["ordinal-delta", "bits", ""] = ""
    """``packed`` only: how values are coded."""

    @property
    def numel(self) -> int:
        """Number of elements of the full tensor."""
        return math.prod(self.shape)

    @property
    def bounds(self) -> tuple[int, int]:
        """The span, or ``(0, numel)``."""
        return self.span if self.span is not None else (0, self.numel)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardHeader:
    """The validated deltasync metadata of a shard."""

    kind: Kind
    """``delta`` (applies on ``base_version``) or ``anchor`` (a full snapshot)."""
    encoding: Encoding
    """``raw`` or ``packed``."""
    base_version: int | None
    """The version a delta applies to; ``None`` for an anchor."""
    target_version: int
    """The version the shard produces."""
    tensors: dict[str, TensorInfo]
    """Per-tensor info, by checkpoint name."""
    format_version: str = FORMAT_VERSION
    """``major.minor`` the shard declares."""


def info_to_json(info: TensorInfo) -> dict[str, Any]:
    """The JSON object of one tensor in ``deltasync.tensors``."""
    out: dict[str, Any] = {
        "shape": list(info.shape),
        "dtype": info.dtype,
        "layout": info.layout,
        "nnz": info.nnz,
        "checksum": info.checksum,
    }
    if info.span is not None:
        out["span"] = list(info.span)
    if info.value_coding:
        out.update(value_coding=info.value_coding, value_planes=info.value_planes)
        if info.layout == "sparse":
            out["index_planes"] = info.index_planes
    return out


def _bad(file: str, what: str) -> FormatError:
    return FormatError(f"{file}: {what}")


def _parse_version(file: str, key: str, raw: str | None) -> int:
    if raw is None or not raw.isascii() or not raw.isdigit() or len(raw) > 18:
        raise _bad(file, f"metadata {META_PREFIX}{key} must be a decimal version number, found {raw!r}")
    return int(raw)


def _is_count(x: object, lo: int, hi: int) -> bool:
    return type(x) is int and lo <= x <= hi


def _parse_info(file: str, name: str, raw: object, encoding: Encoding, kind: Kind, minor: int) -> TensorInfo:
    def fail(what: str) -> FormatError:
        return _bad(file, f"tensor {name!r}: {what}")

    if not isinstance(raw, dict):
        raise fail(f"info must be a JSON object, found {type(raw).__name__}")
    expected = {"shape", "dtype", "layout", "nnz", "checksum"}
    if encoding == "packed":
        expected |= {"value_coding", "value_planes"} | ({"index_planes"} if raw.get("layout") == "sparse" else set())
    if set(raw) - {"span"} != expected:
        raise fail(f"info must have the keys {sorted(expected)} (and optionally span), found {sorted(raw)}")
    shape, dtype, layout, nnz, checksum = (raw[k] for k in ("shape", "dtype", "layout", "nnz", "checksum"))
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(_is_count(d, 0, MAX_TENSOR_NUMEL) for d in shape)
    ):
        raise fail(f"shape must be a list of at most {MAX_NDIM} non-negative ints, found {shape!r}")
    numel = math.prod(shape)
    if numel > MAX_TENSOR_NUMEL:
        raise fail(f"shape {shape} has {numel} elements, more than the cap of {MAX_TENSOR_NUMEL}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise fail(f"dtype must be one of {sorted(DTYPES)}, found {dtype!r}")
    span = raw.get("span")
    if span is not None:
        if not (
            isinstance(span, list)
            and len(span) == 2
            and all(_is_count(s, 0, numel) for s in span)
            and span[0] < span[1]
        ):
            raise fail(f"span must be [start, stop] with 0 <= start < stop <= {numel}, found {span!r}")
        span = (span[0], span[1])
    start, stop = span if span is not None else (0, numel)
    if layout not in ("sparse", "dense") or (kind == "anchor" and layout != "dense"):
        allowed = "'dense'" if kind == "anchor" else "'sparse' or 'dense'"
        raise fail(f"layout must be {allowed} in a {kind}, found {layout!r}")
    if not _is_count(nnz, 0, stop - start) or (layout == "dense" and nnz != stop - start):
        want = f"{stop - start} (dense)" if layout == "dense" else f"an int in [0, {stop - start}]"
        raise fail(f"nnz must be {want}, found {nnz!r}")
    if not isinstance(checksum, str) or not checksum.startswith("xxh3_128:") or len(checksum) != 41:
        raise fail(f"checksum must be 'xxh3_128:' and 32 hex digits, found {checksum!r}")
    common: dict[str, Any] = dict(shape=tuple(shape), dtype=dtype, layout=layout, nnz=nnz, checksum=checksum, span=span)
    if encoding == "raw":
        return TensorInfo(**common)
    coding = raw["value_coding"]
    if coding not in ("ordinal-delta", "bits") or (kind == "anchor" and coding != "bits"):
        want = "'bits'" if kind == "anchor" else "'ordinal-delta' or 'bits'"
        raise fail(f"value_coding must be {want}, found {coding!r}")
    max_value_planes = np.dtype(bits_dtype(dtype) if coding == "bits" else wide_dtypes(dtype)[0]).itemsize
    # Since 1.1 every stored element has at least one byte in each plane stream, so the size of a zstd frame
    # bounds the elements it can describe (zstd expands at most 32768x); 1.0 writers dropped all-zero planes.
    least = 1 if nnz > 0 and minor >= 1 else 0
    if not _is_count(raw["value_planes"], least, max_value_planes):
        raise fail(f"value_planes must be an int in [{least}, {max_value_planes}], found {raw['value_planes']!r}")
    max_index_planes = 4 if numel <= 2**32 else 8
    index_planes = raw.get("index_planes", 0)
    least_index = least if layout == "sparse" else 0
    if not _is_count(index_planes, least_index, max_index_planes):
        raise fail(f"index_planes must be an int in [{least_index}, {max_index_planes}], found {index_planes!r}")
    implied = raw["value_planes"] == 0 or (layout == "sparse" and index_planes == 0)
    if implied and nnz > _IMPLIED_MAX:
        raise fail(f"nnz {nnz} with zero byte planes is more than the {_IMPLIED_MAX} such an entry may imply")
    return TensorInfo(**common, index_planes=index_planes, value_planes=raw["value_planes"], value_coding=coding)


EntrySpec = tuple[set[str], tuple[int, ...] | None]
"""Allowed dtypes and the exact shape (``None``: a 1-D U8 blob of any length)."""


def expected_entries(name: str, info: TensorInfo, encoding: Encoding) -> dict[str, EntrySpec]:
    """The safetensors entries that must hold one tensor, by key."""
    if encoding == "packed":
        out: dict[str, EntrySpec] = {f"{name}:packed_values": ({"U8"}, None)}
        if info.layout == "sparse":
            out[f"{name}:packed_indices"] = ({"U8"}, None)
        return out
    if info.layout == "dense" and info.span is None:
        return {name: ({info.dtype}, info.shape)}
    out = {f"{name}:values": ({info.dtype}, (info.nnz,))}
    if info.layout == "sparse":
        out[f"{name}:indices"] = ({"I32", "I64"}, (info.nnz,))
    return out


def parse_shard(buf: bytes | bytearray | memoryview, name: str) -> tuple[ShardHeader, SafetensorsFile]:
    """Validate the container and the deltasync metadata of a shard (not its data)."""
    st = parse_safetensors(buf, name=name)
    meta = st.metadata
    fmt = meta.get(META_PREFIX + "format_version")
    if fmt is None:
        raise _bad(name, f"metadata {META_PREFIX}format_version is missing; this is not a deltasync shard")
    major, _, minor = fmt.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise _bad(name, f"metadata {META_PREFIX}format_version must be 'major.minor', found {fmt!r}")
    known = FORMAT_VERSION.split(".")[0]
    if major != known:
        raise UnsupportedFormatVersion(
            f"{name}: format_version {fmt} is not supported; this reader knows {known}.x (upgrade deltasync)"
        )
    kind, encoding = meta.get(META_PREFIX + "kind"), meta.get(META_PREFIX + "encoding")
    if kind not in KINDS:
        raise _bad(name, f"metadata {META_PREFIX}kind must be one of {list(KINDS)}, found {kind!r}")
    if encoding not in ENCODINGS:
        raise _bad(name, f"metadata {META_PREFIX}encoding must be one of {list(ENCODINGS)}, found {encoding!r}")
    target = _parse_version(name, "target_version", meta.get(META_PREFIX + "target_version"))
    base: int | None = None
    if kind == "delta":
        base = _parse_version(name, "base_version", meta.get(META_PREFIX + "base_version"))
        if base >= target:
            raise _bad(name, f"base_version {base} must be lower than target_version {target}")
    elif META_PREFIX + "base_version" in meta:
        raise _bad(name, f"an anchor has no {META_PREFIX}base_version, found {meta[META_PREFIX + 'base_version']!r}")
    try:
        raw_infos = json.loads(meta.get(META_PREFIX + "tensors", ""))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _bad(name, f"metadata {META_PREFIX}tensors is not valid JSON ({exc})") from None
    if not isinstance(raw_infos, dict):
        raise _bad(name, f"metadata {META_PREFIX}tensors must be a JSON object, found {type(raw_infos).__name__}")
    for t in raw_infos:
        if not CHECKPOINT_NAME.fullmatch(t):
            raise _bad(name, f"tensor name {t[:80]!r} must have 1 to 1024 characters, no ':' and no control characters")
    infos = {t: _parse_info(name, t, raw, encoding, kind, int(minor)) for t, raw in raw_infos.items()}
    expected: dict[str, EntrySpec] = {}
    for t, info in infos.items():
        expected.update(expected_entries(t, info, encoding))
    if set(expected) != set(st.entries):
        missing, extra = sorted(set(expected) - set(st.entries)), sorted(set(st.entries) - set(expected))
        raise _bad(name, f"entries do not match {META_PREFIX}tensors: missing {missing}, unexpected {extra}")
    for key, (dtypes, shape) in expected.items():
        e = st.entries[key]
        if e.dtype not in dtypes or (e.shape != shape if shape is not None else len(e.shape) != 1):
            want = f"{'/'.join(sorted(dtypes))} of shape {list(shape) if shape is not None else '[n]'}"
            raise _bad(name, f"entry {key!r} must be {want}, found {e.dtype} of shape {list(e.shape)}")
    header = ShardHeader(
        kind=kind, encoding=encoding, base_version=base, target_version=target, tensors=infos, format_version=fmt
    )
    return header, st


def read_shard_header(buf: bytes | bytearray | memoryview, *, name: str) -> ShardHeader:
    """Validate a shard's container and metadata (not its data) and return its header.

    Raises:
        FormatError: the container or the deltasync metadata is malformed.
        UnsupportedFormatVersion: the major format version is unknown.
    """
    return parse_shard(buf, name)[0]
