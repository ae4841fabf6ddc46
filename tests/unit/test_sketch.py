"""The linear sketch: it adds up over any partition, follows a delta from the changed elements, catches any
one-element change, and its weights never change (a golden value and an independent reference)."""

from __future__ import annotations

import pytest
import torch

from deltasync.sketch import (
    _THREAD_CHUNKS,
    ZERO,
    ChangeProof,
    Sketch,
    add_sketches,
    format_sketch,
    parse_sketch,
    sketch_at,
    sketch_change,
    sketch_range,
    sub_sketches,
    tensor_sketch,
)

pytestmark = pytest.mark.usefixtures("kernel_modes")  # the compiled loops and the numpy code alike

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_M64 = (1 << 64) - 1


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(dtype)


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _reference(values: torch.Tensor, start: int = 0) -> Sketch:
    """The definition in docs/FORMAT.md, one word at a time in plain Python."""
    per = values.element_size() // 2
    words = values.reshape(-1).contiguous().view(torch.uint16).tolist()
    lanes = [0, 0, 0, 0]
    for j, b in enumerate(words):
        i = start * per + j
        for k in range(4):
            w = (_splitmix64((i % 2**16) * 4 + k + (1 << 56)) >> 45) | 1  # W: odd, below 2**19
            v = (_splitmix64((i // 2**16) * 4 + k + (2 << 56)) >> 45) & ~1  # V: even, below 2**19
            lanes[k] = (lanes[k] + b * (w + v)) & _M64
    return lanes[0], lanes[1], lanes[2], lanes[3]


def test_golden_values_pin_the_weights() -> None:
    """These strings are in published manifests: a change of the weights or the word order breaks every one."""
    bf16 = torch.tensor([0.5, -0.25, 1.0, 2.0, -0.0, 0.125, 3.0, -1.5], dtype=torch.bfloat16)
    f32 = torch.tensor([1.0, 0.5, 1.5, -1.0], dtype=torch.float32)
    assert tensor_sketch(bf16) == "wsum4:0000002a50aa61000000001b579d78000000001e85766e800000001d7a67b780"
    assert tensor_sketch(f32) == "wsum4:0000001426fe06400000000c119b86400000000f42fae5c00000000dc61d0840"
    far = 2**32 + 65535  # across a chunk boundary, far into a huge tensor
    assert format_sketch(sketch_range(bf16, far)) == (
        "wsum4:00000021cfc350800000001358ebd1000000000ec878e600000000217cbc0700"
    )
    assert tensor_sketch(bf16.to(torch.float16)) == (
        "wsum4:0000002891b8c8000000001a148e00000000001d41e534000000001c28aafc00"
    )
    for values, start in ((bf16, 0), (f32, 0), (bf16, far), (_random(300, torch.float32, 0), 65_400)):
        assert sketch_range(values, start) == _reference(values, start)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_partition_adds_up(dtype: torch.dtype) -> None:
    # f32: 1.06 M words, more than one block of whole chunks, and a ragged end
    t = _random(530_003 if dtype == torch.float32 else 200_003, dtype, 1)
    whole = sketch_range(t)
    g = torch.Generator().manual_seed(2)
    for cuts in (1, 7, 30):
        bounds = [0, *sorted(torch.randint(0, t.numel(), (cuts,), generator=g).tolist()), t.numel()]
        spans = list(zip(bounds, bounds[1:], strict=False))
        assert add_sketches(*[sketch_range(t[a:b], a) for a, b in spans]) == whole
        assert add_sketches(*[parse_sketch(tensor_sketch(t, span)) for span in spans]) == whole
    # a TP rank's column slice of a matrix is no span: any subset of positions adds up
    rows = t[: 300 * 400].view(300, 400)
    idx = torch.arange(rows.numel()).view(300, 400)
    slices = [sketch_at(rows[:, c : c + 100].contiguous(), idx[:, c : c + 100]) for c in range(0, 400, 100)]
    assert add_sketches(*slices) == sketch_range(rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sketch_at_equals_sketch_range_in_any_order(dtype: torch.dtype) -> None:
    t = _random(140_000, dtype, 3)
    g = torch.Generator().manual_seed(4)
    for a, b in ((0, 140_000), (65_530, 65_540), (123, 131_200), (139_999, 140_000), (7, 7)):
        perm = torch.randperm(b - a, generator=g)
        idx = torch.arange(a, b)[perm]
        assert sketch_at(t[idx], idx) == sketch_range(t[a:b], a)
    idx = torch.randperm(140_000, generator=g)[:500]
    assert sketch_at(t[idx], idx) == add_sketches(*(sketch_range(t[i : i + 1], i) for i in idx.tolist()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_one_element_change_always_changes_it(dtype: torch.dtype) -> None:
    t = _random(70_000, dtype, 5)
    ints = torch.int16 if dtype != torch.float32 else torch.int32
    bits = torch.iinfo(ints).bits
    whole = sketch_range(t)
    for i in (0, 65_535, 65_536, 69_999, 12_345):
        for bit in (0, 9, bits - 1):  # a bit flip in the low word, the middle, the sign
            changed = t.clone()
            changed.view(ints)[i] ^= 1 << bit if bit < bits - 1 else -(1 << bit)
            assert sketch_range(changed) != whole, (i, bit)
    # any new value at one place, anywhere in a huge tensor: its weighted difference is never 0 mod 2**64
    g = torch.Generator().manual_seed(6)
    at = torch.randint(0, 2**40, (300,), generator=g).tolist()
    old, new = _random(300, dtype, 7), _random(300, dtype, 8)
    for k, i in enumerate(at):
        if old[k : k + 1].view(ints) != new[k : k + 1].view(ints):
            assert sketch_range(new[k : k + 1], i) != sketch_range(old[k : k + 1], i), (i, old[k], new[k])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_update_from_the_changed_elements_equals_the_new_sketch(dtype: torch.dtype) -> None:
    old = _random(200_000, dtype, 9)
    new = old.clone()
    g = torch.Generator().manual_seed(10)
    idx = torch.randperm(old.numel(), generator=g)[:4000]  # 2% of the elements, in no particular order
    new[idx] = _random(4000, dtype, 11)
    step = sub_sketches(sketch_at(new[idx], idx), sketch_at(old[idx], idx))
    assert add_sketches(sketch_range(old), step) == sketch_range(new)
    assert tensor_sketch(new) == format_sketch(add_sketches(sketch_range(old), step))
    # and over a span (one rank's rows), from the rank's own elements only
    a, b = 50_000, 150_000
    inside = idx[(idx >= a) & (idx < b)]
    step = sub_sketches(sketch_at(new[inside], inside), sketch_at(old[inside], inside))
    assert add_sketches(sketch_range(old[a:b], a), step) == sketch_range(new[a:b], a)
    # in one pass over the changed elements, sorted (as a delta's indices are: chunk sums off a running sum,
    # chunks with no change in between) or not
    for at in (idx, idx.sort().values):
        assert add_sketches(sketch_range(old), sketch_change(new[at], old[at], at)) == sketch_range(new)
    at = idx.sort().values  # known increasing (a decoded delta's): the same sketch without the check
    assert add_sketches(sketch_range(old), sketch_change(new[at], old[at], at, increasing=True)) == sketch_range(new)
    sparse = torch.tensor([3, 70_000, 199_999])  # three chunks apart, one chunk skipped
    assert add_sketches(sketch_range(old), sketch_change(new[sparse], old[sparse], sparse)) == sketch_range(
        torch.where(torch.isin(torch.arange(old.numel()), sparse), new, old)
    )
    with pytest.raises(ValueError, match="sketch_change: 3 new"):
        sketch_change(new[sparse], old[:2], sparse)


def test_the_lanes_wrap_modulo_2_64() -> None:
    big: Sketch = (_M64, _M64 - 1, 1 << 63, 12345)
    other: Sketch = (1, 2, 1 << 63, _M64)
    total = add_sketches(big, other)
    assert total == (0, 0, 0, 12344)
    assert sub_sketches(total, other) == big and sub_sketches(ZERO, big) == (1, 2, 1 << 63, _M64 - 12344)
    assert add_sketches() == ZERO and sketch_range(torch.zeros(0, dtype=torch.bfloat16)) == ZERO
    assert sketch_at(torch.zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.int64)) == ZERO


def test_format_and_parse_round_trip() -> None:
    g = torch.Generator().manual_seed(12)
    for _ in range(50):
        a, b, c, d = (
            int.from_bytes(bytes(torch.randint(0, 256, (8,), generator=g).tolist()), "little") for _ in "abcd"
        )
        s: Sketch = (a, b, c, d)
        text = format_sketch(s)
        assert len(text) == 6 + 64 and parse_sketch(text) == s and format_sketch(parse_sketch(text)) == text
    assert format_sketch(ZERO) == "wsum4:" + "0" * 64
    assert format_sketch((_M64, 0, 1, 2)) == "wsum4:" + "f" * 16 + "0" * 16 + "0" * 15 + "1" + "0" * 15 + "2"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("wsum4:00", "a sketch must be 'wsum4:' and 64 lowercase hex digits, got 'wsum4:00'"),
        ("wsum4:" + "A" * 64, f"a sketch must be 'wsum4:' and 64 lowercase hex digits, got {'wsum4:' + 'A' * 64!r}"),
        (
            "xxh3_128:" + "0" * 61,
            f"a sketch must be 'wsum4:' and 64 lowercase hex digits, got {'xxh3_128:' + '0' * 61!r}",
        ),
        ("wsum4:" + "0" * 65, f"a sketch must be 'wsum4:' and 64 lowercase hex digits, got {'wsum4:' + '0' * 65!r}"),
        (
            "wsum4:" + "0" * 63 + "g",
            f"a sketch must be 'wsum4:' and 64 lowercase hex digits, got {'wsum4:' + '0' * 63 + 'g'!r}",
        ),
        (None, "a sketch must be 'wsum4:' and 64 lowercase hex digits, got None"),
        (42, "a sketch must be 'wsum4:' and 64 lowercase hex digits, got 42"),
    ],
    ids=["short", "upper", "prefix", "long", "not-hex", "none", "int"],
)
def test_parse_errors(text: object, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_sketch(text)  # type: ignore[arg-type]
    assert str(exc.value) == message


def test_argument_errors() -> None:
    with pytest.raises(ValueError) as exc:
        sketch_at(torch.zeros(2, dtype=torch.bfloat16), torch.arange(3))
    assert str(exc.value) == "sketch_at: 3 indices for 2 values"
    with pytest.raises(ValueError) as exc:
        sketch_range(torch.zeros(2, dtype=torch.int8))
    assert str(exc.value) == "the sketch takes 16-bit, 32-bit or 64-bit elements, got torch.int8"


@pytest.mark.parametrize("word", [1, 0x7FFF, 0xFFFF])
def test_row_sums_small_and_large_give_the_same_sketch_by_every_path(word: int) -> None:
    """The weighted row sums take a float64 product when every row's sum is below 2**16 in magnitude and an
    integer one otherwise; whole tensors of one word (rows summing to ``word`` x 40, past 2**16 for the large
    words) must give what the per-chunk ``sketch_range`` gives, sorted, shuffled and from a change."""
    n = 40 * 65536 + 123  # bf16: one word per element, 41 chunks, 40-41 elements per row
    t = torch.full((n,), word, dtype=torch.int16).view(torch.bfloat16) if word < 0x8000 else None
    if t is None:
        t = torch.full((n,), word - 0x10000, dtype=torch.int16).view(torch.bfloat16)
    idx = torch.arange(n)
    whole = sketch_range(t)
    assert sketch_at(t, idx) == whole
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(word))
    assert sketch_at(t[perm], perm) == whole
    zero = torch.zeros(n, dtype=torch.bfloat16)
    assert add_sketches(sketch_range(zero), sketch_change(t, zero, idx, increasing=True)) == whole


# --------------------------------------------------------------------------------------------------- ChangeProof
def _changed(numel: int, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A served tensor, the published one (``n`` elements changed) and the changed flat indices, sorted."""
    g = torch.Generator().manual_seed(seed)
    served = torch.randn(numel, generator=g).to(dtype)
    at = torch.randperm(numel, generator=g)[:n].sort().values
    published = served.clone()
    published[at] = (served[at].float() * 1.01 + 0.001).to(dtype)
    return served, published, at


def _proof(tensors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], pieces: int = 1) -> ChangeProof:
    proof = ChangeProof()
    for name, (served, published, at) in tensors.items():
        proof.expect(name, sketch_range(served), sketch_range(published))
        for part in at.tensor_split(pieces):  # a tensor's changes in disjoint parts, as the engine's blocks
            proof.add(name, published[part], served[part], part, increasing=True)
    return proof


@pytest.mark.parametrize("dtype", DTYPES)
def test_change_proof_holds_exactly_when_every_tensor_gives_its_published_sketch(dtype: torch.dtype) -> None:
    """Many tensors, from a few changes to more than 2**16 (the compiled histogram's sizes), far into a tensor
    and in parts: the proof holds; then one wrong value in any one tensor, in any part, fails it."""
    sizes = [(10, 3), (5000, 70), (300_000, 70_000), (3 << 17, 4000)]
    tensors = {f"t{k}": _changed(numel, n, dtype, seed=k) for k, (numel, n) in enumerate(sizes)}
    for pieces in (1, 3):
        assert _proof(tensors, pieces).holds()
    for name, (served, published, at) in tensors.items():
        for pos in (0, at.numel() // 2, at.numel() - 1):
            wrong = published.clone()
            wrong[at[pos]] = (wrong[at[pos]].float() * 2 + 1).to(dtype)
            bad = {**tensors, name: (served, wrong, at)}
            proof = ChangeProof()
            for n2, (s, p, a) in bad.items():
                proof.expect(n2, sketch_range(s), sketch_range(tensors[n2][1]))  # the true published sketches
                for part in a.tensor_split(3):
                    proof.add(n2, p[part], s[part], part, increasing=True)
            assert not proof.holds(), (name, pos)


def test_change_proof_catches_two_tensors_swapping_their_changes() -> None:
    """Two tensors whose staged changes are swapped (same indices: each gets the other's values) move the plain
    sum of their sketches exactly as the right changes do; each tensor's own random factor catches the swap."""
    served = _random(4096, torch.bfloat16, 1)
    at = torch.arange(0, 4096, 7)
    a, b = served.clone(), served.clone()
    a[at] = (served[at].float() + 0.5).to(torch.bfloat16)
    b[at] = (served[at].float() - 0.5).to(torch.bfloat16)
    plain = add_sketches(sketch_change(b[at], served[at], at), sketch_change(a[at], served[at], at))
    assert plain == add_sketches(sketch_change(a[at], served[at], at), sketch_change(b[at], served[at], at))
    for _ in range(3):
        proof = ChangeProof()
        proof.expect("a", sketch_range(served), sketch_range(a))
        proof.expect("b", sketch_range(served), sketch_range(b))
        proof.add("a", b[at], served[at], at, increasing=True)  # swapped
        proof.add("b", a[at], served[at], at, increasing=True)
        assert not proof.holds()


def test_change_proof_edges(kernel_modes: str) -> None:
    """Nothing to prove holds; a change with no expected sketch fails (unless it changes nothing); a tensor
    expected twice is a clear error; mismatched inputs are refused as sketch_change refuses them; a caller wrong
    about ``increasing`` still gets the true proof."""
    assert ChangeProof().holds()
    served, published, at = _changed(70_000, 66_000, torch.bfloat16, seed=3)
    proof = ChangeProof()
    proof.add("t", published[at], served[at], at)
    assert not proof.holds()
    proof = ChangeProof()
    proof.add("t", served[at], served[at], at, increasing=True)
    assert proof.holds()
    proof.expect("t", ZERO, ZERO)
    with pytest.raises(ValueError, match="already expected"):
        proof.expect("t", ZERO, ZERO)
    with pytest.raises(ValueError, match=r"ChangeProof.add\('t'\)"):
        proof.add("t", published[at][:-1], served[at], at)
    with pytest.raises(ValueError, match="cannot be negative"):
        proof.add("u", published[at][:2], served[at][:2], torch.tensor([-1, 5]))
    # unsorted indices whose first and last fall in chunk 0 and others in chunk 1: told sorted, the compiled
    # pass stops at the first word of chunk 1 and takes back what it added before the true pass (the numpy
    # reference trusts the flag: the strict xfail in test_kernels.py)
    perm = torch.randperm(at.numel(), generator=torch.Generator().manual_seed(0))
    low = (at[perm] < 1 << 16).nonzero().squeeze(1)
    order = torch.cat([perm[low[:1]], perm[(at[perm] >= 1 << 16)], perm[low[1:]]])
    assert at[order[0]] < 1 << 16 and at[order[-1]] < 1 << 16 and at[order[1]] >= 1 << 16
    for increasing in (True, False) if kernel_modes == "numba" else (False,):
        proof = ChangeProof()
        proof.expect("t", sketch_range(served), sketch_range(published))
        proof.add("t", published[at][order], served[at][order], at[order], increasing=increasing)
        assert proof.holds(), increasing


def test_change_proof_and_sketch_change_take_one_element_strided_fp32() -> None:
    """A 0- or 1-element slice with a stride (torch calls it contiguous, and ``.view`` to 16-bit words refuses
    it) is sketched as its values, never a RuntimeError."""
    base = torch.randn(10, 3, generator=torch.Generator().manual_seed(4))
    for k in (0, 1):
        new, old, at = base[:, 1][:k], base[:, 2][:k], torch.arange(k)
        assert sketch_change(new, old, at) == sketch_change(new.clone(), old.clone(), at)
        proof = ChangeProof()
        proof.expect("t", ZERO, sketch_change(new.clone(), old.clone(), at))
        proof.add("t", new, old, at)
        assert proof.holds()
    assert tensor_sketch(base[:, 1][:1]) == tensor_sketch(base[:, 1][:1].clone())


@pytest.mark.xfail(
    strict=True,
    reason="known limit (docs/RELIABILITY.md, the linear sketch's limits): errors of 2**63 in the same lane of an "
    "even number of tensors cancel for any odd factors; only wrong sketch strings make them, the values written are "
    "the published ones, and the whole-state proof reports the version as drift",
)
def test_change_proof_decides_as_each_tensor_alone_for_errors_of_two_to_the_63() -> None:
    """Two tensors whose published sketches are each off by 2**63 in every lane: each alone is refused; the sum
    of the two, multiplied by odd factors, is 2**64 = 0 in every lane."""
    served, published, at = _changed(1000, 3, torch.bfloat16, seed=9)
    wrong = tuple((x + (1 << 63)) & _M64 for x in sketch_range(published))
    assert add_sketches(sketch_range(served), sketch_change(published[at], served[at], at)) != wrong
    proof = ChangeProof()
    for name in ("a", "b"):
        proof.expect(name, sketch_range(served), wrong)  # type: ignore[arg-type]
        proof.add(name, published[at], served[at], at, increasing=True)
    assert not proof.holds()


def test_change_proof_takes_adds_from_many_threads_at_once() -> None:
    """Threads add different tensors (and disjoint parts of one) at the same time, each to its own histogram:
    the proof decides exactly as one thread's does, holding when all match and failing on one wrong value."""
    import threading

    sizes = [(300_000, 70_000), (3 << 17, 90_000), (5000, 70), (200_000, 100_000)]
    tensors = {f"t{k}": _changed(numel, n, torch.bfloat16, seed=10 + k) for k, (numel, n) in enumerate(sizes)}
    for wrong_in in (None, "t1", "t3"):
        proof = ChangeProof()
        jobs = []
        for name, (served, published, at) in tensors.items():
            proof.expect(name, sketch_range(served), sketch_range(published))
            new = published.clone()
            if name == wrong_in:
                new[at[-1]] = (new[at[-1]].float() * 2 + 1).to(torch.bfloat16)
            jobs += [(name, new, served, part) for part in at.tensor_split(2)]
        start = threading.Barrier(len(jobs))

        def add(
            name: str,
            new: torch.Tensor,
            served: torch.Tensor,
            part: torch.Tensor,
            proof: ChangeProof = proof,
            start: threading.Barrier = start,
        ) -> None:
            start.wait()  # every thread adds at once
            proof.add(name, new[part], served[part], part, increasing=True)

        threads = [threading.Thread(target=add, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert proof.holds() is (wrong_in is None), wrong_in


def test_whole_chunks_at_the_largest_words_are_exact() -> None:
    """The compiled whole-chunk pass sums in float64: with every word 0xFFFF (each product near 2**35, a chunk's
    sum near 2**51, the most float64 must hold exactly) and spread over threads, it gives the plain-Python
    definition's lanes, in the chunks far into a huge tensor too."""
    words = torch.full((3 * 2**16 + 5,), -1, dtype=torch.int16).view(torch.bfloat16)  # 0xFFFF: a NaN's bits
    big = torch.full((_THREAD_CHUNKS * 2**16 + 2**16,), -1, dtype=torch.int16).view(torch.bfloat16)
    for values, start in ((words, 0), (words, 2**32), (words, 2**16 - 5)):
        assert sketch_range(values, start) == _reference(values, start)
    with_threads = sketch_range(big)  # more than one task of the pass
    assert with_threads == add_sketches(sketch_range(big[: 2**16]), sketch_range(big[2**16 :], 2**16))
    assert with_threads == sketch_at(big, torch.arange(big.numel()))
