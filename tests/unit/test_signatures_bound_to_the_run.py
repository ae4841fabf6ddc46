"""Signatures bound to a run: one signing key often serves many runs (a team's key), so a reader that
trusts the key but has no coordinator must still never read another run's validly signed objects as this run's.
Each test plants real objects of run A, published by a real Publisher with the shared key, into run B's store."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deltasync import (
    ForeignObject,
    FormatError,
    LocalStore,
    Publisher,
    Trust,
    VerifyKey,
    list_versions,
    read_manifest,
    read_weights,
)
from deltasync.config import PublisherConfig
from deltasync.runrecord import RUN_KEY, claim_run
from deltasync.testing.models import qwen3_shapes
from deltasync.testing.stream import UpdateStream
from tests.conftest import SMALL_QWEN3, assert_bit_equal


def _publish(root: Path, key_path: Path, steps: int, *, seed: int, anchor_every: int | None = None) -> dict:
    """A run without a coordinator: the store's run.json is its identity. Returns version -> weights."""
    stream = UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=seed)
    config = PublisherConfig(signing_key=str(key_path), anchor_every=anchor_every, anchor_bytes_fraction=None)
    truth = {}
    with Publisher(LocalStore(root), None, config) as pub:
        for step in range(steps):
            weights = stream.step()
            truth[pub.publish(weights, step)] = weights
    return truth


def _plant(src: Path, dst: Path, prefix: str) -> None:
    shutil.copytree(src / prefix, dst / prefix, dirs_exist_ok=True)


def _run_id(root: Path) -> str:
    return str(json.loads((root / RUN_KEY).read_text().split("\n")[0])["run_id"])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deltasync.cli", *args], capture_output=True, text=True, timeout=120)


def test_another_runs_signed_objects_planted_in_this_store_are_refused(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    """Run A's objects planted in run B's store: ``read_weights(store_b, 2, trust=Trust(verify_key=K))`` must not
    return run A's v2, nor ``deltasync verify`` say ok, nor A's v6 anchor + v7 delta above B's latest read as
    B's v7."""
    key_path, verify_key = publisher_key
    a, b = tmp_path / "a", tmp_path / "b"
    _publish(a, key_path, 8, seed=0, anchor_every=6)
    truth_b = _publish(b, key_path, 2, seed=1)
    run_a, run_b = _run_id(a), _run_id(b)
    assert run_a != run_b
    _plant(a, b, "v00000002")  # A's delta 1 -> 2, validly signed by the shared key
    store = LocalStore(b)
    trust = Trust(verify_key=verify_key)
    with pytest.raises(ForeignObject, match=rf"belongs to run {run_a}, this reader is pinned to run {run_b}"):
        read_weights(store, 2, trust=trust)
    with pytest.raises(ForeignObject):
        read_weights(store, 2, trust=Trust(verify_key=verify_key, run_id=run_b))
    assert_bit_equal(read_weights(store, 1, trust=trust), truth_b[1])  # the run's own versions still read
    done = _cli("verify", str(b), "--version", "2", "--public-key", f"{key_path}.pub")
    assert done.returncode != 0 and f"belongs to run {run_a}" in done.stderr and "Traceback" not in done.stderr, done
    _plant(a, b, "v00000006")  # A's anchor v6 (and its delta v6) ...
    _plant(a, b, "v00000007")  # ... and delta v7, above B's latest
    with pytest.raises(ForeignObject):
        read_weights(store, 7, trust=trust)
    listing = _cli("ls", str(b), "--public-key", f"{key_path}.pub", "--json")
    rows = {(r["version"], r["kind"]): r["status"] for r in json.loads(listing.stdout)}
    assert rows[(1, "delta")] == "ok" and rows[(7, "delta")] == rows[(6, "anchor")] == f"FOREIGN: run {run_a}"
    plain = _cli("ls", str(b))
    assert plain.returncode == 0 and f"run {run_b} (the store's run.json)" in plain.stdout
    assert "readers refuse them" in plain.stderr, plain


def test_a_foreign_anchor_is_passed_over_for_the_runs_own_chain(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    """One planted foreign anchor never fails the whole chain ("mixes objects of runs"): the reader rebuilds
    through the run's own deltas, bit-exact."""
    key_path, verify_key = publisher_key
    a, b = tmp_path / "a", tmp_path / "b"
    _publish(a, key_path, 8, seed=0, anchor_every=6)
    truth_b = _publish(b, key_path, 8, seed=1)
    shutil.copytree(a / "v00000006" / "anchor", b / "v00000006" / "anchor")
    store = LocalStore(b)
    assert list_versions(store)[6].anchor  # the planted anchor is there, signed by the trusted key
    with pytest.raises(FormatError, match="mixes objects of runs"):  # a reader that pins no run cannot choose
        read_weights(store, 7)
    assert_bit_equal(read_weights(store, 7, trust=Trust(verify_key=verify_key)), truth_b[7])
    assert_bit_equal(read_weights(store, 7, trust=Trust(run_id=_run_id(b))), truth_b[7])


def test_a_reader_pinned_to_another_run_refuses_the_store(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    key_path, verify_key = publisher_key
    _publish(tmp_path / "b", key_path, 2, seed=1)
    store = LocalStore(tmp_path / "b")
    with pytest.raises(ForeignObject, match=r"the store belongs to run run-\w+ \(run.json\), this reader is pinned"):
        read_weights(store, 1, trust=Trust(verify_key=verify_key, run_id="run-someone-else"))
    done = _cli("verify", str(tmp_path / "b"), "--version", "1", "--run-id", "run-someone-else")
    assert done.returncode != 0 and "pinned to run run-someone-else" in done.stderr


def test_a_run_record_rewritten_by_someone_without_the_key_is_refused(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    """The store's record pins the run only when the key signed it: a record swapped in by whoever can write
    the bucket (to adopt planted objects) is ignored, with a warning, never believed."""
    key_path, verify_key = publisher_key
    a, b = tmp_path / "a", tmp_path / "b"
    _publish(a, key_path, 3, seed=0)
    _publish(b, key_path, 2, seed=1)
    signature = (b / RUN_KEY).read_bytes().split(b"\n")[1]  # B's own signature line, under A's run id
    (b / RUN_KEY).write_bytes(json.dumps({"format_version": "1.3", "run_id": _run_id(a)}).encode() + b"\n" + signature)
    _plant(a, b, "v00000002")  # A's object, which the swapped record names: never adopted
    with pytest.raises(ForeignObject, match=r"run.json is ignored \(the signature does not match the record's"):
        read_weights(LocalStore(b), 2, trust=Trust(verify_key=verify_key))
    # a record signed by the key for run A (copied whole) pins A: B's own objects are then refused, never
    # A's read as B's; a reader that knows its run says so with run_id and is told what the store holds
    shutil.copy(a / RUN_KEY, b / RUN_KEY)  # the record and its signature line
    with pytest.raises(ForeignObject, match=f"pinned to run {_run_id(a)}"):
        read_weights(LocalStore(b), 1, trust=Trust(verify_key=verify_key))


def test_a_publisher_refuses_a_store_that_belongs_to_another_run(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    """A run's store is written by that run only: a second run pointed at it (a copy-pasted --store) is refused
    before anything is written, with what to do."""
    store = LocalStore(tmp_path / "b")
    claim_run(store, "run-first", None)
    before = sorted(store.list())
    with pytest.raises(ForeignObject, match="belongs to run run-first .* publish each run under its own store prefix"):
        claim_run(store, "run-second", None)
    assert sorted(store.list()) == before
    claim_run(store, "run-first", None)  # the same run again (a restarted publisher) is welcome


def test_without_a_coordinator_a_restarted_publisher_keeps_the_stores_run(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    key_path, verify_key = publisher_key
    root = tmp_path / "b"
    _publish(root, key_path, 2, seed=1)
    run = _run_id(root)
    weights = UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=2).step()
    with Publisher(LocalStore(root), None, PublisherConfig(signing_key=str(key_path))) as pub:
        version = pub.publish(weights, 0)
    store = LocalStore(root)
    assert version == 2 and _run_id(root) == run
    kinds = [(v.version, "anchor" if v.anchor else "delta") for v in list_versions(store)]
    assert {read_manifest(store, v, kind).run_id for v, kind in kinds} == {run}
    assert_bit_equal(read_weights(store, 2, trust=Trust(verify_key=verify_key)), weights)


def test_a_store_whose_run_record_was_deleted_is_refused_not_read_unpinned(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    """With `run.json` deleted, a key-only reader must not pin nothing and read another run's objects (a whole
    chain of run B copied into run A's store) as valid: an object that names a run, written since format 1.3
    (its publisher always records the run), is refused until the reader pins a run."""
    key_path, verify_key = publisher_key
    a, b = tmp_path / "a", tmp_path / "b"
    _publish(a, key_path, 3, seed=0)
    truth_b = _publish(b, key_path, 6, seed=1, anchor_every=4)
    for prefix in ("v00000004", "v00000005"):  # B's own anchor v4 and delta v5: a chain of run B alone
        _plant(b, a, prefix)
    run_a = _run_id(a)
    (a / RUN_KEY).unlink()
    store = LocalStore(a)
    with pytest.raises(ForeignObject, match=r"names run run-\w+, and the store .* has no run record \(run.json"):
        read_weights(store, 5, trust=Trust(verify_key=verify_key))
    done = _cli("verify", str(a), "--version", "5", "--public-key", f"{key_path}.pub")
    assert done.returncode != 0 and "has no run record" in done.stderr, done
    # a reader that knows its run still reads its own versions, and never B's
    pinned = Trust(verify_key=verify_key, run_id=run_a)
    assert read_weights(store, 2, trust=pinned).keys() == truth_b[5].keys()
    with pytest.raises(ForeignObject, match=f"pinned to run {run_a}"):
        read_weights(store, 5, trust=pinned)
    assert_bit_equal(read_weights(LocalStore(b), 5, trust=Trust(verify_key=verify_key)), truth_b[5])


def test_planted_epoch_records_never_stop_the_reads(tmp_path: Path, publisher_key: tuple[Path, VerifyKey]) -> None:
    """A 50 MB planted epochs/e*.json (or a file where the directory goes) never makes a key-only read fail: a
    record that cannot fence anything is ignored, with a warning."""
    key_path, verify_key = publisher_key
    root = tmp_path / "b"
    truth = _publish(root, key_path, 2, seed=1)
    (root / "epochs").mkdir()
    (root / "epochs" / "e00000009.json").write_bytes(b"x" * (1 << 20))
    assert_bit_equal(read_weights(LocalStore(root), 1, trust=Trust(verify_key=verify_key)), truth[1])
    (root / "epochs" / "e00000009.json").unlink()
    (root / "epochs").rmdir()
    (root / "epochs").write_bytes(b"not a directory")
    assert_bit_equal(read_weights(LocalStore(root), 1, trust=Trust(verify_key=verify_key)), truth[1])
    record = (root / RUN_KEY).read_text().split("\n")[0]
    assert '"format_version": "1.5"' in record
