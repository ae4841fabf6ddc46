"""How few bytes a delta could take: the information bounds of the update stream's positions and steps, and a
static rANS coder measured on it, beside ``packed`` (run by hand; asserts nothing but losslessness).

Per step (2..N; step 1 is Adam's warm-up), in bytes per changed element:

* ``packed``: the shard's bytes, and its two streams alone (gaps and zigzagged ordinal steps, byte planes + zstd 3);
* bounds of order-0 coding with one frequency table per tensor: positions (a Bernoulli draw per element of the
  tensor, what any gap coding approaches) and steps; and of coding each with the **base value's exponent** as
  context: steps (the decoder reads the base at the changed elements already) and positions (it would need the
  exponent of *every* base element: O(numel) reads per decode, and no tensor-parallel rank could decode the
  elements it does not hold);
* ``rans``: the real size of both streams coded by a static rANS coder (2 interleaved 64-bit states, 12-bit
  frequencies, one table per tensor and stream, literals below 128 for gaps and 16 for steps, a log2 bucket plus
  raw bits above), decoded back and checked bit for bit; its encode speed, and its decode speed against packed's
  decode path (zstd + the compiled joins and ordinal undo of ``deltasync._codec``), one thread each, same data.

    python benchmarks/bench_entropy.py [--steps 6] [--lr 1e-6]      # ~4 min, ~12 GB
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numba
import numpy as np
import torch

from deltasync import _codec, compute_delta
from deltasync.testing.models import QWEN3_0_6B_CONFIG, qwen3_shapes
from deltasync.testing.stream import UpdateStream

Arr = np.ndarray[Any, Any]
PROB_BITS = 12
RANS_LOW = 1 << 31
_SLOT_MASK = (1 << PROB_BITS) - 1
_MASK32 = (1 << 32) - 1
_JIT = {"cache": True, "nogil": True, "boundscheck": False, "error_model": "numpy"}


def encode_symbols(
    syms: Arr, freq: Arr, start: Arr, out: Arr
) -> int:  # pragma: no cover - compiled (and run as written in tests)
    """rANS-encode ``syms`` (uint8) with two interleaved states (symbol ``i`` on state ``i mod 2``) into the
    uint32 words of ``out``, written from its end backwards; returns the index of the first word written. The
    decoder reads the words forwards: the two final states (each as its low then its high word), then one word
    wherever a state falls below :data:`RANS_LOW`. ``out`` must hold ``4 + len(syms)`` words."""
    x0 = RANS_LOW
    x1 = RANS_LOW
    p = out.size
    for i in range(syms.size - 1, -1, -1):
        s = syms[i]
        f = freq[s]
        c = start[s]
        x_max = ((RANS_LOW >> PROB_BITS) << 32) * f
        if i & 1:
            if x1 >= x_max:
                p -= 1
                out[p] = x1 & _MASK32
                x1 >>= 32
            x1 = ((x1 // f) << PROB_BITS) + (x1 % f) + c
        else:
            if x0 >= x_max:
                p -= 1
                out[p] = x0 & _MASK32
                x0 >>= 32
            x0 = ((x0 // f) << PROB_BITS) + (x0 % f) + c
    out[p - 1] = x1 >> 32
    out[p - 2] = x1 & _MASK32
    out[p - 3] = x0 >> 32
    out[p - 4] = x0 & _MASK32
    return p - 4


def split_symbols(
    values: Arr, literals: int, syms: Arr, raw: Arr
) -> int:  # pragma: no cover - compiled (and run as written in tests)
    """The symbol of each value (``values``: int64, >= 0) into ``syms``: the value itself below ``literals``, else
    ``literals + k`` with ``v = value - literals + 1`` in ``[2**k, 2**(k+1))``, and the ``k`` low bits of ``v`` are
    appended to ``raw`` (bytes, least significant bit first; ``raw`` must hold them: 8 bytes per value is always
    enough). Returns the number of raw bits written."""
    bit = 0
    for i in range(values.size):
        v = values[i]
        if v < literals:
            syms[i] = v
            continue
        v = v - literals + 1
        k = 0
        while (v >> (k + 1)) != 0:
            k += 1
        syms[i] = literals + k
        for b in range(k):
            if (v >> b) & 1:
                raw[bit >> 3] |= 1 << (bit & 7)
            bit += 1
    return bit


def decode_symbols(
    words: Arr, table: Arr, raw: Arr, literals: int, cumulative: bool, out: Arr
) -> int:  # pragma: no cover - compiled (and run as written in tests)
    """Decode ``out.size`` values from the rANS ``words`` (uint32) and the ``raw`` bits (uint8), the inverse of
    :func:`encode_symbols` after :func:`split_symbols`. ``table[slot]`` (uint32, ``2**PROB_BITS`` entries) packs
    the slot's symbol (bits 0-7), ``slot - start`` (bits 8-19) and the symbol's frequency (bits 20-31). With
    ``cumulative``, ``out[i]`` is ``sum(value[0..i] + 1) - 1`` (gaps to positions) instead of the value.

    Returns -1, or where the data are corrupt: -2 words run out, -3 raw bits run out, -4 the states do not end
    where the encoder began or words are left over, -5 a position passes 2**62. Reads nothing outside its arrays:
    every table entry is valid by construction (the caller checked the frequencies), and each read is checked.
    Two symbols per turn, one per state: the states' chains of work interleave (~1.6x one at a time).
    """
    n = out.size
    nwords = words.size
    nbits = raw.size * 8
    if nwords < 4:
        return -2
    if words[1] >= 1 << 31 or words[3] >= 1 << 31:
        return -4
    x0 = np.int64(words[0]) | (np.int64(words[1]) << 32)
    x1 = np.int64(words[2]) | (np.int64(words[3]) << 32)
    if x0 < RANS_LOW or x1 < RANS_LOW:
        return -4
    p = 4
    bit = 0
    acc = np.int64(-1)
    i = 0
    while i < n:
        e0 = np.int64(table[x0 & _SLOT_MASK])
        x0 = (e0 >> 20) * (x0 >> PROB_BITS) + ((e0 >> 8) & _SLOT_MASK)
        if x0 < RANS_LOW:
            if p >= nwords:
                return -2
            x0 = (x0 << 32) | np.int64(words[p])
            p += 1
        v0 = e0 & 0xFF
        if v0 >= literals:
            k = v0 - literals
            if bit + k > nbits:
                return -3
            v0 = np.int64(1) << k
            for b in range(k):
                v0 |= np.int64((raw[bit >> 3] >> (bit & 7)) & 1) << b
                bit += 1
            v0 = v0 + literals - 1
        if cumulative:
            acc += v0 + 1
            if acc >= np.int64(1) << 62:
                return -5
            out[i] = acc
        else:
            out[i] = v0
        if i + 1 == n:
            break
        e1 = np.int64(table[x1 & _SLOT_MASK])
        x1 = (e1 >> 20) * (x1 >> PROB_BITS) + ((e1 >> 8) & _SLOT_MASK)
        if x1 < RANS_LOW:
            if p >= nwords:
                return -2
            x1 = (x1 << 32) | np.int64(words[p])
            p += 1
        v1 = e1 & 0xFF
        if v1 >= literals:
            k = v1 - literals
            if bit + k > nbits:
                return -3
            v1 = np.int64(1) << k
            for b in range(k):
                v1 |= np.int64((raw[bit >> 3] >> (bit & 7)) & 1) << b
                bit += 1
            v1 = v1 + literals - 1
        if cumulative:
            acc += v1 + 1
            if acc >= np.int64(1) << 62:
                return -5
            out[i + 1] = acc
        else:
            out[i + 1] = v1
        i += 2
    if x0 != RANS_LOW or x1 != RANS_LOW or p != nwords:
        return -4
    return -1


encode_symbols = numba.njit(**_JIT)(encode_symbols)
split_symbols = numba.njit(**_JIT)(split_symbols)
decode_symbols = numba.njit(**_JIT)(decode_symbols)


def _normalize(counts: Arr) -> Arr:
    """Frequencies summing to 4096, none 4096 (a lone symbol gets a partner), nonzero wherever ``counts`` is."""
    counts = counts.astype(np.int64)
    present = np.flatnonzero(counts)
    if present.size == 1:
        counts[1 if present[0] == 0 else 0] = 1
    freq = counts * (1 << PROB_BITS) // int(counts.sum())
    freq[(counts > 0) & (freq == 0)] = 1
    diff = (1 << PROB_BITS) - int(freq.sum())
    order = np.argsort(-freq, kind="stable")
    if freq[order[0]] + diff >= 1:
        freq[order[0]] += diff
    else:
        for s in np.resize(order, -diff):
            freq[s] -= 1
    return freq


def rans_encode(values: Arr, literals: int) -> tuple[Arr, Arr, Arr]:
    """(frequencies, raw bits, rANS words) of non-negative int64 ``values``; the stream's bytes are their sizes
    plus a varint per frequency (counted by :func:`stream_bytes`)."""
    syms = np.empty(values.size, dtype=np.uint8)
    raw = np.zeros(8 * values.size + 8, dtype=np.uint8)
    bits = split_symbols(values, literals, syms, raw)
    freq = _normalize(np.bincount(syms, minlength=literals + 41))
    start = (np.cumsum(freq) - freq).astype(np.int64)
    words = np.empty(values.size + 4, dtype=np.uint32)
    first = encode_symbols(syms, freq, start, words)
    return freq, raw[: (bits + 7) // 8], words[first:]


def stream_bytes(freq: Arr, raw: Arr, words: Arr) -> int:
    nsym = int(np.flatnonzero(freq)[-1]) + 1
    return 1 + int(np.sum(1 + (freq[:nsym] >= 128))) + 2 + raw.size + 4 * words.size


def rans_decode(freq: Arr, raw: Arr, words: Arr, n: int, literals: int, cumulative: bool, out_dtype: Any) -> Arr:
    sym = np.repeat(np.arange(freq.size, dtype=np.int64), freq)
    start = np.repeat(np.cumsum(freq) - freq, freq)
    table = (sym | ((np.arange(1 << PROB_BITS) - start) << 8) | (np.repeat(freq, freq) << 20)).astype(np.uint32)
    out = np.empty(n, dtype=out_dtype)
    code = decode_symbols(words, table, raw, literals, cumulative, out)
    assert code == -1, code
    return out


def _h(counts: Arr) -> float:
    c = counts[counts > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum())


def _h_given(ctx: Arr, sym: Arr) -> float:
    """Bits of ``sym`` coded with one order-0 table per value of ``ctx`` (both small non-negative ints)."""
    width = int(sym.max()) + 1 if sym.size else 1
    joint = np.bincount(ctx.astype(np.int64) * width + sym, minlength=256 * width).reshape(-1, width)
    return sum(_h(row) for row in joint if row.any())


def _bernoulli_bits(changed: Arr, total: Arr) -> float:
    ok = (changed > 0) & (changed < total)
    p = changed[ok] / total[ok]
    return float((total[ok] * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))).sum())


def _exponent(bits16: Arr) -> Arr:
    return (bits16.astype(np.int32) >> 7) & 0xFF


def _measure(changes: dict, base: dict[str, torch.Tensor]) -> dict[str, float]:
    """Bytes per changed element of each coding, and one-thread speeds, for one step's bf16 deltas."""
    nnz = sum(d.nnz for d in changes.values())
    acc = dict.fromkeys(
        ("packed_pos", "packed_val", "pos_h0", "pos_h_exp", "val_h0", "val_h_exp", "rans_pos", "rans_val"), 0.0
    )
    t_enc = t_rans = t_packed = 0.0
    for name, d in changes.items():
        new = d.values.view(torch.int16).numpy().reshape(-1)
        old = d.base_values.view(torch.int16).numpy().reshape(-1)
        z = _codec.zigzag_encode(_codec.to_ordinal(new).astype(np.int32) - _codec.to_ordinal(old), np.uint32)
        n = z.size
        planes = _codec.planes_needed(z)
        val_frame = _codec.zstd_compress(_codec.split_planes(z, planes), 3)
        acc["packed_val"] += len(val_frame)
        acc["val_h0"] += _h(np.bincount(np.minimum(z, 255)))
        acc["val_h_exp"] += _h_given(_exponent(old), np.minimum(z, 255).astype(np.int64))
        t0 = time.perf_counter()
        coded_val = rans_encode(z.astype(np.int64), 16)
        t_enc += time.perf_counter() - t0
        acc["rans_val"] += stream_bytes(*coded_val)
        pos = None
        if d.indices is not None:
            idx = d.indices.numpy()
            gaps = _codec.encode_gaps(idx, np.uint32)
            gap_planes = _codec.planes_needed(gaps)
            pos_frame = _codec.zstd_compress(_codec.split_planes(gaps, gap_planes), 3)
            acc["packed_pos"] += len(pos_frame)
            whole = base[name].view(torch.int16).numpy().reshape(-1)
            exps = _exponent(whole)
            total = np.bincount(exps, minlength=256)
            changed = np.bincount(exps[idx], minlength=256)
            acc["pos_h0"] += _bernoulli_bits(np.array([n]), np.array([whole.size]))
            acc["pos_h_exp"] += _bernoulli_bits(changed, total)
            t0 = time.perf_counter()
            pos = rans_encode(gaps.astype(np.int64), 128)
            t_enc += time.perf_counter() - t0
            acc["rans_pos"] += stream_bytes(*pos)
        t0 = time.perf_counter()
        if pos is not None:
            got_idx = rans_decode(*pos, n, 128, True, np.uint64)
        steps = rans_decode(*coded_val, n, 16, False, np.uint32)
        got = _codec.undo_ordinal_delta(old, steps)
        t_rans += time.perf_counter() - t0
        assert got is not None and np.array_equal(got, new), name
        assert pos is None or np.array_equal(got_idx.view(np.int64), idx), name
        t0 = time.perf_counter()
        if pos is not None:
            _codec.join_gaps(_codec.zstd_decompress(pos_frame, n * gap_planes), n, gap_planes)
        _codec.undo_ordinal_planes(old, _codec.zstd_decompress(val_frame, n * planes), n, planes, np.uint32)
        t_packed += time.perf_counter() - t0
    out = {k: (v if k.startswith(("packed", "rans")) else v / 8) / nnz for k, v in acc.items()}
    out.update(
        nnz=nnz,
        packed_streams=out["packed_pos"] + out["packed_val"],
        bound_order0=out["pos_h0"] + out["val_h0"],
        bound_step_ctx=out["pos_h0"] + out["val_h_exp"],
        bound_both_ctx=out["pos_h_exp"] + out["val_h_exp"],
        rans=out["rans_pos"] + out["rans_val"],
        rans_encode_Melem_per_s=nnz / t_enc / 1e6,
        rans_decode_Melem_per_s=nnz / t_rans / 1e6,
        packed_decode_Melem_per_s=nnz / t_packed / 1e6,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="the figures are medians over 2..N")
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()
    stream = UpdateStream.from_shapes(qwen3_shapes(QWEN3_0_6B_CONFIG), lr=args.lr, seed=0)
    snapshot = stream.bf16()
    base = {k: v.clone() for k, v in snapshot.items()}
    for literals, cumulative, dtype in ((16, False, np.uint32), (128, True, np.uint64)):  # compiled before timing
        rans_decode(*rans_encode(np.arange(9, dtype=np.int64), literals), 9, literals, cumulative, dtype)
    cols = ("step", "changed", "packed", "pos", "val", "H0", "H|step", "H|both", "rans", "pos", "val", "enc", "dec")
    print(f"lr {args.lr}; B per changed element; speeds in M changed elements/s, one thread\n")
    print(("{:>4} {:>8} " + "{:>7} " * 9 + "{:>6} {:>12}").format(*cols[:-1], "dec (packed)"))
    rows = []
    for step in range(1, args.steps + 1):
        changes = compute_delta(snapshot, stream.step(), update_prev=True)
        if step >= 2:
            r = _measure(changes, base)
            r["changed_fraction"] = r["nnz"] / sum(t.numel() for t in base.values())
            rows.append(r)
            print(
                f"{step:4d} {r['changed_fraction']:8.3%} {r['packed_streams']:7.3f} {r['packed_pos']:7.3f} "
                f"{r['packed_val']:7.3f} {r['bound_order0']:7.3f} {r['bound_step_ctx']:7.3f} "
                f"{r['bound_both_ctx']:7.3f} {r['rans']:7.3f} {r['rans_pos']:7.3f} {r['rans_val']:7.3f} "
                f"{r['rans_encode_Melem_per_s']:6.0f} {r['rans_decode_Melem_per_s']:5.0f} "
                f"({r['packed_decode_Melem_per_s']:4.0f})",
                flush=True,
            )
        for k, v in snapshot.items():
            base[k].copy_(v)
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(json.dumps({"lr": args.lr, "steps": list(range(2, args.steps + 1)), **summary}))


if __name__ == "__main__":
    main()
