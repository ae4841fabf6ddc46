"""A store writer without the key can delay, never stall: whoever can create (or replace) keys in the store but
holds no signing key (another tenant of a shared bucket) plants what it likes, as plain files or through the
store API, and the publisher and every key-holding reader go on, or stop with a message that says what to do.

Each test plants from where that writer stands: the run id from the coordinator's unauthenticated ``/healthz``,
the version keys from the store's public layout."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from deltasync_coordinator.app import create_app

from deltasync import (
    FencedObject,
    ForeignObject,
    LocalStore,
    ObjectWriter,
    Publisher,
    SigningKey,
    Trust,
    VerifyKey,
    _commit,
    compute_delta,
    read_manifest,
    read_weights,
    write_delta,
)
from deltasync._commit import LeaseKeeper
from deltasync._sharding import TensorView, dense_entries, globalize
from deltasync.cli import main
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.config import PublisherConfig
from deltasync.errors import VersionTaken
from deltasync.runrecord import RUN_KEY, claim_run
from deltasync.signing import RUN_CONTEXT
from deltasync.store.s3 import S3Store
from deltasync.testing.models import qwen3_shapes
from deltasync.testing.stream import UpdateStream
from tests.conftest import PUBLISHER_TOKEN, SMALL_QWEN3, ServerThread, assert_bit_equal
from tests.support.asgi import make_settings
from tests.unit.test_publisher import _ThreadRanks


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(create_app(make_settings(tmp_path / "coordinator"))) as s:
        yield s


def _client(server: ServerThread) -> CoordinatorClient:
    return CoordinatorClient(server.url, token=PUBLISHER_TOKEN, retry=RetryPolicy(backoff_s=0.01))


def _config(key_path: Path) -> PublisherConfig:
    return PublisherConfig(signing_key=str(key_path), anchor_bytes_fraction=None, lease_wait_s=2.0)


def _public_run_id(server: ServerThread) -> str:
    """What any client on the network learns, without a token."""
    return str(httpx.get(f"{server.url}/healthz").json()["run_id"])


def _stream(seed: int) -> UpdateStream:
    return UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=seed)


def _publish(pub: Publisher, stream: UpdateStream, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """Publish ``steps`` versions; returns the published version -> weights (the versions actually written)."""
    before = len(pub.published)
    weights = []
    for step in range(steps):
        weights.append(stream.step())
        pub.publish(weights[-1], step)
    pub.flush()
    written = sorted({m.version for m in pub.published[before:]})
    assert len(written) == steps, written
    return dict(zip(written, weights, strict=True))


def _run_of(root: Path) -> str:
    return str(json.loads((root / RUN_KEY).read_bytes().split(b"\n")[0])["run_id"])


# ---------------------------------------------------------------------------------------------- run.json


@pytest.mark.parametrize("planted", ["unsigned", "signed by the planter's own key"])
def test_a_run_record_planted_before_the_first_publish_is_refused_by_the_publisher(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey], server: ServerThread, planted: str
) -> None:
    """A record planted under the publisher's run id (read from ``/healthz``) is refused, never taken as its own
    silently (every key-only reader, with or without ``--run-id``, would then refuse every version it
    published)."""
    key_path, verify_key = publisher_key
    root = tmp_path / "store"
    record = (json.dumps({"format_version": "1.4", "run_id": _public_run_id(server)}, sort_keys=True) + "\n").encode()
    if planted != "unsigned":
        record += SigningKey.generate().sign(record, context=RUN_CONTEXT)
    LocalStore(root).put(RUN_KEY, record)
    with _client(server) as client:
        with pytest.raises(ForeignObject) as refused:
            Publisher(LocalStore(root), client, _config(key_path))
        message = str(refused.value)
        assert message.startswith(
            f"{LocalStore(root).uri}/run.json: this publisher did not write the store's run record"
        )
        found = "the record is unsigned: no signature line after its JSON" if planted == "unsigned" else "signed by key"
        assert found in message and f"signs with key {verify_key.key_id}" in message, message
        assert "Nothing was written" in message and "delete run.json and start the publisher again" in message
        assert sorted(LocalStore(root).list()) == [RUN_KEY]  # not even its epoch
        # the operator's fix, as the message says; the refused publisher gave its lease back at once
        (root / RUN_KEY).unlink()
        with Publisher(LocalStore(root), client, _config(key_path)) as pub:
            truth = _publish(pub, _stream(0), 2)
    run = _run_of(root)
    for trust in (Trust(verify_key=verify_key), Trust(verify_key=verify_key, run_id=run)):
        assert_bit_equal(read_weights(LocalStore(root), 1, trust=trust), truth[1])


def test_without_a_coordinator_a_planted_run_record_is_refused_too(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    """A publisher without a coordinator adopts the store's run: never one its key did not record."""
    key_path, _ = publisher_key
    store = LocalStore(tmp_path / "store")
    store.put(RUN_KEY, b'{"format_version": "1.4", "run_id": "run-planted"}\n')
    with pytest.raises(ForeignObject, match=r"run.json: this publisher did not write the store's run record"):
        Publisher(store, None, _config(key_path))
    assert store.list() == [RUN_KEY]


def _another_runs_record(tmp_path: Path, key_path: Path) -> bytes:
    other = LocalStore(tmp_path / "other")
    claim_run(other, "run-other", SigningKey.from_file(key_path))
    return other.get(RUN_KEY)


REPLACEMENTS = {
    "signature line cut": lambda record, tmp, key_path: record.split(b"\n")[0] + b"\n",
    "another run's signed record": lambda record, tmp, key_path: _another_runs_record(tmp, key_path),
    "9,000 bytes": lambda record, tmp, key_path: b" " * 9000,
    "not JSON": lambda record, tmp, key_path: b"\x00not json at all\n",
}


@pytest.mark.parametrize("replacement", list(REPLACEMENTS))
def test_a_reader_pinned_with_run_id_never_depends_on_run_json(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey], caplog: pytest.LogCaptureFixture, replacement: str
) -> None:
    """A reader pinned with ``--run-id`` knows its run: a replaced ``run.json`` never makes it refuse a version
    (``SignatureError``, ``ForeignObject``, ``ObjectTooLarge``, ``FormatError``)."""
    key_path, verify_key = publisher_key
    root = tmp_path / "store"
    with Publisher(LocalStore(root), None, _config(key_path)) as pub:
        truth = _publish(pub, _stream(1), 3)
    run = _run_of(root)
    (root / RUN_KEY).write_bytes(REPLACEMENTS[replacement]((root / RUN_KEY).read_bytes(), tmp_path, key_path))
    store, pub_key = LocalStore(root), f"{key_path}.pub"
    caplog.set_level(logging.WARNING, logger="deltasync")
    assert_bit_equal(read_weights(store, 2, trust=Trust(verify_key=verify_key, run_id=run)), truth[2])
    assert main(["verify", str(root), "--version", "2", "--public-key", pub_key, "--run-id", run]) == 0
    assert main(["ls", str(root), "--public-key", pub_key, "--run-id", run, "--json"]) == 0
    assert not [r for r in caplog.records if RUN_KEY in r.getMessage()]  # not even read
    if replacement == "another run's signed record":
        # a record the key signed is believed: a key-only reader without --run-id is pinned to that run and
        # refuses this run's objects (never another run's read as this one's); --run-id is the way out
        with pytest.raises(ForeignObject, match="this reader is pinned to run run-other"):
            read_weights(store, 2, trust=Trust(verify_key=verify_key))
        return
    # a record the key did not sign is ignored, with a warning, by a reader with the key alone too
    assert_bit_equal(read_weights(store, 2, trust=Trust(verify_key=verify_key)), truth[2])
    assert any(f"{RUN_KEY}: ignored (" in r.getMessage() for r in caplog.records), caplog.text
    assert any(f"pinned to run {run}, the one run the objects signed" in r.getMessage() for r in caplog.records)


def test_a_key_only_reader_never_adopts_planted_objects_through_an_ignored_record(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    """With the record ignored, the run is the one that every object the key signed names: another run's
    signed objects planted beside it make the store ambiguous, and every object is refused until the reader
    pins its run."""
    key_path, verify_key = publisher_key
    a, b = tmp_path / "a", tmp_path / "b"
    with Publisher(LocalStore(a), None, _config(key_path)) as pub:
        _publish(pub, _stream(0), 4)
    with Publisher(LocalStore(b), None, _config(key_path)) as pub:
        truth_b = _publish(pub, _stream(1), 2)
    run_b = _run_of(b)
    (b / RUN_KEY).write_bytes(b"planted\n")
    for name in ("manifest.json", "manifest.sig", "shard-00000.safetensors"):  # A's signed delta v3
        LocalStore(b).put(f"v00000003/{name}", LocalStore(a).get(f"v00000003/{name}"))
    with pytest.raises(ForeignObject, match=r"names run run-\w+, and the store's run record .* is ignored .* several"):
        read_weights(LocalStore(b), 1, trust=Trust(verify_key=verify_key))
    assert_bit_equal(read_weights(LocalStore(b), 1, trust=Trust(verify_key=verify_key, run_id=run_b)), truth_b[1])


# ---------------------------------------------------------------------------------------------- version keys

SQUATS = ["v00000003/manifest.sig", "v00000003/manifest.json", "v00000003/shard-00000.safetensors", "v00000003"]


@pytest.mark.parametrize("squat", SQUATS)
def test_a_squatted_version_key_is_skipped_by_the_publisher_that_holds_the_lease(
    tmp_path: Path,
    publisher_key: tuple[Path, VerifyKey],
    server: ServerThread,
    caplog: pytest.LogCaptureFixture,
    squat: str,
) -> None:
    """A key of the next version, planted before the publisher writes it, never stops the publisher
    (``ObjectExists: ... exists; objects are create-only (another writer?)``). The lease makes it the run's
    only writer and the ledger allows gaps: the version is skipped, and every version reads back exact."""
    key_path, verify_key = publisher_key
    root = tmp_path / "store"
    stream = _stream(2)
    with _client(server) as client, Publisher(LocalStore(root), client, _config(key_path)) as pub:
        truth = _publish(pub, stream, 3)
        if squat == "v00000003":  # a file where the version's directory goes
            (root / squat).write_bytes(b"squat")
        else:
            LocalStore(root).put(squat, b"{}")
        LocalStore(root).put("v00000004/anchor/manifest.json", b"{}")  # and the version after it
        caplog.set_level(logging.WARNING, logger="deltasync")
        truth |= _publish(pub, stream, 2)
        registered = [v.version for v in client.wait_for_versions(None, wait_s=0)]
        published = [(m.version, m.kind, m.base_version) for m in pub.published]
    assert sorted(truth) == [0, 1, 2, 5, 6] and registered == [0, 1, 2, 5, 6]
    assert published[-2:] == [(5, "delta", 2), (6, "delta", 5)]
    warned = [r.getMessage() for r in caplog.records if "is skipped" in r.getMessage()]
    assert len(warned) == 1 and f"{LocalStore(root).uri}/{squat}" in warned[0], caplog.text
    assert "v3 is skipped, this version is published as v5 and every later one moves up by 2" in warned[0]
    if squat == "v00000003/manifest.json":  # its signature, written first, was taken back
        assert not LocalStore(root).exists("v00000003/manifest.sig")
    run = _run_of(root)
    with _client(server) as client:
        ledger = client.registered_digest
        for version, weights in truth.items():
            for trust in (Trust(verify_key=verify_key, run_id=run), Trust(ledger=ledger)):
                assert_bit_equal(read_weights(LocalStore(root), version, trust=trust), weights)


def test_a_key_planted_far_ahead_does_not_use_up_the_versions(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey], server: ServerThread
) -> None:
    """A publisher does not start above every key in the store: one planted ``v99999999/x`` would make its first
    version 100000000, and its first publish fail (``version must be an int in [0, 99999999]``)."""
    key_path, verify_key = publisher_key
    root = tmp_path / "store"
    LocalStore(root).put("v99999999/x", b"squat")
    with _client(server) as client, Publisher(LocalStore(root), client, _config(key_path)) as pub:
        truth = _publish(pub, _stream(3), 2)
    assert sorted(truth) == [0, 1]
    assert_bit_equal(read_weights(LocalStore(root), 1, trust=Trust(verify_key=verify_key)), truth[1])


def test_without_a_coordinator_a_key_planted_at_the_last_version_is_named_at_start(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    """Without a ledger the store is the run's only record of its versions, so the publisher starts above every
    key in it: one planted at the last version leaves none, and the publisher says so at start, naming the key,
    rather than failing its first publish with ``version must be an int in [0, 99999999], got 100000000``."""
    key_path, _ = publisher_key
    root = tmp_path / "store"
    LocalStore(root).put("v99999999/anchor/x", b"squat")
    with pytest.raises(VersionTaken) as stopped:
        Publisher(LocalStore(root), None, _config(key_path))
    assert str(stopped.value).startswith(
        f"{LocalStore(root).uri}/v99999999/anchor/x: a key at v99999999 leaves this publisher no version to publish"
    )
    assert "If no publisher of this run wrote it (a store writer planted it), delete it" in str(stopped.value)
    (root / "v99999999" / "anchor" / "x").unlink()
    with Publisher(LocalStore(root), None, _config(key_path)) as pub:
        assert sorted(_publish(pub, _stream(8), 1)) == [0]


def test_without_a_coordinator_a_squatted_version_key_stops_the_publisher_saying_what_to_do(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey]
) -> None:
    """Without a lease nothing tells a planted key from a second publisher writing the store: the publisher
    stops, naming the key and the way on (a new Publisher starts above it)."""
    key_path, verify_key = publisher_key
    root = tmp_path / "store"
    stream = _stream(4)
    pub = Publisher(LocalStore(root), None, _config(key_path))
    truth = _publish(pub, stream, 2)
    LocalStore(root).put("v00000002/manifest.sig", b"squat")
    pub.publish(stream.step(), 2)
    with pytest.raises(VersionTaken) as stopped:
        pub.close()
    message = str(stopped.value)
    assert message.startswith(f"{LocalStore(root).uri}/v00000002/manifest.sig: taken by an object this writer")
    assert "Without a coordinator this publisher cannot tell a planted object from a second publisher" in message
    assert "start a new Publisher: it starts above every key in the store, this one included" in message
    with Publisher(LocalStore(root), None, _config(key_path)) as again:
        truth |= _publish(again, stream, 1)
    assert sorted(truth) == [0, 1, 3]
    assert_bit_equal(read_weights(LocalStore(root), 3, trust=Trust(verify_key=verify_key)), truth[3])


# ---------------------------------------------------------------------------------------------- epoch records


def test_a_planted_epoch_record_does_not_stop_the_next_publisher_recording_its_own(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey], server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """An epoch record planted at the next publisher's key (``epochs/e00000002.json``) never makes that publisher
    skip its own (``already recorded``): key-holding readers ignore unsigned records, so nothing would fence the
    first publisher's late write, and ``verify --public-key --run-id`` would say ok."""
    key_path, verify_key = publisher_key
    root = tmp_path / "store"
    stream = _stream(5)
    with _client(server) as client:
        with Publisher(LocalStore(root), client, _config(key_path)) as first:  # lease epoch 1
            truth = _publish(first, stream, 2)
            last = first.published[-1]
        run = _run_of(root)
        planted = {"format_version": "1.4", "run_id": run, "epoch": 2, "registered_through": 99999999}
        LocalStore(root).put("epochs/e00000002.json", (json.dumps(planted) + "\n").encode())
        caplog.set_level(logging.WARNING, logger="deltasync")
        with Publisher(LocalStore(root), client, _config(key_path)) as second:  # lease epoch 2
            own = [
                k for k in LocalStore(root).list("epochs/") if re.fullmatch(r"epochs/e00000002-[0-9a-f]{16}\.json", k)
            ]
            assert len(own) == 1, LocalStore(root).list("epochs/")
            body, sig = LocalStore(root).get(own[0]).split(b"\n", 1)
            verify_key.verify(body + b"\n", sig, name=own[0], context=RUN_CONTEXT)
            assert json.loads(body)["registered_through"] == 1
            assert any(
                "epochs/e00000002.json: taken by a record this publisher did not write" in r.getMessage()
                for r in caplog.records
            ), caplog.text
            # the first publisher, frozen past its lease, wakes and commits the delta it was writing
            late = ObjectWriter(
                store=LocalStore(root), signing_key=SigningKey.from_file(key_path), run_id=run, lease_epoch=1
            )
            weights = stream.step()
            write_delta(late, compute_delta(truth[1], weights), state=weights, version=2, base=last)
            with pytest.raises(FencedObject, match="written under publisher lease epoch 1, but epoch 2 took run"):
                read_weights(LocalStore(root), 2, trust=Trust(verify_key=verify_key, run_id=run))
            with pytest.raises(FencedObject):
                read_weights(LocalStore(root), 2, trust=Trust(verify_key=verify_key))
            pub_key = f"{key_path}.pub"
            assert main(["verify", str(root), "--version", "2", "--public-key", pub_key, "--run-id", run]) == 1
            # the live publisher goes on: its first object is an anchor, read before the fenced delta beside it
            truth |= _publish(second, stream, 2)
    assert sorted(truth) == [0, 1, 2, 3] and read_manifest(LocalStore(root), 2, "anchor").lease_epoch == 2
    for version in (2, 3):
        trust = Trust(verify_key=verify_key, run_id=run)
        assert_bit_equal(read_weights(LocalStore(root), version, trust=trust), truth[version])


# ---------------------------------------------------------------------------------------------- ls


def test_ls_lists_what_it_can_and_marks_what_it_cannot_read(
    tmp_path: Path, publisher_key: tuple[Path, VerifyKey], capsys: pytest.CaptureFixture[str]
) -> None:
    """One planted ``manifest.json`` of ``{}`` never makes ``deltasync ls --public-key`` exit 1 with
    ``FormatError``, listing nothing: it lists what it can and marks what it cannot read."""
    key_path, _ = publisher_key
    root = tmp_path / "store"
    with Publisher(LocalStore(root), None, _config(key_path)) as pub:
        _publish(pub, _stream(6), 3)
    store = LocalStore(root)
    store.put("v00000007/manifest.json", b"{}")
    store.put("v00000008/anchor/manifest.json", b" " * (16 * 1024 * 1024 + 1))
    pub_key = f"{key_path}.pub"
    assert main(["ls", str(root), "--public-key", pub_key, "--json"]) == 0
    rows = {(r["version"], r["kind"]): r for r in json.loads(capsys.readouterr().out)}
    assert [rows[(v, k)]["status"] for v, k in [(0, "anchor"), (1, "delta"), (2, "delta")]] == ["ok"] * 3
    assert rows[(7, "delta")]["status"].startswith("UNREADABLE: ") and rows[(7, "delta")]["nnz"] is None
    assert "'kind'" in rows[(7, "delta")]["status"] or "kind" in rows[(7, "delta")]["status"], rows[(7, "delta")]
    assert (
        rows[(8, "anchor")]["status"].startswith("UNREADABLE: ") and "16777217 bytes" in rows[(8, "anchor")]["status"]
    )
    assert main(["ls", str(root), "--public-key", pub_key]) == 0
    out, err = capsys.readouterr()
    assert "UNREADABLE" in out and "5 objects in" in out and "readers refuse them" in err, (out, err)


# ---------------------------------------------------------------------------------------------- S3


def test_on_s3_a_planted_run_record_and_a_squatted_version_key_only_delay_the_publisher(
    s3_store: S3Store, publisher_key: tuple[Path, VerifyKey], server: ServerThread
) -> None:
    """The same planter on S3 (moto), through the store API: the planted record is refused with what to do, and
    once the operator removed it a squatted version key is skipped."""
    key_path, verify_key = publisher_key
    s3_store.put(RUN_KEY, (json.dumps({"format_version": "1.4", "run_id": _public_run_id(server)}) + "\n").encode())
    stream = _stream(7)
    with _client(server) as client:
        with pytest.raises(ForeignObject, match=r"run.json: this publisher did not write the store's run record"):
            Publisher(s3_store, client, _config(key_path))
        s3_store.delete(RUN_KEY)
        with Publisher(s3_store, client, _config(key_path)) as pub:
            truth = _publish(pub, stream, 2)
            s3_store.put("v00000002/manifest.sig", b"squat")
            truth |= _publish(pub, stream, 1)
    assert sorted(truth) == [0, 1, 3]
    run = str(json.loads(s3_store.get(RUN_KEY).split(b"\n")[0])["run_id"])
    for version, weights in truth.items():
        assert_bit_equal(read_weights(s3_store, version, trust=Trust(verify_key=verify_key, run_id=run)), weights)


@pytest.mark.parametrize("lease", [True, False], ids=["with a lease", "without"])
def test_every_rank_hears_of_a_key_squatted_on_another_rank_and_moves_on_alike(
    tmp_path: Path, server: ServerThread, monkeypatch: pytest.MonkeyPatch, lease: bool
) -> None:
    """FSDP: each rank writes its own shard, so a squat only one rank meets must reach every rank, with rank 0's
    decision (the next free version, or stop), else the ranks part ways and wait on each other for ever."""
    ranks = _ThreadRanks(2)
    monkeypatch.setattr(_commit, "dist", ranks)
    store = LocalStore(tmp_path / "store")
    spans = {0: (0, 16), 1: (16, 28)}
    views = {r: {"w": TensorView((7, 4), spans[r], True)} for r in spans}
    full = [torch.randn(7, 4, generator=torch.Generator().manual_seed(v)).bfloat16() for v in range(2)]
    store.put("v00000001/shard-00001.safetensors", b"squat")  # rank 1's shard of v1
    client = _client(server)
    keeper = LeaseKeeper(client, client.acquire_lease("fsdp", ttl_s=60), 60) if lease else None
    outcomes: dict[int, object] = {}

    def rank(r: int) -> None:
        commit = _commit.RankCommit(
            ObjectWriter(store=store),
            client if r == 0 and lease else None,
            keeper if r == 0 else None,
            rank=r,
            world=2,
            group="gloo",
        )
        local = [{"w": f.view(-1)[spans[r][0] : spans[r][1]].reshape(-1, 4).clone()} for f in full]
        commit.publish(
            0, "anchor", dense_entries(local[0], views[r]), base_version=None, views=views[r], dtype_name="BF16"
        )
        deltas = [globalize(d, local[1]["w"], views[r]["w"])[0] for d in compute_delta(local[0], local[1]).values()]
        try:
            commit.publish(1, "delta", deltas, base_version=0, views=views[r], dtype_name="BF16")
            outcomes[r] = "committed"
        except VersionTaken as exc:
            outcomes[r] = (exc.key, exc.next_free, "Without a coordinator" in str(exc))
            if exc.next_free is not None:
                commit.publish(exc.next_free, "delta", deltas, base_version=0, views=views[r], dtype_name="BF16")

    ranks.run(spans, rank, outcomes.__setitem__)
    if keeper is not None:
        keeper.close()
    client.close()
    expected = (
        ("v00000001/shard-00001.safetensors", 2, False) if lease else ("v00000001/shard-00001.safetensors", None, True)
    )
    assert outcomes == {0: expected, 1: expected}
    if lease:
        assert_bit_equal(read_weights(store, 2), {"w": full[1]})


@pytest.mark.parametrize("record", [b"junk\n", b"signature-cut"], ids=["garbage", "signature line cut"])
def test_a_run_record_replaced_after_publishing_does_not_stop_a_restarted_publisher(
    tmp_path: Path,
    publisher_key: tuple[Path, VerifyKey],
    server: ServerThread,
    caplog: pytest.LogCaptureFixture,
    record: bytes,
) -> None:
    """A trainer restarts (a crash, a preemption, the run's next job) after a store writer replaced run.json: the
    objects its key signed in the store name its run, so the record is ignored with a warning and publishing goes
    on; a key-only reader reads the new version."""
    key_path, verify_key = publisher_key
    root = tmp_path / "store"
    with _client(server) as client, Publisher(LocalStore(root), client, _config(key_path)) as pub:
        _publish(pub, _stream(0), 2)
    original = (root / RUN_KEY).read_bytes()
    (root / RUN_KEY).unlink()
    (root / RUN_KEY).write_bytes(original.split(b"\n")[0] + b"\n" if record == b"signature-cut" else record)
    with caplog.at_level(logging.WARNING, logger="deltasync.runrecord"), _client(server) as client:
        with Publisher(LocalStore(root), client, _config(key_path)) as pub:
            truth = _publish(pub, _stream(1), 1)
    assert any("not written by this publisher" in m and "which it goes on publishing" in m for m in caplog.messages)
    [(version, weights)] = truth.items()
    assert_bit_equal(read_weights(LocalStore(root), version, trust=Trust(verify_key=verify_key)), weights)
