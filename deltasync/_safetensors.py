"""A minimal, validating reader and a byte-deterministic writer of the safetensors container."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import FormatError

__all__ = [
    "DTYPE_ITEMSIZE",
    "MAX_HEADER_BYTES",
    "SafetensorsEntry",
    "SafetensorsFile",
    "encode_safetensors",
    "parse_safetensors",
    "safetensors_parts",
]

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Header cap, as in the safetensors reference implementation (100 MB)."""

DTYPE_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SafetensorsEntry:
    """One tensor of a safetensors file, as raw little-endian bytes."""

    key: str
    """The tensor's key in the header."""
    dtype: str
    """A safetensors dtype name, e.g. ``"BF16"``."""
    shape: tuple[int, ...]
    """The tensor's shape."""
    data: memoryview
    """The tensor's bytes, ``prod(shape) * itemsize`` long."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SafetensorsFile:
    """A parsed safetensors file: header metadata and entries that view the original buffer."""

    metadata: dict[str, str]
    """The ``__metadata__`` map (str to str); empty when absent."""
    entries: dict[str, SafetensorsEntry]
    """Entries by key, in file order."""


def encode_safetensors(entries: Sequence[SafetensorsEntry], metadata: dict[str, str]) -> bytes:
    """Serialize entries to safetensors bytes, deterministically.

    Entries are laid out by decreasing item size, then by key (as the reference writer does), so
    every tensor is aligned to its item size; the JSON header has sorted keys, no spaces, and is
    padded with spaces to a multiple of 8 bytes.
    """
    return b"".join(safetensors_parts(entries, metadata))


def safetensors_parts(entries: Sequence[SafetensorsEntry], metadata: dict[str, str]) -> list[bytes | memoryview]:
    """:func:`encode_safetensors`' bytes as the buffers to write one after the other: the length and header, then
    each entry's data as it is (no copy of the tensor data: a file writer takes them in turn)."""
    ordered = sorted(entries, key=lambda e: (-DTYPE_ITEMSIZE[e.dtype], e.key))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for e in ordered:
        n = e.data.nbytes
        header[e.key] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, n + offset],
        }
        offset += n
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [struct.pack("<Q", len(raw)) + raw, *(memoryview(e.data) for e in ordered)]


def _fail(name: str, what: str) -> FormatError:
    return FormatError(f"{name}: {what}; the file is not a valid safetensors file, re-publish it")


def parse_safetensors(buf: bytes | bytearray | memoryview, *, name: str) -> SafetensorsFile:
    """Parse and validate a safetensors buffer without copying tensor data.

    Args:
        buf: the whole file.
        name: how to name the file in error messages (a path or store key).

    Raises:
        FormatError: the header is too large, not JSON, names an unknown dtype, or the data
            offsets do not tile the byte buffer exactly (no holes, no overlaps, no overrun).
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < 8:
        raise _fail(name, f"expected at least 8 bytes, found {view.nbytes}")
    (n_header,) = struct.unpack("<Q", view[:8])
    if n_header > MAX_HEADER_BYTES:
        raise _fail(
            name,
            f"header length {n_header} exceeds the cap of {MAX_HEADER_BYTES} bytes",
        )
    if 8 + n_header > view.nbytes:
        raise _fail(name, f"header length {n_header} overruns the {view.nbytes}-byte file")
    try:
        header = json.loads(bytes(view[8 : 8 + n_header]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _fail(name, f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _fail(name, f"header must be a JSON object, found {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _fail(name, "__metadata__ must map str to str")
    data = view[8 + n_header :]
    spans: list[tuple[int, int, str]] = []
    entries: dict[str, SafetensorsEntry] = {}
    for key, info in header.items():
        if not isinstance(info, dict) or set(info) != {
            "dtype",
            "shape",
            "data_offsets",
        }:
            raise _fail(name, f"tensor {key!r} must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            raise _fail(name, f"tensor {key!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > 16 or not all(type(d) is int and 0 <= d < 2**62 for d in shape):
            raise _fail(name, f"tensor {key!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data.nbytes
        ):
            raise _fail(name, f"tensor {key!r} has data_offsets {offsets!r} outside the data")
        numel = 1
        for d in shape:
            numel *= d
        if numel * DTYPE_ITEMSIZE[dtype] != offsets[1] - offsets[0]:
            raise _fail(
                name,
                f"tensor {key!r} of shape {shape} and dtype {dtype} needs "
                f"{numel * DTYPE_ITEMSIZE[dtype]} bytes but data_offsets span {offsets[1] - offsets[0]}",
            )
        spans.append((offsets[0], offsets[1], key))
        entries[key] = SafetensorsEntry(key=key, dtype=dtype, shape=tuple(shape), data=data[offsets[0] : offsets[1]])
    spans.sort()
    end = 0
    for start, stop, key in spans:
        if start != end:
            raise _fail(
                name,
                f"tensor {key!r} starts at byte {start}, expected {end} (hole or overlap)",
            )
        end = stop
    if end != data.nbytes:
        raise _fail(name, f"tensors cover {end} of the {data.nbytes} data bytes")
    return SafetensorsFile(metadata=metadata, entries=entries)
