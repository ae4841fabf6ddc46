"""The coordinator's ledger and answers, attacked through the public interface (the cases that need a server
process are in ``tests/integration/test_coordinator_server.py``): one ledger file has one coordinator, by whatever
path it is reached, with no lock file to plant; a file or database that is not this ledger is refused clearly;
weak or contradictory credentials are refused; one forged report does not degrade the ledger for good; health never
touches a locked database; pins, plans and the shared answer cache are bounded; refusals name the run and say
why."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from pathlib import Path

import pytest
from deltasync_coordinator.db import Database, backup
from deltasync_coordinator.ledger import DamagedLedger, LedgerLocked
from deltasync_coordinator.registry import MIGRATIONS
from deltasync_coordinator.settings import InsecureConfiguration, check_credentials

from deltasync.schemas import RUN_HEADER
from deltasync.vocab import MAX_INT
from tests.conftest import coordinator_settings
from tests.support.asgi import PUB, Coordinator, auth, make_settings, open_coordinator
from tests.support.postgres import hold_write_lock

pytestmark = pytest.mark.anyio


def _db(path: Path) -> Database:
    return Database(path, MIGRATIONS)


# ---------------------------------------------------------------------------------------------- one owner per file


@pytest.mark.sqlite
@pytest.mark.parametrize("route", ["hardlink", "symlink", "dotdot"])
def test_a_second_coordinator_cannot_reach_the_file_by_another_path(tmp_path: Path, route: str) -> None:
    """The lock is on the file itself, not a lock file named after the path: a hard link (worst: each process
    would keep its own WAL, both grant lease epoch 1, and A's acknowledged registrations vanish), a symlink, or a
    removed lock file never lets a second coordinator run on the same ledger."""
    first = _db(tmp_path / "ledger.db")
    try:
        other = {
            "hardlink": tmp_path / "hard.db",
            "symlink": tmp_path / "sym.db",
            "dotdot": tmp_path / "sub" / ".." / "ledger.db",
        }[route]
        (tmp_path / "sub").mkdir()
        if route == "hardlink":
            os.link(tmp_path / "ledger.db", other)
        elif route == "symlink":
            other.symlink_to(tmp_path / "ledger.db")
        with pytest.raises(LedgerLocked, match=r"is in use by another coordinator \(\{\"pid\": \d+, \"host\""):
            _db(other)
    finally:
        first.close()


@pytest.mark.sqlite
def test_the_lock_holds_without_any_lock_file(tmp_path: Path) -> None:
    first = _db(tmp_path / "ledger.db")
    try:
        for leftover in tmp_path.glob("ledger.db.lock"):
            leftover.unlink()  # nothing depends on a lock file
        with pytest.raises(LedgerLocked):
            _db(tmp_path / "ledger.db")
    finally:
        first.close()
    _db(tmp_path / "ledger.db").close()  # free once the first is gone


@pytest.mark.sqlite
def test_a_planted_lock_symlink_never_truncates_its_target(tmp_path: Path) -> None:
    """No ``<db>.lock`` is opened following links and truncated: a planted link never destroys another ledger."""
    victim = tmp_path / "other-run.db"
    victim.write_bytes(b"SQLite format 3\x00" + b"x" * 65536)
    (tmp_path / "new.db.lock").symlink_to(victim)
    _db(tmp_path / "new.db").close()
    assert victim.stat().st_size == 65552


@pytest.mark.sqlite
@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal"])
def test_sqlites_side_files_are_not_ledgers(tmp_path: Path, suffix: str) -> None:
    """A coordinator started on ``ledger.db-wal`` (or another side file) refuses it, never writing a whole
    database into a live WAL file."""
    with pytest.raises(DamagedLedger, match="this is one of SQLite's side files, not a ledger"):
        _db(tmp_path / f"ledger.db{suffix}")


@pytest.mark.sqlite
def test_a_removed_or_replaced_file_stops_acknowledging(tmp_path: Path) -> None:
    """With ``ledger.db*`` deleted or replaced under a running coordinator, it stops acknowledging: a 201 for v6
    and a healthy answer would be lies, and after a restart v0..v6 would be gone."""
    db = _db(tmp_path / "ledger.db")
    try:
        assert db.file_replaced() is None
        for f in tmp_path.glob("ledger.db*"):
            f.unlink()
        assert "was removed while this coordinator ran" in (db.file_replaced() or "")
        with pytest.raises(Exception, match="was removed while this coordinator ran"):
            with db.tx() as c:
                c.execute("INSERT INTO meta VALUES ('x', 'y')")
    finally:
        db.close()


@pytest.mark.sqlite
def test_close_says_when_another_process_blocks_the_checkpoint(tmp_path: Path, caplog) -> None:
    """With a reader holding a read transaction, close says the checkpoint is blocked, never "checkpointed and
    closed" while a ``-wal`` remains and the ``.db`` alone is malformed."""
    db = Database(tmp_path / "ledger.db", MIGRATIONS, timeout_s=0.5)  # the checkpoint waits this long for readers
    with db.tx() as c:
        c.executemany("INSERT INTO meta VALUES (?, ?)", [(f"k{i}", "v" * 500) for i in range(300)])
    reader = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM meta").fetchone()  # a read transaction pins the WAL
    try:
        with caplog.at_level(logging.ERROR):
            db.close()
        assert not db.checkpointed
        assert "NOT checkpointed: another process holds the database open" in caplog.text
    finally:
        reader.close()
    again = _db(tmp_path / "ledger.db")
    again.close()
    wal = tmp_path / "ledger.db-wal"
    assert again.checkpointed and (not wal.exists() or wal.stat().st_size == 0)


# ------------------------------------------------------------------------------------ start-up: clear refusals


def _sql(path: Path, statement: str) -> None:
    """``statement`` run on the file ``path`` and committed by another program (plain sqlite3)."""
    con = sqlite3.connect(path)
    con.execute(statement)
    con.commit()
    con.close()


@pytest.mark.sqlite
def test_files_that_are_not_this_ledger_are_refused_clearly(tmp_path: Path) -> None:
    """Each is refused with a message naming it, never a traceback, and a newer schema is never accepted."""
    _sql(tmp_path / "app.db", "CREATE TABLE users (id INTEGER)")
    with pytest.raises(DamagedLedger, match=r"a SQLite database of something else \(tables \['users'\]\)"):
        _db(tmp_path / "app.db")
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(DamagedLedger, match="is a directory; pass a database file path"):
        _db(tmp_path / "dir.db")
    _db(tmp_path / "new.db").close()
    _sql(tmp_path / "new.db", "INSERT INTO schema_migrations VALUES (4, 0)")
    with pytest.raises(DamagedLedger, match="schema version 4 was written by a newer deltasync"):
        _db(tmp_path / "new.db")
    _db(tmp_path / "lost.db").close()
    _sql(tmp_path / "lost.db", "DROP TABLE agents")
    with pytest.raises(DamagedLedger, match=r"migrations are recorded but tables \['agents'\] are missing"):
        _db(tmp_path / "lost.db")
    _db(tmp_path / "ok.db").close()
    with pytest.raises(FileNotFoundError, match="no such directory for the backup; create it first"):
        backup(tmp_path / "ok.db", tmp_path / "missing" / "dir" / "x.db")


@pytest.mark.postgres
def test_databases_that_are_not_this_ledger_are_refused_clearly_on_postgres(pg_url: str) -> None:
    """The PostgreSQL ledger refuses what the SQLite one refuses: a foreign schema, a newer one, a lost table."""
    import psycopg
    from deltasync_coordinator.pg import PgDatabase
    from deltasync_coordinator.registry import PG_MIGRATIONS

    with psycopg.connect(pg_url, autocommit=True) as con:
        con.execute("CREATE TABLE users (id INTEGER)")
    with pytest.raises(DamagedLedger, match=r"a database of something else \(tables \['users'\]\)"):
        PgDatabase(pg_url, PG_MIGRATIONS)
    with psycopg.connect(pg_url, autocommit=True) as con:
        con.execute("DROP TABLE users")
    PgDatabase(pg_url, PG_MIGRATIONS).close()
    with psycopg.connect(pg_url, autocommit=True) as con:
        con.execute("INSERT INTO schema_migrations VALUES (4, 0)")
    with pytest.raises(DamagedLedger, match="schema version 4 was written by a newer deltasync"):
        PgDatabase(pg_url, PG_MIGRATIONS)
    with psycopg.connect(pg_url, autocommit=True) as con:
        con.execute("DELETE FROM schema_migrations WHERE version = 4")
        con.execute("DROP TABLE agents")
    with pytest.raises(DamagedLedger, match=r"migrations are recorded but tables \['agents'\] are missing"):
        PgDatabase(pg_url, PG_MIGRATIONS)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"publisher_token": "a"}, "DELTASYNC_PUBLISHER_TOKEN must have at least 16 characters"),
        ({"agent_secret": " " * 16}, "DELTASYNC_AGENT_SECRET must have at least 16 characters"),
        ({"insecure": True}, r"would ignore the credentials set \(DELTASYNC_PUBLISHER_TOKEN, DELTASYNC_AGENT_SECRET"),
    ],
)
def test_weak_or_contradictory_credentials_are_refused(tmp_path: Path, overrides: dict, message: str) -> None:
    """A 1-character publisher token (``Bearer a``) and a secret of 16 spaces are refused, and
    ``DELTASYNC_INSECURE=1`` beside real credentials is a contradiction, never a silent way to disable them."""
    with pytest.raises(InsecureConfiguration, match=message):
        check_credentials(coordinator_settings(tmp_path, **overrides))


# ------------------------------------------------------------------------------------------- health and alerts


async def test_one_forged_report_does_not_degrade_the_ledger_for_good(coord: Coordinator) -> None:
    """One heartbeat at v99999999 (422) leaves no alert that only v99999999's registration could clear: honest
    reports, new versions, expiry and restarts clear it."""
    await coord.publish(0, "anchor")
    r = await coord.http.post(
        "/v1/agents/a1/heartbeat", headers=auth("a1"), json={"applied_version": 99999999, "state": "idle"}
    )
    assert r.status_code == 422
    assert (await coord.http.get("/healthz")).json()["status"] == "degraded"
    r = await coord.http.post(
        "/v1/agents/a1/heartbeat", headers=auth("a1"), json={"applied_version": 0, "state": "idle"}
    )
    assert r.status_code == 200
    health = (await coord.http.get("/healthz")).json()
    assert health["status"] == "ok", health
    with coord.app.state.db.read() as c:
        rows = c.execute("SELECT COUNT(*) FROM alerts").fetchone()[0]
    assert rows == 0  # forgotten in the ledger too: a restart does not bring it back


async def test_an_expired_agent_takes_its_alert_with_it(tmp_path: Path, ledger_db: Path | str) -> None:
    app, http = await open_coordinator(make_settings(tmp_path, db=ledger_db))
    async with http:
        c = Coordinator(app, http)
        await c.publish(0, "anchor")
        await http.post(
            "/v1/agents/ghost/heartbeat", headers=auth("ghost"), json={"applied_version": 5, "state": "idle"}
        )
        assert (await http.get("/healthz")).json()["status"] == "degraded"
        await http.post(
            "/v1/agents/ghost/heartbeat", headers=auth("ghost"), json={"applied_version": None, "state": "idle"}
        )
        await http.post(
            "/v1/agents/ghost/heartbeat", headers=auth("ghost"), json={"applied_version": 9, "state": "idle"}
        )
        app.state.fleet._clock = lambda: time.time() + 10**6  # ...and it falls silent for long
        assert app.state.fleet.expire(60) == 1
        assert (await http.get("/healthz")).json()["status"] == "ok"
    app.state.db.close()


async def test_health_never_touches_a_locked_database(coord: Coordinator, tmp_path: Path) -> None:
    """``/healthz`` never writes to the database on the event loop: with another process holding the database,
    a write there would take seconds and every request would wait behind it."""
    await coord.publish(0, "anchor")
    await coord.http.post("/v1/agents/a1/heartbeat", headers=auth("a1"), json={"applied_version": 1, "state": "idle"})
    await coord.publish(1)  # clears the alert's condition: the next /healthz used to write
    with hold_write_lock(coord.app.state.db):  # another process holds the database (SQLite) or the write lock (PG)
        t0 = time.perf_counter()
        r = await coord.http.get("/healthz")
        assert time.perf_counter() - t0 < 0.5 and r.status_code == 200 and r.json()["status"] == "ok"


# ------------------------------------------------------------------------------------------- plans and GC pins


async def test_readers_cannot_pin_what_gc_deletes_and_agents_pin_one_plan(
    tmp_path: Path, ledger_db: Path | str
) -> None:
    """A reader's ``GET /v1/plan`` pins nothing, and an agent pins one plan: if every plan (a read token's too)
    were recorded and pinned its objects for the plan lease, repeating it would keep deltas from GC forever."""
    app, http = await open_coordinator(make_settings(tmp_path, read_token="reader-token-0123456789", db=ledger_db))
    async with http:
        c = Coordinator(app, http)
        await c.publish(0, "anchor")
        for v in range(1, 10):
            await c.publish(v)
        reader = {"Authorization": "Bearer reader-token-0123456789"}
        for to in range(10):
            assert (await http.get(f"/v1/plan?from=0&to={to}", headers=reader)).status_code == 200

        def count() -> int:
            with app.state.db.read() as c:
                return c.execute("SELECT COUNT(*) FROM plans").fetchone()[0]

        assert count() == 0
        for to in range(10):
            assert (await http.get(f"/v1/plan?from=0&to={to}", headers=auth("a1"))).status_code == 200
        assert count() == 1  # one agent, one plan: its latest
    app.state.db.close()


async def test_a_plan_never_goes_down_and_its_bytes_are_capped(coord: Coordinator) -> None:
    await coord.publish(0, "anchor", nbytes=MAX_INT)
    await coord.publish(1, nbytes=MAX_INT)
    await coord.publish(2, nbytes=MAX_INT)
    r = await coord.http.get("/v1/plan?from=2&to=0", headers=auth("a1"))
    assert r.status_code == 409 and "a plan never goes down" in r.json()["detail"]
    r = await coord.http.get("/v1/plan?from=0&to=2", headers=auth("a1"))
    assert r.status_code == 200 and r.json()["bytes"] == MAX_INT  # was 18446744073709551614


# ------------------------------------------------------------------------------------------------ long-polls


async def test_the_shared_answer_cache_is_bounded(coord: Coordinator) -> None:
    """The shared answer cache is bounded: one entry per distinct ``(after, limit)`` until the next registration
    would let 600 distinct limits take the server from 250 to 935 MiB."""
    await coord.publish(0, "anchor")
    for v in range(1, 20):
        await coord.publish(v)
    for limit in range(1, 601):
        r = await coord.http.get(f"/v1/versions?after=-1&limit={min(limit, 1000)}", headers=auth("a1"))
        assert r.status_code == 200
    notifier = coord.app.state.notifier
    assert len(notifier._bodies) <= notifier.MAX_SHARED and len(notifier._answers) <= notifier.MAX_SHARED


async def test_an_answer_computed_across_a_registration_is_not_kept(coord: Coordinator, monkeypatch) -> None:
    """A page computed before a registration but stored after it is never served for the new latest
    (``versions=[]`` with ``latest=1``). The test widens the window with a 0.3 s delay after the query."""
    await coord.publish(0, "anchor")
    registry = coord.app.state.registry
    real = registry.list_after

    def slow(after: int, limit: int):
        rows = real(after, limit)
        time.sleep(0.3)
        return rows

    monkeypatch.setattr(registry, "list_after", slow)
    poll = asyncio.ensure_future(coord.http.get("/v1/versions?after=0&limit=5", headers=auth("a1")))
    await asyncio.sleep(0.1)  # the query has run; the answer is not stored yet
    await coord.publish(1)
    first = await poll
    monkeypatch.setattr(registry, "list_after", real)
    r = await coord.http.get("/v1/versions?after=0&limit=5", headers=auth("a1"))
    assert [v["version"] for v in r.json()["versions"]] == [1], (first.json(), r.json())


# ------------------------------------------------------------------------------- every answer names its run


async def test_size_refusals_and_internal_errors_name_the_run_and_say_why(coord: Coordinator) -> None:
    """413 and 431 carry the run header (the size check sits inside it), and a damaged row gives a JSON 500
    with it that says why, not a text/plain 500 that closes the connection."""
    run = coord.app.state.registry.run_id
    r = await coord.http.post("/v1/versions", content=b"x" * 10_000, headers=PUB | {"content-type": "application/json"})
    assert r.status_code == 413 and r.headers[RUN_HEADER] == run
    r = await coord.http.get("/v1/versions", headers=PUB | {"x-big": "y" * 70_000})
    assert r.status_code == 431 and r.headers[RUN_HEADER] == run
    await coord.publish(0, "anchor")
    await coord.http.post("/v1/agents/a1/heartbeat", headers=auth("a1"), json={"applied_version": 0, "state": "idle"})
    with coord.app.state.db.tx() as c:
        c.execute("UPDATE agents SET timings='{not json' WHERE agent_id='a1'")  # damage in a row
    r = await coord.http.get("/v1/agents", headers=PUB)
    assert r.status_code == 500 and r.headers[RUN_HEADER] == run
    assert r.json()["detail"].startswith("internal error (JSONDecodeError:")
    assert (await coord.http.get("/healthz")).status_code == 200  # the same client goes on


async def test_a_client_pinned_to_a_run_refuses_an_answer_without_one(tmp_path: Path) -> None:
    import httpx

    from deltasync.client import CoordinatorClient, RetryPolicy
    from deltasync.errors import RunMismatch

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ok", "latest": None, "run_id": "run-x", "reasons": []})

    client = CoordinatorClient("http://c", run_id="run-x", retry=RetryPolicy(retries=0))
    client._http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://c")
    with pytest.raises(RunMismatch, match="names no run"):
        client.health()
