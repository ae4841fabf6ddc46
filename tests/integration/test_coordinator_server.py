"""The coordinator as a real process (uvicorn, SQLite file): restarts, races, and 100 long-pollers."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deltasync.protocol import VersionCreate
from deltasync.testing import CoordinatorProcess

from deltasync import CoordinatorError
from deltasync.client import CoordinatorClient
from tests.conftest import AGENT_TOKEN, PUBLISHER_TOKEN, version_body

pytestmark = pytest.mark.slow
ENV = {"DELTASYNC_PUBLISHER_TOKEN": PUBLISHER_TOKEN, "DELTASYNC_AGENT_TOKEN": AGENT_TOKEN}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with CoordinatorProcess(tmp_path / "ledger.db", env=ENV, args=["--max-wait-s", "20"]) as proc:
        yield proc


def test_kill_9_and_restart_mid_stream_loses_nothing(server: CoordinatorProcess) -> None:
    publisher = CoordinatorClient(server.url, token=PUBLISHER_TOKEN, retries=30, backoff_s=0.05, timeout_s=5)
    agent = CoordinatorClient(server.url, token=AGENT_TOKEN, retries=30, backoff_s=0.05, timeout_s=5)
    last = 60
    published: list[int] = []
    seen: list[int] = []
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            publisher.register_version(VersionCreate(**version_body(0, "anchor")))
            for v in range(1, last + 1):
                publisher.register_version(VersionCreate(**version_body(v)))
                published.append(v)
                time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)

    def follow() -> None:
        try:
            after: int | None = None
            while not seen or seen[-1] < last:
                for v in agent.wait_for_versions(after, wait_s=2):
                    seen.append(v.version)
                    after = v.version
                agent.heartbeat("follower", applied_version=after, state="idle")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=publish), threading.Thread(target=follow)]
    with publisher, agent:
        for t in threads:
            t.start()
        while len(published) < 20 and not errors:
            time.sleep(0.01)
        server.kill()  # mid-stream: requests in flight are lost
        time.sleep(0.5)
        server.start()
        for t in threads:
            t.join(120)
        ledger = agent.wait_for_versions(None, wait_s=0)
        fleet = agent.agents()
    assert not errors, errors
    assert published == list(range(1, last + 1))
    assert seen == list(range(0, last + 1)), "the agent missed or duplicated a version"
    assert [(v.version, v.kind) for v in ledger] == [(0, "anchor")] + [(v, "delta") for v in range(1, last + 1)]
    assert [a.applied_version for a in fleet] == [last]


def test_racing_publishers_exactly_one_wins(server: CoordinatorProcess) -> None:
    clients = [CoordinatorClient(server.url, token=PUBLISHER_TOKEN) for _ in range(2)]
    clients[0].register_version(VersionCreate(**version_body(0, "anchor")))
    for v in range(1, 16):
        barrier = threading.Barrier(2)
        outcomes: list[str] = []

        def race(i: int, v: int = v, barrier: threading.Barrier = barrier, outcomes: list[str] = outcomes) -> None:
            body = VersionCreate(**version_body(v, nbytes=100 + i))  # different checksums: a real conflict
            barrier.wait()
            try:
                outcomes.append("created" if clients[i].register_version(body)[1] else "known")
            except CoordinatorError as exc:
                outcomes.append(str(exc.status_code))

        threads = [threading.Thread(target=race, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(outcomes) == ["409", "created"], (v, outcomes)
    assert clients[0].latest_version().version == 15
    for c in clients:
        c.close()


@pytest.mark.anyio
async def test_100_long_pollers_are_all_woken_by_one_publish(server: CoordinatorProcess) -> None:
    pub = {"Authorization": f"Bearer {PUBLISHER_TOKEN}"}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=30) as http:
        assert (await http.post("/v1/versions", json=version_body(0, "anchor"), headers=pub)).status_code == 201
        done: list[float] = []

        async def poll() -> list[int]:
            r = await http.get("/v1/versions", params={"after": 0, "wait_s": 20})
            done.append(time.perf_counter())
            return [v["version"] for v in r.json()["versions"]]

        pollers = [asyncio.create_task(poll()) for _ in range(100)]
        await asyncio.sleep(1.5)  # let all of them reach the server and wait
        assert not done, "a long-poll answered before anything was published"
        t0 = time.perf_counter()
        assert (await http.post("/v1/versions", json=version_body(1), headers=pub)).status_code == 201
        results = await asyncio.gather(*pollers)
    assert all(r == [1] for r in results), "a poller was not woken with the new version"
    latency_ms = sorted((t - t0) * 1e3 for t in done)
    print(f"\n100 long-pollers woken: median {statistics.median(latency_ms):.1f} ms, max {latency_ms[-1]:.1f} ms")
    assert latency_ms[-1] < 15_000  # far below the 20 s wait: they were woken, not timed out
