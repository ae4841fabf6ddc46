"""Lossless array codecs of the ``packed`` encoding: gap coding, ordinal deltas, byte planes, zstd."""

from __future__ import annotations

import operator
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from ._kernels import OrdinalCode, kernels

__all__ = [
    "MAX_ZSTD_RATIO",
    "PLANE_HASH_LOG",
    "PLANE_MIN_MATCH",
    "decode_gaps",
    "encode_gaps",
    "from_ordinal",
    "gap_planes",
    "join_gaps",
    "join_planes",
    "ordinal_planes",
    "planes_needed",
    "split_planes",
    "to_ordinal",
    "zigzag_decode",
    "zigzag_encode",
    "zstd_compress",
    "zstd_decompress",
]

assert sys.byteorder == "little", "deltasync's codecs assume a little-endian host"

UIntArray = npt.NDArray[np.unsignedinteger]
IntArray = npt.NDArray[np.signedinteger]


MAX_ZSTD_RATIO = 32768
"""zstd's own limit: a 4-byte RLE block stands for at most 128 KiB. A frame that declares more than this
many times its own size is forged, and is refused before anything is allocated."""


def planes_needed(values: UIntArray) -> int:
    """Return how many low byte planes hold every value: 0 for an empty array, at least 1 otherwise (so
    every element costs at least one byte before compression, which bounds what a frame can declare)."""
    if values.size == 0:
        return 0
    top = int(values.max())
    return max(1, (top.bit_length() + 7) // 8)


def split_planes(values: UIntArray, planes: int) -> bytes:
    """Return the ``planes`` low bytes of each value, plane by plane (all low bytes first)."""
    as_bytes = values.reshape(-1, 1).view(np.uint8)
    return np.ascontiguousarray(as_bytes[:, :planes].T).tobytes()


def join_planes(buf: bytes, n: int, planes: int, dtype: type[np.unsignedinteger[Any]]) -> UIntArray:
    """Inverse of :func:`split_planes`: rebuild ``n`` unsigned values of ``dtype`` in one buffer, Horner's way: the
    top plane widened, then shifted by a byte and or-ed with the next plane down, in place (~5x a widened
    temporary per plane)."""
    n, planes = _counts(n, planes)
    src = np.frombuffer(buf, dtype=np.uint8).reshape(planes, n)
    if not planes:
        return np.zeros(n, dtype=dtype)
    out: UIntArray = src[planes - 1].astype(dtype)
    byte = dtype(8)
    for k in range(planes - 2, -1, -1):
        np.left_shift(out, byte, out=out)
        np.bitwise_or(out, src[k], out=out)
    return out


_GUESS_PLANES = 2
"""Planes a compiled encode writes before it knows the largest value: a step's gaps and ordinal differences fit in
two bytes almost always (one more pass where they do not)."""


def _plane_rows(top: int, n: int) -> int:
    """:func:`planes_needed` of ``n`` values whose largest is ``top``."""
    return 0 if n == 0 else max(1, (top.bit_length() + 7) // 8)


def _compiled_planes(run: Callable[[npt.NDArray[np.uint8]], int], n: int) -> tuple[npt.NDArray[np.uint8], int]:
    """The byte planes a compiled loop ``run`` writes (the low ``out.shape[0]`` of each value into ``out``, returning
    the largest value), as one contiguous buffer: the guessed planes, and the loop run again on every plane where
    its largest value needs more. The low planes of a plane-major array are its head, so fewer are a view."""
    out = np.empty((_GUESS_PLANES, n), dtype=np.uint8)
    planes = _plane_rows(int(run(out)), n)
    if planes > _GUESS_PLANES:
        out = np.empty((planes, n), dtype=np.uint8)
        run(out)
    return out[:planes].reshape(-1), planes


def gap_planes(indices: npt.NDArray[np.int64], work: type[np.unsignedinteger]) -> tuple[npt.NDArray[np.uint8], int]:
    """``split_planes(gaps, planes_needed(gaps))`` of ``gaps = encode_gaps(indices, work)``, and that plane count:
    where numba is installed, one compiled pass with no gap array (bit for bit the same bytes)."""
    compiled = kernels()
    if compiled is None or indices.dtype != np.int64:
        gaps = encode_gaps(indices, work)
        planes = planes_needed(gaps)
        return np.frombuffer(split_planes(gaps, planes), dtype=np.uint8), planes
    src, mask = _native(indices), np.uint64(np.iinfo(work).max)
    return _compiled_planes(lambda out: int(compiled.gap_planes(src, mask, out)), indices.size)


def ordinal_planes(
    new_bits: IntArray, base_bits: IntArray, unsigned: type[np.unsignedinteger[Any]]
) -> tuple[npt.NDArray[np.uint8], int]:
    """The byte planes of the ``ordinal-delta`` code of ``new_bits`` against ``base_bits`` (signed bit patterns of
    one width; ``unsigned``: the coded type, twice that width), and their count: ``split_planes`` of
    ``zigzag_encode(to_ordinal(new).astype(signed) - to_ordinal(base), unsigned)``. Where numba is installed, one
    compiled pass with no temporaries (bit for bit the same bytes)."""
    if new_bits.size != base_bits.size or new_bits.dtype != base_bits.dtype:
        raise ValueError(f"ordinal_planes: {new_bits.size} {new_bits.dtype} values against {base_bits.size} base ones")
    compiled = kernels()
    if compiled is None or (new_bits.dtype, np.dtype(unsigned)) not in _COMPILED_UNDO:
        signed = np.dtype(f"i{np.dtype(unsigned).itemsize}")
        diff = to_ordinal(new_bits).astype(signed)
        diff -= to_ordinal(base_bits)
        coded = zigzag_encode(diff, unsigned)
        planes = planes_needed(coded)
        return np.frombuffer(split_planes(coded, planes), dtype=np.uint8), planes
    new, base, mask = _native(new_bits), _native(base_bits), np.uint64(np.iinfo(unsigned).max)
    return _compiled_planes(lambda out: int(compiled.ordinal_planes(new, base, mask, out)), new.size)


def encode_gaps(indices: IntArray, work: type[np.unsignedinteger]) -> UIntArray:
    """Strictly increasing indices -> gaps ``i[0]`` and ``i[k] - i[k-1] - 1`` (all >= 0)."""
    gaps = np.empty(indices.size, dtype=work)
    if indices.size:
        gaps[0] = indices[0]
        np.subtract(indices[1:], indices[:-1], out=gaps[1:], casting="unsafe")
        gaps[1:] -= 1
    return gaps


def decode_gaps(gaps: UIntArray) -> npt.NDArray[np.uint64]:
    """Inverse of :func:`encode_gaps`, as uint64, in one buffer (``i[k] = sum(g[0..k] + 1) - 1``): uint64 gaps'
    own, which the caller gives up. The caller checks bounds (and, for gaps that may wrap around, more than 4 bytes
    wide, that the result is strictly increasing)."""
    out = gaps.astype(np.uint64, copy=False)
    out += np.uint64(1)
    np.cumsum(out, out=out)
    out -= np.uint64(1)
    return out


def _counts(n: int, planes: int) -> tuple[int, int]:
    """A value count and a plane count as ints, neither negative (a float or a negative count is a caller's bug,
    refused the same way by the compiled loops and the numpy code)."""
    n, planes = operator.index(n), operator.index(planes)
    if n < 0 or planes < 0:
        raise ValueError(f"{n} values of {planes} byte planes: counts cannot be negative")
    return n, planes


def _native(a: np.ndarray) -> np.ndarray:
    """``a`` as a writable, C-contiguous, native-endian array: itself where it is one, else a copy (the compiled
    loops take only those, and the numpy undo writes into its coded values)."""
    if not a.dtype.isnative:
        return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
    out = np.ascontiguousarray(a)
    return out if out.flags.writeable else out.copy()


def _plane_bytes(buf: bytes, n: int, planes: int, what: str) -> np.ndarray:
    """``buf`` as the bytes of ``planes`` planes of ``n`` values each, what a compiled loop reads (sized here: the
    loops do not check their bounds)."""
    src = np.frombuffer(buf, dtype=np.uint8)
    if src.size != n * planes:
        raise ValueError(f"{what}: {src.size} bytes for {n} values of {planes} planes")
    return src


def _undo_constants(dtype: np.dtype) -> OrdinalCode:
    """What the compiled undo takes for a base of ``dtype``: the sign's shift, the magnitude's mask, and the
    dtype's least and largest values."""
    width = dtype.itemsize * 8
    info = np.iinfo(dtype)
    return OrdinalCode(width - 1, (1 << (width - 1)) - 1, int(info.min), int(info.max))


def join_gaps(buf: bytes, n: int, planes: int) -> npt.NDArray[np.uint64]:
    """``decode_gaps(join_planes(buf, n, planes, np.uint64))``: where numba is installed, one compiled pass that
    joins each gap from its planes and adds it up as it goes (no joined copy read back three times)."""
    n, planes = _counts(n, planes)
    compiled = kernels()
    if compiled is None or not 0 < planes <= 8:
        return decode_gaps(join_planes(buf, n, planes, np.uint64))
    src = _plane_bytes(buf, n, planes, "join_gaps")  # sized before anything is allocated
    out = np.empty(n, dtype=np.uint64)
    compiled.join_gaps(src, n, planes, out)
    return out


def to_ordinal(bits: IntArray) -> IntArray:
    """Map sign-magnitude float bit patterns (as signed ints) to integers in float order.

    ``-0.0`` maps to -1 and ``+0.0`` to 0, so the map is a bijection on bit patterns (NaN payloads
    included). The map is an involution: :func:`from_ordinal` is the same operation.
    """
    width = bits.dtype.itemsize * 8
    mask = np.array((1 << (width - 1)) - 1, dtype=bits.dtype)
    out: IntArray = np.bitwise_xor(bits, (bits >> (width - 1)) & mask)
    return out


from_ordinal = to_ordinal


def zigzag_encode(d: IntArray, unsigned: type[np.unsignedinteger]) -> UIntArray:
    """Signed -> unsigned with small magnitudes first: 0, -1, 1, -2, 2 -> 0, 1, 2, 3, 4."""
    width = d.dtype.itemsize * 8
    return ((d << 1) ^ (d >> (width - 1))).view(unsigned)


def zigzag_decode(z: UIntArray, signed: type[np.signedinteger]) -> IntArray:
    """Inverse of :func:`zigzag_encode`."""
    half: IntArray = (z >> 1).view(signed)
    sign: IntArray = (z & 1).view(signed)
    out: IntArray = np.bitwise_xor(half, np.negative(sign))
    return out


_COMPILED_UNDO = {(np.dtype(np.int16), np.dtype(np.uint32)), (np.dtype(np.int32), np.dtype(np.uint64))}
"""(base, coded) dtypes the compiled undo takes: bf16/fp16 and fp32 values."""


def undo_ordinal_delta(base_bits: IntArray, coded: UIntArray) -> IntArray | None:
    """The new bit patterns from the base's (``base_bits``, signed, the dtype's width) and the zigzagged ordinal
    differences (``coded``, unsigned, twice that width): ``from_ordinal(to_ordinal(base) + zigzag_decode(coded))``,
    computed in ``coded``'s own buffer (which the caller gives up) with one narrow and one wide temporary, where the
    composed functions make six (fresh pages cost more than the arithmetic here). ``None`` if a result falls outside
    the dtype (a corrupt shard). Where numba is installed, one compiled pass (:mod:`deltasync._kernels`) writes the
    result into a fresh array instead, and leaves ``coded`` as it was."""
    if base_bits.size != coded.size:
        raise ValueError(f"undo_ordinal_delta: {coded.size} coded values for {base_bits.size} base values")
    base_bits, coded = _native(base_bits), _native(coded)  # a copy only of a read-only, strided or foreign array
    compiled = kernels()
    if compiled is not None and (base_bits.dtype, coded.dtype) in _COMPILED_UNDO:
        result = np.empty(coded.size, dtype=base_bits.dtype)
        bad = compiled.undo_ordinal(base_bits, coded, result, _undo_constants(base_bits.dtype))
        return None if bad >= 0 else result
    signed = np.dtype(f"i{coded.dtype.itemsize}")
    d: IntArray = coded.view(signed)
    sign = np.bitwise_and(coded, coded.dtype.type(1)).view(signed)
    np.right_shift(coded, coded.dtype.type(1), out=coded)
    np.negative(sign, out=sign)
    np.bitwise_xor(d, sign, out=d)  # zigzag decoded, in place
    del sign
    ordinal = to_ordinal(base_bits)
    np.add(d, ordinal, out=d)
    del ordinal
    info = np.iinfo(base_bits.dtype)
    if d.size and (int(d.min()) < info.min or int(d.max()) > info.max):
        return None
    out: IntArray = d.astype(base_bits.dtype)
    width = out.dtype.itemsize * 8
    flip = np.right_shift(out, width - 1)  # from_ordinal, in place: one narrow temporary
    np.bitwise_and(flip, np.array((1 << (width - 1)) - 1, dtype=out.dtype), out=flip)
    np.bitwise_xor(out, flip, out=out)
    return out


def undo_ordinal_planes(
    base_bits: IntArray, buf: bytes, n: int, planes: int, unsigned: type[np.unsignedinteger[Any]]
) -> IntArray | None:
    """``undo_ordinal_delta(base_bits, join_planes(buf, n, planes, unsigned))``: where numba is installed, one
    compiled pass that joins each coded value from its planes as it undoes it (no joined copy)."""
    n, planes = _counts(n, planes)
    if base_bits.size != n:
        raise ValueError(f"undo_ordinal_planes: {n} coded values for {base_bits.size} base values")
    base_bits = _native(base_bits)
    compiled = kernels()
    coded = np.dtype(unsigned)
    if compiled is None or not 0 < planes <= coded.itemsize or (base_bits.dtype, coded) not in _COMPILED_UNDO:
        return undo_ordinal_delta(base_bits, join_planes(buf, n, planes, unsigned))
    src = _plane_bytes(buf, n, planes, "undo_ordinal_planes")
    result = np.empty(n, dtype=base_bits.dtype)
    bad = compiled.undo_planes(base_bits, src, n, planes, result, _undo_constants(base_bits.dtype))
    return None if bad >= 0 else result


PLANE_MIN_MATCH = 7
"""zstd's longest minimum match: byte planes of small codes repeat in short runs, which cost more as matches than as
literals (zstd's Huffman coder takes those near their order-0 entropy); the runs of a plane of zeros stay matches."""
PLANE_HASH_LOG = 6
"""zstd's smallest match table (64 entries): few matches are looked for, fewer found. Measured on Qwen3-0.6B
shapes at lr 1e-6 (``benchmarks/bench_codec.py``): against level 3's own match finder, a delta's packed streams
are 2.5% smaller and compress 1.6x faster, an anchor's 6% smaller, compressed 4.7x and decompressed 2x faster."""

_COMPRESSORS = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (a context is made once per thread, not once per frame)."""
    made: dict[int, zstandard.ZstdCompressor] | None = getattr(_COMPRESSORS, "by_level", None)
    if made is None:
        made = _COMPRESSORS.by_level = {}
    if level not in made:
        params = zstandard.ZstdCompressionParameters.from_level(
            level, min_match=PLANE_MIN_MATCH, hash_log=PLANE_HASH_LOG, write_content_size=1
        )
        made[level] = zstandard.ZstdCompressor(compression_params=params)
    return made[level]


def zstd_compress(data: bytes | npt.NDArray[np.uint8], level: int) -> bytes:
    """One zstd frame with its content size recorded: ``level``'s strategy and window, with the match finder of
    byte planes (:data:`PLANE_MIN_MATCH`, :data:`PLANE_HASH_LOG`). Identical inputs give identical frames."""
    return _compressor(level).compress(data if isinstance(data, bytes) else data.data)


def zstd_decompress(frame: bytes | memoryview, expected: int) -> bytes:
    """Decompress one frame that must hold exactly ``expected`` bytes.

    Raises:
        ValueError: the frame is corrupt or does not declare ``expected`` bytes; the caller
            turns this into a FormatError naming the file and tensor.
    """
    if expected > MAX_ZSTD_RATIO * len(frame):
        raise ValueError(
            f"a {len(frame)}-byte zstd frame cannot hold {expected} bytes (zstd expands at most {MAX_ZSTD_RATIO}x)"
        )
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise ValueError(f"not a zstd frame ({exc})") from None
    if declared != expected:
        raise ValueError(f"zstd frame declares {declared} bytes, expected {expected}")
    try:
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise ValueError(f"corrupt zstd frame ({exc})") from None
    if len(out) != expected:
        raise ValueError(f"zstd frame holds {len(out)} bytes, expected {expected}")
    return out
