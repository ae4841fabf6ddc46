"""Codec benchmark on the update stream of ``deltasync.testing`` at Qwen3-0.6B size (run by hand; asserts nothing).

Per step (2..N; step 1 is Adam's warm-up): changed fraction; bytes per changed element and file size
for `raw`, `packed` and the peer baselines computed on the same deltas (TRL-style int32 indices + bf16
values, 6 B; uint16 gaps with a uint32 escape + bf16); diff time (snapshot kept up to date) against one
memcpy of the whole model measured in the same run (into an existing buffer, and into a new one, i.e. a
clone) and against plain torch `!=` + `nonzero`; encode and decode+apply throughput; the time to read
the delta file from disk (cold: page cache dropped); peak RSS. Ends with one JSON line of the figures.

    python benchmarks/bench_codec.py [--steps 6] [--lr 1e-6] [--out bench-out]    # `make bench` (~1 min, ~14 GB)
        [--slow-alternatives]    (zstd 19 and lzma 6 beside zstd 1, 3 and 9: about a minute more)
    python benchmarks/bench_codec.py --steps 2      # the smallest real run: one step measured after the warm-up
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import lzma
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from deltasync import _codec, compute_delta, decode_shard, encode_shard, tensor_checksum
from deltasync.testing.models import QWEN3_0_6B_CONFIG, qwen3_shapes
from deltasync.testing.stream import UpdateStream


def _timed(fn, repeat: int = 1):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _uint16_gap_bytes(idx: np.ndarray) -> int:
    gaps = np.diff(idx, prepend=-1) - 1
    return int(2 * gaps.size + 4 * np.count_nonzero(gaps >= 0xFFFF))


def _cold_read_s(path: Path) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    t0 = time.perf_counter()
    path.read_bytes()
    return time.perf_counter() - t0


def _alternatives(changes: dict, slow: bool) -> dict[str, float]:
    """Bytes per changed element of other codings of the same delta, to justify packed's choices (zstd 1, 3 and 9;
    with ``slow``, zstd 19 and lzma 6 too: about 3 MB/s each, half of a default run's time)."""
    pos, ordv, xorv = [], [], []
    for d in changes.values():
        if d.indices is None:
            continue
        gaps = _codec.encode_gaps(d.indices.numpy(), np.uint32)
        pos.append(_codec.split_planes(gaps, _codec.planes_needed(gaps)))
        new = d.values.view(torch.int16).numpy()
        old = d.base_values.view(torch.int16).numpy()
        z = _codec.zigzag_encode(_codec.to_ordinal(new).astype(np.int32) - _codec.to_ordinal(old), np.uint32)
        ordv.append(_codec.split_planes(z, _codec.planes_needed(z)))
        x = (new ^ old).view(np.uint16)
        xorv.append(_codec.split_planes(x, 2))
    nnz = sum(d.nnz for d in changes.values() if d.indices is not None)
    streams = {"positions": b"".join(pos), "ordinal-delta": b"".join(ordv), "xor": b"".join(xorv)}
    out = {}
    for level in (1, 3, 9, 19) if slow else (1, 3, 9):
        c = zstandard.ZstdCompressor(level=level)
        t, sizes = _timed(lambda c=c: {k: len(c.compress(v)) for k, v in streams.items()})
        out[f"zstd{level}_positions"] = sizes["positions"] / nnz
        out[f"zstd{level}_ordinal"] = sizes["ordinal-delta"] / nnz
        out[f"zstd{level}_xor"] = sizes["xor"] / nnz
        out[f"zstd{level}_encode_MBps"] = sum(map(len, streams.values())) / t / 1e6
    if slow:
        t, sizes = _timed(lambda: {k: len(lzma.compress(v, preset=6)) for k, v in streams.items()})
        out["lzma6_positions"] = sizes["positions"] / nnz
        out["lzma6_ordinal"] = sizes["ordinal-delta"] / nnz
        out["lzma6_encode_MBps"] = sum(map(len, streams.values())) / t / 1e6
    return out


def _measure_step(step, curr, snapshot, host, out: Path):
    t_clone, scratch = _timed(lambda: {k: v.clone() for k, v in curr.items()})
    t_copy, _ = _timed(lambda s=scratch: [s[k].copy_(v) for k, v in curr.items()], repeat=2)  # into its pages
    del scratch
    t_plain, _ = _timed(
        lambda: {k: (snapshot[k].view(torch.int16) != v.view(torch.int16)).nonzero() for k, v in curr.items()}
    )
    t_diff, changes = _timed(lambda: compute_delta(snapshot, curr, update_prev=True))
    changes = {n: dataclasses.replace(d, checksum=tensor_checksum(curr[n])) for n, d in changes.items()}
    nnz = sum(d.nnz for d in changes.values())
    meta = dict(kind="delta", base_version=step - 1, target_version=step)
    t_raw, raw = _timed(lambda: encode_shard(changes.values(), encoding="raw", **meta))
    t_enc, packed = _timed(lambda: encode_shard(changes.values(), encoding="packed", **meta))
    reads = {}
    for name, data in (("packed", packed), ("raw", raw)):
        path = out / f"delta-{name}.safetensors"
        path.write_bytes(data)
        reads[name] = _cold_read_s(path)
    t_warm_read, _ = _timed((out / "delta-packed.safetensors").read_bytes, repeat=3)

    def decode_apply():
        _, deltas = decode_shard(bytearray(packed), name="delta-packed.safetensors", base=host)
        for d in deltas.values():  # the write step of deltasync.apply, without a manifest
            flat = host[d.ckpt_name].view(-1)
            if d.indices is None:
                flat.copy_(d.values.reshape(-1))
            else:
                flat[d.indices] = d.values

    t_dec, _ = _timed(decode_apply)
    assert all(torch.equal(host[k].view(torch.int16), curr[k].view(torch.int16)) for k in curr), "not bit-exact"
    u16 = sum(_uint16_gap_bytes(d.indices.numpy()) + 2 * d.nnz for d in changes.values() if d.indices is not None)
    u16 += sum(2 * d.nnz for d in changes.values() if d.indices is None)
    row = {
        "step": step,
        "changed_fraction": nnz / sum(t.numel() for t in curr.values()),
        "nnz": nnz,
        "raw_bytes": len(raw),
        "packed_bytes": len(packed),
        "raw_B_per_elem": len(raw) / nnz,
        "packed_B_per_elem": len(packed) / nnz,
        "trl_B_per_elem": 6.0,
        "u16gap_B_per_elem": u16 / nnz,
        "diff_ms": t_diff * 1e3,
        "memcpy_ms": t_copy * 1e3,
        "clone_ms": t_clone * 1e3,
        "plain_ne_nonzero_ms": t_plain * 1e3,
        "diff_over_memcpy": t_diff / t_copy,
        "diff_over_clone": t_diff / t_clone,
        "diff_over_plain": t_diff / t_plain,
        "encode_packed_ms": t_enc * 1e3,
        "encode_raw_ms": t_raw * 1e3,
        "encode_packed_MBps": len(packed) / t_enc / 1e6,
        "encode_packed_Melem_per_s": nnz / t_enc / 1e6,
        "decode_apply_ms": t_dec * 1e3,
        "decode_apply_Melem_per_s": nnz / t_dec / 1e6,
        "cold_read_ms": reads["packed"] * 1e3,
        "cold_read_raw_ms": reads["raw"] * 1e3,
        "warm_read_ms": t_warm_read * 1e3,
    }
    return row, changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=int, default=6, help="steps; the figures are medians over 2..N (step 1: Adam's warm-up)"
    )
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument(
        "--out", type=Path, default=Path("bench-out"), help="scratch for the delta files (a subdirectory, removed)"
    )
    parser.add_argument(
        "--slow-alternatives",
        action="store_true",
        help="also compress step 2's streams with zstd 19 and lzma 6 (about a minute more here)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    scratch_dir = Path(tempfile.mkdtemp(prefix="bench-codec-", dir=args.out))

    shapes = qwen3_shapes(QWEN3_0_6B_CONFIG)
    t0 = time.perf_counter()
    stream = UpdateStream.from_shapes(shapes, lr=args.lr, seed=0)
    snapshot = stream.bf16()
    host = {k: v.clone() for k, v in snapshot.items()}  # the receiver's host copy
    numel = sum(t.numel() for t in snapshot.values())
    print(
        f"Qwen3-0.6B shapes: {len(shapes)} tensors, {numel:,} elements, {numel * 2 / 1e9:.2f} GB bf16; "
        f"lr {args.lr}; torch threads {torch.get_num_threads()}; set-up {time.perf_counter() - t0:.0f} s\n"
    )
    hdr = (
        f"{'step':>4} {'changed':>8} {'raw B/e':>8} {'packed':>7} {'trl6':>5} {'u16gap':>7} {'packed MB':>9} "
        f"{'diff ms':>8} {'copy ms':>8} {'clone ms':>8} {'plain ms':>8} {'diff/copy':>9} {'diff/clone':>10} "
        f"{'enc MB/s':>8} {'dec+apply ms':>12} {'cold read ms':>12}"
    )
    print(hdr)
    rows = []
    alternatives: dict[str, float] = {}
    for step in range(1, args.steps + 1):
        row, changes = _measure_step(step, stream.step(), snapshot, host, scratch_dir)
        rows.append(row)
        print(
            f"{step:4d} {row['changed_fraction']:8.3%} {row['raw_B_per_elem']:8.3f} {row['packed_B_per_elem']:7.3f} "
            f"{6.0:5.1f} {row['u16gap_B_per_elem']:7.3f} {row['packed_bytes'] / 1e6:9.2f} {row['diff_ms']:8.0f} "
            f"{row['memcpy_ms']:8.0f} {row['clone_ms']:8.0f} {row['plain_ne_nonzero_ms']:8.0f} "
            f"{row['diff_over_memcpy']:9.2f} {row['diff_over_clone']:10.2f} {row['encode_packed_MBps']:8.1f} "
            f"{row['decode_apply_ms']:12.0f} {row['cold_read_ms']:12.1f}",
            flush=True,
        )
        if step == 2:
            alternatives = _alternatives(changes, args.slow_alternatives)
    report = [r for r in rows if r["step"] >= 2] or rows

    def med(key: str) -> float:
        return statistics.median(r[key] for r in report)

    print("\nalternatives on step 2 (bytes per changed element of each stream):")
    for k, v in alternatives.items():
        print(f"  {k:24s} {v:8.3f}")
    summary = {k: med(k) for k in report[0] if k != "step"}
    summary.update(
        steps=[r["step"] for r in report],
        lr=args.lr,
        model_elements=numel,
        peak_rss_GB=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        alternatives_step2=alternatives,
        decode_apply_over_2x_cold_read=med("decode_apply_ms") / (2 * med("cold_read_ms")),
        decode_apply_over_2x_cold_raw_read=med("decode_apply_ms") / (2 * med("cold_read_raw_ms")),
        decode_apply_over_2x_warm_read=med("decode_apply_ms") / (2 * med("warm_read_ms")),
    )
    print(
        f"\nmedians over steps {summary['steps']}: packed {summary['packed_B_per_elem']:.3f} B/changed elem "
        f"(raw {summary['raw_B_per_elem']:.2f}, TRL 6, u16-gap {summary['u16gap_B_per_elem']:.2f}); "
        f"diff {summary['diff_over_memcpy']:.2f}x memcpy, {summary['diff_over_clone']:.2f}x clone, "
        f"{summary['diff_over_plain']:.2f}x plain torch; decode+apply / 2x cold read "
        f"{summary['decode_apply_over_2x_cold_read']:.2f} (of the raw file: "
        f"{summary['decode_apply_over_2x_cold_raw_read']:.2f}); peak RSS {summary['peak_rss_GB']:.1f} GB"
    )
    print(json.dumps(summary))
    shutil.rmtree(scratch_dir)
    with contextlib.suppress(OSError):  # --out is removed only if this run made it and left it empty
        args.out.rmdir()


if __name__ == "__main__":
    main()
