"""The ledger alone (no HTTP): registration rules, plans, retention, migrations, restarts, and the database
file itself (one owner, integrity, clean close, online backup). The backend-neutral cases run on SQLite and on
PostgreSQL (``ledger_db``); ``sqlite``-marked ones are about the file; ``postgres``-marked ones about several
coordinators sharing one database."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from deltasync_coordinator.db import Database, backup
from deltasync_coordinator.fleet import Fleet
from deltasync_coordinator.ledger import Busy, DamagedLedger, LedgerLocked
from deltasync_coordinator.registry import MIGRATIONS, PG_MIGRATIONS, Conflict, Fenced, Invalid, NotFound, Registry
from deltasync_coordinator.retention import Retention

from deltasync.schemas import AgentHeartbeat, VersionCreate
from tests.conftest import version_body
from tests.support.postgres import hold_write_lock


@dataclasses.dataclass
class Ledger:
    db: Database
    registry: Registry
    fleet: Fleet
    retention: Retention
    lease: str

    def close(self) -> None:
        self.db.close()


def open_ledger(path: Path | str, clock, timeout_s: float = 1) -> Ledger:
    if isinstance(path, str):  # a PostgreSQL URL
        from deltasync_coordinator.pg import PgDatabase

        db = PgDatabase(path, PG_MIGRATIONS, clock=clock, timeout_s=timeout_s)
    else:
        db = Database(path, MIGRATIONS, clock=clock, timeout_s=timeout_s)
    registry = Registry(db)
    fleet = Fleet(db, registry)
    try:
        lease = registry.acquire_lease("test", 3600, None).lease_id
    except Conflict:  # reopened within its lease
        with db.tx() as c:
            lease = c.execute("SELECT lease_id FROM lease").fetchone()[0]
    return Ledger(db, registry, fleet, Retention(db, registry, fleet, stale_after_s=60, plan_lease_s=0), lease)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(ledger_db: Path | str, clock: Clock):
    ledger = open_ledger(ledger_db, clock)
    yield ledger
    ledger.close()


@pytest.fixture
def sqlite_ledger(tmp_path: Path, clock: Clock):
    ledger = open_ledger(tmp_path / "ledger.db", clock)
    yield ledger
    ledger.close()


@pytest.fixture
def registry(ledger: Ledger) -> Registry:
    return ledger.registry


def reg(registry: Registry, *args, **kwargs):
    """Register a made-up object under the live lease."""
    with registry.db.tx() as c:
        lease_id = c.execute("SELECT lease_id FROM lease").fetchone()[0]
    return registry.register(VersionCreate(**version_body(*args, **kwargs)), lease_id)


def test_register_is_idempotent_and_conflicts_are_refused(registry: Registry) -> None:
    _, created = reg(registry, 0, "anchor")
    assert created
    record, created = reg(registry, 0, "anchor")
    assert not created and record.version == 0
    with pytest.raises(Conflict, match="anchor v0 is already registered with other fields"):
        reg(registry, 0, "anchor", nbytes=5)
    with pytest.raises(Conflict, match="delta v3: its base v2 is not registered; publish an anchor instead"):
        reg(registry, 3, base=2)
    reg(registry, 1)
    reg(registry, 2)
    with pytest.raises(Conflict, match="delta v2 is already registered"):
        reg(registry, 2, nbytes=7)
    reg(registry, 4, base=2)  # versions may skip (a coalesced delta)
    with pytest.raises(Conflict, match="delta v3 is stale: v4 is already registered"):
        reg(registry, 3, base=2)
    reg(registry, 2, "anchor")  # an anchor for a version that has a delta, written after it
    with pytest.raises(Conflict, match="anchor v3 is stale: v4 is already registered"):
        reg(registry, 3, "anchor")
    assert registry.latest_version() == 4
    assert [(v.version, v.kind) for v in registry.list_after(0)] == [
        (1, "delta"),
        (2, "delta"),
        (2, "anchor"),
        (4, "delta"),
    ]
    assert registry.get(2).kind == "delta" and registry.get(2, "anchor").kind == "anchor"
    with pytest.raises(NotFound, match="version 3 is not registered"):
        registry.get(3)


def test_plan_picks_the_cheaper_route(registry: Registry) -> None:
    reg(registry, 0, "anchor", nbytes=1000)
    for v in range(1, 8):
        reg(registry, v, nbytes=100)
    reg(registry, 5, "anchor", nbytes=1000)
    p = registry.plan(6, None)
    assert (p.route, [(s.version, s.kind) for s in p.steps], p.bytes) == ("deltas", [(7, "delta")], 100)
    p = registry.plan(1, 7)  # 6 deltas (600 B) beat the anchor at 5 + 2 deltas (1200 B)
    assert p.route == "deltas" and [s.version for s in p.steps] == [2, 3, 4, 5, 6, 7]
    p = registry.plan(None, 7)  # nothing held: the newest anchor on the chain and what follows it
    assert [(s.version, s.kind) for s in p.steps] == [(5, "anchor"), (6, "delta"), (7, "delta")]
    assert p.bytes == 1200 and p.route == "anchor"
    p = registry.plan(None, 3)
    assert [(s.version, s.kind) for s in p.steps] == [(0, "anchor"), (1, "delta"), (2, "delta"), (3, "delta")]
    assert registry.plan(7, 7).route == "none"
    with pytest.raises(Conflict, match="a plan from v9 refused: the ledger's latest is v7; the agent is ahead"):
        registry.plan(9, 7)  # an agent ahead of the ledger is never given a way down


def test_plan_prefers_the_anchor_when_the_chain_costs_more(registry: Registry) -> None:
    reg(registry, 0, "anchor", nbytes=50)
    for v in range(1, 4):
        reg(registry, v, nbytes=100)
    reg(registry, 3, "anchor", nbytes=50)
    p = registry.plan(0, 3)
    assert p.route == "anchor" and [(s.version, s.kind) for s in p.steps] == [(3, "anchor")]
    with pytest.raises(NotFound, match="version 9 is not registered"):
        registry.plan(0, 9)


def test_heartbeats_lag_and_staleness(ledger: Ledger, clock: Clock) -> None:
    registry, fleet = ledger.registry, ledger.fleet
    reg(registry, 0, "anchor")
    reg(registry, 1)
    a = fleet.heartbeat("a1", AgentHeartbeat(applied_version=0, state="idle", timings={"pause": 0.01}), 60)
    assert a.lag == 1 and not a.stale and a.timings == {"pause": 0.01}
    fleet.heartbeat("b2", AgentHeartbeat(applied_version=None, state="fetching"), 60)
    clock.now += 61
    fleet.heartbeat("b2", AgentHeartbeat(applied_version=1, state="idle"), 60)
    agents = {x.agent_id: x for x in fleet.agents(60).agents}
    assert agents["a1"].stale and not agents["b2"].stale and agents["b2"].lag == 0
    assert fleet.stats(60)[0] == {"idle": 1, "stale": 1}


def test_an_agent_above_the_latest_is_refused_and_degrades_the_ledger(ledger: Ledger) -> None:
    """A ledger behind what its agents report is degraded, never healthy."""
    reg(ledger.registry, 0, "anchor")
    reg(ledger.registry, 1)
    with pytest.raises(Invalid, match="applied_version 7 is above the latest version 1"):
        ledger.fleet.heartbeat("a1", AgentHeartbeat(applied_version=7, state="idle"), 60)
    assert ledger.fleet.alerts() == [
        "agent a1 reports v7, above the ledger's latest v1: the ledger is behind its agents (restored from an old "
        "backup, or copied without its WAL?)"
    ]
    for v in range(2, 8):  # a publisher moves the run past what the agent reported: healthy again
        reg(ledger.registry, v)
    assert ledger.fleet.alerts() == []


def test_gc_keeps_what_live_agents_and_plans_need(ledger: Ledger, clock: Clock) -> None:
    registry, retention = ledger.registry, ledger.retention
    assert retention.candidates().candidates == []
    reg(registry, 0, "anchor")
    for v in range(1, 10):
        reg(registry, v)
    reg(registry, 4, "anchor")
    reg(registry, 8, "anchor")
    ledger.fleet.heartbeat("slow", AgentHeartbeat(applied_version=3, state="idle"), 60)
    g = retention.candidates()
    assert g.keep_from == 3
    assert [(c.version, c.kind) for c in g.candidates] == [
        (0, "anchor"),
        (1, "delta"),
        (2, "delta"),
        (3, "delta"),
        (4, "anchor"),
    ]
    clock.now += 120  # the slow agent goes stale: only the newest anchor and what follows it stay
    g = retention.candidates()
    assert g.keep_from == 8
    kept = {(v.version, v.kind) for v in registry.list_after(-1)} - {(c.version, c.kind) for c in g.candidates}
    assert kept == {(8, "anchor"), (9, "delta")}
    for c in g.candidates:
        retention._mark_deleted(c, [c.manifest_key], "gc")
    assert registry.plan(None, 9).steps[0].version == 8
    assert len(retention.deletions()) == len(g.candidates)
    assert retention.candidates().candidates == []


def test_registration_needs_the_live_lease(ledger: Ledger, clock: Clock) -> None:
    body = VersionCreate(**version_body(0, "anchor"))
    with pytest.raises(Fenced, match="registering needs the run's publisher lease"):
        ledger.registry.register(body, None)
    clock.now += 7200  # the lease expires
    with pytest.raises(Fenced, match="no publisher holds the run"):
        ledger.registry.register(body, ledger.lease)
    fresh = ledger.registry.acquire_lease("b", 60, None)
    assert fresh.epoch == 2 and fresh.next_version == 0
    record, created = ledger.registry.register(body, fresh.lease_id)
    assert created and record.version == 0
    assert ledger.registry.register(body, None) == (record, False)  # an identical retry needs no lease


@pytest.mark.sqlite
def test_state_survives_a_restart_and_migrations_are_recorded(tmp_path: Path, clock: Clock) -> None:
    first = open_ledger(tmp_path / "l.db", clock)
    reg(first.registry, 0, "anchor")
    reg(first.registry, 1)
    first.fleet.heartbeat("a", AgentHeartbeat(applied_version=1, state="idle"), 60)
    run = first.registry.run_id
    first.close()
    assert not (tmp_path / "l.db-wal").exists() or (tmp_path / "l.db-wal").stat().st_size == 0  # checkpointed
    again = open_ledger(tmp_path / "l.db", clock)
    assert again.registry.latest_version() == 1 and again.fleet.agents(60).agents[0].applied_version == 1
    assert again.db.schema_version == len(MIGRATIONS) and again.registry.run_id == run
    db = sqlite3.connect(tmp_path / "l.db")
    assert [r[0] for r in db.execute("SELECT version FROM schema_migrations")] == list(range(1, len(MIGRATIONS) + 1))
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again.close()


@pytest.mark.sqlite
def test_a_closed_ledger_raises_instead_of_deadlocking(sqlite_ledger: Ledger) -> None:
    ledger = sqlite_ledger
    ledger.close()
    for _ in range(2):  # the second call would hang if the first had leaked the lock
        with pytest.raises(sqlite3.ProgrammingError, match="closed database"):
            ledger.registry.counts()


@pytest.mark.sqlite
def test_one_coordinator_per_database(tmp_path: Path, clock: Clock) -> None:
    """One coordinator per database file: a second one running beside it would answer "no version registered"
    and its long-poll would miss versions."""
    first = open_ledger(tmp_path / "l.db", clock)
    with pytest.raises(LedgerLocked, match=r"l.db is in use by another coordinator \(\{\"pid\": \d+"):
        Database(tmp_path / "l.db", MIGRATIONS, clock=clock)
    first.close()
    Database(tmp_path / "l.db", MIGRATIONS, clock=clock).close()  # free again once the first is gone


@pytest.mark.sqlite
def test_a_damaged_file_is_refused_at_start(tmp_path: Path, clock: Clock) -> None:
    """A zeroed page is refused at start, never left unnoticed until list and GC return 500."""
    ledger = open_ledger(tmp_path / "l.db", clock)
    for v in range(300):
        reg(ledger.registry, v, "anchor" if v == 0 else "delta")
    ledger.close()
    raw = bytearray((tmp_path / "l.db").read_bytes())
    page = 4096
    assert len(raw) > 4 * page
    raw[2 * page : 3 * page] = bytes(page)  # one zeroed page in the middle of the file
    (tmp_path / "l.db").write_bytes(raw)
    with pytest.raises(
        DamagedLedger, match=r"l.db: (the integrity check found|not a usable SQLite).* restore it from a backup"
    ):
        Database(tmp_path / "l.db", MIGRATIONS, clock=clock)
    (tmp_path / "junk.db").write_bytes(b"not a database at all" * 100)
    with pytest.raises(DamagedLedger, match=r"junk.db: not a SQLite database \(it starts with b'not a da'\)"):
        Database(tmp_path / "junk.db", MIGRATIONS, clock=clock)


@pytest.mark.sqlite
def test_an_online_backup_is_consistent_and_never_overwrites(tmp_path: Path, clock: Clock) -> None:
    """Copying only ledger.db of a running coordinator can lose versions silently; the backup command copies a
    live ledger consistently (SQLite's backup API) and never overwrites."""
    ledger = open_ledger(tmp_path / "l.db", clock)
    for v in range(200):
        reg(ledger.registry, v, "anchor" if v == 0 else "delta")
    assert (tmp_path / "l.db-wal").stat().st_size > 0  # the commits sit in the WAL while it runs
    stop = threading.Event()

    def writer() -> None:
        v = 200
        while not stop.is_set():
            reg(ledger.registry, v)
            v += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        time.sleep(0.05)
        backup(tmp_path / "l.db", tmp_path / "copy.db")
    finally:
        stop.set()
        t.join()
    latest = ledger.registry.latest_version()
    ledger.close()
    copy = sqlite3.connect(tmp_path / "copy.db")
    versions = [r[0] for r in copy.execute("SELECT version FROM versions ORDER BY version")]
    assert versions == list(range(len(versions))) and 200 <= len(versions) <= latest + 1  # a prefix, no hole
    assert copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with pytest.raises(FileExistsError, match="never overwrites"):
        backup(tmp_path / "l.db", tmp_path / "copy.db")
    restored = open_ledger(tmp_path / "copy.db", clock)
    assert restored.registry.latest_version() == versions[-1]
    restored.close()


def test_a_locked_database_is_busy_after_the_timeout_not_a_stall(ledger: Ledger) -> None:
    """A database held locked (PostgreSQL: another session holding the coordinators' write lock) makes requests
    Busy after the timeout, never stalls them."""
    reg(ledger.registry, 0, "anchor")
    with hold_write_lock(ledger.db):
        t0 = time.monotonic()
        with pytest.raises(Busy, match="locked by another (process|coordinator or session)"):
            reg(ledger.registry, 1)
        assert time.monotonic() - t0 < 5
        assert "locked" in (ledger.db.probe(timeout_s=0.1) or "")
    assert ledger.db.probe() is None
    reg(ledger.registry, 1)


@pytest.mark.sqlite
def test_plan_cost_grows_with_the_plan_not_the_ledger(sqlite_ledger: Ledger) -> None:
    """A plan's cost grows with the plan, not the ledger (a plan that read every row took 0.375 s for one step
    over 100k rows). The walk touches one indexed row per step: count the statements SQLite runs."""
    registry = sqlite_ledger.registry
    reg(registry, 0, "anchor")
    for v in range(1, 3000):
        reg(registry, v)
    statements: list[str] = []
    registry.db._db.set_trace_callback(statements.append)
    try:
        plan = registry.plan(2998, None)
    finally:
        registry.db._db.set_trace_callback(None)
    assert [s.version for s in plan.steps] == [2999]
    assert len([s for s in statements if s.startswith("SELECT")]) <= 3


# ------------------------------------------------------------------ PostgreSQL: several coordinators, one ledger


@pytest.mark.postgres
def test_state_survives_a_restart_and_the_run_is_created_once_on_postgres(pg_url: str, clock: Clock) -> None:
    """Two coordinators opening a new database at once: one migration, one run id, seen by both."""
    import psycopg

    opened: list[Ledger] = []
    barrier = threading.Barrier(4)

    def start() -> None:
        barrier.wait()
        opened.append(open_ledger(pg_url, clock))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(opened) == 4 and len({o.registry.run_id for o in opened}) == 1
    assert len({o.lease for o in opened}) == 1  # one lease granted, the others read it (open_ledger)
    reg(opened[0].registry, 0, "anchor")
    reg(opened[1].registry, 1)
    run = opened[0].registry.run_id
    for o in opened:
        o.close()
    again = open_ledger(pg_url, clock)
    assert again.registry.latest_version() == 1 and again.registry.run_id == run
    assert again.db.schema_version == len(PG_MIGRATIONS)
    again.close()
    with psycopg.connect(pg_url) as con:
        rows = [r[0] for r in con.execute("SELECT version FROM schema_migrations ORDER BY version")]
        assert rows == list(range(1, len(PG_MIGRATIONS) + 1))
        assert con.execute("SELECT COUNT(*) FROM meta WHERE key='run_id'").fetchone()[0] == 1  # type: ignore[index]


@pytest.mark.postgres
def test_two_coordinators_racing_register_each_version_exactly_once(pg_url: str, clock: Clock) -> None:
    """Every registration of a version through two coordinators at once: exactly one row; the other gets the
    idempotent answer (same body) or 409 (another body), never a second row, never a 500."""
    a, b = open_ledger(pg_url, clock), open_ledger(pg_url, clock)
    try:
        reg(a.registry, 0, "anchor")
        for v in range(1, 25):
            barrier = threading.Barrier(4)
            outcomes: list[str] = []

            def race(registry: Registry, nbytes: int, v: int = v, barrier=barrier, outcomes=outcomes) -> None:
                barrier.wait()
                try:
                    outcomes.append("created" if reg(registry, v, nbytes=nbytes)[1] else "known")
                except Conflict as exc:
                    outcomes.append("409" if "already registered" in str(exc) or "stale" in str(exc) else str(exc))

            same = v % 2 == 0  # even versions: the same body four times (a retried request); odd: four bodies
            threads = [
                threading.Thread(target=race, args=(r, 100 if same else 100 + i))
                for i, r in enumerate((a.registry, b.registry, a.registry, b.registry))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert outcomes.count("created") == 1, (v, outcomes)
            assert sorted(outcomes) == sorted(["created"] + (["known"] * 3 if same else ["409"] * 3)), (v, outcomes)
        with a.db.read() as c:
            rows = c.execute("SELECT version, kind FROM versions ORDER BY version").fetchall()
        assert [tuple(r) for r in rows] == [(0, "anchor")] + [(v, "delta") for v in range(1, 25)]
        assert b.registry.refresh_latest() == 24
    finally:
        a.close()
        b.close()


@pytest.mark.postgres
def test_the_lease_fences_across_coordinators(pg_url: str, clock: Clock) -> None:
    """A publisher holding the lease through A; a second publisher through B is refused, and once the lease has
    passed to B (A's expired), A's publisher is fenced through either coordinator."""
    a = open_ledger(pg_url, clock)  # takes the lease (holder "test")
    b = open_ledger(pg_url, clock)
    try:
        reg(a.registry, 0, "anchor")
        with pytest.raises(Conflict, match="the run is being published by 'test' .lease epoch 1"):
            b.registry.acquire_lease("second", 60, None)
        with pytest.raises(Fenced, match="registering needs the run's publisher lease"):
            b.registry.register(VersionCreate(**version_body(1)), "f" * 32)
        record, created = b.registry.register(VersionCreate(**version_body(1)), a.lease)  # A's lease through B
        assert created and record.version == 1
        clock.now += 7200  # A's publisher stalls past its lease; B's takes the run
        second = b.registry.acquire_lease("second", 60, None)
        assert second.epoch == 2 and second.next_version == 2
        for registry in (a.registry, b.registry):
            with pytest.raises(Fenced, match="held by 'second' .epoch 2."):
                registry.register(VersionCreate(**version_body(2)), a.lease)
            with pytest.raises(Fenced, match="is lost .'second' holds the run now."):
                registry.acquire_lease("test", 60, a.lease)
        assert a.registry.register(VersionCreate(**version_body(2)), second.lease_id)[1]
        with a.db.read() as c:
            epochs = [r[0] for r in c.execute("SELECT epoch FROM versions ORDER BY version")]
        assert epochs == [1, 1, 2]
    finally:
        a.close()
        b.close()


@pytest.mark.postgres
def test_a_lagging_coordinator_reads_the_database_before_refusing(pg_url: str, clock: Clock) -> None:
    """B has not yet heard of A's registration: a heartbeat or a plan at that version is still accepted (B reads
    the database before calling the agent ahead of the ledger)."""
    a, b = open_ledger(pg_url, clock), open_ledger(pg_url, clock)
    try:
        reg(a.registry, 0, "anchor")
        reg(a.registry, 1)
        assert b.registry.latest_version() is None  # no listener here: B's memory is behind
        assert b.fleet.heartbeat("x", AgentHeartbeat(applied_version=1, state="idle"), 60).lag == 0
        assert b.registry.plan(0, 1).route == "deltas"
        assert b.fleet.alerts() == []
    finally:
        a.close()
        b.close()


@pytest.mark.postgres
def test_the_password_never_appears_in_messages(pg_url: str) -> None:
    from deltasync_coordinator.pg import PgDatabase, redact

    assert redact("postgresql://user:s3cret@host:5432/db") == "postgresql://user:***@host:5432/db"
    assert redact("postgres://user@host/db") == "postgres://user@host/db"
    bad = pg_url.replace("postgres@", "postgres:s3cret@").rsplit(":", 1)[0] + ":1/db"  # nothing listens on port 1
    with pytest.raises(Busy, match=r"is unreachable") as info:
        PgDatabase(bad, PG_MIGRATIONS, timeout_s=1)
    assert "s3cret" not in str(info.value) and "***" in str(info.value)


@pytest.mark.postgres
def test_late_news_of_another_registration_never_moves_the_latest_back(pg_url: str, clock: Clock) -> None:
    """A's NOTIFY of v1 reaches B after B registered v2 itself: B stays at v2; a GC deletion's news is exact."""
    from deltasync_coordinator.app import follow_latest

    a, b = open_ledger(pg_url, clock), open_ledger(pg_url, clock)
    try:
        reg(a.registry, 0, "anchor")
        reg(a.registry, 1)
        reg(b.registry, 2)
        assert b.registry.latest_version() == 2
        assert not follow_latest(b.registry, 1, exact=False) and b.registry.latest_version() == 2
        assert follow_latest(b.registry, 3, exact=False) and b.registry.latest_version() == 3
        assert follow_latest(b.registry, 2, exact=True) and b.registry.latest_version() == 2
    finally:
        a.close()
        b.close()
