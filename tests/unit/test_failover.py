"""CoordinatorClient over several replicas: failover order, stickiness, run-id refusal, retries that
are safe on another replica, and the give-up message. Real servers on 127.0.0.1: a real coordinator, and
``http.server`` stubs in front of it that fail as replicas do (tests/support/replicas.py); no mocked transport."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deltasync_coordinator.app import create_app

from deltasync import CoordinatorError, LeaseError, LocalStore, RunMismatch
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.config import PublisherConfig
from deltasync.publisher import Publisher
from deltasync.schemas import VersionCreate
from tests.conftest import PUBLISHER_TOKEN, ServerThread, version_body
from tests.support.asgi import make_settings
from tests.support.replicas import ReplicaStub, refused_url


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(create_app(make_settings(tmp_path / "a"))) as s:
        yield s


@pytest.fixture
def replicas(coordinator: ServerThread) -> Iterator[tuple[ReplicaStub, ReplicaStub]]:
    """Two replicas of one ledger: two stubs forwarding to the same coordinator."""
    with ReplicaStub(coordinator.url) as a, ReplicaStub(coordinator.url) as b:
        yield a, b


def client(urls, *, run_id: str | None = None, **retry) -> CoordinatorClient:
    policy = RetryPolicy(**({"backoff_s": 0.01, "retries": 2, "timeout_s": 5.0} | retry))
    return CoordinatorClient(urls, token=PUBLISHER_TOKEN, run_id=run_id, retry=policy)


def test_urls_a_list_or_a_comma_separated_string() -> None:
    a, b = "http://127.0.0.1:1", "http://coord-b:8600"  # one scheme: a mixed list is refused (test_client.py)
    assert CoordinatorClient(f" {a}/ , {b} ,").urls == (a, b) == CoordinatorClient([a, b]).urls
    c = CoordinatorClient(a)
    assert c.urls == (a,) and c.base_url == a and repr(c) == f"CoordinatorClient({a!r})"
    assert repr(CoordinatorClient([a, b])) == f"CoordinatorClient('{a},{b}')"
    with pytest.raises(ValueError, match="need at least one coordinator URL"):
        CoordinatorClient(" , ")
    with pytest.raises(ValueError, match="'coord:8600' must start with http:// or https://"):
        CoordinatorClient("coord:8600")
    with pytest.raises(ValueError, match=f"{a} is listed twice"):
        CoordinatorClient([a, a + "/"])


def test_fails_over_in_order_and_sticks_to_the_replica_that_answers(
    replicas: tuple[ReplicaStub, ReplicaStub],
) -> None:
    a, b = replicas
    down = refused_url()
    with client([down, a.url, b.url]) as c:
        for _ in range(3):
            assert c.health()["status"] == "ok"
        assert c.base_url == a.url and len(a.hits) == 3 and b.hits == []  # the dead one once, then a sticks
        a.mode = "busy"  # a's replica goes down behind its proxy: 503
        c.health()
        assert c.base_url == b.url and len(a.hits) == 4 and len(b.hits) == 1
        a.mode = "forward"  # a is back: the client stays with b (sticky), no flapping
        for _ in range(3):
            c.health()
        assert len(a.hits) == 4 and len(b.hits) == 4
        b.mode = "cut"  # b dies: round robin wraps past the dead URL to a
        c.health()
        assert c.base_url == a.url and len(a.hits) == 5


def test_a_replica_of_another_run_is_refused_never_used(tmp_path: Path, coordinator: ServerThread) -> None:
    """A replica that answers 200 with another run id (another ledger) raises RunMismatch; the client does not
    fail over past it (a wrong replica list is an operator's error and must be loud), but moves on from it:
    once the right replica is back, the next call uses it."""
    with ServerThread(create_app(make_settings(tmp_path / "other"))) as other, ReplicaStub(coordinator.url) as a:
        with client([a.url, other.url]) as c:
            pinned = c.health()["run_id"]
            a.mode = "cut"
            with pytest.raises(RunMismatch, match=rf"the coordinator at {other.url} keeps run run-[0-9a-f]+, this cl"):
                c.latest_version()
            a.mode = "forward"
            assert c.health()["run_id"] == pinned and c.base_url == a.url
        with client([other.url, a.url], run_id=pinned) as c:  # pinned beforehand: the first URL is refused
            with pytest.raises(RunMismatch, match=f"this client follows run {pinned}"):
                c.health()
            assert c.health()["run_id"] == pinned  # the next call tries the other replica first


def test_a_replica_answering_without_a_run_is_refused(replicas: tuple[ReplicaStub, ReplicaStub]) -> None:
    a, b = replicas
    with client([a.url, b.url]) as c:
        c.health()  # pins the run
        a.mode = "html"  # a wrong URL: some web server answering 200
        with pytest.raises(RunMismatch, match=rf"the answer from {a.url} \(200\) names no run"):
            c.latest_version()
        a.mode, b.mode = "busy", "html"  # failing over to a replica that is no coordinator: refused too
        with pytest.raises(RunMismatch, match=rf"the answer from {b.url} \(200\) names no run"):
            c.latest_version()


def test_a_replica_that_hangs_costs_one_timeout_then_the_next_answers(
    replicas: tuple[ReplicaStub, ReplicaStub],
) -> None:
    a, b = replicas
    a.mode = "hang"
    with client([a.url, b.url], timeout_s=0.3) as c:
        t0 = time.monotonic()
        assert c.health()["status"] == "ok"
        took = time.monotonic() - t0
        assert 0.3 <= took < 2.0 and c.base_url == b.url
        t0 = time.monotonic()
        c.health()  # sticky: the hanging replica is not asked again
        assert time.monotonic() - t0 < 0.3 and len(a.hits) == 1


def test_garbage_bytes_fail_over(replicas: tuple[ReplicaStub, ReplicaStub]) -> None:
    a, b = replicas
    a.mode = "garbage"
    with client([a.url, b.url]) as c:
        assert c.health()["status"] == "ok" and c.base_url == b.url


def test_a_registration_cut_after_it_committed_is_idempotent_on_the_next_replica(
    replicas: tuple[ReplicaStub, ReplicaStub],
) -> None:
    """The registration reaches the ledger through a, whose answer is lost; the retry through b gets the
    identical-digest answer (200, not new), never a 409; a different body is still a conflict."""
    a, b = replicas
    with client([a.url, b.url]) as c:
        lease = c.acquire_lease("pub", ttl_s=60)
        a.mode_for = lambda method, path: "cut_after_forward" if path in ("/v1/versions", "/v1/lease") else None
        v0, created = c.register_version(VersionCreate(**version_body(0, "anchor")), lease=lease)
        assert v0.version == 0 and created is False  # the first attempt created it; the retry found it
        assert a.hits.count(("POST", "/v1/versions")) == 1 and b.hits.count(("POST", "/v1/versions")) == 1
        v1, created = c.register_version(VersionCreate(**version_body(1)), lease=lease)  # sticky on b now
        assert created is True
        ledger = c.wait_for_versions(None, wait_s=0)
        assert [(v.version, v.kind) for v in ledger] == [(0, "anchor"), (1, "delta")]  # each exactly once
        with pytest.raises(CoordinatorError, match="already registered with other fields") as exc:
            c.register_version(VersionCreate(**version_body(1, nbytes=7)), lease=lease)
        assert exc.value.status_code == 409
        # a renewal cut after it took effect: the retry renews the same lease (fenced by its id), no error
        c._active = 0  # back to a
        renewed = c.renew_lease(lease, ttl_s=60)
        assert renewed.lease_id == lease.lease_id and renewed.epoch == lease.epoch
        c.release_lease(renewed)
        c._active = 0
        with pytest.raises(LeaseError) as taken:  # taking the lease is not idempotent: the loss is named
            c.acquire_lease("pub-2", ttl_s=60)
        assert taken.value.orphaned and "this client's own earlier attempt may have taken the lease" in str(taken.value)
        assert f"{a.url}: RemoteProtocolError" in str(taken.value)


def test_a_publisher_waits_out_its_own_orphaned_lease(
    tmp_path: Path, replicas: tuple[ReplicaStub, ReplicaStub]
) -> None:
    """The lease was taken through a replica that died before answering: the publisher does not fail (its
    lease_wait_s is 0) and is not fooled into sharing the run: it waits for its orphan to lapse, then takes it."""
    a, b = replicas
    a.mode_for = lambda method, path: "cut_after_forward" if path == "/v1/lease" else None
    with client([a.url, b.url]) as c:
        t0 = time.monotonic()
        with Publisher(LocalStore(tmp_path / "store"), c, PublisherConfig(lease_ttl_s=1)) as pub:
            assert pub.lease is not None and pub.lease.epoch == 2  # epoch 1 was the orphan
        assert 0.9 < time.monotonic() - t0 < 8


def test_a_long_poll_moves_to_the_next_replica_when_its_replica_dies(
    coordinator: ServerThread, replicas: tuple[ReplicaStub, ReplicaStub]
) -> None:
    a, b = replicas
    a.mode, a.cut_after_s = "cut_long_poll", 0.3
    with client([a.url, b.url]) as pub, client([a.url, b.url]) as agent:
        lease = pub.acquire_lease("pub", ttl_s=60)
        pub.register_version(VersionCreate(**version_body(0, "anchor")), lease=lease)
        got: list = []
        poll = threading.Thread(target=lambda: got.extend(agent.wait_for_versions(0, wait_s=5)))
        t0 = time.monotonic()
        poll.start()
        time.sleep(0.8)  # a cut the poll at 0.3 s; it now waits on b
        assert ("GET", "/v1/versions") in b.hits
        pub.register_version(VersionCreate(**version_body(1)), lease=lease)
        poll.join(5)
        assert [v.version for v in got] == [1] and time.monotonic() - t0 < 3


def test_when_every_replica_fails_the_error_names_each_url_and_its_answer(tmp_path: Path) -> None:
    down = refused_url()
    with ReplicaStub(mode="busy") as busy, ReplicaStub(mode="hang") as hung:
        with client([down, busy.url, hung.url], retries=1, timeout_s=0.2) as c:
            with pytest.raises(CoordinatorError) as exc:
                c.health()
    message = str(exc.value)
    assert message.startswith("GET /healthz: no coordinator replica answered in 2 rounds over 3 replicas (")
    assert f"{down}: ConnectError(" in message
    assert f"{busy.url} answered 503 stub: replica down" in message
    assert f"{hung.url}: ReadTimeout(" in message
    assert exc.value.status_code is None and exc.value.url == f"{hung.url}/healthz"
    assert len(busy.hits) == 2 and len(hung.hits) == 2  # every replica once per round, retries + 1 rounds
