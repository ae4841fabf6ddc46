"""Several coordinator replicas of one ledger, with real processes: the publisher and agents are
configured with every replica's URL and go on through another when theirs dies.

On SQLite one coordinator at a time may serve the file (an ``flock``), so the SQLite story is a **standby**:
replica A serves ``ledger.db``; B's URL is configured but B is not running; A is killed (``kill -9``) mid-run and
B is started on the same file (the lock died with A). On PostgreSQL both replicas run from the start on one
database and A is killed under load. Only :class:`Replicas` (how to start replica i, how to read the ledger back)
differs.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deltasync import LocalStore
from deltasync.agent import Agent
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.config import AgentConfig, PublisherConfig
from deltasync.publisher import Publisher
from deltasync.schemas import VersionCreate
from deltasync.targets import InMemoryTarget
from deltasync.testing.launchers import CoordinatorProcess
from deltasync.testing.models import qwen3_shapes
from deltasync.testing.stream import UpdateStream
from tests.conftest import PUBLISHER_TOKEN, SMALL_QWEN3, TOKENS_ENV, agent_token, assert_agents_hold, version_body
from tests.support.replicas import ReplicaStub

pytestmark = pytest.mark.slow


@dataclass
class Replicas:
    """How to start replica i of the run's one ledger, and how to read that ledger back.

    SQLite (``standby``): one replica runs at a time, on ``tmp/ledger.db``; the others are standbys started when it
    dies (the ``flock`` dies with it). PostgreSQL: every replica runs from the start, on one database."""

    make: Callable[[int], CoordinatorProcess]
    standby: bool
    query: Callable[[str], list[tuple[Any, ...]]]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Replicas]:
    made: list[CoordinatorProcess] = []
    db: Path | str = tmp_path / "ledger.db" if request.param == "sqlite" else request.getfixturevalue("pg_url")

    def make(i: int) -> CoordinatorProcess:
        proc = CoordinatorProcess(
            db,
            store=str(tmp_path / "store"),
            env=TOKENS_ENV,
            args=["--max-wait-s", "5"],
            log=tmp_path / f"coordinator-{i}.log",
        )
        made.append(proc)
        return proc

    def query(sql: str) -> list[tuple[Any, ...]]:
        if isinstance(db, Path):
            with sqlite3.connect(db) as conn:
                return conn.execute(sql).fetchall()
        import psycopg

        with psycopg.connect(db) as conn:
            return [tuple(row) for row in conn.execute(sql).fetchall()]

    yield Replicas(make, standby=isinstance(db, Path), query=query)
    for proc in made:
        proc.stop()


def _client(urls: list[str], token: str) -> CoordinatorClient:
    return CoordinatorClient(urls, token=token, retry=RetryPolicy(retries=40, backoff_s=0.05, timeout_s=10))


def test_a_replica_killed_mid_run_the_publisher_and_agents_go_on_through_the_next(
    tmp_path: Path, replicas: Replicas
) -> None:
    a, b = replicas.make(0), replicas.make(1)
    a.start()
    if not replicas.standby:
        b.start()
    urls = [a.url, b.url]
    store = LocalStore(tmp_path / "store")
    stream = UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=14)
    clients = [_client(urls, agent_token(f"a{i}")) for i in range(3)]
    agents = [
        Agent(
            store=store,
            coordinator=c,
            target=InMemoryTarget(),
            config=AgentConfig(
                agent_id=f"a{i}", staging_dir=str(tmp_path / f"a{i}"), retries=1, backoff_s=0.01, poll_wait_s=1
            ),
        )
        for i, c in enumerate(clients)
    ]
    stop = threading.Event()
    threads = [threading.Thread(target=agent.run, args=(stop,)) for agent in agents]
    for t in threads:
        t.start()
    publisher = _client(urls, PUBLISHER_TOKEN)
    truth = {}
    takeover: threading.Timer | None = None
    t0 = time.monotonic()
    try:
        with Publisher(store, publisher, PublisherConfig(anchor_every=15, lease_ttl_s=30)) as pub:
            lease = pub.lease
            for step in range(40):
                if step == 15:  # A dies mid-run (agents are long-polling it); the standby takes the file over
                    a.kill()
                    if replicas.standby:
                        takeover = threading.Timer(0.5, b.start)
                        takeover.start()
                weights = stream.step()
                truth[pub.publish(weights, step)] = weights
            assert pub.lease is not None and lease is not None and pub.lease.lease_id == lease.lease_id  # one lease
        deadline = time.monotonic() + 60
        while any(agent.target.version != 39 for agent in agents) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        if takeover is not None:
            takeover.join()
    took = time.monotonic() - t0
    ledger = publisher.wait_for_versions(None, wait_s=0)
    assert publisher.base_url == b.url and all(c.base_url == b.url for c in clients)  # everyone moved to B
    assert publisher.run_id == clients[0].run_id  # one run: B serves A's ledger
    for c in [publisher, *clients]:
        c.close()
    b.stop()  # checkpoints the WAL: the file alone is the ledger
    deltas = [v.version for v in ledger if v.kind == "delta"]
    assert deltas == list(range(1, 40))
    rows = replicas.query("SELECT version, kind, COUNT(*) FROM versions GROUP BY version, kind")  # each once
    assert all(n == 1 for _, _, n in rows) and sorted(v for v, k, _ in rows if k == "delta") == list(range(1, 40))
    assert_agents_hold(agents, 39, truth[39])
    print(
        f"\nRELIABILITY replica A kill -9 at v15, {'standby' if replicas.standby else 'running'} B on the same "
        f"ledger: 40 versions in {took:.1f} s, "
        "registered once each, lost 0; the publisher (one lease) and 3 agents at v39 bit-exact through B"
    )


def test_a_registration_that_committed_on_a_replica_killed_before_answering_is_idempotent_on_the_next(
    tmp_path: Path, replicas: Replicas
) -> None:
    """v5's registration reaches A's ledger; A is killed before its answer leaves (a stub in front of A cuts
    the connection); the retry on B, over the same ledger, is the identical-digest answer: 200, not new, never
    409; the lease taken on A goes on registering on B; every version is in the ledger once."""
    a, b = replicas.make(0), replicas.make(1)
    a.start()
    if not replicas.standby:
        b.start()
    with ReplicaStub(a.url) as front:
        with _client([front.url, b.url], PUBLISHER_TOKEN) as c:
            lease = c.acquire_lease("pub", ttl_s=30)
            c.register_version(VersionCreate(**version_body(0, "anchor")), lease=lease)
            for v in range(1, 5):
                assert c.register_version(VersionCreate(**version_body(v)), lease=lease)[1]

            takeover = threading.Timer(0.3, b.start if replicas.standby else lambda: None)

            def die(method: str, path: str) -> None:  # after A committed v5, before its answer is passed on
                if (method, path) == ("POST", "/v1/versions"):
                    a.kill()
                    takeover.start()

            front.after_forward = die
            front.mode = "cut_after_forward"
            v5, created = c.register_version(VersionCreate(**version_body(5)), lease=lease)
            assert v5.version == 5 and created is False and c.base_url == b.url
            assert c.register_version(VersionCreate(**version_body(6)), lease=lease)[1]  # the same lease, on B
            assert [v.version for v in c.wait_for_versions(0, wait_s=0)] == [1, 2, 3, 4, 5, 6]
    takeover.join()
    b.stop()
    rows = replicas.query("SELECT version, kind, epoch FROM versions ORDER BY version, kind")
    assert rows == [(0, "anchor", 1), *((v, "delta", 1) for v in range(1, 7))]
