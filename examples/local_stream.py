"""The local end-to-end demo: a realistic update stream on the tiny Qwen3, published to a local store,
then listed, inspected and verified with the ``deltasync`` CLI (what ``make demo-local`` runs).

    python examples/local_stream.py --out demo-out/local --steps 12 --anchor-every 5
    python examples/local_stream.py --out /tmp/local --steps 2      # the smallest real run (seconds)

``--out`` is replaced only if it is new, empty or an earlier run's output (:mod:`deltasync.testing.output_dir`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from deltasync import LocalStore, compute_delta, write_anchor, write_delta
from deltasync.testing.models import build_tiny_model
from deltasync.testing.output_dir import fresh_output_dir
from deltasync.testing.stream import UpdateStream


def _run(*args: str) -> None:
    exe = Path(sys.executable).with_name("deltasync")
    print(f"\n$ deltasync {' '.join(args)}", flush=True)
    subprocess.run([str(exe), *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo-out/local"), help="output directory (replaced)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps to publish")
    parser.add_argument("--anchor-every", type=int, default=5, help="write a full anchor every K versions")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of the update stream")
    parser.add_argument("--encoding", choices=["packed", "raw"], default="packed")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1 (the last two versions are verified), got {args.steps}")
    try:
        args.out = fresh_output_dir(args.out)
    except ValueError as exc:
        parser.error(str(exc))
    model_dir = build_tiny_model(args.out / "tiny-qwen3", seed=0)
    store = LocalStore(args.out / "store")
    weights = load_file(model_dir / "model.safetensors")
    stream = UpdateStream(weights, lr=args.lr, seed=0)
    snapshot = {k: v.clone() for k, v in weights.items()}
    full_bytes = sum(t.numel() * t.element_size() for t in weights.values())

    print(f"model: {model_dir} ({len(weights)} tensors, {full_bytes / 2**20:.2f} MiB in bf16)")
    print(f"store: {store.uri}\n")
    manifest = write_anchor(store, weights, version=0, encoding=args.encoding)
    print(f"v0   anchor  {manifest.total_bytes:>9d} B")
    print(f"{'':4s} {'changed':>8s} {'delta bytes':>12s} {'B/changed':>10s} {'vs full':>8s} {'diff+write':>10s}")
    for version in range(1, args.steps + 1):
        curr = stream.step()
        t0 = time.perf_counter()
        changes = compute_delta(snapshot, curr, update_prev=True)
        manifest = write_delta(store, changes, state=curr, version=version, base=manifest, encoding=args.encoding)
        ms = (time.perf_counter() - t0) * 1e3
        per = manifest.total_bytes / max(manifest.nnz, 1)
        print(
            f"v{version:<3d} {manifest.nnz / manifest.numel:8.3%} {manifest.total_bytes:12d} {per:10.2f} "
            f"{manifest.total_bytes / full_bytes:8.2%} {ms:8.1f}ms"
        )
        if version % args.anchor_every == 0:
            anchor = write_anchor(store, curr, version=version, encoding=args.encoding)
            print(f"v{version:<3d} anchor  {anchor.total_bytes:>9d} B")

    _run("ls", str(store.root))
    _run("inspect", str(store.root), "--version", str(args.steps))
    _run("verify", str(store.root), "--version", str(args.steps))
    _run("verify", str(store.root), "--version", str(args.steps - 1))


if __name__ == "__main__":
    main()
