"""Every endpoint and error code of the coordinator, over httpx.ASGITransport (no network)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch

from deltasync import LocalStore, compute_delta, write_anchor, write_delta
from deltasync.versions import list_versions
from services.coordinator.app import create_app
from services.coordinator.settings import Settings
from tests.conftest import AGENT_TOKEN, PUBLISHER_TOKEN, version_body

pytestmark = pytest.mark.anyio
PUB = {"Authorization": f"Bearer {PUBLISHER_TOKEN}"}
AGT = {"Authorization": f"Bearer {AGENT_TOKEN}"}


def make_settings(tmp_path: Path, **over) -> Settings:
    values = dict(
        db=tmp_path / "c.db",
        store=str(tmp_path / "store"),
        publisher_token=PUBLISHER_TOKEN,
        agent_token=AGENT_TOKEN,
        max_wait_s=2.0,
        agent_stale_after_s=60.0,
        max_body_bytes=4096,
    )
    values.update(over)
    return Settings(**values)


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(make_settings(tmp_path))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator") as c:
        yield c


async def publish(client: httpx.AsyncClient, *args, **kwargs) -> httpx.Response:
    return await client.post("/v1/versions", json=version_body(*args, **kwargs), headers=PUB)


async def test_register_codes(client: httpx.AsyncClient) -> None:
    r = await publish(client, 0, "anchor")
    assert r.status_code == 201 and r.json()["version"] == 0 and r.json()["created_at"]
    assert (await publish(client, 0, "anchor")).status_code == 200
    r = await publish(client, 0, "anchor", nbytes=1)
    assert r.status_code == 409 and "already registered with other fields" in r.json()["detail"]
    r = await publish(client, 5, base=4)
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
    assert r.json()["detail"][0]["loc"] == ["body", "manifest_key"]
    r = await client.post("/v1/versions", json=version_body(1) | {"base_version": 1}, headers=PUB)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "base_version"]
    r = await client.post("/v1/versions", json=version_body(1) | {"extra": 1}, headers=PUB)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "extra"]


async def test_auth(client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    r = await client.post("/v1/versions", json=version_body(0, "anchor"))
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = await client.post("/v1/versions", json=version_body(0, "anchor"), headers=AGT)
    assert (
        r.status_code == 403 and r.json()["detail"] == "the bearer token is not allowed to publish or collect garbage"
    )
    r = await client.post("/v1/agents/a1/heartbeat", json={"applied_version": None, "state": "idle"}, headers=PUB)
    assert r.status_code == 403
    r = await client.post("/v1/gc", headers=AGT)
    assert r.status_code == 403
    r = await client.post(
        "/v1/agents/a1/heartbeat", json={"applied_version": None, "state": "idle"}, headers={"Authorization": "Basic x"}
    )
    assert r.status_code == 401
    assert (await client.get("/v1/agents")).status_code == 200  # reads are open by default
    assert PUBLISHER_TOKEN not in caplog.text and AGENT_TOKEN not in caplog.text


async def test_reads_can_require_a_token(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path, read_requires_token=True, read_token="reader"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as c:
        assert (await c.get("/v1/versions")).status_code == 401
        assert (await c.get("/v1/versions", headers={"Authorization": "Bearer nope"})).status_code == 403
        for token in ("reader", AGENT_TOKEN, PUBLISHER_TOKEN):
            assert (await c.get("/v1/versions", headers={"Authorization": f"Bearer {token}"})).status_code == 200
        assert (await c.get("/healthz")).status_code == 200


async def test_body_cap(client: httpx.AsyncClient) -> None:
    big = version_body(0, "anchor") | {"pad": "x" * 5000}
    r = await client.post("/v1/versions", json=big, headers=PUB)
    assert r.status_code == 413 and r.json()["detail"] == "request body over 4096 bytes"

    async def chunks():
        yield b'{"version": 0, '
        yield b" " * 5000

    r = await client.post("/v1/versions", content=chunks(), headers=PUB | {"content-type": "application/json"})
    assert r.status_code == 413


async def test_versions_latest_get_and_list(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/versions/latest")
    assert r.status_code == 404 and r.json()["detail"] == "no version is registered yet"
    await publish(client, 0, "anchor")
    await publish(client, 1)
    await publish(client, 1, "anchor")
    assert (await client.get("/v1/versions/latest")).json()["kind"] == "delta"
    assert (await client.get("/v1/versions/1", params={"kind": "anchor"})).json()["kind"] == "anchor"
    r = await client.get("/v1/versions/7")
    assert r.status_code == 404 and r.json()["detail"] == "version 7 is not registered"
    assert (await client.get("/v1/versions/-1")).status_code == 422
    assert (await client.get("/v1/versions/1", params={"kind": "full"})).status_code == 422
    page = (await client.get("/v1/versions", params={"after": 0})).json()
    assert [(v["version"], v["kind"]) for v in page["versions"]] == [(1, "delta"), (1, "anchor")] and page[
        "latest"
    ] == 1
    assert (await client.get("/v1/versions", params={"after": -5})).status_code == 422


async def test_long_poll_wakes_on_publish_and_times_out(client: httpx.AsyncClient) -> None:
    await publish(client, 0, "anchor")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    empty = (await client.get("/v1/versions", params={"after": 0, "wait_s": 0.3})).json()
    assert empty["versions"] == [] and 0.25 < loop.time() - t0 < 1.5
    t0 = loop.time()
    capped = (await client.get("/v1/versions", params={"after": 0, "wait_s": 3600})).json()  # capped at max_wait_s=2
    assert capped["versions"] == [] and loop.time() - t0 < 3.5
    waiters = [asyncio.create_task(client.get("/v1/versions", params={"after": 0, "wait_s": 10})) for _ in range(20)]
    await asyncio.sleep(0.2)
    assert not any(w.done() for w in waiters)
    t0 = loop.time()
    await publish(client, 1)
    answers = await asyncio.gather(*waiters)
    assert loop.time() - t0 < 1.5
    assert all([v["version"] for v in a.json()["versions"]] == [1] for a in answers)


async def test_plan(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/plan")
    assert r.status_code == 404
    await publish(client, 0, "anchor", nbytes=1000)
    for v in (1, 2, 3):
        await publish(client, v)
    plan = (await client.get("/v1/plan", params={"from": 1})).json()
    assert plan["route"] == "deltas" and [s["version"] for s in plan["steps"]] == [2, 3] and plan["bytes"] == 200
    plan = (await client.get("/v1/plan", params={"to": 2})).json()
    assert plan["route"] == "anchor" and [s["version"] for s in plan["steps"]] == [0, 1, 2]
    assert (await client.get("/v1/plan", params={"from": 3})).json()["route"] == "none"
    r = await client.get("/v1/plan", params={"to": 9})
    assert r.status_code == 404 and r.json()["detail"] == "version 9 is not registered"
    assert (await client.get("/v1/plan", params={"from": "x"})).status_code == 422


async def test_heartbeat_and_fleet(client: httpx.AsyncClient) -> None:
    await publish(client, 0, "anchor")
    await publish(client, 1)
    r = await client.post(
        "/v1/agents/vllm-0/heartbeat",
        headers=AGT,
        json={"applied_version": 0, "state": "applying", "timings": {"pause": 0.02}},
    )
    assert r.status_code == 200 and r.json()["lag"] == 1 and r.json()["stale"] is False
    bad = await client.post("/v1/agents/vllm-0/heartbeat", headers=AGT, json={"applied_version": 0, "state": "dancing"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "state"]
    bad = await client.post("/v1/agents/..%2Fx/heartbeat", headers=AGT, json={"applied_version": 0, "state": "idle"})
    assert bad.status_code in (404, 422)
    fleet = (await client.get("/v1/agents")).json()
    assert fleet["latest"] == 1 and [a["agent_id"] for a in fleet["agents"]] == ["vllm-0"]
    assert fleet["agents"][0]["state"] == "applying" and fleet["agents"][0]["timings"] == {"pause": 0.02}


async def test_gc_deletes_through_the_store(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    weights = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    app = create_app(make_settings(tmp_path))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as c:
        base = write_anchor(store, weights, version=0)
        await publish(c, 0, "anchor")
        prev = {k: v.clone() for k, v in weights.items()}
        for v in range(1, 6):
            curr = {"w": prev["w"].clone()}
            curr["w"][v] = v
            base = write_delta(store, compute_delta(prev, curr, update_prev=True), state=curr, version=v, base=base)
            await publish(c, v)
        write_anchor(store, curr, version=5)
        await publish(c, 5, "anchor")
        await c.post("/v1/agents/a/heartbeat", headers=AGT, json={"applied_version": 3, "state": "idle"})
        dry = (await c.get("/v1/gc/candidates")).json()
        assert [(x["version"], x["kind"]) for x in dry["candidates"]] == [
            (0, "anchor"),
            (1, "delta"),
            (2, "delta"),
            (3, "delta"),
        ]
        assert [x.version for x in list_versions(store)] == [0, 1, 2, 3, 4, 5]  # a dry run deletes nothing
        done = (await c.post("/v1/gc", headers=PUB)).json()
        assert [(x["version"], x["kind"]) for x in done["deleted"]] == [
            (0, "anchor"),
            (1, "delta"),
            (2, "delta"),
            (3, "delta"),
        ]
        listing = {x.version: x for x in list_versions(store)}
        assert sorted(listing) == [4, 5] and listing[5].anchor and listing[5].delta
        assert not any(k.startswith(("v00000001/", "v00000002/", "v00000003/")) for k in store.list())
        assert app.state.registry.deletions()[0]["keys"][0] == "v00000000/anchor/manifest.json"  # manifest first
        assert (await c.post("/v1/gc", headers=PUB)).json()["deleted"] == []
        plan = (await c.get("/v1/plan")).json()
        assert [(s["version"], s["kind"]) for s in plan["steps"]] == [(5, "anchor")]


async def test_gc_without_a_store_is_409(tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path, store=None))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as c:
        r = await c.post("/v1/gc", headers=PUB)
        assert r.status_code == 409 and "no store configured" in r.json()["detail"]


async def test_health_metrics_and_docs(client: httpx.AsyncClient) -> None:
    await publish(client, 0, "anchor")
    await client.post("/v1/agents/x/heartbeat", headers=AGT, json={"applied_version": 0, "state": "idle"})
    assert (await client.get("/healthz")).json() == {"status": "ok", "latest": 0, "schema_version": 1}
    text = (await client.get("/metrics")).text
    assert "deltasync_latest_version 0.0" in text
    assert 'deltasync_agents{state="idle"} 1.0' in text
    assert 'deltasync_agent_lag_versions{agent="x"} 0.0' in text
    assert 'deltasync_request_seconds_count{method="POST",route="/v1/versions",status="201"} 1.0' in text
    spec = (await client.get("/openapi.json")).json()
    assert "/v1/plan" in spec["paths"] and (await client.get("/docs")).status_code == 200
