"""CoordinatorClient against the real app (in-process) and against transport faults."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deltasync_coordinator.app import create_app

from deltasync import CoordinatorError, LeaseError, RunMismatch
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.schemas import VersionCreate
from tests.conftest import PUBLISHER_TOKEN, ServerThread, agent_token, version_body
from tests.support.asgi import make_settings


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(create_app(make_settings(tmp_path))) as s:
        yield s


class Publishing(CoordinatorClient):
    """A publisher's client holding the run's lease, for brevity."""

    def register(self, body: dict):
        return self.register_version(VersionCreate(**body), lease=self.lease)


@pytest.fixture
def publisher(server: ServerThread) -> Iterator[Publishing]:
    with Publishing(server.url, token=PUBLISHER_TOKEN, retry=RetryPolicy(backoff_s=0.01)) as c:
        c.lease = c.acquire_lease("test", ttl_s=60)
        yield c


@pytest.fixture
def agent(server: ServerThread) -> Iterator[CoordinatorClient]:
    with CoordinatorClient(server.url, token=agent_token("vllm-0"), retry=RetryPolicy(backoff_s=0.01)) as c:
        yield c


def test_publish_read_plan_and_heartbeat(publisher: Publishing, agent: CoordinatorClient) -> None:
    assert publisher.latest_version() is None
    v0, created = publisher.register(version_body(0, "anchor"))
    assert created and v0.kind == "anchor" and v0.created_at.tzinfo is not None
    assert publisher.register(version_body(0, "anchor"))[1] is False
    publisher.register(version_body(1))
    assert publisher.latest_version().version == 1
    assert agent.get_version(0, "anchor").manifest_key == "v00000000/anchor/manifest.json"
    assert [v.version for v in agent.wait_for_versions(None, wait_s=0)] == [0, 1]
    plan = agent.plan(None)
    assert plan.route == "anchor" and [s.version for s in plan.steps] == [0, 1] and plan.to_version == 1
    status = agent.heartbeat("vllm-0", applied_version=0, state="idle", timings={"apply": 0.1})
    assert status.lag == 1 and not status.stale
    assert [a.agent_id for a in publisher.agents()] == ["vllm-0"]
    assert publisher.health()["latest"] == 1
    assert publisher.gc_candidates().keep_from == 0
    assert "pub-secret" not in repr(publisher)
    assert publisher.run_id == agent.run_id == publisher.health()["run_id"]  # both pinned from the first answer


def test_a_second_publisher_and_a_fenced_one_get_lease_errors(publisher: Publishing, server: ServerThread) -> None:
    with CoordinatorClient(server.url, token=PUBLISHER_TOKEN, retry=RetryPolicy(backoff_s=0.01)) as other:
        with pytest.raises(LeaseError, match=r"the run is being published by 'test' \(lease epoch 1"):
            other.acquire_lease("job-b", ttl_s=30)
        publisher.release_lease(publisher.lease)
        taken = other.acquire_lease("job-b", ttl_s=30)
        assert taken.epoch == 2
    with pytest.raises(
        LeaseError, match="registering needs the run's publisher lease, and the lease is held by 'job-b'"
    ):
        publisher.register(version_body(0, "anchor"))
    with pytest.raises(LeaseError, match="is lost"):
        publisher.renew_lease(publisher.lease, ttl_s=30)


def test_a_client_refuses_a_coordinator_of_another_run(tmp_path: Path, agent: CoordinatorClient) -> None:
    """Agents and publishers pin the run identity; a coordinator with another one (a new
    ledger behind the same URL) is refused."""
    agent.health()
    pinned = agent.run_id
    assert pinned and pinned.startswith("run-")
    with ServerThread(create_app(make_settings(tmp_path / "other"))) as other:
        stranger = CoordinatorClient(
            other.url, token=agent_token("vllm-0"), run_id=pinned, retry=RetryPolicy(retries=0)
        )
        with pytest.raises(RunMismatch, match=rf"keeps run run-[0-9a-f]+, this client follows run {pinned}"):
            stranger.latest_version()
        stranger.close()
    with pytest.raises(RunMismatch, match="this client follows run"):
        agent.pin_run("run-other")


def test_errors_carry_status_method_and_url(
    publisher: Publishing, agent: CoordinatorClient, server: ServerThread
) -> None:
    publisher.register(version_body(0, "anchor"))
    with pytest.raises(CoordinatorError) as exc:
        publisher.register(version_body(0, "anchor", nbytes=3))
    assert exc.value.status_code == 409 and exc.value.method == "POST" and exc.value.url == f"{server.url}/v1/versions"
    assert str(exc.value).startswith("POST /v1/versions: 409 anchor v0 is already registered with other fields")
    with pytest.raises(CoordinatorError) as exc:
        agent.register_version(VersionCreate(**version_body(1)))
    assert exc.value.status_code == 403
    with pytest.raises(CoordinatorError) as exc:
        agent.heartbeat("vllm-1", applied_version=0, state="idle")  # another agent's id
    assert exc.value.status_code == 403
    with pytest.raises(CoordinatorError) as exc:
        agent.get_version(42)
    assert exc.value.status_code == 404 and "version 42 is not registered" in str(exc.value)
    with pytest.raises(CoordinatorError) as exc:
        agent.heartbeat("bad id!", applied_version=0, state="idle")
    assert exc.value.status_code in (403, 404, 422)


def test_long_poll_returns_when_a_version_is_published(publisher: Publishing, agent: CoordinatorClient) -> None:
    publisher.register(version_body(0, "anchor"))
    got: list = []
    t = threading.Thread(target=lambda: got.extend(agent.wait_for_versions(0, wait_s=10)))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.3)
    publisher.register(version_body(1))
    t.join(5)
    assert [v.version for v in got] == [1] and time.monotonic() - t0 < 3


def _client(handler, retries: int = 3) -> CoordinatorClient:
    http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://c")
    return CoordinatorClient("http://c", http_client=http, retry=RetryPolicy(retries=retries, backoff_s=0.001))


def test_retries_connection_errors_and_5xx_then_succeeds() -> None:
    calls: list[int] = []
    health = {"status": "ok", "latest": 3, "run_id": "run-x", "schema_version": 2, "reasons": []}

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            return httpx.Response(503, json={"detail": "busy"})
        return httpx.Response(200, json=health)

    assert _client(handler).health()["latest"] == 3 and len(calls) == 3


def test_gives_up_after_the_retries_with_a_clear_error() -> None:
    calls: list[int] = []

    def down(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(CoordinatorError, match=r"GET /healthz: no answer from http://c in 3 attempts") as exc:
        _client(down, retries=2).health()
    assert exc.value.status_code is None and len(calls) == 3

    def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"detail": "database is locked"})

    with pytest.raises(CoordinatorError, match=r"GET /healthz: 500 database is locked") as exc:
        _client(broken, retries=1).health()
    assert exc.value.status_code == 500


def test_4xx_is_not_retried_and_bad_answers_are_named() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if request.url.path == "/healthz":
            return httpx.Response(200, json={"hello": "world"})
        return httpx.Response(422, json={"detail": [{"loc": ["body", "bytes"], "msg": "must be >= 0"}]})

    client = _client(handler)
    with pytest.raises(CoordinatorError, match=r"POST /v1/versions: 422 body.bytes: must be >= 0"):
        client.register_version(VersionCreate(**version_body(0, "anchor")))
    assert len(calls) == 1
    with pytest.raises(CoordinatorError, match="does not match the protocol"):
        client.health()


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="need retries >= 0"):
        CoordinatorClient("http://c", retry=RetryPolicy(retries=-1))


def test_tokens_never_travel_in_clear_by_accident(caplog: pytest.LogCaptureFixture) -> None:
    """A replica list mixing https:// and http:// is refused (a failover would send the token in clear); a token
    to plain http:// on another host is refused unless insecure_http (then warned about), loopback is not
    (tests/unit/test_plain_http_refused.py has the rest)."""
    with pytest.raises(ValueError, match="mix https:// and http://: a failover would send the token in clear"):
        CoordinatorClient("https://a:8600,http://b:8600", token="t")
    with pytest.raises(ValueError, match="the bearer token would travel in clear"):
        CoordinatorClient("http://coordinator:8600", token="t")
    with caplog.at_level(logging.WARNING, logger="deltasync.client"):
        CoordinatorClient("http://127.0.0.1:8600", token="t").close()
        assert not caplog.records
        CoordinatorClient("http://coordinator:8600", token="t", insecure_http=True).close()
    assert any("the bearer token travels in clear" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "body", ['["a", "list"]', '"text"', "7", "{not json", '{"detail": ["x", {"loc": ["b"], "msg": "m"}]}']
)
def test_an_error_answer_of_any_json_shape_is_a_coordinator_error(body: str) -> None:
    """Whatever a proxy or a broken coordinator answers with an error status, the client raises
    CoordinatorError naming the request and the status, never AttributeError (a JSON list or string body)."""
    import httpx

    from deltasync._client_transport import _raise_for_status

    request = httpx.Request("GET", "http://127.0.0.1:1/v1/versions")
    with pytest.raises(CoordinatorError, match=r"GET /v1/versions: 502 "):
        _raise_for_status(httpx.Response(502, content=body.encode(), request=request))
