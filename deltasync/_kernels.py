"""Compiled loops for the engine's work before the pause, where numba is installed (vLLM depends on it).

In numpy, the ordinal undo of a packed delta is about a dozen whole-array passes over the changed elements (the
zigzag, the ordinal maps, the range check, the cast), the gap decode three more after the planes are joined, and
the sketch of a change a float64 difference, a weighted histogram over 2**16 rows and a run sum; each pass writes
and reads back a temporary. Each loop here does one of those jobs in one pass over its inputs, in integers, with
the same results bit for bit (``tests/unit/test_kernels.py`` checks them against the numpy code on random and edge
inputs; the codec and sketch tests run both ways).

The loops are optional. Without numba, or turned off (:func:`use_compiled`: an engine's ``DELTASYNC_KERNELS=numpy``,
read with its other settings, :class:`deltasync.vllm.config.EngineConfig`), :func:`kernels` is ``None`` and the
callers run their numpy code. They are compiled on first use, with numba's on-disk cache (the engine warms them
at its start, :func:`warm`), and release the GIL, so the decoder's threads can run them side by side.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple, cast

import numpy as np

Arr = np.ndarray[Any, Any]

__all__ = ["OrdinalCode", "kernels", "use_compiled", "warm"]

logger = logging.getLogger(__name__)


class OrdinalCode(NamedTuple):
    """What the compiled undo loops take of a base dtype's ordinal code (one argument: a tuple to the compiler)."""

    width_shift: int
    """The sign bit's position (the dtype's width in bits, minus one)."""
    magnitude: int
    """The mask of every bit below the sign bit."""
    low: int
    """The dtype's least value: a result below it is a corrupt shard."""
    high: int
    """The dtype's largest value: a result above it is a corrupt shard."""


_LOCK = threading.Lock()
_LOADED: dict[str, Any] = {}
_WANTED = {"compiled": True}  # use_compiled's setting for this process
_ordinal_sum: Any = None
"""The compiled ``ordinal_sum`` once :func:`_build` ran (a global: see there)."""


def kernels() -> SimpleNamespace | None:
    """The compiled loops (``undo_ordinal``, ``undo_planes``, ``change_lanes``, ``change_rows``, ``join_gaps``,
    ``gap_planes``, ``ordinal_planes``, ``diff_words``, ``sketch_chunks``),
    or ``None`` where numba is missing or turned off. The first call imports numba and compiles or loads the loops
    (~0.5-1.5 s); later calls cost a lookup."""
    if not _WANTED["compiled"]:
        return None
    loaded = _LOADED.get("k", False)
    if loaded is not False:
        return loaded  # type: ignore[no-any-return]
    with _LOCK:
        if "k" not in _LOADED:
            _LOADED["k"] = _compile()
        return _LOADED["k"]  # type: ignore[no-any-return]


def use_compiled(on: bool) -> None:
    """Whether :func:`kernels` hands out the compiled loops in this process from now on (``False``: the callers run
    the numpy code, bit for bit the same results)."""
    _WANTED["compiled"] = on


def warm() -> bool:
    """Compile (or load) the loops now, where a start can wait for them rather than the first update: whether they
    are in use."""
    return kernels() is not None


def _compile() -> SimpleNamespace | None:
    try:
        import numba  # type: ignore[import-untyped]
    except ImportError:
        return None
    try:
        return _build(numba)
    except Exception as exc:  # an incompatible numba (or numpy) must not take the engine down: numpy does the work
        logger.warning("deltasync: numba %s cannot compile deltasync's loops (%s); using numpy", numba.__version__, exc)
        return None


def _build(numba: Any) -> SimpleNamespace:
    njit = cast(Callable[..., Callable[[Callable[..., Any]], Any]], numba.njit)
    opts = {"cache": True, "nogil": True, "boundscheck": False, "error_model": "numpy"}
    top63 = np.int64(0x7FFFFFFFFFFFFFFF)
    # a global, not a closure variable of the loops that call it: numba keys its cache on the pickled closure, and a
    # dispatcher pickles with a new id in each process (every start compiled them again, ~3 s, and added files)
    global _ordinal_sum

    @njit(inline="always", **opts)  # no signature: specialised inside each loop that calls it
    def ordinal_sum(base: int, coded: int, width_shift: int, magnitude: int) -> np.int64:  # pragma: no cover
        # to_ordinal(base) + zigzag_decode(coded) in int64, wrapping as numpy's int64 does; ``coded`` is
        # reinterpreted as two's complement (a uint64's bits), so its shift is made logical
        b = np.int64(base)
        c = np.int64(coded)
        return (b ^ ((b >> width_shift) & magnitude)) + (((c >> 1) & top63) ^ -(c & 1))

    _ordinal_sum = ordinal_sum

    t = numba.types
    code_type = t.NamedUniTuple(t.int64, 4, OrdinalCode)

    @njit(
        [
            t.int64(t.Array(t.int16, 1, "C"), t.Array(t.uint32, 1, "C"), t.Array(t.int16, 1, "C"), code_type),
            t.int64(t.Array(t.int32, 1, "C"), t.Array(t.uint64, 1, "C"), t.Array(t.int32, 1, "C"), code_type),
        ],
        **opts,
    )
    def undo_ordinal(base: Arr, coded: Arr, out: Arr, code: OrdinalCode) -> int:  # pragma: no cover - compiled
        # out[i] = from_ordinal(to_ordinal(base[i]) + zigzag_decode(coded[i])); the index of the first result
        # outside [low, high] (a corrupt shard), or -1
        width_shift, magnitude, low, high = code
        for i in range(coded.size):
            o = _ordinal_sum(base[i], coded[i], width_shift, magnitude)
            if o < low or o > high:
                return i
            out[i] = o ^ ((o >> width_shift) & magnitude)
        return -1

    @njit(
        ["int64(int64[::1], uint16[::1], uint16[::1], int64[:, ::1], int64[:, ::1], int64, int64[::1])"],
        **opts,
    )
    def change_lanes(
        at: Arr, new: Arr, old: Arr, rows: Arr, chunks: Arr, first: int, lanes: Arr
    ) -> int:  # pragma: no cover - compiled
        # lanes[k] += (new[i] - old[i]) * (rows[at[i] mod 2**16, k] + chunks[at[i] // 2**16 - first, k]), mod 2**64
        # (the words' weights); the index of the first word whose chunk falls outside ``chunks`` (nothing added
        # for it or after it), or -1
        a0 = lanes[0]
        a1 = lanes[1]
        a2 = lanes[2]
        a3 = lanes[3]
        bad = -1
        for i in range(at.size):
            j = at[i]
            k = (j >> 16) - first
            if k < 0 or k >= chunks.shape[0]:
                bad = i
                break
            r = j & 0xFFFF
            diff = np.int64(new[i]) - np.int64(old[i])
            a0 += diff * (rows[r, 0] + chunks[k, 0])
            a1 += diff * (rows[r, 1] + chunks[k, 1])
            a2 += diff * (rows[r, 2] + chunks[k, 2])
            a3 += diff * (rows[r, 3] + chunks[k, 3])
        lanes[0] = a0
        lanes[1] = a1
        lanes[2] = a2
        lanes[3] = a3
        return bad

    @njit(["int64(int64[::1], uint16[::1], uint16[::1], int64[::1], int64[::1], int64, int64)"], **opts)
    def change_rows(
        at: Arr, new: Arr, old: Arr, rows: Arr, chunks: Arr, first: int, factor: int
    ) -> int:  # pragma: no cover - compiled
        # the word differences new - old summed per weight row (at mod 2**16; each times ``factor``, mod 2**64)
        # and per chunk (at // 2**16 - first): a 512 KiB histogram stays in cache where the weights (2 MiB) do
        # not; the index of the first word whose chunk falls outside ``chunks`` (nothing added for it or after
        # it), or -1
        for i in range(at.size):
            j = at[i]
            k = (j >> 16) - first
            if k < 0 or k >= chunks.size:
                return i
            diff = np.int64(new[i]) - np.int64(old[i])
            rows[j & 0xFFFF] += diff * factor
            chunks[k] += diff
        return -1

    u8, u64 = t.Array(t.uint8, 1, "C"), t.Array(t.uint64, 1, "C")
    u8_readonly = t.Array(t.uint8, 1, "C", readonly=True)  # np.frombuffer of bytes, as a shard's are decompressed

    @njit([t.void(planes, t.int64, t.int64, u64) for planes in (u8, u8_readonly)], **opts)
    def join_gaps(planes: Arr, n: int, count: int, out: Arr) -> None:  # pragma: no cover - compiled
        # out[i] = sum(gap[0..i] + 1) - 1, the gaps joined from ``count`` byte planes of ``n`` bytes each (low
        # plane first) as they are read: uint64, as numpy's cumsum of the joined gaps. One or two planes (most
        # deltas' gaps): the bytes joined with no inner loop (~3x)
        acc = np.uint64(0)
        one = np.uint64(1)
        if count == 1:
            for i in range(n):
                acc += np.uint64(planes[i]) + one
                out[i] = acc - one
            return
        if count == 2:
            for i in range(n):
                acc += (np.uint64(planes[i]) | (np.uint64(planes[n + i]) << np.uint64(8))) + one
                out[i] = acc - one
            return
        for i in range(n):
            gap = np.uint64(0)
            for k in range(count - 1, -1, -1):
                gap = (gap << np.uint64(8)) | np.uint64(planes[k * n + i])
            acc += gap + np.uint64(1)
            out[i] = acc - np.uint64(1)

    i16, i32 = t.Array(t.int16, 1, "C"), t.Array(t.int32, 1, "C")
    undo_signatures = [
        t.int64(narrow, planes, t.int64, t.int64, narrow, code_type)
        for narrow in (i16, i32)
        for planes in (u8, u8_readonly)
    ]

    @njit(undo_signatures, **opts)
    def undo_planes(
        base: Arr, planes: Arr, n: int, count: int, out: Arr, code: OrdinalCode
    ) -> int:  # pragma: no cover - compiled
        # undo_ordinal of the coded values as they are joined from ``count`` byte planes of ``n`` bytes each (low
        # plane first): no joined copy of them. One or two planes (most of a step's values): a loop with no
        # branch, which the compiler vectorizes (~10x); a result outside [low, high] is then found by the
        # general loop, which stops at it
        width_shift, magnitude, low, high = code
        if count == 1 or count == 2:
            bad = False
            if count == 1:
                for i in range(n):
                    o = _ordinal_sum(base[i], planes[i], width_shift, magnitude)
                    bad |= (o < low) | (o > high)
                    out[i] = o ^ ((o >> width_shift) & magnitude)
            else:
                for i in range(n):
                    o = _ordinal_sum(
                        base[i], np.int64(planes[i]) | (np.int64(planes[n + i]) << 8), width_shift, magnitude
                    )
                    bad |= (o < low) | (o > high)
                    out[i] = o ^ ((o >> width_shift) & magnitude)
            if not bad:
                return -1
        for i in range(n):
            c = np.int64(0)
            for k in range(count - 1, -1, -1):
                c = (c << 8) | np.int64(planes[k * n + i])  # 8 planes: the uint64's bits, as undo_ordinal reads them
            o = _ordinal_sum(base[i], c, width_shift, magnitude)
            if o < low or o > high:
                return i
            out[i] = o ^ ((o >> width_shift) & magnitude)
        return -1

    found_types = [t.Tuple((t.Array(t.int64, 1, "C"), narrow, narrow, t.int64)) for narrow in (i16, i32)]
    diff_signatures = [
        found(narrow, narrow, t.UniTuple(u64, 2), t.UniTuple(t.int64, 3), found, t.boolean)
        for narrow, found in zip((i16, i32), found_types, strict=True)
    ]

    _STEP = 1 << 14  # words: 128 KiB of each tensor, and the step's changed word numbers, stay in a core's cache

    @njit(diff_signatures, **opts)
    def diff_words(
        a: Arr,
        b: Arr,
        words: tuple[Arr, Arr],
        span: tuple[int, int, int],
        found: tuple[Arr, Arr, Arr, int],
        update: bool,
    ) -> tuple[Arr, Arr, Arr, int]:  # pragma: no cover - compiled
        # the elements of words [w0, w1) of ``words`` (8-byte views of ``a``/``b`` from element ``first``; span is
        # (w0, w1, first)) that differ bit for bit, appended to ``found`` = (idx, new, old, n) at n: their flat
        # index, b's bits, a's bits. One compare per 8 bytes, and a changed word's elements appended with no branch
        # (a mispredicted branch per changed element cost more than the compare). The buffers grow (doubled) when
        # they might overflow; ``update`` also writes the new elements into ``a``. Returns the buffers and count.
        a64, b64 = words
        w0, w1, first = span
        idx, new, old, n = found
        per = 8 // a.itemsize
        cap = idx.size
        if cap - n < per * (w1 - w0):
            cap = max(2 * cap, n + per * (w1 - w0))
            grown = np.empty(cap, np.int64)
            grown[:n] = idx[:n]
            idx = grown
            grown_new = np.empty(cap, new.dtype)
            grown_new[:n] = new[:n]
            new = grown_new
            grown_old = np.empty(cap, old.dtype)
            grown_old[:n] = old[:n]
            old = grown_old
        start = n
        # two passes per step of _STEP words, both in cache: the changed words' numbers listed with no branch
        # (a mispredicted branch per changed word cost more than the compare: ~8% of words differ at 2% changed),
        # then their elements appended, also with no branch; ~1.6x the speed of one pass branching per word
        changed = np.empty(min(_STEP, max(w1 - w0, 1)), np.int64)
        for s in range(w0, w1, _STEP):
            e = min(s + _STEP, w1)
            m = 0
            for j in range(s, e):
                changed[m] = j
                m += a64[j] != b64[j]
            if per == 4:  # the lanes spelled out: a loop over ``per`` is not unrolled, and costs ~1.5x
                for q in range(m):
                    at = first + 4 * changed[q]
                    for k in range(4):
                        x = a[at + k]
                        y = b[at + k]
                        idx[n] = at + k
                        new[n] = y
                        old[n] = x
                        n += x != y
            else:
                for q in range(m):
                    at = first + 2 * changed[q]
                    for k in range(2):
                        x = a[at + k]
                        y = b[at + k]
                        idx[n] = at + k
                        new[n] = y
                        old[n] = x
                        n += x != y
        if update:
            for i in range(start, n):
                a[idx[i]] = new[i]
        return idx, new, old, n

    plane_rows = t.Array(t.uint8, 2, "C")

    @njit([t.uint64(t.Array(t.int64, 1, "C"), t.uint64, plane_rows)], **opts)
    def gap_planes(indices: Arr, mask: np.uint64, out: Arr) -> np.uint64:  # pragma: no cover - compiled
        # the gaps of ``indices`` (i[0], then i[k] - i[k-1] - 1, wrapped to the work type: ``mask`` is its all-ones)
        # as byte planes, the k-th byte of each gap into out[k] for the out.shape[0] low planes, in one pass with
        # no gap array; returns the largest gap (whose planes the caller checks it wrote)
        n = indices.size
        count = out.shape[0]
        top = np.uint64(0)
        prev = np.uint64(0)
        one = np.uint64(1)
        for i in range(n):
            cur = np.uint64(indices[i])
            g = (cur if i == 0 else cur - prev - one) & mask
            prev = cur
            top = max(top, g)
            for k in range(count):
                out[k, i] = np.uint8((g >> np.uint64(8 * k)) & np.uint64(0xFF))
        return top

    @njit([t.uint64(narrow, narrow, t.uint64, plane_rows) for narrow in (i16, i32)], **opts)
    def ordinal_planes(new: Arr, base: Arr, mask: np.uint64, out: Arr) -> np.uint64:  # pragma: no cover - compiled
        # zigzag(to_ordinal(new) - to_ordinal(base)) of each element, wrapped to the coded type (``mask`` is its
        # all-ones), as byte planes into out[k] for the out.shape[0] low planes, in one pass with no temporaries;
        # returns the largest coded value (whose planes the caller checks it wrote)
        width_shift = new.itemsize * 8 - 1
        magnitude = np.int64((1 << width_shift) - 1)
        count = out.shape[0]
        top = np.uint64(0)
        for i in range(new.size):
            a = np.int64(new[i])
            b = np.int64(base[i])
            d = (a ^ ((a >> width_shift) & magnitude)) - (b ^ ((b >> width_shift) & magnitude))
            z = np.uint64((d << 1) ^ (d >> 63)) & mask
            top = max(top, z)
            for k in range(count):
                out[k, i] = np.uint8((z >> np.uint64(8 * k)) & np.uint64(0xFF))
        return top

    words_types = (t.Array(t.uint16, 1, "C"), t.Array(t.uint16, 1, "C", readonly=True))
    weights_type = t.Array(t.float32, 2, "C", readonly=True)

    # fastmath: the compiler may reorder the sums, which is exact here (below)
    @njit([t.void(w, weights_type, t.Array(t.int64, 2, "C")) for w in words_types], **{**opts, "fastmath": True})
    def sketch_chunks(words: Arr, weights: Arr, out: Arr) -> None:  # pragma: no cover - compiled
        # per chunk c of 2**16 words: out[c, k] = sum_i words[c * 2**16 + i] * weights[k, i] for the four lanes,
        # and out[c, 4] the chunk's plain sum. float64 is exact in any order: each product is an integer below
        # 2**35 and a chunk's sum below 2**51, so every partial sum is an integer below 2**53. One pass, five
        # independent sums the compiler vectorizes (the float64 matrix-vector product it replaces converted each
        # block to float64 first: ~3x the time). The weights are float32 (exact: below 2**19), 1 MiB: a float64
        # table (2 MiB) does not stay in a core's cache, and reading it ran at ~1.5x the time
        for c in range(out.shape[0]):
            base = c * 65536
            a0 = 0.0
            a1 = 0.0
            a2 = 0.0
            a3 = 0.0
            plain = 0.0
            for i in range(65536):
                w = np.float64(words[base + i])
                a0 += w * np.float64(weights[0, i])
                a1 += w * np.float64(weights[1, i])
                a2 += w * np.float64(weights[2, i])
                a3 += w * np.float64(weights[3, i])
                plain += w
            out[c, 0] = np.int64(a0)
            out[c, 1] = np.int64(a1)
            out[c, 2] = np.int64(a2)
            out[c, 3] = np.int64(a3)
            out[c, 4] = np.int64(plain)

    return SimpleNamespace(
        sketch_chunks=sketch_chunks,
        diff_words=diff_words,
        undo_ordinal=undo_ordinal,
        undo_planes=undo_planes,
        change_lanes=change_lanes,
        change_rows=change_rows,
        join_gaps=join_gaps,
        gap_planes=gap_planes,
        ordinal_planes=ordinal_planes,
    )
