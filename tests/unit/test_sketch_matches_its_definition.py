"""The linear sketch against an exact reference written from its definition (docs/FORMAT.md: its own splitmix64,
uint64 arithmetic that wraps mod 2**64 exactly), word by word: ``sketch_range``, ``sketch_at`` and
``sketch_change`` over partitions in any order, chunk and 2**32-word boundaries, fp32 word pairs and extreme words;
the changed elements of tensors far larger than memory (past the chunk-offset table's cap); and the offsets
table grown by two threads at once."""

from __future__ import annotations

import inspect
import sys
import threading

import numpy as np
import pytest
import torch

import deltasync.sketch as S
from deltasync.sketch import add_sketches, sketch_at, sketch_change, sketch_range, sub_sketches

pytestmark = pytest.mark.usefixtures("kernel_modes")  # the compiled loops and the numpy code alike

_M = np.uint64


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _M(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _M(30))) * _M(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _M(27))) * _M(0x94D049BB133111EB)
        return z ^ (z >> _M(31))


def _ref(words: np.ndarray, at: np.ndarray) -> tuple[int, int, int, int]:
    """sum_i b_i * (W[i mod 2**16, k] + V[i // 2**16, k]) mod 2**64, in uint64 (wraps exactly)."""
    b, i = words.astype(np.uint64), at.astype(np.uint64)
    out = []
    for k in range(4):
        w = (_splitmix((i & _M(0xFFFF)) * _M(4) + _M(k) + (_M(1) << _M(56))) >> _M(45)) | _M(1)
        v = (_splitmix((i >> _M(16)) * _M(4) + _M(k) + (_M(2) << _M(56))) >> _M(45)) & ~_M(1)
        with np.errstate(over="ignore"):
            out.append(int((b * (w + v)).sum(dtype=np.uint64)))
    return out[0], out[1], out[2], out[3]


def _words(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).contiguous().view(torch.uint16).numpy()


def _word_at(idx: np.ndarray, per: int) -> np.ndarray:
    idx = idx.astype(np.uint64)
    return idx if per == 1 else (idx[:, None] * _M(per) + np.arange(per, dtype=np.uint64)).reshape(-1)


def _random_bits(rng: np.random.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    per = torch.empty((), dtype=dtype).element_size() // 2
    bits = rng.integers(0, 2**16, size=n * per, dtype=np.uint16)
    bits[: min(bits.size, 8)] = [0x0000, 0xFFFF, 0x7FFF, 0x8000, 0x7F80, 0xFFC1, 0x8000, 0x0001][: min(bits.size, 8)]
    return torch.from_numpy(bits).view(dtype) if n else torch.empty(0, dtype=dtype)


DT = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DT, ids=str)
def test_range_at_and_change_match_the_definition_at_every_size_and_boundary(dtype: torch.dtype) -> None:
    """Held: sizes around the direct-path limit (4096 words) and a chunk; starts at chunk and 2**32-word
    boundaries and far beyond the offsets table; indices sorted and shuffled, dense and spread over 2**33."""
    rng = np.random.default_rng(60)
    per = torch.empty((), dtype=dtype).element_size() // 2
    for n in (0, 1, 2, 2047, 2048, 2049, 4095, 4096, 4097, 65_537):
        t = _random_bits(rng, n, dtype)
        for start in (0, 1, 65_535, 65_536, 2**32 // per - 3, 2**32 // per, 2**40 + 7):
            want = _ref(_words(t), np.arange(start * per, (start + n) * per, dtype=np.uint64))
            assert sketch_range(t, start) == want, (n, start)
        for span in (n, 3 * n + 70_000, 2**33):
            if not n:
                idx = np.zeros(0, dtype=np.int64)
            elif span == n:
                idx = np.arange(n, dtype=np.int64)
            else:
                idx = np.unique(rng.integers(0, span, size=2 * n + 8))[:n]
                rng.shuffle(idx)  # unique() sorted them
                idx = idx[:n]
            if idx.size < n:
                continue
            old = _random_bits(rng, n, dtype)
            for order in ("as drawn", "sorted", "reversed"):
                i = idx if order == "as drawn" else np.sort(idx)[:: (1 if order == "sorted" else -1)]
                ti = torch.from_numpy(i.copy())
                wi = _word_at(i, per)
                assert sketch_at(t, ti) == _ref(_words(t), wi), (n, span, order)
                change = sub_sketches(_ref(_words(t), wi), _ref(_words(old), wi))
                assert sketch_change(t, old, ti) == change, (n, span, order)
                if order == "sorted":
                    assert sketch_change(t, old, ti, increasing=True) == change


def test_a_large_tensor_partitioned_at_random_adds_up_and_follows_a_large_change() -> None:
    """Held: 3 M bf16 elements (46 chunks), five random interleaved parts (two shuffled), and a change of
    400,000 elements from all-ones to all 0xFFFF words (the most negative differences)."""
    rng = np.random.default_rng(61)
    n = 3_000_000
    t = _random_bits(rng, n, torch.bfloat16)
    whole = sketch_range(t)
    assert whole == _ref(_words(t), np.arange(n, dtype=np.uint64))
    label = torch.from_numpy(rng.integers(0, 5, size=n))
    parts = []
    for k in range(5):
        idx = torch.nonzero(label == k).squeeze(1)
        if k % 2:
            idx = idx[torch.from_numpy(rng.permutation(idx.numel()))]
        parts.append(sketch_at(t[idx], idx))
    assert add_sketches(*parts) == whole
    idx = torch.from_numpy(np.sort(rng.choice(n, size=400_000, replace=False)))
    old = torch.full((idx.numel(),), 1, dtype=torch.int16).view(torch.bfloat16)
    new = torch.full((idx.numel(),), -1, dtype=torch.int16).view(torch.bfloat16)  # 0xFFFF - 0x0001
    before = t.clone()
    before[idx] = old
    after = t.clone()
    after[idx] = new
    assert add_sketches(sketch_range(before), sketch_change(new, old, idx, increasing=True)) == sketch_range(after)
    assert sub_sketches(sketch_range(after), sketch_range(before)) == sketch_change(new, old, idx)


def _line(func: object, text: str) -> int:
    lines, first = inspect.getsourcelines(func)  # type: ignore[arg-type]
    return first + next(k for k, line in enumerate(lines) if text in line)


def test_the_offsets_table_grown_by_two_threads_at_once_never_gives_a_wrong_sketch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Was broken (fixed): ``_v_span``'s comment said racing threads build the same table, but they build tables of
    different sizes. Thread B (needing 1 chunk) sizes its table at 1 row and is computing it, thread A (needing
    chunk 5) builds and assigns a 6-row table, B then assigns its 1-row table over it, and A returns
    ``_V_TABLE[5:6]`` of B's table: an empty slice. ``sketch_range`` of one whole chunk then broadcasts its plain sum against zero offset rows
    and silently drops the V part of every weight. The interleaving is forced with a line tracer; with real
    threads it is rare (only while the table grows) but possible, e.g. sketches computed on worker threads."""
    monkeypatch.setattr(S, "_V_TABLE", np.zeros((0, S.LANES), dtype=np.int64))
    in_weights = _line(S._weights, "keys = ")  # B: its table's size is decided, the table not yet assigned
    at_return = _line(S._v_span, "return table[first:stop]")
    b_building, a_at_return, b_done = threading.Event(), threading.Event(), threading.Event()

    def tracer(code: object, pause_line: int, reached: threading.Event, wait_for: threading.Event):  # type: ignore[no-untyped-def]
        def local(frame, event, arg):  # type: ignore[no-untyped-def]
            if event == "line" and frame.f_lineno == pause_line and not reached.is_set():
                reached.set()
                wait_for.wait(10)
            return local

        def glob(frame, event, arg):  # type: ignore[no-untyped-def]
            return local if frame.f_code is code else None

        return glob

    t = _random_bits(np.random.default_rng(62), 2 * S._CHUNK, torch.bfloat16)
    chunk5 = t[: S._CHUNK]
    result: dict[str, object] = {}

    def run_b() -> None:
        sys.settrace(tracer(S._weights.__code__, in_weights, b_building, a_at_return))
        try:
            result["b"] = sketch_range(t[S._CHUNK :][:10], 0)  # needs V[0:1]
        finally:
            sys.settrace(None)
            b_done.set()

    def run_a() -> None:
        b_building.wait(10)
        sys.settrace(tracer(S._v_span.__code__, at_return, a_at_return, b_done))
        try:
            result["a"] = sketch_range(chunk5, 5 * S._CHUNK)  # needs V[5:6]
        except Exception as exc:  # noqa: BLE001
            result["a"] = exc
        finally:
            sys.settrace(None)

    threads = [threading.Thread(target=run_b), threading.Thread(target=run_a)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert a_at_return.is_set() and b_done.is_set(), "the interleaving was not reached"
    want = _ref(_words(chunk5), np.arange(5 * S._CHUNK, 6 * S._CHUNK, dtype=np.uint64))
    assert result["a"] == want, f"thread A got {result['a']!r}, the definition says {want}"


_M64 = (1 << 64) - 1
_CHUNK = 1 << 16


# --- the sketch from the changed elements far into huge tensors, against a vectorized reference ------------------


def _sm(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _ref_per_word(words: np.ndarray, word_idx: np.ndarray) -> tuple[int, int, int, int]:
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


def _word_values(t: torch.Tensor) -> np.ndarray:
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
    want_change = _ref_per_word(_word_values(new) - _word_values(old), wi)
    for increasing in (False, True):
        assert sketch_change(new, old, at, increasing=increasing) == want_change, increasing
    perm = torch.randperm(n, generator=g)
    assert sketch_change(new[perm], old[perm], at[perm]) == want_change  # unsorted: the scatter path
    assert sketch_at(new, at) == _ref_per_word(_word_values(new), wi)
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
