"""Keys planted under an ``s3://`` store's prefix by something other than deltasync (an empty segment,
``..``, ``.``) are skipped with a warning, on every path: a read that meets a 404 (its one-object listing after
the HEAD), ``exists``, ``list``, ``delete``, ``read_weights``, the CLI and GC; obstore's raw ``InvalidPathError``
never comes out of a read that meets a 404 (``deltasync verify`` would print a traceback).

The keys are planted with boto3 straight into moto's real S3 server, bypassing the store; everything else goes
through the public API."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from deltasync import ObjectNotFound, Publisher, StoreError, read_weights
from deltasync.cli import main
from deltasync.layout import manifest_key
from deltasync.store.s3 import S3Store, S3Transfer
from deltasync.testing.s3 import MotoServer
from deltasync.testing.stream import UpdateStream
from tests.conftest import assert_bit_equal
from tests.support.asgi import PUB, Coordinator, make_settings, open_coordinator, weights_store
from tests.unit.conftest import S3_BUCKET

# Relative to the store's prefix. Each is a key S3 stores as given and obstore refuses to parse.
HOSTILE = ["/v00000001/manifest.json", "../x", "./y", "v00000001//shard-00000.safetensors"]


def plant(moto_server: MotoServer, store: S3Store, keys: list[str]) -> None:
    """Write ``keys`` under the store's prefix with a raw boto3 client, as another tool would."""
    client = moto_server.boto3()
    for key in keys:
        client.put_object(Bucket=S3_BUCKET, Key=f"{store.prefix}/{key}", Body=b"not deltasync's")


def fresh(store: S3Store) -> S3Store:
    """Another store on the same prefix: nothing cached (a bucket not yet seen, no key yet warned about)."""
    return S3Store(store.bucket, store.prefix, endpoint=store.endpoint, transfer=S3Transfer(backoff_s=0.001))


@pytest.mark.parametrize("hostile", HOSTILE)
def test_a_hostile_key_never_turns_a_404_into_a_raw_obstore_error(
    moto_server: MotoServer, s3_store: S3Store, caplog: pytest.LogCaptureFixture, hostile: str
) -> None:
    """Each read that meets a 404 on a store not yet sure its bucket exists lists one object; that listing
    meets the hostile key. The missing key is ObjectNotFound, as without the hostile key."""
    s3_store.put("v00000002/manifest.json", b"{}")
    plant(moto_server, s3_store, [hostile])
    missing = "v00000005/manifest.json"
    for call in (
        lambda s: s.get(missing),
        lambda s: s.open(missing),
        lambda s: s.size(missing),
        lambda s: s.delete(missing),
    ):
        with pytest.raises(ObjectNotFound, match=f"no object '{missing}'$"):
            call(fresh(s3_store))
    assert not fresh(s3_store).exists(missing)
    store = fresh(s3_store)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "deltasync.store"):
        assert not store.exists(missing) and not store.exists("v00000006/manifest.json")
        assert store.list() == ["v00000002/manifest.json"]
    warned = [r.getMessage() for r in caplog.records if "skipping listed key" in r.getMessage()]
    assert warned and all("not a deltasync key" in m for m in warned)
    assert len(warned) == len(set(warned))  # once per key and store, however often it is met
    assert any(repr(hostile) in m for m in warned)
    store.put("v00000003/manifest.json", b"{}")  # writes (the conditional-write probe included) still work
    store.delete("v00000003/manifest.json")
    assert store.list() == ["v00000002/manifest.json"]


def test_read_weights_beside_hostile_keys(
    moto_server: MotoServer, s3_store: S3Store, update_stream: UpdateStream
) -> None:
    """A committed version still rebuilds; an unpublished one is ObjectNotFound naming it, not InvalidPathError."""
    with Publisher(s3_store) as pub:
        pub.publish(update_stream.bf16(), 0)
        pub.publish(update_stream.step(), 1)
    expected = update_stream.bf16()
    plant(moto_server, s3_store, HOSTILE)
    assert_bit_equal(read_weights(fresh(s3_store), 1), expected)
    with pytest.raises(ObjectNotFound, match="version 5 is not committed") as info:
        read_weights(fresh(s3_store), 5)
    assert isinstance(info.value, StoreError)


def test_cli_verify_and_ls_beside_hostile_keys(
    moto_server: MotoServer,
    s3_store: S3Store,
    update_stream: UpdateStream,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``deltasync verify`` of an unpublished version: exit 1, its last line ``ObjectNotFound: ...``, no
    traceback; ``verify`` of a published one and ``ls`` still work, warning about the planted keys."""
    with Publisher(s3_store) as pub:
        pub.publish(update_stream.bf16(), 0)
        pub.publish(update_stream.step(), 1)
    plant(moto_server, s3_store, HOSTILE)
    uri, endpoint = f"s3://{S3_BUCKET}/{s3_store.prefix}", ["--s3-endpoint", moto_server.url]
    missing = subprocess.run(  # in a process of its own, as a user runs it, on the code under test
        [sys.executable, "-m", "deltasync.cli", "verify", uri, *endpoint, "--version", "5"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert (missing.returncode, missing.stdout) == (1, "")
    assert "Traceback" not in missing.stderr
    *warnings, last = missing.stderr.splitlines()
    assert last == f"ObjectNotFound: {uri}?endpoint={moto_server.url}: version 5 is not committed"
    assert all("WARNING" in w and "skipping listed key" in w for w in warnings)
    assert main(["verify", uri, *endpoint, "--version", "1"]) == 0
    assert capsys.readouterr().out.startswith("v1: ok")
    caplog.clear()
    with caplog.at_level(logging.WARNING, "deltasync"):
        assert main(["ls", uri, *endpoint]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"2 objects in {uri}?endpoint={moto_server.url}")
    for key in ("../x", "./y", "/v00000001/manifest.json", "v00000001//shard-00000.safetensors"):
        assert f"skipping listed key {key!r}: not a deltasync key" in caplog.text


@pytest.mark.anyio
async def test_gc_beside_hostile_keys_proves_deletes_and_reports_cleanly(
    moto_server: MotoServer, s3_store: S3Store, tmp_path: Path
) -> None:
    """GC on an s3:// store with planted keys: the newest anchor's manifest is gone, so proving it meets a 404;
    the problem reported is ObjectNotFound (not InvalidPathError), an older anchor is proven and GC deletes."""
    settings = make_settings(tmp_path, store=f"s3://{S3_BUCKET}/{s3_store.prefix}", s3_endpoint=moto_server.url)
    app, http = await open_coordinator(settings)
    async with http:
        coord = Coordinator(app, http)
        await weights_store(coord, s3_store, 6, anchors=(3, 6))  # any Store will do
        plant(moto_server, s3_store, HOSTILE)
        moto_server.boto3().delete_object(Bucket=S3_BUCKET, Key=f"{s3_store.prefix}/{manifest_key(6, 'anchor')}")
        response = await http.post("/v1/gc", headers=PUB)
    app.state.db.close()
    assert response.status_code == httpx.codes.OK, response.text
    report = response.json()
    assert report["kept_anchor"] == 3
    assert len(report["problems"]) == 1
    assert report["problems"][0].startswith("anchor v6 cannot be proven intact (ObjectNotFound: ")
    deleted = [(x["version"], x["kind"]) for x in report["deleted"]]
    assert deleted == [(0, "anchor"), (1, "delta"), (2, "delta"), (3, "delta")]
    assert fresh(s3_store).list("v00000000/") == []


def test_a_hostile_key_is_warned_about_once_per_store(
    moto_server: MotoServer, s3_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The after-404 listing runs once per store (a bucket seen is not asked about again): many misses, one
    listing, one warning."""
    store = S3Store(
        S3_BUCKET, f"h-{uuid.uuid4().hex[:12]}", endpoint=moto_server.url, transfer=S3Transfer(backoff_s=0.001)
    )
    plant(moto_server, store, ["../x"])
    with caplog.at_level(logging.WARNING, "deltasync.store"):
        for v in range(5):
            assert not store.exists(f"v{v:08d}/manifest.json")
    assert [r.getMessage() for r in caplog.records] == [f"{store.uri}: skipping listed key '../x': not a deltasync key"]


def test_the_obstore_listing_of_gs_and_az_names_a_hostile_key(moto_server: MotoServer, s3_store: S3Store) -> None:
    """``gs://`` and ``az://`` list through obstore, which aborts a whole listing over a key it cannot parse:
    that is a StoreError naming the key, never obstore's InvalidPathError. Run here through the same obstore
    code against moto's S3 (no GCS or Azure emulator on this machine)."""
    s3_store.put("v00000001/manifest.json", b"{}")
    plant(moto_server, s3_store, ["../x"])
    store = fresh(s3_store)
    store.scheme = "gs"  # list() takes the obstore path; the backend stays moto's S3
    with pytest.raises(
        StoreError, match=r"^gs://deltasync-test/t-\w+\?endpoint=\S+: list '/' met the key '\.\./x', which"
    ) as info:
        store.list()
    assert str(info.value).endswith("something other than deltasync wrote it; delete it")
    assert type(info.value) is StoreError  # what the CLI prints as the class: one of the documented tree
    assert not store.exists("v00000002/manifest.json")  # the after-404 listing meets it too: skipped
