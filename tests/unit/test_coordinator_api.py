"""Every endpoint and error code of the coordinator, over httpx.ASGITransport (no network)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest
from deltasync_coordinator.app import create_app

from deltasync import LocalStore, list_versions
from tests.conftest import AGENT_TOKEN, PUBLISHER_TOKEN, agent_token, version_body
from tests.support.asgi import AGT, PUB, Coordinator, auth, make_settings, open_coordinator, weights_store

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client(coord: Coordinator) -> httpx.AsyncClient:
    return coord.http


async def test_register_codes(coord: Coordinator) -> None:
    client, publish = coord.http, coord.publish
    r = await publish(0, "anchor")
    assert r.status_code == 201 and r.json()["version"] == 0 and r.json()["created_at"]
    assert (await publish(0, "anchor")).status_code == 200
    r = await publish(0, "anchor", nbytes=1)
    assert r.status_code == 409 and "already registered with other fields" in r.json()["detail"]
    r = await publish(5, base=4)
    assert (
        r.status_code == 409
        and r.json()["detail"] == "delta v5: its base v4 is not registered; publish an anchor instead"
    )
    body = version_body(1) | {"bytes": -1}
    r = await client.post("/v1/versions", json=body, headers=PUB)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "bytes"]
    r = await client.post("/v1/versions", json=version_body(1) | {"manifest_key": "../../etc/passwd"}, headers=PUB)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "manifest_key"]
    r = await client.post(
        "/v1/versions", json=version_body(1) | {"manifest_key": "v00000002/manifest.json"}, headers=PUB
    )
    assert r.status_code == 422 and "manifest_key must be v00000001/manifest.json" in r.json()["detail"][0]["msg"]
    r = await client.post("/v1/versions", json=version_body(1) | {"base_version": 1}, headers=PUB)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "base_version"]
    r = await client.post("/v1/versions", json=version_body(1) | {"extra": 1}, headers=PUB)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "extra"]


async def test_huge_integers_and_non_finite_floats_are_422_not_500(coord: Coordinator) -> None:
    """`bytes: 10**30` is a 422, not a 500 (SQLite OverflowError; clients retry 500s), and a NaN timing is never
    stored (CoordinatorClient.agents() would then raise for every client)."""
    await coord.take_lease()
    for field, value in (("bytes", 10**30), ("nnz", 2**63), ("tensors", -1)):
        r = await coord.http.post(
            "/v1/versions",
            json=version_body(0, "anchor") | {field: value},
            headers=PUB | {"Deltasync-Lease": coord.lease},
        )
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", field], (field, r.text)
    assert (await coord.publish(0, "anchor")).status_code == 201
    for raw in (
        '{"applied_version": 0, "state": "idle", "timings": {"pause": NaN}}',
        '{"applied_version": 0, "state": "idle", "timings": {"pause": Infinity}}',
        '{"applied_version": 0, "state": "idle", "timings": {"pause": -1.0}}',
    ):
        r = await coord.http.post(
            "/v1/agents/agent-0/heartbeat", content=raw, headers=AGT | {"content-type": "application/json"}
        )
        assert r.status_code == 422, raw
    r = await coord.http.post(
        "/v1/agents/agent-0/heartbeat",
        json={"applied_version": 0, "state": "error", "last_error": "x" * 3000},
        headers=AGT,
    )
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "last_error"]
    fleet = (await coord.http.get("/v1/agents", headers=PUB)).json()
    assert fleet["agents"] == []  # nothing of the refused heartbeats was stored


async def test_every_route_but_healthz_needs_a_token(coord: Coordinator, caplog: pytest.LogCaptureFixture) -> None:
    """/v1/agents (with each agent's last_error), /v1/plan, /v1/gc/candidates, /openapi.json and /metrics
    answer only with a token."""
    caplog.set_level(logging.DEBUG)
    client = coord.http
    for method, path in (
        ("GET", "/v1/versions"),
        ("GET", "/v1/versions/latest"),
        ("GET", "/v1/versions/0"),
        ("GET", "/v1/plan"),
        ("GET", "/v1/agents"),
        ("GET", "/v1/gc/candidates"),
        ("GET", "/openapi.json"),
        ("GET", "/metrics"),
        ("POST", "/v1/versions"),
        ("POST", "/v1/gc"),
        ("POST", "/v1/lease"),
    ):
        r = await client.request(method, path, json={})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (method, path, r.status_code)
        r = await client.request(method, path, json={}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 403, (method, path)
    assert (await client.get("/docs")).status_code == 404  # no unauthenticated schema browser
    assert (await client.get("/healthz")).status_code == 200
    for headers in (PUB, AGT):
        assert (await client.get("/v1/agents", headers=headers)).status_code == 200
        assert (await client.get("/openapi.json", headers=headers)).status_code == 200
    r = await client.post("/v1/versions", json=version_body(0, "anchor"), headers=AGT)
    assert (
        r.status_code == 403
        and r.json()["detail"] == "the bearer token is not allowed to publish, lease or collect garbage"
    )
    assert (await client.post("/v1/gc", headers=AGT)).status_code == 403
    r = await client.post("/v1/agents/a1/heartbeat", json={"applied_version": None, "state": "idle"}, headers=PUB)
    assert r.status_code == 403
    r = await client.post(
        "/v1/agents/a1/heartbeat", json={"applied_version": None, "state": "idle"}, headers={"Authorization": "Basic x"}
    )
    assert r.status_code == 401
    assert PUBLISHER_TOKEN not in caplog.text and AGENT_TOKEN not in caplog.text


async def test_an_agent_token_writes_only_its_own_heartbeat(coord: Coordinator) -> None:
    """An agent token writes only its own agent id's heartbeat: a forged row cannot claim v99999999, nor a fake
    agent at v0 pin GC retention."""
    await coord.publish(0, "anchor")
    await coord.publish(1)
    ok = await coord.http.post(
        "/v1/agents/vllm-0/heartbeat", json={"applied_version": 1, "state": "idle"}, headers=auth("vllm-0")
    )
    assert ok.status_code == 200
    forged = await coord.http.post(
        "/v1/agents/vllm-1/heartbeat", json={"applied_version": 0, "state": "idle"}, headers=auth("vllm-0")
    )
    assert (
        forged.status_code == 403 and forged.json()["detail"] == "this agent token belongs to 'vllm-0', not to 'vllm-1'"
    )
    tampered = agent_token("vllm-1")[:-2] + "xx"
    r = await coord.http.post(
        "/v1/agents/vllm-1/heartbeat",
        json={"applied_version": 0, "state": "idle"},
        headers={"Authorization": f"Bearer {tampered}"},
    )
    assert r.status_code == 403
    high = await coord.http.post(
        "/v1/agents/vllm-0/heartbeat", json={"applied_version": 99999999, "state": "idle"}, headers=auth("vllm-0")
    )
    assert high.status_code == 422 and high.json()["detail"][0]["loc"] == ["body", "applied_version"]
    assert "applied_version 99999999 is above the latest version 1" in high.json()["detail"][0]["msg"]
    fleet = (await coord.http.get("/v1/agents", headers=PUB)).json()
    assert [(a["agent_id"], a["applied_version"], a["lag"]) for a in fleet["agents"]] == [("vllm-0", 1, 0)]
    gc = (await coord.http.get("/v1/gc/candidates", headers=PUB)).json()
    assert gc["keep_from"] == 0  # only the anchor decides: no forged agent pins retention


async def test_body_cap(client: httpx.AsyncClient) -> None:
    big = version_body(0, "anchor") | {"pad": "x" * 5000}
    r = await client.post("/v1/versions", json=big, headers=PUB)
    assert r.status_code == 413 and r.json()["detail"] == "request body over 4096 bytes"

    async def chunks():
        yield b'{"version": 0, '
        yield b" " * 5000

    r = await client.post("/v1/versions", content=chunks(), headers=PUB | {"content-type": "application/json"})
    assert r.status_code == 413


async def test_versions_latest_get_and_list(coord: Coordinator) -> None:
    client = coord.http
    r = await client.get("/v1/versions/latest", headers=AGT)
    assert r.status_code == 404 and r.json()["detail"] == "no version is registered yet"
    await coord.publish(0, "anchor")
    await coord.publish(1)
    await coord.publish(1, "anchor")
    assert (await client.get("/v1/versions/latest", headers=AGT)).json()["kind"] == "delta"
    assert (await client.get("/v1/versions/1", params={"kind": "anchor"}, headers=AGT)).json()["kind"] == "anchor"
    r = await client.get("/v1/versions/7", headers=AGT)
    assert r.status_code == 404 and r.json()["detail"] == "version 7 is not registered"
    assert (await client.get("/v1/versions/-1", headers=AGT)).status_code == 422
    assert (await client.get("/v1/versions/1", params={"kind": "full"}, headers=AGT)).status_code == 422
    page = (await client.get("/v1/versions", params={"after": 0}, headers=AGT)).json()
    assert [(v["version"], v["kind"]) for v in page["versions"]] == [(1, "delta"), (1, "anchor")]
    assert page["latest"] == 1
    assert (await client.get("/v1/versions", params={"after": -5}, headers=AGT)).status_code == 422
    assert (await client.get("/v1/versions", params={"wait_s": "nan"}, headers=AGT)).status_code == 422


async def test_long_poll_wakes_on_publish_and_times_out(coord: Coordinator) -> None:
    client = coord.http
    await coord.publish(0, "anchor")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    empty = (await client.get("/v1/versions", params={"after": 0, "wait_s": 0.3}, headers=AGT)).json()
    assert empty["versions"] == [] and 0.25 < loop.time() - t0 < 1.5
    t0 = loop.time()
    capped = (await client.get("/v1/versions", params={"after": 0, "wait_s": 3600}, headers=AGT)).json()
    assert capped["versions"] == [] and loop.time() - t0 < 3.5  # capped at max_wait_s=2
    waiters = [
        asyncio.create_task(client.get("/v1/versions", params={"after": 0, "wait_s": 10}, headers=AGT))
        for _ in range(20)
    ]
    await asyncio.sleep(0.2)
    assert not any(w.done() for w in waiters)
    t0 = loop.time()
    await coord.publish(1)
    answers = await asyncio.gather(*waiters)
    assert loop.time() - t0 < 1.5
    assert all([v["version"] for v in a.json()["versions"]] == [1] for a in answers)


async def test_long_polls_beyond_the_cap_get_503_with_retry_after(tmp_path: Path, ledger_db: Path | str) -> None:
    """Long-polls beyond the cap are told to come back (503 with Retry-After) instead of exhausting the open-files
    limit (1,100 long-polls at nofile 1024 would reset connections)."""
    app, http = await open_coordinator(make_settings(tmp_path, max_long_polls=5, db=ledger_db))
    async with http:
        waiting = [
            asyncio.create_task(http.get("/v1/versions", params={"after": 0, "wait_s": 2}, headers=AGT))
            for _ in range(5)
        ]
        await asyncio.sleep(0.2)
        r = await http.get("/v1/versions", params={"after": 0, "wait_s": 2}, headers=AGT)
        assert r.status_code == 503 and r.headers["retry-after"] == "2" and "the cap is 5" in r.json()["detail"]
        assert (await http.get("/v1/versions", params={"after": 0}, headers=AGT)).status_code == 200  # no wait: fine
        assert [w.status_code for w in await asyncio.gather(*waiting)] == [200] * 5
    app.state.db.close()


async def test_plan(coord: Coordinator) -> None:
    client = coord.http
    r = await client.get("/v1/plan", headers=AGT)
    assert r.status_code == 404
    await coord.publish(0, "anchor", nbytes=1000)
    for v in (1, 2, 3):
        await coord.publish(v)
    plan = (await client.get("/v1/plan", params={"from": 1}, headers=AGT)).json()
    assert plan["route"] == "deltas" and [s["version"] for s in plan["steps"]] == [2, 3] and plan["bytes"] == 200
    plan = (await client.get("/v1/plan", params={"to": 2}, headers=AGT)).json()
    assert plan["route"] == "anchor" and [s["version"] for s in plan["steps"]] == [0, 1, 2]
    assert (await client.get("/v1/plan", params={"from": 3}, headers=AGT)).json()["route"] == "none"
    r = await client.get("/v1/plan", params={"to": 9}, headers=AGT)
    assert r.status_code == 404 and r.json()["detail"] == "version 9 is not registered"
    assert (await client.get("/v1/plan", params={"from": "x"}, headers=AGT)).status_code == 422


async def test_a_plan_from_above_the_latest_is_409_naming_both(coord: Coordinator) -> None:
    """GET /v1/plan?from=99999999 is a 409 naming both versions, never a 200."""
    await coord.publish(0, "anchor")
    await coord.publish(1)
    r = await coord.http.get("/v1/plan", params={"from": 99999999}, headers=AGT)
    assert r.status_code == 409
    assert r.json()["detail"].startswith("a plan from v99999999 refused: the ledger's latest is v1; the agent is ahead")


async def test_one_publisher_per_run(coord: Coordinator) -> None:
    """Two publishers on one store: the second must get a clear error at start, and a
    registration without the live lease is refused (fencing)."""
    first = await coord.take_lease()
    r = await coord.http.post("/v1/lease", json={"holder": "job-b on host2", "ttl_s": 30}, headers=PUB)
    assert r.status_code == 409
    assert r.json()["detail"].startswith("the run is being published by 'test' (lease epoch 1, expires in")
    r = await coord.http.post("/v1/versions", json=version_body(0, "anchor"), headers=PUB)  # no lease
    assert r.status_code == 409 and "registering needs the run's publisher lease" in r.json()["detail"]
    r = await coord.http.post(
        "/v1/versions", json=version_body(0, "anchor"), headers=PUB | {"Deltasync-Lease": "0" * 32}
    )
    assert r.status_code == 409 and "the lease is held by 'test' (epoch 1)" in r.json()["detail"]
    assert (await coord.publish(0, "anchor")).status_code == 201
    renewed = await coord.http.post("/v1/lease", json={"holder": "test", "ttl_s": 30, "lease_id": first}, headers=PUB)
    assert renewed.status_code == 200 and renewed.json()["epoch"] == 1 and renewed.json()["next_version"] == 1
    assert (await coord.http.delete(f"/v1/lease/{first}", headers=PUB)).status_code == 204
    second = await coord.http.post("/v1/lease", json={"holder": "job-b", "ttl_s": 30}, headers=PUB)
    assert second.status_code == 200 and second.json()["epoch"] == 2
    stale = await coord.http.post("/v1/versions", json=version_body(1), headers=PUB | {"Deltasync-Lease": first})
    assert stale.status_code == 409 and "the lease is held by 'job-b' (epoch 2)" in stale.json()["detail"]
    lost = await coord.http.post("/v1/lease", json={"holder": "test", "ttl_s": 30, "lease_id": first}, headers=PUB)
    assert lost.status_code == 409 and "is lost ('job-b' holds the run now)" in lost.json()["detail"]


async def test_heartbeat_fleet_pagination_and_expiry(coord: Coordinator) -> None:
    client = coord.http
    await coord.publish(0, "anchor")
    await coord.publish(1)
    r = await client.post(
        "/v1/agents/vllm-0/heartbeat",
        headers=auth("vllm-0"),
        json={"applied_version": 0, "state": "applying", "timings": {"pause": 0.02}},
    )
    assert r.status_code == 200 and r.json()["lag"] == 1 and r.json()["stale"] is False
    bad = await client.post(
        "/v1/agents/vllm-0/heartbeat", headers=auth("vllm-0"), json={"applied_version": 0, "state": "dancing"}
    )
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "state"]
    bad = await client.post("/v1/agents/..%2Fx/heartbeat", headers=AGT, json={"applied_version": 0, "state": "idle"})
    assert bad.status_code in (403, 404, 422)
    for i in range(1, 5):
        await client.post(
            f"/v1/agents/vllm-{i}/heartbeat", headers=auth(f"vllm-{i}"), json={"applied_version": 1, "state": "idle"}
        )
    page = (await client.get("/v1/agents", params={"limit": 2}, headers=PUB)).json()
    assert [a["agent_id"] for a in page["agents"]] == ["vllm-0", "vllm-1"] and page["next_after"] == "vllm-1"
    assert page["total"] == 5 and page["agents"][0]["timings"] == {"pause": 0.02}
    page = (await client.get("/v1/agents", params={"limit": 2, "after": "vllm-3"}, headers=PUB)).json()
    assert [a["agent_id"] for a in page["agents"]] == ["vllm-4"] and page["next_after"] is None
    assert coord.app.state.fleet.expire(silent_s=-1) == 5  # all silent longer than -1 s: forgotten
    assert (await client.get("/v1/agents", headers=PUB)).json()["total"] == 0


async def test_metrics_are_aggregates_without_a_series_per_agent(coord: Coordinator) -> None:
    """/metrics holds aggregates, not one series per agent (5,000 agent ids would make it hundreds of KB)."""
    await coord.publish(0, "anchor")
    await coord.publish(1)
    for i in range(50):
        await coord.http.post(
            f"/v1/agents/a{i}/heartbeat", headers=auth(f"a{i}"), json={"applied_version": i % 2, "state": "idle"}
        )
    text = (await coord.http.get("/metrics", headers=PUB)).text
    assert 'deltasync_agents{state="idle"} 50.0' in text
    assert 'deltasync_agent_lag_versions_bucket{le="0"} 25.0' in text
    assert 'deltasync_agent_lag_versions_bucket{le="+Inf"} 50.0' in text
    assert "a17" not in text and "agent=" not in text
    assert 'deltasync_request_seconds_count{method="POST",route="/v1/versions",status="201"} 2.0' in text


async def test_a_metrics_token_scrapes_but_reads_nothing_else(tmp_path: Path, ledger_db: Path | str) -> None:
    app, http = await open_coordinator(make_settings(tmp_path, metrics_token="scrape-me-0123456789", db=ledger_db))
    async with http:
        scrape = {"Authorization": "Bearer scrape-me-0123456789"}
        assert (await http.get("/metrics", headers=scrape)).status_code == 200
        assert (await http.get("/v1/agents", headers=scrape)).status_code == 403
    app.state.db.close()


async def test_health_answers_from_memory_and_names_the_run(coord: Coordinator) -> None:
    await coord.publish(0, "anchor")
    health = (await coord.http.get("/healthz")).json()
    run = coord.app.state.registry.run_id
    assert health == {"status": "ok", "latest": 0, "run_id": run, "schema_version": 3, "reasons": []}
    r = await coord.http.get("/v1/versions/0", headers=AGT)
    assert r.headers["deltasync-run-id"] == run


async def test_gc_deletes_through_the_store(coord: Coordinator, tmp_path: Path) -> None:
    c = coord.http
    store = LocalStore(tmp_path / "store")
    await weights_store(coord, store, 5, anchors=(5,))
    await c.post("/v1/agents/a/heartbeat", headers=auth("a"), json={"applied_version": 3, "state": "idle"})
    collectable = [(0, "anchor"), (1, "delta"), (2, "delta"), (3, "delta")]
    dry = (await c.get("/v1/gc/candidates", headers=PUB)).json()
    assert [(x["version"], x["kind"]) for x in dry["candidates"]] == collectable
    proven = (await c.post("/v1/gc", params={"dry_run": True}, headers=PUB)).json()
    assert proven["kept_anchor"] == 5 and proven["deleted"] == [] and len(proven["candidates"]) == 4
    assert [x.version for x in list_versions(store)] == [0, 1, 2, 3, 4, 5]  # a dry run deletes nothing
    done = (await c.post("/v1/gc", headers=PUB)).json()
    assert [(x["version"], x["kind"]) for x in done["deleted"]] == collectable
    listing = {x.version: x for x in list_versions(store)}
    assert sorted(listing) == [4, 5] and listing[5].anchor and listing[5].delta
    assert not any(k.startswith(("v00000001/", "v00000002/", "v00000003/")) for k in store.list())
    assert coord.app.state.retention.deletions()[0]["keys"][0] == "v00000000/anchor/manifest.json"  # manifest first
    assert (await c.post("/v1/gc", headers=PUB)).json()["deleted"] == []
    plan = (await c.get("/v1/plan", headers=AGT)).json()
    assert [(s["version"], s["kind"]) for s in plan["steps"]] == [(5, "anchor")]


async def test_gc_without_a_store_is_409(tmp_path: Path, ledger_db: Path | str) -> None:
    app, http = await open_coordinator(make_settings(tmp_path, store=None, db=ledger_db))
    async with http:
        r = await http.post("/v1/gc", headers=PUB)
        assert r.status_code == 409 and "no store configured" in r.json()["detail"]
    app.state.db.close()


async def test_no_credentials_no_coordinator_unless_insecure(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With no tokens set (also with --host 0.0.0.0) it refuses to start unless insecure: started with a warning,
    an unauthenticated POST /v1/versions would get 201 and POST /v1/gc delete the real anchor v0."""
    from deltasync_coordinator.settings import InsecureConfiguration, Settings

    for values in ({}, {"publisher_token": PUBLISHER_TOKEN}, {"host": "0.0.0.0"}):
        with pytest.raises(InsecureConfiguration, match=r"refuses to start without credentials: set DELTASYNC_"):
            create_app(Settings(db=tmp_path / "c.db", **values))
    with pytest.raises(InsecureConfiguration, match="DELTASYNC_PUBLISHER_TOKEN and DELTASYNC_AGENT_SECRET"):
        create_app(Settings(db=tmp_path / "c.db"))
    assert not (tmp_path / "c.db").exists()  # refused before the ledger was even created
    with pytest.raises(InsecureConfiguration, match="at least 16 characters"):
        create_app(Settings(db=tmp_path / "c.db", publisher_token="p", agent_secret="short"))
    caplog.set_level(logging.WARNING)
    app = create_app(Settings(db=tmp_path / "c.db", insecure=True))
    assert "INSECURE: the coordinator runs without credentials" in caplog.text
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as c:
        assert (await c.get("/v1/versions")).status_code == 200  # explicitly open
    app.state.db.close()


async def test_a_drifted_engine_degrades_health_and_shows_in_metrics_until_re_proven(coord: Coordinator) -> None:
    """An agent's ``drift`` (which tensors, when) makes /healthz degraded and /metrics name it, until a
    heartbeat without it (a whole-state proof of the restored engine passed)."""
    await coord.publish(0, "anchor")
    drift = "drift: 1 tensors differ from v0's published checksums (e.g. model.norm.weight), found 2026-12-02T00:00:00Z"
    r = await coord.http.post(
        "/v1/agents/vllm-0/heartbeat",
        headers=auth("vllm-0"),
        json={"applied_version": None, "state": "unhealthy", "drift": drift},
    )
    assert r.status_code == 200
    health = (await coord.http.get("/healthz")).json()
    assert health["status"] == "degraded" and f"agent vllm-0: {drift}" in health["reasons"]
    text = (await coord.http.get("/metrics", headers=PUB)).text
    assert "deltasync_engine_drifts_total 1.0" in text and 'deltasync_engine_drift{agent="vllm-0"' in text
    for state in ("unhealthy", "idle"):  # still drifted until re-proven: counted once
        body = {"applied_version": 0, "state": state, "drift": drift}
        assert (
            await coord.http.post("/v1/agents/vllm-0/heartbeat", headers=auth("vllm-0"), json=body)
        ).status_code == 200
    assert "deltasync_engine_drifts_total 1.0" in (await coord.http.get("/metrics", headers=PUB)).text
    body = {"applied_version": 0, "state": "idle"}
    assert (await coord.http.post("/v1/agents/vllm-0/heartbeat", headers=auth("vllm-0"), json=body)).status_code == 200
    health = (await coord.http.get("/healthz")).json()
    assert health["status"] == "ok" and not health["reasons"]
    text = (await coord.http.get("/metrics", headers=PUB)).text
    assert 'deltasync_engine_drift{agent="vllm-0"' not in text and "deltasync_engine_drifts_total 1.0" in text
