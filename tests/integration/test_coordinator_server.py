"""The coordinator as a real process (uvicorn; a SQLite file, or PostgreSQL where marked): restarts, races,
long-pollers, and the operator's failure modes (no credentials, SIGTERM and copies, two coordinators, a damaged
or locked file, file-descriptor limits, TLS); on PostgreSQL, several coordinators on one database and a database
server restarted under them."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deltasync import CoordinatorError
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.schemas import VersionCreate
from deltasync.testing.launchers import CoordinatorProcess, free_port
from deltasync.testing.tls import make_certificates
from tests.conftest import PUBLISHER_TOKEN, TOKENS_ENV, agent_token, version_body
from tests.support.sockets import rss_mib

pytestmark = pytest.mark.slow
PUB = {"Authorization": f"Bearer {PUBLISHER_TOKEN}"}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=["--max-wait-s", "20"]) as proc:
        yield proc


@pytest.fixture
def any_server(tmp_path: Path, ledger_db: Path | str) -> Iterator[CoordinatorProcess]:
    """A coordinator process on each backend (SQLite, then PostgreSQL)."""
    log = tmp_path / "coordinator.log"
    with CoordinatorProcess(ledger_db, env=TOKENS_ENV, args=["--max-wait-s", "20"], log=log) as proc:
        yield proc


class Publishing(CoordinatorClient):
    def register(self, body: dict):
        return self.register_version(VersionCreate(**body), lease=self.lease)


def publishing(url: str, **retry) -> Publishing:
    client = Publishing(url, token=PUBLISHER_TOKEN, retry=RetryPolicy(**retry))
    client.lease = client.acquire_lease("test", ttl_s=120)
    return client


def test_kill_9_and_restart_mid_stream_loses_nothing(any_server: CoordinatorProcess) -> None:
    server = any_server
    publisher = publishing(server.url, retries=30, backoff_s=0.05, timeout_s=5)
    agent = CoordinatorClient(
        server.url, token=agent_token("follower"), retry=RetryPolicy(retries=30, backoff_s=0.05, timeout_s=5)
    )
    last = 60
    published: list[int] = []
    seen: list[int] = []
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            publisher.register(version_body(0, "anchor"))
            for v in range(1, last + 1):
                publisher.register(version_body(v))
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


def test_racing_registrations_exactly_one_wins(any_server: CoordinatorProcess) -> None:
    server = any_server
    first = publishing(server.url)
    second = Publishing(server.url, token=PUBLISHER_TOKEN)
    second.lease = first.lease  # two threads of one publisher, racing with conflicting bodies
    clients = [first, second]
    first.register(version_body(0, "anchor"))
    for v in range(1, 16):
        barrier = threading.Barrier(2)
        outcomes: list[str] = []

        def race(i: int, v: int = v, barrier: threading.Barrier = barrier, outcomes: list[str] = outcomes) -> None:
            body = version_body(v, nbytes=100 + i)  # different checksums: a real conflict
            barrier.wait()
            try:
                outcomes.append("created" if clients[i].register(body)[1] else "known")
            except CoordinatorError as exc:
                outcomes.append(str(exc.status_code))

        threads = [threading.Thread(target=race, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(outcomes) == ["409", "created"], (v, outcomes)
    assert first.latest_version().version == 15
    for c in clients:
        c.close()


@pytest.mark.anyio
async def test_100_long_pollers_are_all_woken_by_one_publish(any_server: CoordinatorProcess) -> None:
    server = any_server
    with publishing(server.url) as pub:
        pub.register(version_body(0, "anchor"))
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        headers = {"Authorization": f"Bearer {agent_token('poller')}"}
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=30, headers=headers) as http:
            done: list[float] = []

            async def poll() -> list[int]:
                r = await http.get("/v1/versions", params={"after": 0, "wait_s": 20})
                done.append(time.perf_counter())
                return [v["version"] for v in r.json()["versions"]]

            pollers = [asyncio.create_task(poll()) for _ in range(100)]
            await asyncio.sleep(1.5)  # let all of them reach the server and wait
            assert not done, "a long-poll answered before anything was published"
            t0 = time.perf_counter()
            await asyncio.to_thread(pub.register, version_body(1))
            results = await asyncio.gather(*pollers)
    assert all(r == [1] for r in results), "a poller was not woken with the new version"
    latency_ms = sorted((t - t0) * 1e3 for t in done)
    print(f"\n100 long-pollers woken: median {statistics.median(latency_ms):.1f} ms, max {latency_ms[-1]:.1f} ms")
    assert latency_ms[-1] < 15_000  # far below the 20 s wait: they were woken, not timed out


def _coordinator(db: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "deltasync.cli", "coordinator", "--db", str(db), "--port", str(free_port()), *args]
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("DELTASYNC_")}
    return subprocess.run(cmd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=60)


def test_without_credentials_the_process_refuses_to_start(tmp_path: Path) -> None:
    """With no tokens (also with --host 0.0.0.0) the process exits 1 naming what to set: it never starts with a
    warning, where an unauthenticated POST /v1/gc could delete the real anchor."""
    for args in ((), ("--host", "0.0.0.0")):
        proc = _coordinator(tmp_path / "l.db", *args)
        assert proc.returncode == 1
        assert (
            "refuses to start without credentials: set DELTASYNC_PUBLISHER_TOKEN and DELTASYNC_AGENT_SECRET"
            in proc.stderr
        )
    assert not (tmp_path / "l.db").exists()


@pytest.mark.sqlite
def test_sigterm_checkpoints_so_the_db_file_alone_is_complete(tmp_path: Path) -> None:
    """SIGTERM closes the connection and checkpoints the WAL, so the ledger.db file alone (without its -wal) holds
    every registered version: a copy of that one file loses nothing."""
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV) as proc, publishing(proc.url) as pub:
        pub.register(version_body(0, "anchor"))
        for v in range(1, 400):
            pub.register(version_body(v))
        assert (tmp_path / "ledger.db-wal").stat().st_size > 0  # while it runs, the commits sit in the WAL
    assert proc.proc is not None and proc.proc.returncode in (0, -15)  # uvicorn re-raises SIGTERM after shutdown
    assert not (tmp_path / "ledger.db-wal").exists() or (tmp_path / "ledger.db-wal").stat().st_size == 0
    shutil.copy(tmp_path / "ledger.db", tmp_path / "copy.db")  # the operator copies only the .db file
    latest = sqlite3.connect(tmp_path / "copy.db").execute("SELECT MAX(version) FROM versions").fetchone()[0]
    assert latest == 399
    assert "checkpointed and closed" in proc.log_path.read_text()


@pytest.mark.sqlite
def test_a_second_coordinator_on_one_database_exits_naming_the_holder(server: CoordinatorProcess) -> None:
    proc = _coordinator(server.db, env=TOKENS_ENV)
    assert proc.returncode == 1
    assert 'is in use by another coordinator ({"pid": ' in proc.stderr
    assert f'"pid": {server.proc.pid}' in proc.stderr  # type: ignore[union-attr]
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"  # the first one serves on


@pytest.mark.sqlite
def test_a_damaged_database_is_refused_at_start(tmp_path: Path) -> None:
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV) as proc, publishing(proc.url) as pub:
        pub.register(version_body(0, "anchor"))
        for v in range(1, 300):
            pub.register(version_body(v))
    raw = bytearray((tmp_path / "ledger.db").read_bytes())
    raw[3 * 4096 : 4 * 4096] = bytes(4096)  # a zeroed page
    (tmp_path / "ledger.db").write_bytes(raw)
    proc = _coordinator(tmp_path / "ledger.db", env=TOKENS_ENV)
    assert proc.returncode == 1 and "restore it from a backup" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.sqlite
def test_backup_of_a_running_coordinator_restores(tmp_path: Path, server: CoordinatorProcess) -> None:
    with publishing(server.url) as pub:
        pub.register(version_body(0, "anchor"))
        for v in range(1, 50):
            pub.register(version_body(v))
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "deltasync.cli",
                "coordinator",
                "backup",
                "--db",
                str(server.db),
                "--out",
                str(tmp_path / "backup.db"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "consistent as of now" in out.stdout, out.stderr
        run = pub.health()["run_id"]
    server.stop()
    with CoordinatorProcess(tmp_path / "backup.db", env=TOKENS_ENV) as restored:
        health = httpx.get(restored.url + "/healthz").json()
        assert health["latest"] == 49 and health["run_id"] == run  # a backup keeps the run's identity


@pytest.mark.sqlite
def test_health_answers_fast_and_requests_get_503_while_the_database_is_locked(tmp_path: Path) -> None:
    """A database held locked by another session: requests are 503 after --db-timeout-s, never stalled, and
    /healthz answers at once from memory, never a bare 500."""
    args = ["--db-timeout-s", "1"]
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=args) as proc, publishing(proc.url) as pub:
        pub.register(version_body(0, "anchor"))
        other = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None, timeout=10)
        other.execute("BEGIN EXCLUSIVE")  # another process holds the database
        try:
            time.sleep(2.5)  # the probe notices
            t0 = time.perf_counter()
            health = httpx.get(proc.url + "/healthz", timeout=5)
            health_ms = (time.perf_counter() - t0) * 1e3
            assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
            assert "locked" in " ".join(health.json()["reasons"])
            assert health_ms < 100, health_ms
            t0 = time.perf_counter()
            r = httpx.post(
                proc.url + "/v1/versions",
                json=version_body(1),
                headers=PUB | {"Deltasync-Lease": pub.lease.lease_id},
                timeout=30,
            )
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and time.perf_counter() - t0 < 5, r.text
        finally:
            other.execute("ROLLBACK")
            other.close()
        pub.register(version_body(1))  # the client retries 503s: fine once the lock is gone
        time.sleep(1.5)
        assert httpx.get(proc.url + "/healthz").json()["status"] == "ok"


@pytest.mark.anyio
async def test_long_polls_beyond_the_cap_at_a_low_file_limit_are_503_not_resets(tmp_path: Path) -> None:
    """Long-polls beyond --max-long-polls at a low open-files limit are told 503 (retry later); no connection
    is reset."""
    prefix = ["prlimit", "--nofile=256:256"]
    args = ["--max-long-polls", "150", "--max-wait-s", "3"]
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=args, prefix=prefix) as proc:
        headers = {"Authorization": f"Bearer {agent_token('p')}"}
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=proc.url, limits=limits, timeout=30, headers=headers) as http:

            async def poll() -> int | str:
                try:
                    return (await http.get("/v1/versions", params={"after": 5, "wait_s": 3})).status_code
                except httpx.TransportError as exc:
                    return type(exc).__name__

            outcomes = await asyncio.gather(*[poll() for _ in range(220)])
    assert set(outcomes) <= {200, 503}, sorted(set(map(str, outcomes)))
    assert outcomes.count(200) >= 150 - 5 and outcomes.count(503) >= 1


def test_tls_with_a_certificate_made_in_the_test(tmp_path: Path) -> None:
    """Bearer tokens never cross hosts in clear text: the coordinator speaks TLS and clients verify it against a
    CA bundle."""
    ca, cert, key = make_certificates(tmp_path / "tls")
    args = ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=args, ca_bundle=ca) as proc:
        assert proc.url.startswith("https://")
        with Publishing(proc.url, token=PUBLISHER_TOKEN, ca_bundle=str(ca)) as pub:
            pub.lease = pub.acquire_lease("tls", ttl_s=60)
            assert pub.register(version_body(0, "anchor"))[1]
        untrusting = CoordinatorClient(proc.url, token=PUBLISHER_TOKEN, retry=RetryPolicy(retries=0))
        with pytest.raises(CoordinatorError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            untrusting.health()
        untrusting.close()
        with pytest.raises(httpx.HTTPError):
            httpx.get(proc.url.replace("https://", "http://") + "/healthz", timeout=5)  # no plain HTTP beside it


def test_an_endless_request_head_is_431_before_it_costs_memory(server: CoordinatorProcess) -> None:
    """An endless request head is refused (431) before it costs memory: uvicorn's httptools buffers an
    unfinished header line without limit (``h11_max_incomplete_event_size`` applies to h11 only), so 128 MiB of
    one header would grow the server by as much before any check ran."""
    import socket

    assert server.proc is not None
    before = rss_mib(server.proc.pid)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        sent, answer = 0, b""
        try:
            while sent < 64 << 20:
                sock.sendall(b"a" * (256 << 10))
                sent += 256 << 10
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            answer = sock.recv(4096)
        except ConnectionResetError:
            pass
    assert sent < 4 << 20, f"the server read {sent} bytes of one head"
    assert answer.startswith(b"HTTP/1.1 431") and b"request head over 65536 bytes" in answer, answer[:200]
    assert b"deltasync-run-id: run-" in answer.lower()
    assert rss_mib(server.proc.pid) - before < 30
    assert httpx.get(server.url + "/healthz").status_code == 200


@pytest.mark.anyio
async def test_abandoned_long_polls_give_their_slots_back(tmp_path: Path) -> None:
    """Clients that open a long-poll and hang up give their slots back at once: they cannot hold every slot for
    the whole wait while a real agent gets 503 on every poll."""
    import socket

    args = ["--max-long-polls", "10", "--max-wait-s", "30"]
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=args) as proc:
        host, port = proc.url.removeprefix("http://").split(":")
        request = (
            f"GET /v1/versions?after=5&wait_s=30 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {agent_token('p')}\r\n\r\n"
        ).encode()
        for _ in range(10):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(request)
                time.sleep(0.05)  # the poll is waiting; then the client goes away
        time.sleep(0.5)
        headers = {"Authorization": f"Bearer {agent_token('real')}"}
        r = httpx.get(proc.url + "/v1/versions", params={"after": 5, "wait_s": 1}, headers=headers, timeout=10)
        assert r.status_code == 200, r.text


@pytest.mark.sqlite
def test_a_second_coordinator_through_a_hard_link_exits_naming_the_holder(server: CoordinatorProcess) -> None:
    """A coordinator on a hard link of the ledger exits naming the holder: a lock named after the path (as
    SQLite's WAL is) would let both start, both grant lease epoch 1, both acknowledge different v0..v2, and the
    first one's registrations be gone after both stopped."""
    link = server.db.with_name("hard.db")
    link.hardlink_to(server.db)
    out = subprocess.run(
        [sys.executable, "-m", "deltasync.cli", "coordinator", "--db", str(link), "--port", str(free_port())],
        env={**__import__("os").environ, **TOKENS_ENV},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "is in use by another coordinator" in out.stderr and '"pid": ' in out.stderr, out.stderr


# ------------------------------------------------------------------ PostgreSQL: several coordinators, one ledger


@contextlib.contextmanager
def _two_coordinators(
    db: str, tmp_path: Path, args: list[str]
) -> Iterator[tuple[CoordinatorProcess, CoordinatorProcess]]:
    """Coordinators A and B on one database, started side by side (an interpreter start each: seconds)."""
    a, b = (CoordinatorProcess(db, env=TOKENS_ENV, args=args, log=tmp_path / f"{n}.log") for n in "ab")
    try:
        starts = [threading.Thread(target=p.start) for p in (a, b)]
        for t in starts:
            t.start()
        for t in starts:
            t.join(60)
        for p in (a, b):
            assert p.proc is not None and p.proc.poll() is None, p.log_path.read_text()[-2000:]
        yield a, b
    finally:
        a.stop()
        b.stop()


def _poll_wake_ms(url: str, after: int, n: int, publish) -> list[float]:
    """``n`` long-polls on ``url`` waiting above ``after``; ``publish()`` (elsewhere); each poll's wake-up in ms."""

    async def run() -> list[float]:
        headers = {"Authorization": f"Bearer {agent_token('poller')}"}
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30, headers=headers) as http:
            done: list[float] = []

            async def poll() -> list[int]:
                r = await http.get("/v1/versions", params={"after": after, "wait_s": 15})
                done.append(time.perf_counter())
                return [v["version"] for v in r.json()["versions"]]

            pollers = [asyncio.create_task(poll()) for _ in range(n)]
            await asyncio.sleep(1.0)  # every poll reaches the server and waits
            assert not done, "a long-poll answered before anything was published"
            t0 = time.perf_counter()
            await asyncio.to_thread(publish)
            results = await asyncio.gather(*pollers)
        assert all(r == [after + 1] for r in results), results[:3]
        return [(t - t0) * 1e3 for t in done]

    return asyncio.run(run())


@pytest.mark.postgres
def test_two_coordinators_on_one_postgres_share_the_run_wake_each_other_and_fence(tmp_path: Path, pg_url: str) -> None:
    """A version registered through A is listed by B and wakes B's long-polls (< 1 s, median over 5
    publishes of 50 pollers); a second publisher through B is refused while A's holds the lease; racing
    registrations of one version through A and B: exactly one row."""
    with _two_coordinators(pg_url, tmp_path, ["--max-wait-s", "20"]) as (a, b), publishing(a.url) as pub:
        assert httpx.get(a.url + "/healthz").json()["run_id"] == httpx.get(b.url + "/healthz").json()["run_id"]
        pub.register(version_body(0, "anchor"))
        wake: list[float] = []
        for v in range(1, 6):
            wake += _poll_wake_ms(b.url, v - 1, 50, lambda v=v: pub.register(version_body(v)))
        median = statistics.median(wake)
        print(f"\nRELIABILITY woken on B by a registration through A: median {median:.1f} ms, max {max(wake):.1f} ms")
        assert median < 1000 and max(wake) < 5000
        assert httpx.get(b.url + "/healthz").json()["latest"] == 5
        with CoordinatorClient(b.url, token=PUBLISHER_TOKEN, retry=RetryPolicy(retries=0)) as other:
            with pytest.raises(CoordinatorError, match="409.*the run is being published by 'test'"):
                other.acquire_lease("intruder", ttl_s=60)
            r = httpx.post(b.url + "/v1/versions", json=version_body(6), headers=PUB, timeout=10)
            assert r.status_code == 409 and "registering needs the run's publisher lease" in r.json()["detail"]
            r = httpx.post(
                b.url + "/v1/versions", json=version_body(6), headers=PUB | {"Deltasync-Lease": "0" * 32}, timeout=10
            )
            assert r.status_code == 409 and "held by 'test' (epoch 1)" in r.json()["detail"]
        through_b = Publishing(b.url, token=PUBLISHER_TOKEN)
        through_b.lease = pub.lease  # the publisher's own threads, one through each coordinator
        for v in range(6, 16):
            barrier = threading.Barrier(2)
            outcomes: list[str] = []

            def race(c: Publishing, i: int, v: int = v, barrier=barrier, outcomes=outcomes) -> None:
                barrier.wait()
                try:
                    outcomes.append("created" if c.register(version_body(v, nbytes=100 + i))[1] else "known")
                except CoordinatorError as exc:
                    outcomes.append(str(exc.status_code))

            threads = [threading.Thread(target=race, args=(c, i)) for i, c in enumerate((pub, through_b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert sorted(outcomes) == ["409", "created"], (v, outcomes)
        through_b.close()
        with CoordinatorClient(b.url, token=PUBLISHER_TOKEN) as reader:
            listed = reader.wait_for_versions(None, wait_s=0)
    assert [(x.version, x.kind) for x in listed] == [(0, "anchor")] + [(v, "delta") for v in range(1, 16)]


@pytest.mark.postgres
def test_a_postgres_restart_mid_run_gives_503s_then_recovers(tmp_path: Path, pg_url: str, postgres) -> None:
    """The database server stops under two running coordinators: requests get 503 with Retry-After (never 500),
    /healthz says degraded; once it is back every acknowledged version is there, registrations go on, and B's
    long-polls are woken by A's registrations again (its listener reconnected)."""
    if postgres.external is not None:
        pytest.skip("the test session does not own the PostgreSQL server of DELTASYNC_TEST_POSTGRES_URL")
    args = ["--max-wait-s", "20", "--db-timeout-s", "2"]
    with (
        _two_coordinators(pg_url, tmp_path, args) as (a, b),
        publishing(a.url, retries=40, backoff_s=0.25, timeout_s=10) as pub,
    ):
        pub.register(version_body(0, "anchor"))
        for v in range(1, 10):
            pub.register(version_body(v))
        postgres.stop("fast")
        try:
            fenced = PUB | {"Deltasync-Lease": pub.lease.lease_id}
            codes = set()
            for url in (a.url, b.url):
                r = httpx.post(url + "/v1/versions", json=version_body(10), headers=fenced, timeout=30)
                codes.add(r.status_code)
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert "unreachable" in r.json()["detail"] or "fails" in r.json()["detail"], r.text
                r = httpx.get(url + "/v1/versions", params={"after": -1}, headers=PUB, timeout=30)
                assert r.status_code == 503, r.text
            time.sleep(1.5)  # the probes notice
            health = httpx.get(b.url + "/healthz", timeout=5).json()
            assert health["status"] == "degraded", health
        finally:
            postgres.start_again()
        t0 = time.monotonic()
        pub.register(version_body(10))  # the client retries its 503s
        print(f"\nRELIABILITY PostgreSQL restarted: the next registration took {time.monotonic() - t0:.2f} s")
        time.sleep(1.0)  # B's listener reconnects (it retries every 0.5-1 s)
        wake = _poll_wake_ms(b.url, 10, 10, lambda: pub.register(version_body(11)))
        assert max(wake) < 5000, wake
        with CoordinatorClient(b.url, token=PUBLISHER_TOKEN) as reader:
            listed = reader.wait_for_versions(None, wait_s=0)
        assert [x.version for x in listed] == list(range(0, 12))
        deadline = time.monotonic() + 10
        while httpx.get(a.url + "/healthz").json()["status"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(a.url + "/healthz").json()["status"] == "ok"
    assert "Traceback" not in (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()


@pytest.mark.postgres
def test_a_newer_schema_on_postgres_is_refused_at_start(pg_url: str) -> None:
    import psycopg
    from deltasync_coordinator.pg import PgDatabase
    from deltasync_coordinator.registry import PG_MIGRATIONS

    PgDatabase(pg_url, PG_MIGRATIONS).close()  # a ledger, migrated
    with psycopg.connect(pg_url, autocommit=True) as con:
        con.execute("INSERT INTO schema_migrations VALUES (99, 0)")
    proc = _coordinator(pg_url, env=TOKENS_ENV)  # type: ignore[arg-type]
    assert proc.returncode == 1
    assert "schema version 99 was written by a newer deltasync (this one knows 3)" in proc.stderr, proc.stderr[-2000:]
