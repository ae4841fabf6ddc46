"""Bounded reads: hostile files in a store cost a clear FormatError/StoreError and little memory, never a
crash. Each case runs ``deltasync verify`` in a fresh subprocess that reports the error class and its peak RSS
above the baseline (after imports); the bound is 300 MB.

The cases: a valid 473-byte packed shard declaring nnz 2**28 (and 2**34) with zero value planes, which an
unchecked decoder would expand to gigabytes; a 1 GiB and a 64 GiB sparse manifest, which must be refused by size
before they are read; a shard symlinked to /dev/zero, which must never be read.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltasync import _codec
from deltasync._safetensors import SafetensorsEntry, encode_safetensors
from deltasync.layout import manifest_key, object_prefix

pytestmark = pytest.mark.slow

RSS_BOUND_MB = 300
CHILD = r"""
import json, resource, sys
from deltasync.cli import main
import deltasync.reader, deltasync.format, torch  # what verify needs, loaded before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from deltasync import read_weights, open_store
try:
    read_weights(open_store(sys.argv[1]), 0)
    outcome = ["ok"]
except BaseException as exc:
    outcome = [c.__name__ for c in type(exc).__mro__]
    message = str(exc)
else:
    message = ""
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("RESULT " + json.dumps({"mro": outcome, "message": message[:500], "extra_mb": (peak - base) / 1024}))
"""


def run_verify(store: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(store)], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _packed_anchor(store: Path, numel: int, *, value_planes: int, frame: bytes, fmt: str) -> None:
    """An anchor of one BF16 tensor of ``numel`` elements whose only payload is ``frame``; its manifest matches."""
    info = {
        "checksum": "xxh3_128:" + "0" * 32,
        "dtype": "BF16",
        "layout": "dense",
        "nnz": numel,
        "shape": [numel],
        "value_coding": "bits",
        "value_planes": value_planes,
    }
    metadata = {
        "deltasync.format_version": fmt,
        "deltasync.kind": "anchor",
        "deltasync.encoding": "packed",
        "deltasync.target_version": "0",
        "deltasync.tensors": json.dumps({"w": info}, sort_keys=True, separators=(",", ":")),
    }
    shard = encode_safetensors(
        [SafetensorsEntry(key="w:packed_values", dtype="U8", shape=(len(frame),), data=memoryview(frame))], metadata
    )
    manifest = {
        "format_version": "1.0",
        "kind": "anchor",
        "version": 0,
        "base_version": None,
        "encoding": "packed",
        "shards": [
            {"file": "shard-00000.safetensors", "bytes": len(shard), "sha256": hashlib.sha256(shard).hexdigest()}
        ],
        "tensors": {
            "w": {
                "shape": [numel],
                "dtype": "BF16",
                "nnz": numel,
                "shards": [0],
                "checksums": [[0, numel, "xxh3_128:" + "0" * 32]],
            }
        },
    }
    root = store / object_prefix(0, "anchor")
    root.mkdir(parents=True)
    (root / "shard-00000.safetensors").write_bytes(shard)
    (store / manifest_key(0, "anchor")).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("numel", "planes", "fmt", "expected"),
    [
        (2**28, 0, "1.0", "with zero byte planes is more than the 65536 such an entry may imply"),
        (2**34, 0, "1.0", "with zero byte planes is more than the 65536 such an entry may imply"),
        (2**28, 0, "1.1", "value_planes must be an int in [1, 2], found 0"),
        (2**28, 1, "1.1", "cannot hold 268435456 bytes (zstd expands at most 32768x)"),
    ],
    ids=["2^28-zero-planes", "2^34-zero-planes", "2^28-1.1", "2^28-ratio"],
)
def test_a_tiny_shard_declaring_a_huge_tensor(tmp_path: Path, numel: int, planes: int, fmt: str, expected: str) -> None:
    frame = _codec.zstd_compress(bytes(64), 3)  # a few dozen bytes of payload
    _packed_anchor(tmp_path / "store", numel, value_planes=planes, frame=frame, fmt=fmt)
    assert (tmp_path / "store" / "v00000000" / "anchor" / "shard-00000.safetensors").stat().st_size < 1024
    r = run_verify(tmp_path / "store")
    assert "FormatError" in r["mro"] and expected in r["message"], r
    assert r["extra_mb"] < RSS_BOUND_MB, r


@pytest.mark.parametrize("size", [1 << 30, 64 << 30], ids=["1GiB", "64GiB"])
def test_a_sparse_huge_manifest_is_refused_before_reading(tmp_path: Path, size: int) -> None:
    store = tmp_path / "store"
    path = store / manifest_key(0, "anchor")
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(size)
    r = run_verify(store)
    assert "ObjectTooLarge" in r["mro"] and "StoreError" in r["mro"], r
    assert f"is {size} bytes, more than the 16777216 allowed; not read" in r["message"]
    assert r["extra_mb"] < RSS_BOUND_MB, r


def _real_anchor(store: Path) -> Path:
    import torch

    from deltasync import LocalStore, write_anchor

    write_anchor(LocalStore(store), {"w": torch.ones(1024, dtype=torch.bfloat16)}, version=0)
    return store / object_prefix(0, "anchor") / "shard-00000.safetensors"


def test_a_shard_symlinked_to_dev_zero_is_never_read(tmp_path: Path) -> None:
    shard = _real_anchor(tmp_path / "store")
    shard.unlink()
    os.symlink("/dev/zero", shard)
    r = run_verify(tmp_path / "store")
    assert "UnsafeObject" in r["mro"] and "is a symlink; deltasync reads only regular files" in r["message"], r
    assert r["extra_mb"] < RSS_BOUND_MB, r


def test_a_fifo_or_a_directory_where_a_shard_should_be(tmp_path: Path) -> None:
    shard = _real_anchor(tmp_path / "store")
    shard.unlink()
    os.mkfifo(shard)  # opening a fifo for reading would block forever
    r = run_verify(tmp_path / "store")
    assert "UnsafeObject" in r["mro"] and "is a fifo" in r["message"], r
    shard.unlink()
    shard.mkdir()
    r = run_verify(tmp_path / "store")
    assert "UnsafeObject" in r["mro"] or "ObjectNotFound" in r["mro"], r


def test_a_sparse_shard_larger_than_its_manifest_says(tmp_path: Path) -> None:
    shard = _real_anchor(tmp_path / "store")
    with open(shard, "r+b") as f:
        f.truncate(8 << 30)  # 8 GiB, mostly holes
    r = run_verify(tmp_path / "store")
    assert "ObjectTooLarge" in r["mro"] and "not read" in r["message"], r
    assert r["extra_mb"] < RSS_BOUND_MB, r
