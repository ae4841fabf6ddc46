"""The linear sketch: a tensor checksum that adds up over any partition of its elements.

``xxh3_128`` (:func:`~deltasync.format.tensor_checksum`) proves a whole tensor or a contiguous span, and only
that: a TP rank holding a column slice of ``o_proj`` cannot prove its part against it, and a delta cannot
update it from the changed elements. The sketch can do both. A tensor's elements are read as little-endian
16-bit words ``b_i`` (one per bf16/fp16 element, two per fp32 element); word ``i`` of the flat tensor has
four public weights ``w_k(i) = W[i mod 2**16, k] + V[i // 2**16, k]``, each in ``[1, 2**20)``, and

    sketch_k(T) = sum_i b_i * w_k(i)  mod 2**64,   k = 0..3   (written ``"wsum4:" + 4 x 16 hex digits``)

Why it serves:

* **Any partition.** The sketch is a sum over elements, so the sketches of disjoint parts (FSDP spans on the
  trainer, TP slices in any layout on the engine, the elements a rank holds) add up to the whole tensor's:
  ranks prove their parts, and whoever holds the parts' sums proves the whole.
* **From what changed.** A delta changes the sketch by ``sum over changed i of (new_i - old_i) * w_k(i)``:
  an engine keeps it current at O(changed elements).
* **What it catches.** A change of one 16-bit word (one bf16/fp16 element, or half of an fp32 one) is always
  caught (every weight is odd, so never 0, and ``|new - old| < 2**16``, so ``(new - old) * w`` is a non-zero
  number below ``2**36``). Several changed words cancel only if their weighted differences sum to 0 mod
  ``2**64`` in all four lanes: for an error that does not depend on the weights (a bit flip, a stray write, a
  kernel writing at a wrong offset) each lane acts as a roughly 19-bit test, so a miss is estimated at about
  ``2**-76`` (an estimate, not a proof). It is a checksum against
  accidents, not against a forger who knows the weights: authenticity comes from the sha256 of every shard
  file, the registered manifest digest and the publisher's signature, and only the engine's agent (which
  checked all of them) can hand the engine an update.
* **Speed.** Per 65,536-word chunk the four lanes are one exact float64 matrix-vector product (each product
  is below ``2**36`` and a chunk's sum below ``2**52``), so a whole tensor costs about 2-3 x a memcpy.

Pure: torch and numpy; where numba is installed, a change's sketch is one compiled pass (:mod:`deltasync._kernels`).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable

import numpy as np
import torch

from ._cpus import parallel_map
from ._kernels import kernels

__all__ = [
    "LANES",
    "ChangeProof",
    "SKETCH_PREFIX",
    "ZERO",
    "Sketch",
    "add_sketches",
    "format_sketch",
    "parse_sketch",
    "sketch_at",
    "sketch_change",
    "sketch_range",
    "sub_sketches",
    "tensor_sketch",
]

LANES = 4
"""Independent weighted sums per sketch."""
SKETCH_PREFIX = "wsum4:"
"""How a sketch is written: this prefix and ``LANES`` x 16 lowercase hex digits."""

Sketch = tuple[int, int, int, int]
"""The four lanes, each in ``[0, 2**64)``."""
ZERO: Sketch = (0, 0, 0, 0)

_CHUNK_BITS = 16
_CHUNK = 1 << _CHUNK_BITS
_MASK64 = (1 << 64) - 1
_BLOCK_CHUNKS = 16  # chunks per matrix-vector product (1 Mi words: cache-sized float64 buffer)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _weights(stream: int, rows: np.ndarray) -> np.ndarray:
    """``rows x LANES`` pseudo-random 19-bit integers of one stream, the same on every machine."""
    keys = (rows.astype(np.uint64)[:, None] * np.uint64(LANES) + np.arange(LANES, dtype=np.uint64)[None, :]) + (
        np.uint64(stream) << np.uint64(56)
    )
    return (_splitmix64(keys) >> np.uint64(45)).astype(np.int64)


_W_INT = torch.from_numpy(_weights(1, np.arange(_CHUNK)) | 1)  # odd, in [1, 2**19): never a zero weight
_W_F64 = torch.cat([_W_INT, torch.ones(_CHUNK, 1, dtype=torch.int64)], 1).to(torch.float64)  # + the plain sum
_W_T = _W_F64.t().contiguous()  # (LANES + 1, chunk): F.linear's layout, ~3x faster than ``block @ _W_F64`` here


_W_NP = _W_INT.numpy()
_W_NP_T_F64 = np.ascontiguousarray(_W_NP.T.astype(np.float64))  # (LANES, chunk): a matrix-vector product in BLAS
_W_NP_T_F32 = _W_NP_T_F64.astype(np.float32)  # exact (below 2**19): the compiled pass's table, 1 MiB
_W_NP_T_F32.flags.writeable = False  # shared by every thread (the compiled pass takes it read-only)
_THREAD_CHUNKS = 64
"""Chunks (2**22 words, 8 MiB) per task of a whole tensor's compiled sketch."""
_ROWS_F64 = float(1 << 16)
"""Row sums below this in magnitude make the weighted row product exact in float64, in any order: 2**16 rows of
|sum| < 2**16 times weights < 2**19 add up to less than 2**51."""
_V_TABLE = np.zeros((0, LANES), dtype=np.int64)
_V_LOCK = threading.Lock()
_DIRECT_MAX = 4096  # words: below this a sketch gathers each word's weights (a histogram costs 2**16 rows)
_V_TABLE_MAX = 1 << 16  # chunks (2**32 words, 8 MiB of offsets); a larger tensor's far chunks are computed


def _v_span(first: int, stop: int) -> np.ndarray:
    """The per-chunk offsets ``V[first:stop]`` (``stop - first`` x ``LANES`` int64, even, in ``[0, 2**19)``: W + V
    stays odd), from a table grown on demand: a sketch of the changed elements of a small tensor would otherwise
    spend more on its offsets than on its elements."""
    global _V_TABLE
    if stop > _V_TABLE_MAX:
        return _weights(2, np.arange(first, stop)) & ~np.int64(1)
    table = _V_TABLE
    if stop > len(table):
        # sliced from this call's own table: another thread may meanwhile publish a shorter one it grew
        table = _weights(2, np.arange(min(max(stop, 2 * len(table)), _V_TABLE_MAX))) & ~np.int64(1)
        with _V_LOCK:
            if len(table) > len(_V_TABLE):
                _V_TABLE = table
    return table[first:stop]


def _words(values: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as flat little-endian uint16 words (a contiguous CPU copy only if needed)."""
    flat = values.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if flat.element_size() % 2:
        raise ValueError(f"the sketch takes 16-bit, 32-bit or 64-bit elements, got {flat.dtype}")
    if flat.numel() <= 1 and flat.stride(-1) != 1:  # torch calls such a tensor contiguous, and .view refuses it
        flat = torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
    return flat.contiguous().view(torch.uint16)


def _lanes(acc: Iterable[int]) -> Sketch:
    a, b, c, d = (int(x) & _MASK64 for x in acc)
    return a, b, c, d


def _whole_chunks(words: np.ndarray, chunk: int) -> list[int]:
    """Exact lane sums of whole chunks of words (uint16, a multiple of ``2**16``), the first one chunk ``chunk``:
    the compiled pass (:mod:`deltasync._kernels` ``sketch_chunks``) on blocks of chunks spread over deltasync's
    threads (:func:`~deltasync._cpus.parallel_map`)."""
    compiled = kernels()
    assert compiled is not None
    count = words.size >> _CHUNK_BITS
    per_chunk = np.empty((count, LANES + 1), dtype=np.int64)
    blocks = range(0, count, _THREAD_CHUNKS)

    def run(first: int) -> None:
        stop = min(first + _THREAD_CHUNKS, count)
        compiled.sketch_chunks(words[first << _CHUNK_BITS : stop << _CHUNK_BITS], _W_NP_T_F32, per_chunk[first:stop])

    parallel_map(run, blocks, elements=words.size)
    with np.errstate(over="ignore"):  # int64: wraps mod 2**64, as the lanes do
        lanes = per_chunk[:, :LANES].sum(0) + (per_chunk[:, LANES:] * _v_span(chunk, chunk + count)).sum(0)
    return [int(x) for x in lanes]


def _sum_words(words: torch.Tensor, start: int) -> list[int]:
    """Exact lane sums of ``words`` (uint16, 1-D) placed at word indices ``start, start + 1, ...``."""
    total = [0] * LANES
    n, pos = words.numel(), 0
    while pos < n:
        word = start + pos
        chunk, offset = word >> _CHUNK_BITS, word & (_CHUNK - 1)
        if offset == 0 and n - pos >= _CHUNK and kernels() is not None:  # every whole chunk in one compiled pass
            take = ((n - pos) >> _CHUNK_BITS) << _CHUNK_BITS
            total = [a + b for a, b in zip(total, _whole_chunks(words[pos : pos + take].numpy(), chunk), strict=True)]
            pos += take
            continue
        if offset == 0 and n - pos >= _CHUNK:  # whole chunks: one matrix-vector product per block
            count = min((n - pos) >> _CHUNK_BITS, _BLOCK_CHUNKS)
            block = words[pos : pos + count * _CHUNK].view(count, _CHUNK).to(torch.float64)
            per_chunk = torch.nn.functional.linear(block, _W_T).to(
                torch.int64
            )  # exact: each lane's sum < 2**52, the plain sum < 2**32
            offsets = torch.from_numpy(_v_span(chunk, chunk + count))
            lanes = per_chunk[:, :LANES].sum(0) + (per_chunk[:, LANES:] * offsets).sum(0)  # int64, wraps mod 2**64
            take = count * _CHUNK
        else:  # a partial chunk
            take = min(n - pos, _CHUNK - offset)
            part = words[pos : pos + take].to(torch.float64)
            sums = (part @ _W_F64[offset : offset + take]).to(torch.int64)
            lanes = sums[:LANES] + int(sums[LANES]) * torch.from_numpy(_v_span(chunk, chunk + 1)[0])
        for k in range(LANES):
            total[k] += int(lanes[k])
        pos += take
    return total


def sketch_range(values: torch.Tensor, start: int = 0) -> Sketch:
    """The sketch of consecutive elements of a tensor whose first element is flat element ``start``.

    Args:
        values: the elements (any shape; read flat, row-major), on any device.
        start: the flat index of ``values``' first element in the whole tensor.
    """
    words = _words(values)
    per = values.element_size() // 2
    return _lanes(_sum_words(words, start * per))


def _word_indices(indices: torch.Tensor, per: int) -> torch.Tensor:
    idx = indices.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
    return (idx[:, None] * per + torch.arange(per)).reshape(-1) if per > 1 else idx


def _weighted(words: np.ndarray, idx: torch.Tensor, *, increasing: bool = False) -> Sketch:
    """``sum_i words[i] * w(idx[i])`` per lane, mod 2**64, for float64 ``words`` holding integers (any sign,
    ``|words| < 2**17``) at word indices ``idx`` (no repeats). Two histograms instead of a gather of weights per
    element: the words summed per weight row (``idx mod 2**16``) and per chunk (``idx // 2**16``; for sorted
    ``idx``, one sum per run of a chunk, no prefix sum), then two small exact products. Every partial sum stays
    far below ``2**53``, so float64 is exact here, and the words need no integer copy. ``increasing``: ``idx`` is
    known to be strictly increasing (a decoded delta's indices are), which skips checking it."""
    if idx.numel() == 0:
        return ZERO
    at = idx.numpy()
    lowest = int(at[0]) if increasing else int(at.min())
    if lowest < 0:
        raise ValueError(f"a sketch's flat indices cannot be negative, got {lowest}")
    if at.size <= _DIRECT_MAX:  # few words: their weights gathered, not two histograms over a whole chunk's rows
        first = (int(at.min()) if increasing else lowest) >> _CHUNK_BITS
        chunks = np.right_shift(at, _CHUNK_BITS) - first
        weights = _W_NP[np.bitwise_and(at, _CHUNK - 1)] + _v_span(first, first + int(chunks.max()) + 1)[chunks]
        with np.errstate(over="ignore"):  # int64: wraps mod 2**64, as the lanes do
            lanes = (words.astype(np.int64)[:, None] * weights).sum(0)
        return _lanes(lanes.tolist())
    rows = np.bincount(np.bitwise_and(at, _CHUNK - 1), weights=words, minlength=_CHUNK)
    first, last = int(at[0]) >> _CHUNK_BITS, int(at[-1]) >> _CHUNK_BITS
    # sorted (a delta's indices are): no per-element chunk
    if increasing or at.size < 2 or bool((idx[1:] > idx[:-1]).all()):
        # where each chunk's run of indices starts; a chunk no index falls in is an empty run (and sums to 0)
        starts = np.empty(last - first + 2, dtype=np.int64)
        starts[0], starts[-1] = 0, at.size
        starts[1:-1] = np.searchsorted(at, np.arange(first + 1, last + 1, dtype=np.int64) << _CHUNK_BITS)
        full = starts[:-1] < starts[1:]
        sums = np.zeros(last - first + 1, dtype=np.float64)
        sums[full] = np.add.reduceat(words, starts[:-1][full])  # each run up to the next non-empty one's start
        per_chunk = sums.astype(np.int64)
    else:
        chunks = np.right_shift(at, _CHUNK_BITS)
        first = int(chunks.min())
        per_chunk = np.bincount(chunks - first, weights=words).astype(np.int64)
    return _sum_rows(rows, per_chunk, first)


def _sum_rows(rows: np.ndarray, per_chunk: np.ndarray, first: int) -> Sketch:
    """The lanes from the word sums per weight row (``2**16``, float64 or int64) and per chunk (int64, the first
    one chunk ``first``): two small exact products."""
    with np.errstate(over="ignore"):  # int64: wraps mod 2**64, as the lanes do
        if -_ROWS_F64 < rows.min() and rows.max() < _ROWS_F64:  # float64 is exact: one BLAS product, ~5x
            by_rows = (_W_NP_T_F64 @ rows.astype(np.float64, copy=False)).astype(np.int64)
        else:
            by_rows = rows.astype(np.int64) @ _W_NP
        lanes = by_rows + per_chunk @ _v_span(first, first + per_chunk.size)
    return _lanes(lanes.tolist())


def _change_compiled(
    new: np.ndarray,
    old: np.ndarray,
    at: np.ndarray,
    increasing: bool,
    rows: np.ndarray | None = None,
    factor: int = 1,
) -> Sketch | None:
    """:func:`sketch_change` of 16-bit words in one compiled pass (:mod:`deltasync._kernels`), with no temporary
    per element: below 2**16 words each difference times its word's four weights, added up as it is read (int64,
    wrapping mod 2**64 as the lanes do); above, the differences summed per weight row and per chunk, then two
    small products as :func:`_weighted` makes. With ``rows`` (a caller's int64 histogram of 2**16 rows,
    :class:`ChangeProof`), the differences times ``factor`` (an int64) are added to it, whatever their number, and
    only the chunks' part of the lanes is returned. ``None`` without numba."""
    compiled = kernels()
    if compiled is None:
        return None
    for trusted in (increasing, False):  # a caller wrong about ``increasing`` gets the chunks of min and max
        first, last = (int(at[0]), int(at[-1])) if trusted else (int(at.min()), int(at.max()))
        if first < 0:
            if trusted:
                continue
            raise ValueError(f"a sketch's flat indices cannot be negative, got {first}")
        first, last = first >> _CHUNK_BITS, last >> _CHUNK_BITS
        if last < first:
            continue  # ``increasing`` was wrong: the untrusted pass
        if rows is None and at.size < _CHUNK:  # each word's weights read where they are: no 2**16-row histogram
            lanes = np.zeros(LANES, dtype=np.int64)
            if compiled.change_lanes(at, new, old, _W_NP, _v_span(first, last + 1), first, lanes) < 0:
                return _lanes(lanes.tolist())
            continue
        # per row and per chunk, then two small products (a histogram in cache beats the weights' table)
        hist = np.zeros(_CHUNK, dtype=np.int64) if rows is None else rows
        per_chunk = np.zeros(last - first + 1, dtype=np.int64)
        stop = compiled.change_rows(at, new, old, hist, per_chunk, first, factor)
        if stop < 0:
            if rows is None:
                return _sum_rows(hist, per_chunk, first)
            with np.errstate(over="ignore"):  # int64: wraps mod 2**64, as the lanes do
                return _lanes((per_chunk @ _v_span(first, first + per_chunk.size)).tolist())
        if rows is not None:  # take back what the stopped pass added to the caller's histogram (all in its chunks)
            compiled.change_rows(at[:stop], new[:stop], old[:stop], rows, per_chunk, first, -factor)
    raise AssertionError("sketch_change: a word's chunk fell outside the chunks of its indices' min and max")


def sketch_at(values: torch.Tensor, indices: torch.Tensor) -> Sketch:
    """The sketch of the elements at flat ``indices`` (any order, no repeats) with ``values``.

    Vectorized (two weighted histograms, :func:`_weighted`); for a contiguous run :func:`sketch_range` is faster.
    """
    words = _words(values)
    per = values.element_size() // 2
    if words.numel() != indices.numel() * per:
        raise ValueError(f"sketch_at: {indices.numel()} indices for {words.numel() // per} values")
    return _weighted(words.numpy().astype(np.float64), _word_indices(indices, per))


def _change_inputs(new: torch.Tensor, old: torch.Tensor, indices: torch.Tensor, what: str) -> int:
    """Words per element of a change (1: 16-bit elements), its three tensors checked against each other."""
    if new.dtype != old.dtype or new.numel() != old.numel() or new.numel() != indices.numel():
        raise ValueError(
            f"{what}: {new.numel()} new {new.dtype} values, {old.numel()} old {old.dtype}, {indices.numel()} indices"
        )
    return new.element_size() // 2


def _flat_indices(indices: torch.Tensor) -> np.ndarray:
    return indices.detach().reshape(-1).to(device="cpu", dtype=torch.int64).contiguous().numpy()


def sketch_change(new: torch.Tensor, old: torch.Tensor, indices: torch.Tensor, *, increasing: bool = False) -> Sketch:
    """How a tensor's sketch moves when the elements at flat ``indices`` (no repeats) go from ``old`` to ``new``:
    ``sketch_at(new, indices) - sketch_at(old, indices)`` in one pass over the changed elements (an engine
    proves an update from what it changes, against the version it serves: :func:`add_sketches` of the served
    sketch and this one must be the published sketch). ``increasing``: ``indices`` are known to be strictly
    increasing (a decoded delta's are checked so), which saves a pass over them."""
    per = _change_inputs(new, old, indices, "sketch_change")
    if per == 1 and indices.numel():
        done = _change_compiled(_words(new).numpy(), _words(old).numpy(), _flat_indices(indices), increasing)
        if done is not None:
            return done
    # the differences straight into float64 (exact: |new - old| < 2**16), the histograms' own type: one pass
    diff = np.subtract(_words(new).numpy(), _words(old).numpy(), dtype=np.float64)
    return _weighted(diff, _word_indices(indices, per), increasing=increasing)


class ChangeProof:
    """Whether many tensors' changes each move the tensor's served sketch to its published one, proven at once:
    ``served_t + sketch_change_t == published_t`` for every tensor ``t``.

    Each tensor's terms are multiplied by a random odd 64-bit factor of its own (drawn from the OS for each proof,
    after the changes exist) and added up mod 2**64. Where numba is installed, the word differences of all
    tensors go into one histogram of 2**16 weight rows (512 KiB, in cache), multiplied by the weights once, in
    :meth:`holds`; a proof per tensor reads the weights (2 MiB) once per tensor, or a row of them per changed
    word. The sum is 0 when every tensor's sketch matches. When some do not, it is 0 only if the factors cancel
    their errors: for errors that do not depend on the factors, all multiples of ``2**v`` in every lane, about
    ``2**-(63 - v)``. A wrong value moves each lane by its word difference (below ``2**16``) times an odd weight,
    so errors in what would be written have a small ``v`` in all four lanes at once, and a swap of two tensors'
    changes, which a plain sum of their sketches would not see, is caught as any other error is. Errors of
    ``2**63`` in the same lane of an even number of tensors cancel for any odd factors: only wrong sketch strings
    (their top bit lost) make such errors, and then the values written are the published ones, and the
    whole-state proof, tensor by tensor against the published sketches, reports the version as drift.
    :meth:`holds` says only whether all hold: the caller proves each tensor alone (:func:`sketch_change`) to name
    those that do not.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._factors: dict[str, int] = {}
        self._expected: set[str] = set()
        self._sum = [0] * LANES
        self._rows: dict[int, np.ndarray] = {}
        """One histogram per thread that adds (threads add different tensors at once, each to its own)."""

    def _factor(self, name: str) -> int:
        with self._lock:
            factor = self._factors.get(name)
            if factor is None:
                factor = self._factors[name] = secrets.randbits(64) | 1
            return factor

    def _add(self, factor: int, lanes: Sketch) -> None:
        with self._lock:
            self._sum = [(a + factor * b) & _MASK64 for a, b in zip(self._sum, lanes, strict=True)]

    def _thread_rows(self) -> np.ndarray:
        rows = self._rows.get(threading.get_ident())
        if rows is None:
            rows = np.zeros(_CHUNK, dtype=np.int64)
            with self._lock:
                self._rows[threading.get_ident()] = rows
        return rows

    def expect(self, name: str, served: Sketch, published: Sketch) -> None:
        """Tensor ``name`` serves ``served`` and its changes must give ``published``.

        Raises:
            ValueError: ``name`` was expected already.
        """
        with self._lock:
            if name in self._expected:
                raise ValueError(f"ChangeProof: tensor {name!r} is already expected")
            self._expected.add(name)
        self._add(self._factor(name), sub_sketches(served, published))

    def add(
        self, name: str, new: torch.Tensor, old: torch.Tensor, indices: torch.Tensor, *, increasing: bool = False
    ) -> None:
        """Tensor ``name``'s elements at flat ``indices`` go from ``old`` to ``new`` (as :func:`sketch_change`; a
        tensor's changes may come in disjoint parts). Threads may add at once (different tensors, or disjoint
        parts of one)."""
        per = _change_inputs(new, old, indices, f"ChangeProof.add({name!r})")
        factor = self._factor(name)
        if per == 1 and indices.numel():
            signed = factor - (1 << 64) if factor >> 63 else factor  # the kernel's int64
            at = _flat_indices(indices)
            rows = self._thread_rows()
            part = _change_compiled(_words(new).numpy(), _words(old).numpy(), at, increasing, rows, signed)
            if part is not None:
                self._add(factor, part)
                return
        self._add(factor, sketch_change(new, old, indices, increasing=increasing))

    def holds(self) -> bool:
        """Whether every tensor added gives its expected sketch (a tensor with changes and no :meth:`expect` does
        not, unless its changes sum to nothing)."""
        with self._lock:
            lanes, histograms = self._sum, list(self._rows.values())
        if histograms:
            with np.errstate(over="ignore"):  # int64: wraps mod 2**64, as the lanes do
                rows = histograms[0] if len(histograms) == 1 else np.sum(histograms, axis=0, dtype=np.int64)
                by_rows = (rows @ _W_NP).tolist()
            lanes = [a + b for a, b in zip(lanes, by_rows, strict=True)]
        return all(x & _MASK64 == 0 for x in lanes)


def add_sketches(*sketches: Sketch) -> Sketch:
    """The sketch of the union of disjoint parts."""
    return _lanes(sum(s[k] for s in sketches) for k in range(LANES))


def sub_sketches(a: Sketch, b: Sketch) -> Sketch:
    """``a - b``: e.g. a tensor's sketch less one part's."""
    return _lanes(a[k] - b[k] for k in range(LANES))


def format_sketch(s: Sketch) -> str:
    """``"wsum4:" + 64 hex digits``."""
    return SKETCH_PREFIX + "".join(f"{x & _MASK64:016x}" for x in s)


def parse_sketch(text: str) -> Sketch:
    """The lanes of a :func:`format_sketch` string.

    Raises:
        ValueError: not ``"wsum4:"`` and 64 lowercase hex digits.
    """
    body = text[len(SKETCH_PREFIX) :] if isinstance(text, str) and text.startswith(SKETCH_PREFIX) else ""
    if len(body) != 16 * LANES or any(c not in "0123456789abcdef" for c in body):
        raise ValueError(f"a sketch must be {SKETCH_PREFIX!r} and {16 * LANES} lowercase hex digits, got {text!r}")
    return _lanes(int(body[16 * k : 16 * (k + 1)], 16) for k in range(LANES))


def tensor_sketch(tensor: torch.Tensor, span: tuple[int, int] | None = None) -> str:
    """The sketch of a whole tensor (or of its flat elements ``[start, stop)``, placed where they are), as text."""
    flat = tensor.detach().reshape(-1)
    start = 0
    if span is not None:
        start, flat = span[0], flat[span[0] : span[1]]
    return format_sketch(sketch_range(flat, start))
