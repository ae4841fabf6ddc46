"""S3Store against moto's real S3 server, with faults injected by a TCP proxy in front of it: throttling, cut
connections, lying sizes, racing writers, a service that ignores If-None-Match, keys that are not ours."""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltasync import ObjectExists, ObjectNotFound, ObjectTooLarge, StoreError, UnsafeObject, open_store
from deltasync.cli import main
from deltasync.publisher import Publisher
from deltasync.store.s3 import S3Store, S3Transfer, parse_bucket_uri, with_s3_endpoint
from deltasync.testing.s3 import MotoServer
from deltasync.testing.stream import UpdateStream
from tests.support.s3 import FaultProxy
from tests.unit.conftest import S3_BUCKET


@pytest.fixture
def proxy(moto_server: MotoServer) -> Iterator[FaultProxy]:
    with FaultProxy(moto_server.port) as p:
        yield p


def through(proxy: FaultProxy, retries: int = 3, conditional_writes: bool | None = None, **transfer: int) -> S3Store:
    """A store whose every request goes through the fault proxy, under a fresh prefix."""
    policy = S3Transfer(retries=retries, backoff_s=0.001, **transfer)
    prefix = f"f-{uuid.uuid4().hex[:12]}"
    return S3Store(S3_BUCKET, prefix, endpoint=proxy.url, conditional_writes=conditional_writes, transfer=policy)


def test_503_slowdown_then_success(proxy: FaultProxy, s3_env: None) -> None:
    store = through(proxy)
    store.put("k", b"v" * 100)
    proxy.add(method="GET", path_contains="/k", status=503, times=2)
    assert store.get("k") == b"v" * 100
    assert proxy.count("GET", "/k") == 3
    proxy.add(method="PUT", path_contains="/k2", status=503, times=2)
    store.put("k2", b"w")
    assert store.get("k2") == b"w" and proxy.count("PUT", "/k2") == 3


def test_503_forever_gives_a_clear_error_after_bounded_retries(proxy: FaultProxy, s3_env: None) -> None:
    store = through(proxy, retries=2)
    store.put("k", b"v")
    proxy.add(method="*", status=503, times=None)
    with pytest.raises(
        StoreError, match=r"s3://deltasync-test/f-\w+\?endpoint=.*: head 'k' failed after 3 attempts \(HTTP 503"
    ):
        store.get("k")
    assert proxy.count("HEAD", "/k") == 3
    with pytest.raises(StoreError, match=r"throttling or unreachable: retry later"):
        store.put("k3", b"v")


def test_a_connection_cut_mid_download_is_retried(proxy: FaultProxy, s3_env: None) -> None:
    store = through(proxy)
    data = os.urandom(3 << 20)
    store.put("k", data)
    proxy.add(method="GET", path_contains="/k", cut_after=100_000, times=1)
    assert store.get("k") == data
    assert proxy.count("GET", "/k") == 2
    proxy.add(method="GET", path_contains="/k", cut_after=100_000, times=1)
    with store.open("k") as f:
        assert f.read() == data


def test_a_connection_cut_every_time_is_an_error_never_short_bytes(proxy: FaultProxy, s3_env: None) -> None:
    store = through(proxy, retries=2)
    data = os.urandom(1 << 20)
    store.put("k", data)
    proxy.add(method="GET", path_contains="/k", cut_after=1000, times=None)
    for read in (lambda: store.get("k"), lambda: store.open("k").read()):
        with pytest.raises(StoreError, match=r"get 'k' failed after 3 attempts \(transport error"):
            read()


def test_a_lying_head_is_refused_not_trusted(proxy: FaultProxy, s3_env: None) -> None:
    """A HEAD that says fewer bytes than the object holds must not yield a prefix of it; more must not pass."""
    store = through(proxy)
    store.put("k", b"x" * 1000)
    proxy.add(method="HEAD", path_contains="/k", content_length=10, times=None)
    with pytest.raises(StoreError, match=r"'k': its HEAD said 10 bytes but its GET says 1000"):
        store.get("k", max_bytes=100)
    proxy.clear()
    proxy.add(method="HEAD", path_contains="/k", content_length=5000, times=None)
    with pytest.raises(StoreError, match=r"its HEAD said 5000 bytes but its GET says 1000"):
        store.get("k")
    with pytest.raises(ObjectTooLarge, match="5000 bytes, more than the 999 allowed"):
        store.get("k", max_bytes=999)


def test_a_missing_key(s3_store: S3Store, moto_server: MotoServer) -> None:
    for call in (s3_store.get, s3_store.open, s3_store.size, s3_store.delete):
        with pytest.raises(ObjectNotFound, match="no object 'missing'"):
            call("missing")
    assert not s3_store.exists("missing")
    nowhere = S3Store("no-such-bucket", endpoint=moto_server.url, transfer=S3Transfer(backoff_s=0.001))
    with pytest.raises(StoreError, match="the bucket 'no-such-bucket' does not exist; create it first"):
        nowhere.put("k", b"1")
    with pytest.raises(ObjectNotFound, match="the bucket 'no-such-bucket' does not exist"):
        nowhere.list()


@pytest.mark.parametrize("multipart", [False, True])
def test_writers_racing_on_one_key_exactly_one_wins(moto_server: MotoServer, s3_env: None, multipart: bool) -> None:
    """Four writers, one key: one wins, three get ObjectExists.

    moto's conditional PUT and CompleteMultipartUpload check If-None-Match and then write, with no lock between
    (``moto/s3/responses.py``, ``moto/s3/models.py``): straight against moto, all four writers can "win" and the
    last one's bytes stay. S3 makes the check and the write one step, so the proxy forwards one PUT or
    POST at a time to model it. This test shows S3Store's side of the race (its retries and its reading back of
    a 412 never turn another's win into its own); it does not show that a service without atomic conditional
    writes is safe: see the S3Store module docstring."""
    with FaultProxy(moto_server.port, serialize_writes=True) as proxy:
        race(through(proxy, multipart_bytes=5 << 20), multipart)


def race(store: S3Store, multipart: bool) -> None:
    size = (6 << 20) if multipart else 1000
    payloads = [bytes([i]) * size for i in range(4)]
    barrier = threading.Barrier(len(payloads))
    outcomes: list[str] = [""] * len(payloads)

    def write(i: int) -> None:
        barrier.wait()
        try:
            store.put("v00000001/manifest.json", payloads[i])
            outcomes[i] = "won"
        except ObjectExists:
            outcomes[i] = "exists"

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["exists"] * (len(payloads) - 1) + ["won"]
    assert store.get("v00000001/manifest.json") == payloads[outcomes.index("won")]
    assert store.list() == ["v00000001/manifest.json"]  # no staging object left behind, none listed


def test_a_retried_put_whose_first_attempt_landed_succeeds(proxy: FaultProxy, s3_env: None) -> None:
    """The PUT reached the store but its answer was lost: the retry's 412 is our own object, not another's."""
    store = through(proxy)
    store.put("warm", b"")  # the conditional-write probe, out of the way
    proxy.add(method="PUT", path_contains="/k", cut_after=0, times=1)
    store.put("k", b"mine")
    assert store.get("k") == b"mine" and proxy.count("PUT", "/k") == 2
    proxy.add(method="PUT", path_contains="/k", cut_after=0, times=1)
    with pytest.raises(ObjectExists):  # a retried put over another writer's bytes is still refused
        store.put("k", b"other")


def test_a_service_that_ignores_if_none_match_falls_back_to_head_then_put(
    proxy: FaultProxy, s3_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    proxy.add(method="PUT", drop_header="If-None-Match", times=None)
    store = through(proxy)
    with caplog.at_level(logging.WARNING, "deltasync.store.s3"):
        store.put("k", b"first")
    assert "ignores If-None-Match: writes fall back to HEAD-then-PUT" in caplog.text
    with pytest.raises(ObjectExists, match="create-only"):
        store.put("k", b"second")
    with pytest.raises(ObjectExists, match="create-only"):
        store.put_many([("k2", b"1"), ("k", b"2")])
    assert store.get("k") == b"first" and not store.exists("k2")
    assert store.list() == ["k"]  # the probe object was removed


def test_keys_that_are_not_ours_are_skipped_when_listed(moto_server: MotoServer, s3_store: S3Store) -> None:
    s3_store.put("v00000001/manifest.json", b"{}")
    client = moto_server.boto3()
    for bad in ["../x", "a//b", ".hidden", "sp ace", "v00000001/.tmp", "v00000001/", "%2e%2e/y", "a\\b"]:
        client.put_object(Bucket=S3_BUCKET, Key=f"{s3_store.prefix}/{bad}", Body=b"evil")
    client.put_object(Bucket=S3_BUCKET, Key=f"{s3_store.prefix}-sibling/v00000002/manifest.json", Body=b"{}")
    assert s3_store.list() == ["v00000001/manifest.json"]
    assert s3_store.list("v00000001/") == ["v00000001/manifest.json"]
    with pytest.raises(ValueError, match="store key"):
        s3_store.get("../x")


def test_big_objects_go_up_in_parts_and_come_back_in_ranges(
    moto_server: MotoServer, s3_env: None, tmp_path: Path
) -> None:
    store = S3Store(
        S3_BUCKET,
        f"b-{uuid.uuid4().hex[:12]}",
        endpoint=moto_server.url,
        transfer=S3Transfer(multipart_bytes=5 << 20, parallel_bytes=5 << 20, part_bytes=5 << 20),
    )
    src = tmp_path / "anchor.bin"
    src.write_bytes(os.urandom(12 << 20))
    store.put_file("v00000001/anchor/shard-00000.safetensors", src)
    assert store.get("v00000001/anchor/shard-00000.safetensors") == src.read_bytes()
    head = moto_server.boto3().head_object(
        Bucket=S3_BUCKET, Key=f"{store.prefix}/v00000001/anchor/shard-00000.safetensors"
    )
    assert head["ContentLength"] == 12 << 20
    with pytest.raises(ObjectExists, match="create-only"):
        store.put_file("v00000001/anchor/shard-00000.safetensors", src)
    assert store.list() == ["v00000001/anchor/shard-00000.safetensors"]


def test_uris_endpoints_and_credentials(moto_server: MotoServer, s3_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_bucket_uri("s3://bkt/a/b/") == ("s3", "bkt", "a/b", None)
    assert parse_bucket_uri("s3://bkt?endpoint=http://h:9000") == ("s3", "bkt", "", "http://h:9000")
    for bad, message in [
        ("s3://bkt/../x", "store key"),
        ("s3:///x", "expected s3://<bucket>"),
        ("s3://bkt?region=x", "unknown query parameters"),
        ("gs://bkt?endpoint=http://h", "s3:// URIs only"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_bucket_uri(bad)
    with pytest.raises(ValueError, match="--s3-endpoint applies to s3:// URIs only"):
        open_store("/tmp/x", s3_endpoint="http://h")
    with pytest.raises(ValueError, match="names endpoint 'http://a'"):
        with_s3_endpoint("s3://bkt?endpoint=http://a", "http://b")
    explicit = open_store("s3://deltasync-test/u1", s3_endpoint=moto_server.url)
    assert isinstance(explicit, S3Store) and explicit.uri == f"s3://deltasync-test/u1?endpoint={moto_server.url}"
    assert open_store(explicit.uri).uri == explicit.uri
    explicit.put("k", b"1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server.url)  # the S3-specific one wins
    from_env = open_store("s3://deltasync-test/u1")
    assert from_env.uri == "s3://deltasync-test/u1" and from_env.get("k") == b"1"


def test_gcs_and_azure_open_but_are_untested_beyond_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    gs = open_store("gs://bucket/run1")
    assert isinstance(gs, S3Store) and gs.uri == "gs://bucket/run1"
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    with pytest.raises(ValueError, match="set AZURE_STORAGE_ACCOUNT_NAME"):
        open_store("az://container/run1")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "account")
    assert open_store("az://container/run1").uri == "az://container/run1"


def test_cli_ls_and_verify_take_s3_endpoint(
    moto_server: MotoServer, s3_store: S3Store, update_stream: UpdateStream, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's commands: publish into s3://, then `deltasync ls` and `deltasync verify` with --s3-endpoint."""
    uri = f"s3://{S3_BUCKET}/{s3_store.prefix}"
    assert main(["ls", uri, "--s3-endpoint", moto_server.url, "--json"]) == 0
    assert capsys.readouterr().out.strip() == "[]"
    with Publisher(s3_store) as pub:
        pub.publish(update_stream.bf16(), 0)
        pub.publish(update_stream.step(), 1)
    assert main(["ls", uri, "--s3-endpoint", moto_server.url, "--json"]) == 0
    assert [(row["version"], row["kind"]) for row in json.loads(capsys.readouterr().out)] == [
        (0, "anchor"),
        (1, "delta"),
    ]
    assert main(["verify", uri, "--s3-endpoint", moto_server.url, "--version", "1"]) == 0
    assert capsys.readouterr().out.startswith("v1: ok")
    assert main(["ls", "/tmp/nowhere", "--s3-endpoint", moto_server.url]) == 2
    assert "--s3-endpoint applies to s3:// URIs only" in capsys.readouterr().err


def test_a_service_that_ignores_if_none_match_on_multipart_complete(
    proxy: FaultProxy, s3_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Small objects stay conditional; large ones (a create-only copy) fall back to HEAD-then-upload."""
    proxy.add(method="POST", drop_header="If-None-Match", times=None)  # CompleteMultipartUpload is a POST
    store = through(proxy, multipart_bytes=5 << 20)
    big = os.urandom(5 << 20)
    with caplog.at_level(logging.WARNING, "deltasync.store.s3"):
        store.put("small", b"1")
        store.put("big", big)
    assert "ignores If-None-Match on CompleteMultipartUpload" in caplog.text
    assert "ignores If-None-Match: writes fall back" not in caplog.text
    for key, data in (("small", b"2"), ("big", big[::-1])):
        with pytest.raises(ObjectExists, match="create-only"):
            store.put(key, data)
    assert store.get("big") == big and store.list() == ["big", "small"]


def test_uris_refuse_odd_buckets_and_endpoints() -> None:
    for bad in ["s3://user:secret@bucket/x", "s3://Bucket", "s3://b", "s3://b_/x"]:
        with pytest.raises(ValueError, match="must be 3\\+ lowercase"):
            parse_bucket_uri(bad)
    for endpoint in ["ftp://h", "http://user:pw@h:9000", "h:9000"]:
        with pytest.raises(ValueError, match="http:// or https:// URL with a host and no credentials"):
            with_s3_endpoint("s3://bucket", endpoint)


@pytest.mark.parametrize("key", ["../x", "a/../../b", "./a", "a//b", "/abs", "a\\b", "a/.hidden", "%2e%2e/x", ""])
def test_every_method_checks_its_key(s3_store: S3Store, tmp_path: Path, key: str) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"x")
    for call in (
        lambda: s3_store.put(key, b"x"),
        lambda: s3_store.put_many([("ok", b"x"), (key, b"x")]),
        lambda: s3_store.put_file(key, src),
        lambda: s3_store.get(key),
        lambda: s3_store.open(key),
        lambda: s3_store.size(key),
        lambda: s3_store.exists(key),
        lambda: s3_store.delete(key),
        lambda: s3_store.list(key.rstrip("/") + "/"),
    ):
        with pytest.raises(ValueError, match="store key|prefix"):
            call()
    assert not s3_store.exists("ok")  # a batch with one bad key writes none


def test_a_lost_answer_to_the_probe_never_surfaces_as_objectexists(proxy: FaultProxy, s3_env: None) -> None:
    """The probe's first PUT lands but its answer is lost; its retry must not meet its own probe."""
    proxy.add(method="PUT", path_contains=".deltasync-probe", cut_after=0, times=1)
    store = through(proxy)
    store.put("k", b"new")
    assert store.get("k") == b"new" and store.list() == ["k"]
    assert store._conditional is True  # the service was found to honour If-None-Match


def test_faults_on_the_probes_are_retried_like_any_request(proxy: FaultProxy, s3_env: None) -> None:
    """A 503 on the probe's second PUT, or on either probe copy, is retried, not raised raw."""
    proxy.add(method="PUT", path_contains=".deltasync-probe", status=503, skip=1, times=1)
    proxy.add(method="POST", path_contains=".copy-", status=503, times=1)  # the first copy's first request
    proxy.add(method="POST", path_contains=".copy-", status=503, skip=3, times=1)  # the second copy's
    store = through(proxy, multipart_bytes=5 << 20)
    store.put("small", b"1")
    big = os.urandom(5 << 20)
    store.put("big", big)
    assert store._conditional is True and store._conditional_copy is True
    assert all(rule.hits for rule in proxy.rules)
    assert store.get("big") == big and store.list() == ["big", "small"]


def test_a_409_conditional_conflict_is_retried_a_412_is_objectexists(proxy: FaultProxy, s3_env: None) -> None:
    """obstore maps both 409 and 412 to AlreadyExistsError; only the 412 means the key is taken."""
    store = through(proxy, conditional_writes=True)
    proxy.add(method="PUT", path_contains="/k", status=409, times=1)
    store.put("k", b"mine")
    assert store.get("k") == b"mine" and proxy.count("PUT", "/k") == 2
    proxy.add(method="PUT", path_contains="/k2", status=412, times=1)
    with pytest.raises(ObjectExists, match="'k2' exists"):
        store.put("k2", b"x")


def test_an_object_rewritten_mid_read_is_refused_even_if_if_match_is_dropped(
    proxy: FaultProxy, moto_server: MotoServer, s3_env: None
) -> None:
    """Deleted and re-written between two ranged GETs, behind a proxy that drops If-Match: the
    second answer's ETag is not the pinned one, so no A-then-B bytes come back."""
    store = through(proxy, part_bytes=5 << 20)
    store.put("k", b"A" * (6 << 20))
    proxy.add(method="GET", path_contains="/k", drop_header="If-Match", times=None)
    with store.open("k") as f:
        assert f.read(5 << 20) == b"A" * (5 << 20)
        client = moto_server.boto3()
        client.delete_object(Bucket=S3_BUCKET, Key=f"{store.prefix}/k")
        client.put_object(Bucket=S3_BUCKET, Key=f"{store.prefix}/k", Body=b"B" * (6 << 20))
        with pytest.raises(StoreError, match=r"'k' changed while it was read \(its HEAD gave ETag"):
            f.read()


def test_reads_need_an_etag_on_head_and_on_every_get(proxy: FaultProxy, s3_env: None) -> None:
    """Without an ETag a read cannot be pinned to one version; it is refused, not read unpinned."""
    store = through(proxy)
    store.put("k", b"x" * 100)
    proxy.add(method="HEAD", path_contains="/k", drop_response_header="ETag", times=None)
    for read in (lambda: store.get("k"), lambda: store.open("k")):
        with pytest.raises(StoreError, match="'k': its HEAD carries no ETag"):
            read()
    proxy.clear()
    proxy.add(method="GET", path_contains="/k", drop_response_header="ETag", times=None)
    with pytest.raises(StoreError, match="'k' changed while it was read"):
        store.get("k")


def test_a_huge_head_claim_is_confirmed_before_it_is_allocated(proxy: FaultProxy, s3_env: None) -> None:
    """A HEAD claiming 10**15 bytes gives a StoreError from the first GET, not a MemoryError."""
    store = through(proxy)
    store.put("k", b"x" * 1000)
    proxy.add(method="HEAD", path_contains="/k", content_length=10**15, times=None)
    for read in (lambda: store.get("k"), lambda: store.open("k").read()):
        with pytest.raises(StoreError, match=r"its HEAD said 1000000000000000 bytes but its GET says 1000"):
            read()


def test_a_service_that_ignores_range_is_a_permanent_error(proxy: FaultProxy, s3_env: None) -> None:
    """A 200 with the whole object to a ranged GET is refused at once, not retried as throttling."""
    store = through(proxy)
    store.put("k", b"x" * 1000)
    proxy.add(method="GET", path_contains="/k", drop_header="Range", times=None)
    with pytest.raises(StoreError, match="ignores Range"):
        store.get("k")
    assert proxy.count("GET", "/k") == 1


@pytest.mark.parametrize("kind", ["device", "fifo", "directory"])
def test_put_file_refuses_what_is_not_a_regular_file(s3_store: S3Store, tmp_path: Path, kind: str) -> None:
    """/dev/zero or a FIFO would be read without end; they are refused before a byte is read."""
    path = {"device": Path("/dev/zero"), "fifo": tmp_path / "fifo", "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(UnsafeObject, match=f"{path}: not a regular file"):
        s3_store.put_file("k", path)
    assert not s3_store.exists("k")


def test_put_file_streams_a_large_file_bounded_to_its_size(s3_store: S3Store, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(6 << 20))
    store = S3Store(
        s3_store.bucket, s3_store.prefix, endpoint=s3_store.endpoint, transfer=S3Transfer(multipart_bytes=5 << 20)
    )
    store.put_file("big", src)
    assert store.get("big") == src.read_bytes()


def test_a_listing_that_ignores_the_prefix_never_yields_other_runs_keys(
    proxy: FaultProxy, s3_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys outside ``prefix/`` (a service that ignores ``prefix=``) are skipped, not cut blindly."""
    other, store = through(proxy), through(proxy)
    other.put("v00000009/manifest.json", b"{}")
    store.put("v00000001/manifest.json", b"{}")
    proxy.add(method="GET", path_contains="list-type=2", drop_query="prefix", times=None)
    with caplog.at_level(logging.WARNING, "deltasync.store.s3"):
        assert store.list() == ["v00000001/manifest.json"]
        assert store.list("v00000001/") == ["v00000001/manifest.json"]
    assert f"{other.prefix}/v00000009/manifest.json': outside the prefix" in caplog.text


def test_endpoints_with_a_path_query_or_fragment_and_repeated_endpoints_are_refused() -> None:
    """http://h/other would move every request into the bucket 'other'."""
    for endpoint in ["http://127.0.0.1:9000/other", "http://h/a/b", "http://h?x=1", "http://h#f"]:
        with pytest.raises(ValueError, match=r"must be scheme://host\[:port\] only, with no path"):
            with_s3_endpoint("s3://bucket", endpoint)
        with pytest.raises(ValueError, match="no path, query or fragment"):
            S3Store("bucket", endpoint=endpoint)
    assert with_s3_endpoint("s3://bucket", "http://h:9000/").endswith("?endpoint=http://h:9000/")
    with pytest.raises(ValueError, match="endpoint= is given 2 times"):
        parse_bucket_uri("s3://bucket?endpoint=http://a&endpoint=http://b")


def test_a_key_longer_than_s3_allows_under_the_prefix_is_refused(s3_store: S3Store) -> None:
    """S3 keys are at most 1024 bytes, the prefix included."""
    key = "/".join(["a" * 202] * 5)  # 1014 characters: a valid store key, too long under the prefix
    with pytest.raises(ValueError, match="more than the 1024 an S3 key may have"):
        s3_store.put(key, b"x")


def test_reads_from_a_missing_bucket_name_the_bucket(moto_server: MotoServer, s3_env: None) -> None:
    """A HEAD's 404 has no body; a missing bucket is told apart by one listing, not called 'no object'."""
    nowhere = S3Store("no-such-bucket", endpoint=moto_server.url, transfer=S3Transfer(backoff_s=0.001))
    for call in (nowhere.get, nowhere.open, nowhere.size, nowhere.exists):
        with pytest.raises(StoreError, match="the bucket 'no-such-bucket' does not exist") as info:
            call("k")
        assert not isinstance(info.value, ObjectNotFound)
