"""Encode and decode one delta or anchor shard (a safetensors file); pure: no I/O, no network.

``docs/FORMAT.md`` is the normative description. Two encodings share one container:

* ``raw``: ``N:indices`` (I32, or I64 when ``numel > 2**31 - 1``) and ``N:values`` per sparse
  entry; ``N`` itself per whole dense tensor (so a raw anchor is a plain checkpoint), or
  ``N:values`` alone for a dense span of a tensor.
* ``packed``: ``N:packed_indices`` (U8: gap-coded positions, byte planes, one zstd frame) and
  ``N:packed_values`` (U8: byte planes of the zigzagged ordinal difference to the base value,
  ``ordinal-delta``, or of the raw bits, ``bits``; one zstd frame).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Required, TypedDict, Unpack, runtime_checkable

import numpy as np
import torch
import xxhash

from . import _codec
from ._cpus import parallel_map
from ._safetensors import SafetensorsEntry, SafetensorsFile, safetensors_parts
from ._shard_header import ShardHeader, TensorInfo, info_to_json, parse_shard, read_shard_header
from .errors import FormatError
from .vocab import (
    CHECKPOINT_NAME,
    DTYPE_NAMES,
    DTYPES,
    ENCODINGS,
    FORMAT_VERSION,
    KINDS,
    META_PREFIX,
    Encoding,
    Kind,
    bits_dtype,
    wide_dtypes,
)

__all__ = [
    "DEFAULT_ZSTD_LEVEL",
    "BaseValues",
    "FORMAT_VERSION",
    "PartialBaseValues",
    "ShardHeader",
    "TensorDelta",
    "TensorInfo",
    "decode_shard",
    "encode_shard",
    "encode_shard_parts",
    "has_nan",
    "read_shard_header",
    "tensor_checksum",
]

DEFAULT_ZSTD_LEVEL = 1
"""zstd level of ``packed`` (its strategy and window; the match finder is set for byte planes,
:data:`deltasync._codec.PLANE_MIN_MATCH`); benchmarks/bench_codec.py measures the alternatives."""

_INT_TORCH = {np.int16: torch.int16, np.int32: torch.int32}


@runtime_checkable
class BaseValues(Protocol):
    """Where a decoder reads the base values of ``packed`` entries coded ``ordinal-delta``, when the base version
    is not at hand as whole tensors: an engine reads them from what it serves (only the changed elements)."""

    def values_at(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, indices: torch.Tensor) -> torch.Tensor:
        """The base version's values of tensor ``name`` (``shape``, ``dtype``) at sorted flat ``indices``: a 1-D
        ``dtype`` tensor of ``indices.numel()`` values on CPU. Raises ``FormatError`` (naming the tensor) when they
        cannot be read."""
        ...


@runtime_checkable
class PartialBaseValues(BaseValues, Protocol):
    """:class:`BaseValues` of a reader that holds only part of some tensors (a tensor-parallel rank that decodes
    against what it serves): it decodes the elements it holds, and leaves the others to the ranks holding them."""

    def held(self, name: str, indices: torch.Tensor) -> torch.Tensor | None:
        """Which of the sorted flat ``indices`` of tensor ``name`` this reader holds (a bool tensor), or ``None``
        for all of them."""
        ...


def tensor_checksum(tensor: torch.Tensor, span: tuple[int, int] | None = None) -> str:
    """Digest of a tensor's bytes in row-major order: ``"xxh3_128:<32 hex digits>"``.

    Args:
        tensor: any CPU tensor.
        span: hash only the flat elements ``[start, stop)``.

    xxh3-128 hashes at memory speed (~35 GB/s here, against ~2 GB/s for sha256 and ~15 GB/s for
    two-thread blake3), and 128 bits make an accidental collision negligible. It proves that a
    receiver holds the trainer's exact bits; it is no defence against a forger (the sha256 of
    each shard file in the manifest is).
    """
    flat = tensor.detach().reshape(-1)
    if span is not None:
        flat = flat[span[0] : span[1]]
    if flat.numel() == 0:  # no bytes (torch cannot view an empty tensor of another width as bytes)
        return "xxh3_128:" + xxhash.xxh3_128_hexdigest(b"")
    data = flat.contiguous().view(torch.uint8).numpy()
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(data.data)


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorDelta:
    """The change of one tensor between two versions, or one tensor of an anchor (dense).

    Values are always the new absolute values, so applying a decoded delta twice is harmless.
    """

    ckpt_name: str
    """Checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    shape: tuple[int, ...]
    """Full shape of the tensor."""
    dtype: torch.dtype
    """bfloat16, float16 or float32."""
    indices: torch.Tensor | None
    """Sparse: 1-D int64 flat indices into the full tensor, strictly increasing. ``None``: dense."""
    values: torch.Tensor
    """Sparse: 1-D new values at ``indices``. Dense: the whole tensor, or 1-D over ``span``."""
    span: tuple[int, int] | None = None
    """Flat element range ``[start, stop)`` the entry covers (one FSDP rank's rows); ``None``:
    the whole tensor."""
    held: torch.Tensor | None = None
    """Decoded by a reader that holds part of the tensor (:class:`PartialBaseValues`): which elements of the entry
    (of ``indices``, or of the span) it decoded, a bool tensor. The others' ``values`` are +0.0 placeholders, never
    to be written. ``None``: every element."""
    base_values: torch.Tensor | None = None
    """What the base version held where ``values`` go; ``packed`` codes values against them.
    ``None`` makes ``packed`` store raw bits."""
    checksum: str | None = None
    """:func:`tensor_checksum` of the span (or whole tensor) after the change; needed to encode."""
    sketch: str | None = None
    """:func:`deltasync.sketch.tensor_sketch` of the span (placed at its offset) or whole tensor after the
    change. Not part of the shard: a publisher sums the spans' sketches into the manifest."""

    @property
    def nnz(self) -> int:
        """Stored elements (the span's length for a dense entry)."""
        return int(self.values.numel())

    @property
    def bounds(self) -> tuple[int, int]:
        """The span, or ``(0, numel)``."""
        if self.span is not None:
            return self.span
        return (0, math.prod(self.shape))


def _bits_of(t: torch.Tensor, dtype_name: str) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(_INT_TORCH[bits_dtype(dtype_name)]).numpy()


def has_nan(values: torch.Tensor) -> bool:
    """Whether a tensor holds a NaN, by one max reduction (torch's max propagates NaN, any payload or sign): no
    boolean mask the size of the tensor, whose fresh pages cost more than the scan here."""
    return values.is_floating_point() and values.numel() > 0 and bool(torch.isnan(values.detach().amax()))


def _validate_for_encoding(d: TensorDelta, kind: Kind) -> str:
    name = d.ckpt_name
    if not CHECKPOINT_NAME.fullmatch(name):
        raise ValueError(
            f"tensor {name!r}: checkpoint names must have 1 to 1024 characters, no ':' and no control characters"
        )
    if d.dtype not in DTYPE_NAMES:
        raise ValueError(f"tensor {name!r}: dtype {d.dtype} is not supported; expected bfloat16, float16 or float32")
    if d.checksum is None:
        raise ValueError(f"tensor {name!r}: checksum is missing; set it to tensor_checksum(new tensor, span)")
    if kind == "anchor" and d.indices is not None:
        raise ValueError(f"tensor {name!r}: an anchor holds dense entries only, got a sparse one")
    if d.values.dtype != d.dtype:
        raise ValueError(f"tensor {name!r}: values are {d.values.dtype}, expected {d.dtype}")
    start, stop = d.bounds
    if d.span is not None and not 0 <= start < stop <= math.prod(d.shape):
        raise ValueError(f"tensor {name!r}: span {d.span} must satisfy 0 <= start < stop <= {math.prod(d.shape)}")
    if d.indices is None:
        want = d.shape if d.span is None else (stop - start,)
        if tuple(d.values.shape) != want:
            raise ValueError(f"tensor {name!r}: dense values have shape {tuple(d.values.shape)}, expected {want}")
    elif d.values.dim() != 1 or d.indices.shape != d.values.shape:
        raise ValueError(f"tensor {name!r}: {d.indices.numel()} indices but {d.values.numel()} values")
    elif d.indices.dtype != torch.int64:
        raise ValueError(f"tensor {name!r}: indices must be int64, got {d.indices.dtype}")
    if d.base_values is not None and d.base_values.shape != d.values.shape:
        raise ValueError(f"tensor {name!r}: base_values must have the shape of values")
    if has_nan(d.values):
        raise ValueError(
            f"tensor {name!r}: values contain NaN, which vLLM reads as 'unchanged'; deltasync refuses "
            "to publish NaN weights (check the training run for divergence)"
        )
    return DTYPE_NAMES[d.dtype]


def _info(d: TensorDelta, dtype_name: str, **packed: Any) -> TensorInfo:
    return TensorInfo(
        shape=d.shape,
        dtype=dtype_name,
        layout="dense" if d.indices is None else "sparse",
        nnz=d.nnz,
        checksum=str(d.checksum),
        span=d.span,
        **packed,
    )


def _encode_raw(d: TensorDelta, dtype_name: str) -> tuple[TensorInfo, list[SafetensorsEntry]]:
    values = d.values.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
    info = _info(d, dtype_name)
    if d.indices is None and d.span is None:
        return info, [SafetensorsEntry(key=d.ckpt_name, dtype=dtype_name, shape=d.shape, data=values)]
    entries = [SafetensorsEntry(key=f"{d.ckpt_name}:values", dtype=dtype_name, shape=(d.nnz,), data=values)]
    if d.indices is not None:
        wide = info.numel > 2**31 - 1
        idx = d.indices.to(torch.int64 if wide else torch.int32).contiguous().numpy()
        entries.append(
            SafetensorsEntry(
                key=f"{d.ckpt_name}:indices",
                dtype="I64" if wide else "I32",
                shape=(d.nnz,),
                data=idx.data.cast("B"),
            )
        )
    return info, entries


def _u8_entry(key: str, blob: bytes) -> SafetensorsEntry:
    return SafetensorsEntry(key=key, dtype="U8", shape=(len(blob),), data=memoryview(blob))


def _encode_packed(d: TensorDelta, dtype_name: str, level: int) -> tuple[TensorInfo, list[SafetensorsEntry]]:
    entries = []
    index_planes = 0
    if d.indices is not None:
        numel = math.prod(d.shape)
        planes_buf, index_planes = _codec.gap_planes(d.indices.numpy(), np.uint32 if numel <= 2**32 else np.uint64)
        entries.append(_u8_entry(f"{d.ckpt_name}:packed_indices", _codec.zstd_compress(planes_buf, level)))
    new = _bits_of(d.values, dtype_name)
    coding: Literal["ordinal-delta", "bits"]
    if d.base_values is not None:
        _, unsigned = wide_dtypes(dtype_name)
        base = _bits_of(d.base_values, dtype_name)
        planes_buf, value_planes = _codec.ordinal_planes(new, base, unsigned)
        coding = "ordinal-delta"
    else:
        coded: _codec.UIntArray = new.view(np.uint16 if new.dtype == np.int16 else np.uint32)
        coding = "bits"
        value_planes = _codec.planes_needed(coded)
        planes_buf = np.frombuffer(_codec.split_planes(coded, value_planes), dtype=np.uint8)
    blob = _codec.zstd_compress(planes_buf, level)
    entries.append(_u8_entry(f"{d.ckpt_name}:packed_values", blob))
    info = _info(d, dtype_name, index_planes=index_planes, value_planes=value_planes, value_coding=coding)
    return info, entries


class _ShardOptions(TypedDict, total=False):
    """The keyword arguments of :func:`encode_shard` and :func:`encode_shard_parts`."""

    kind: Required[Kind]
    encoding: Required[Encoding]
    target_version: Required[int]
    base_version: int | None
    zstd_level: int


def encode_shard(deltas: Iterable[TensorDelta], **options: Unpack[_ShardOptions]) -> bytes:
    """Encode tensor deltas (or an anchor's dense tensors) into one shard file (:func:`encode_shard_parts`, joined).

    Args:
        deltas: one entry per changed tensor (or span), each with its ``checksum``.
        **options: ``kind`` (``"delta"``, which needs ``base_version``, or ``"anchor"``: dense entries only),
            ``encoding`` (``"raw"`` or ``"packed"``), ``target_version`` (the version the shard produces),
            ``base_version`` (the version a delta applies to) and ``zstd_level`` (compression level of ``packed``).

    Returns:
        The shard's bytes; identical inputs give identical bytes.

    Raises:
        ValueError: an entry is malformed or holds NaN (the message names the tensor).
    """
    return b"".join(encode_shard_parts(deltas, **options))


def encode_shard_parts(
    deltas: Iterable[TensorDelta],
    *,
    kind: Kind,
    encoding: Encoding,
    target_version: int,
    base_version: int | None = None,
    zstd_level: int = DEFAULT_ZSTD_LEVEL,
) -> list[bytes | memoryview]:
    """:func:`encode_shard`'s bytes as the buffers to write one after the other: a ``raw`` shard's tensor data is
    not copied (an agent staging a verified anchor writes the decoded tensors straight to the file)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    if kind == "delta" and (base_version is None or not 0 <= base_version < target_version):
        raise ValueError(f"a delta needs 0 <= base_version < target_version, got {base_version} -> {target_version}")
    if kind == "anchor" and (base_version is not None or target_version < 0):
        raise ValueError(f"an anchor needs target_version >= 0 and no base_version, got {base_version}")
    items = list(deltas)
    names = [d.ckpt_name for d in items]
    if len(set(names)) != len(names):
        raise ValueError("a tensor may appear once per shard; split spans of one tensor across shards")
    dtype_names = [_validate_for_encoding(d, kind) for d in items]

    def encode_one(i: int) -> tuple[TensorInfo, list[SafetensorsEntry]]:
        if encoding == "raw":
            return _encode_raw(items[i], dtype_names[i])
        return _encode_packed(items[i], dtype_names[i], zstd_level)

    encoded = parallel_map(encode_one, range(len(items)), sum(d.nnz for d in items), cost=lambda i: items[i].nnz)
    tensors_json = {d.ckpt_name: info_to_json(info) for d, (info, _) in zip(items, encoded, strict=True)}
    metadata = {
        META_PREFIX + "format_version": FORMAT_VERSION,
        META_PREFIX + "kind": kind,
        META_PREFIX + "encoding": encoding,
        META_PREFIX + "target_version": str(target_version),
        META_PREFIX + "tensors": _json_dumps(tensors_json),
    }
    if base_version is not None:
        metadata[META_PREFIX + "base_version"] = str(base_version)
    return safetensors_parts([e for _, es in encoded for e in es], metadata)


def _json_dumps(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _bad(file: str, what: str) -> FormatError:
    return FormatError(f"{file}: {what}")


def _check_indices(file: str, name: str, idx: np.ndarray, bounds: tuple[int, int], *, increasing: bool) -> None:
    """Indices must be strictly increasing (checked unless known ``increasing``) and inside ``bounds``.

    ``idx`` is int64 (raw) or uint64 (decoded gaps); comparisons happen in its own type, so a
    uint64 index above 2**63 cannot slip through as a negative int64.
    """
    if idx.size == 0:
        return
    if not increasing:
        ok = idx[1:] > idx[:-1]
        if not ok.all():
            k = int(np.argmin(ok))
            raise _bad(
                file,
                f"tensor {name!r}: indices must be strictly increasing, found {int(idx[k + 1])} "
                f"after {int(idx[k])} at position {k + 1}",
            )
    if idx[0] < bounds[0] or idx[-1] >= bounds[1]:
        raise _bad(
            file,
            f"tensor {name!r}: indices must lie in [{bounds[0]}, {bounds[1]}), found {int(idx[0])}..{int(idx[-1])}",
        )


def decode_shard(
    buf: bytes | bytearray | memoryview,
    *,
    name: str,
    base: Mapping[str, torch.Tensor] | BaseValues | None = None,
    parsed: tuple[ShardHeader, SafetensorsFile] | None = None,
) -> tuple[ShardHeader, dict[str, TensorDelta]]:
    """Validate and decode a whole shard; nothing is returned unless everything is valid.

    Args:
        buf: the shard's bytes. A writable buffer (``bytearray``) is decoded without copying
            the raw values.
        name: the file's name for error messages.
        base: full tensors of the base version, by checkpoint name, or a :class:`BaseValues` to read them from;
            needed for ``packed`` entries coded as ``ordinal-delta`` (only the values at the changed indices are
            read). Tensors are decoded on several threads: a :class:`BaseValues` must allow concurrent reads.
        parsed: what :func:`~deltasync._shard_header.parse_shard` returned for ``buf`` (callers that checked the
            header first pass it, so it is parsed once).

    Returns:
        The header and one :class:`TensorDelta` per tensor, holding new absolute values.

    Raises:
        FormatError: any malformation: container, metadata, entry shapes, indices not sorted,
            not unique or out of range, NaN values, a corrupt zstd frame, or a ``base`` tensor
            whose shape or dtype differs from the shard's (a delta for another model).
        ValueError: ``base`` is needed but was not given.
        MemoryError: the values the header claims do not fit in memory. Decoding allocates what the header
            claims (bounded by the container: a zstd frame stands for at most ``MAX_ZSTD_RATIO`` times its
            bytes); callers that know the model check the header against it first (:mod:`deltasync.reader` does).
    """
    header, st = parsed if parsed is not None else parse_shard(buf, name)
    needs_base = [t for t, i in header.tensors.items() if i.value_coding == "ordinal-delta"]
    if needs_base and base is None:
        raise ValueError(
            f"{name}: {len(needs_base)} tensors are coded against base version "
            f"{header.base_version}; pass base= the tensors of that version"
        )
    writable = not memoryview(buf).readonly
    against = _Base.of(base)

    def decode_one(t: str) -> TensorDelta:
        try:
            return _decode_tensor(t, header.tensors[t], header.encoding, st, against, writable, name)
        except FormatError:
            raise
        except ValueError as exc:  # codec errors carry no file or tensor name: add them
            raise _bad(name, f"tensor {t!r}: {exc}") from None
        except MemoryError:  # the header's claims are all the bound an unauthenticated reader has
            info = header.tensors[t]
            raise MemoryError(
                f"{name}: tensor {t!r} claims {info.nnz} {info.dtype} values ({info.layout}) and this process "
                "cannot hold them; check the shard against the served model (an agent refuses a foreign model "
                "before fetching) or read it on a host with more memory"
            ) from None

    infos = header.tensors
    decoded = parallel_map(decode_one, list(infos), sum(i.nnz for i in infos.values()), cost=lambda t: infos[t].nnz)
    return header, {d.ckpt_name: d for d in decoded}


@dataclass(frozen=True)
class _Base:
    """What a shard's ``ordinal-delta`` entries are decoded against, judged once per shard (a runtime protocol
    check costs ~15 us a call on Python 3.11, two per tensor)."""

    whole: Mapping[str, torch.Tensor] | None
    reader: BaseValues | None
    partial: PartialBaseValues | None
    """:attr:`reader` again when it holds part of some tensors."""

    @classmethod
    def of(cls, base: Mapping[str, torch.Tensor] | BaseValues | None) -> _Base:
        if isinstance(base, BaseValues):
            return cls(None, base, base if isinstance(base, PartialBaseValues) else None)
        return cls(base, None, None)


def _frombuffer(data: memoryview, np_dtype: type[np.generic], writable: bool) -> np.ndarray:
    arr = np.frombuffer(data, dtype=np_dtype)
    return arr if writable else arr.copy()


def _decode_tensor(
    t: str,
    info: TensorInfo,
    encoding: Encoding,
    st: SafetensorsFile,
    against: _Base,
    writable: bool,
    file: str,
) -> TensorDelta:
    ibits = bits_dtype(info.dtype)
    sparse = info.layout == "sparse"
    n = info.nnz
    indices: np.ndarray | None = None
    held: torch.Tensor | None = None
    if encoding == "raw":
        if sparse:
            ie = st.entries[f"{t}:indices"]
            raw_idx = _frombuffer(ie.data, np.int32 if ie.dtype == "I32" else np.int64, False)
            indices = raw_idx.astype(np.int64, copy=False)
            _check_indices(file, t, indices, info.bounds, increasing=False)
        key = t if info.layout == "dense" and info.span is None else f"{t}:values"
        bits = _frombuffer(st.entries[key].data, ibits, writable)
    else:
        if sparse:
            work = np.uint32 if info.numel <= 2**32 else np.uint64
            raw_gaps = _codec.zstd_decompress(st.entries[f"{t}:packed_indices"].data, n * info.index_planes)
            # joined straight into uint64 (the planes fit ``work``: the header checked them): one buffer
            decoded = _codec.join_gaps(raw_gaps, n, info.index_planes)
            # uint32 gaps (at most 2**32 of them) sum to less than 2**64: the uint64 result cannot wrap
            # and is strictly increasing by construction; uint64 gaps can wrap, so check them
            _check_indices(file, t, decoded, info.bounds, increasing=work is np.uint32)
            indices = decoded.view(np.int64)
        raw_vals = _codec.zstd_decompress(st.entries[f"{t}:packed_values"].data, n * info.value_planes)
        if info.value_coding == "bits":
            unsigned_bits = np.uint16 if ibits is np.int16 else np.uint32
            bits = _codec.join_planes(raw_vals, n, info.value_planes, unsigned_bits).view(ibits)
        else:
            bits, held = _undo_ordinal_delta(file, t, info, raw_vals, against, indices)
    shape = info.shape if info.layout == "dense" and info.span is None else (n,)
    values = torch.from_numpy(bits).view(DTYPES[info.dtype]).reshape(shape)
    if has_nan(values):
        k = int(torch.isnan(values.reshape(-1)).nonzero()[0, 0])
        raise _bad(
            file,
            f"tensor {t!r}: value {k} is NaN; NaN is vLLM's 'unchanged' sentinel and never valid in a delta",
        )
    return TensorDelta(
        ckpt_name=t,
        shape=info.shape,
        dtype=DTYPES[info.dtype],
        span=info.span,
        checksum=info.checksum,
        indices=None if indices is None else torch.from_numpy(indices),
        values=values,
        held=held,
    )


def _undo_ordinal_delta(
    file: str,
    t: str,
    info: TensorInfo,
    raw_vals: bytes,
    against: _Base,
    indices: np.ndarray | None,
) -> tuple[np.ndarray, torch.Tensor | None]:
    """The new bits from the coded values' byte planes (``raw_vals``), and which of them were decoded (``None``:
    all; a :class:`PartialBaseValues` reader decodes only the elements it holds, and the others are +0.0)."""
    _, unsigned = wide_dtypes(info.dtype)
    n, planes = info.nnz, info.value_planes
    held: torch.Tensor | None = None
    base = against.reader
    if base is not None:
        at = torch.from_numpy(indices) if indices is not None else torch.arange(*info.bounds, dtype=torch.int64)
        if against.partial is not None:
            held = against.partial.held(t, at)
            if held is not None:
                if held.dtype != torch.bool or held.numel() != at.numel():
                    raise _bad(file, f"tensor {t!r}: the base's held mask does not match {at.numel()} elements")
                at = at[held]
        read = base.values_at(t, info.shape, DTYPES[info.dtype], at)
        if read.dtype != DTYPES[info.dtype] or read.numel() != at.numel():
            raise _bad(file, f"tensor {t!r}: the base gave {read.numel()} {read.dtype} values for {at.numel()}")
        base_bits = _bits_of(read, info.dtype)
        if held is not None:
            keep = held.numpy()
            coded = _codec.join_planes(raw_vals, n, planes, unsigned)
            part = _codec.undo_ordinal_delta(base_bits, coded[keep])  # boolean indexing: a copy, the caller's
            if part is None:
                raise _bad(
                    file, f"tensor {t!r}: a coded value falls outside the {info.dtype} range; the shard is corrupt"
                )
            whole = np.zeros(n, dtype=part.dtype)  # +0.0 where another rank decodes
            whole[keep] = part
            return whole, held
    else:
        whole_base = None if against.whole is None else against.whole.get(t)
        if whole_base is None:
            raise _bad(file, f"tensor {t!r} is coded against the base version, but the base has no such tensor")
        if tuple(whole_base.shape) != info.shape or whole_base.dtype != DTYPES[info.dtype]:
            found = f"{DTYPE_NAMES.get(whole_base.dtype, str(whole_base.dtype))} {list(whole_base.shape)}"
            raise _bad(
                file,
                f"tensor {t!r}: the shard expects {info.dtype} {list(info.shape)}, the base holds "
                f"{found} (a delta for another model?)",
            )
        held_bits = _bits_of(whole_base, info.dtype)
        # np.take: ~1.2x numpy's fancy indexing on a large tensor
        bounds = info.bounds
        base_bits = np.take(held_bits, indices) if indices is not None else held_bits[bounds[0] : bounds[1]]
    if base_bits.size != n:
        raise _bad(file, f"tensor {t!r}: {n} coded values for {base_bits.size} base values")
    out = _codec.undo_ordinal_planes(base_bits, raw_vals, n, planes, unsigned)
    if out is None:
        raise _bad(file, f"tensor {t!r}: a coded value falls outside the {info.dtype} range; the shard is corrupt")
    return out, held
