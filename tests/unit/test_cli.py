from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltasync import LocalStore, compute_delta, write_anchor, write_delta
from deltasync.cli import main
from deltasync.testing import UpdateStream


@pytest.fixture
def published(local_store: LocalStore, update_stream: UpdateStream) -> LocalStore:
    prev = update_stream.bf16()
    base = write_anchor(local_store, prev, version=0, encoding="packed")
    prev = {k: v.clone() for k, v in prev.items()}
    for v in (1, 2, 3):
        curr = update_stream.step()
        base = write_delta(local_store, compute_delta(prev, curr, update_prev=True), state=curr, version=v, base=base)
    write_anchor(local_store, curr, version=3, encoding="raw")
    return local_store


def test_ls(published: LocalStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(published.root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["kind"], r["base_version"]) for r in rows] == [
        (0, "anchor", None),
        (1, "delta", 0),
        (2, "delta", 1),
        (3, "delta", 2),
        (3, "anchor", None),
    ]
    assert all(0 < r["changed_fraction"] < 0.1 for r in rows if r["kind"] == "delta")
    assert main(["ls", published.uri]) == 0
    out = capsys.readouterr().out
    assert "5 objects in file://" in out and "packed" in out


def test_inspect_store_version_and_file(published: LocalStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(published.root), "--version", "2", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["kind"] == "delta" and report["encoding"] == "packed" and report["base_version"] == 1
    nnz = sum(t["nnz"] for t in report["tensors"])
    stored = sum(t["bytes"] for t in report["tensors"])
    assert nnz > 0 and stored / nnz < 3 and sum(t["raw_bytes"] for t in report["tensors"]) == 6 * nnz
    shard = published.root / "v00000003" / "anchor" / "shard-00000.safetensors"
    assert main(["inspect", str(shard)]) == 0
    out = capsys.readouterr().out
    assert "anchor v3, raw" in out and "model.embed_tokens.weight" in out and "100.00%" in out


def test_verify(published: LocalStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(published.root), "--version", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) | {"elements": 0} == {
        "version": 2,
        "ok": True,
        "anchor": 0,
        "deltas": [1, 2],
        "tensors": 24,
        "elements": 0,
    }
    assert main(["verify", str(published.root), "--version", "3"]) == 0
    assert "v3: ok, 24 tensors" in capsys.readouterr().out


def test_errors_exit_1_with_the_class_name(published: LocalStore, capsys: pytest.CaptureFixture[str]) -> None:
    key = "v00000002/shard-00000.safetensors"
    data = bytearray(published.get(key))
    data[-1] ^= 0xFF
    published.put(key, bytes(data))
    assert main(["verify", str(published.root), "--version", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("IntegrityError: ") and "sha256" in err and "Traceback" not in err
    assert main(["verify", str(published.root), "--version", "9"]) == 1
    assert capsys.readouterr().err.startswith("ObjectNotFound: ")
    assert main(["inspect", str(published.root / "nope.safetensors")]) == 1
    assert "no such shard file" in capsys.readouterr().err


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["verify", str(tmp_path)])
    assert exc.value.code == 2
    assert main(["ls", "s3://bucket"]) == 2
    assert "no store for scheme 's3'" in capsys.readouterr().err


def test_console_script_is_installed(published: LocalStore) -> None:
    exe = Path(sys.executable).with_name("deltasync")
    out = subprocess.run([str(exe), "ls", str(published.root), "--json"], capture_output=True, text=True, check=True)
    assert len(json.loads(out.stdout)) == 5
