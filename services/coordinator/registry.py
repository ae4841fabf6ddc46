"""The coordinator's ledger in SQLite: versions, agents and deletions (no FastAPI here).

Thread-safe: one connection (WAL) guarded by a lock; every method is one short transaction, so
callers run them in a thread pool and never hold a connection while they wait.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from deltasync.protocol import (
    AgentHeartbeat,
    AgentPublic,
    AgentsPublic,
    GcPublic,
    PlanPublic,
    VersionCreate,
    VersionKind,
    VersionPublic,
)

__all__ = ["MIGRATIONS", "Conflict", "NotFound", "Registry"]

MIGRATIONS: list[str] = [
    # 1: the initial schema
    """
    CREATE TABLE versions (
        version INTEGER NOT NULL,
        kind TEXT NOT NULL CHECK (kind IN ('delta', 'anchor')),
        base_version INTEGER,
        manifest_key TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        nnz INTEGER NOT NULL,
        tensors INTEGER NOT NULL,
        checksum TEXT NOT NULL,
        created_at REAL NOT NULL,
        deleted_at REAL,
        PRIMARY KEY (version, kind)
    );
    CREATE TABLE agents (
        agent_id TEXT PRIMARY KEY,
        applied_version INTEGER,
        state TEXT NOT NULL,
        last_error TEXT,
        timings TEXT NOT NULL,
        last_seen REAL NOT NULL
    );
    CREATE TABLE deletions (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        version INTEGER NOT NULL,
        kind TEXT NOT NULL,
        keys TEXT NOT NULL,
        reason TEXT NOT NULL,
        deleted_at REAL NOT NULL
    );
    """,
]
"""Schema migrations, applied in order and recorded in ``schema_migrations``; append, never edit."""

_LATEST_SQL = "SELECT MAX(version) FROM versions WHERE deleted_at IS NULL"
_FIELDS = ("version", "kind", "base_version", "manifest_key", "bytes", "nnz", "tensors", "checksum")


class Conflict(Exception):
    """The request contradicts the ledger (HTTP 409)."""


class NotFound(Exception):
    """No such version or object (HTTP 404)."""


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


class Registry:
    """The ledger. ``clock`` returns seconds since the epoch (tests pass a fake one)."""

    def __init__(self, db_path: str | Path, *, clock: Callable[[], float] = time.time) -> None:
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self.schema_version = self._migrate()
        with self._tx() as db:
            self._latest: int | None = db.execute(_LATEST_SQL).fetchone()[0]

    def close(self) -> None:
        """Close the connection; later calls raise ``sqlite3.ProgrammingError``."""
        with self._lock:
            self._db.close()

    def _migrate(self) -> int:
        with self._lock:
            db = self._db
            db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at REAL)")
            done = {r[0] for r in db.execute("SELECT version FROM schema_migrations")}
            for number, sql in enumerate(MIGRATIONS, start=1):
                if number in done:
                    continue
                db.execute("BEGIN IMMEDIATE")
                try:
                    for statement in sql.split(";"):
                        if statement.strip():
                            db.execute(statement)
                    db.execute("INSERT INTO schema_migrations VALUES (?, ?)", (number, self._clock()))
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
            return len(MIGRATIONS)

    def _tx(self, *, durable: bool = True) -> _Transaction:
        """A transaction; ``durable=False`` commits without an fsync (WAL: it still survives a
        process crash, only a power loss could undo it), for heartbeats."""
        return _Transaction(self, durable)

    # ------------------------------------------------------------------ versions

    @staticmethod
    def _public(row: sqlite3.Row) -> VersionPublic:
        return VersionPublic(**{k: row[k] for k in _FIELDS}, created_at=_dt(row["created_at"]))

    def register(self, v: VersionCreate) -> tuple[VersionPublic, bool]:
        """Record a published object. Returns it and whether it was new.

        Raises:
            Conflict: the same (version, kind) was registered with other fields; a delta's base is
                not registered; or the version is stale (a delta at or below the latest version, an
                anchor below it at a version that has no delta).
        """
        with self._tx() as db:
            row = db.execute("SELECT * FROM versions WHERE version=? AND kind=?", (v.version, v.kind)).fetchone()
            if row is not None:
                if {k: row[k] for k in _FIELDS} == v.model_dump(include=set(_FIELDS)):
                    return self._public(row), False
                raise Conflict(
                    f"{v.kind} v{v.version} is already registered with other fields "
                    f"(checksum {row['checksum']}); a version is never re-published differently"
                )
            latest = db.execute("SELECT MAX(version) FROM versions").fetchone()[0]  # deleted ones count too
            if v.kind == "delta":
                base = db.execute(
                    "SELECT 1 FROM versions WHERE version=? AND deleted_at IS NULL", (v.base_version,)
                ).fetchone()
                if base is None:
                    raise Conflict(
                        f"delta v{v.version}: its base v{v.base_version} is not registered; publish an anchor instead"
                    )
                if latest is not None and v.version <= latest:
                    raise Conflict(f"delta v{v.version} is stale: v{latest} is already registered")
            elif latest is not None and v.version < latest:
                has_delta = db.execute(
                    "SELECT 1 FROM versions WHERE version=? AND kind='delta'", (v.version,)
                ).fetchone()
                if has_delta is None:
                    raise Conflict(f"anchor v{v.version} is stale: v{latest} is already registered")
            now = self._clock()
            db.execute(
                f"INSERT INTO versions ({', '.join(_FIELDS)}, created_at) VALUES ({', '.join('?' * 9)})",
                (*(getattr(v, k) for k in _FIELDS), now),
            )
            self._latest = max(v.version, self._latest if self._latest is not None else -1)
            return VersionPublic(**v.model_dump(), created_at=_dt(now)), True

    def latest_version(self) -> int | None:
        """The newest registered (not deleted) version, from memory."""
        return self._latest

    def get(self, version: int, kind: VersionKind | None = None) -> VersionPublic:
        """The object at ``version`` (the delta when both exist and ``kind`` is not given)."""
        with self._tx() as db:
            rows = db.execute(
                "SELECT * FROM versions WHERE version=? AND deleted_at IS NULL ORDER BY kind DESC", (version,)
            ).fetchall()
        rows = [r for r in rows if kind is None or r["kind"] == kind]
        if not rows:
            raise NotFound(f"version {version}{'' if kind is None else f' ({kind})'} is not registered")
        return self._public(rows[0])

    def list_after(self, after: int, limit: int = 1000) -> list[VersionPublic]:
        """Objects with a version above ``after``, ascending (delta before anchor)."""
        with self._tx() as db:
            rows = db.execute(
                "SELECT * FROM versions WHERE version > ? AND deleted_at IS NULL ORDER BY version, kind DESC LIMIT ?",
                (after, limit),
            ).fetchall()
        return [self._public(r) for r in rows]

    def counts(self) -> tuple[int, int | None]:
        """(objects registered, latest version)."""
        with self._tx() as db:
            n = db.execute("SELECT COUNT(*) FROM versions WHERE deleted_at IS NULL").fetchone()[0]
        return n, self._latest

    # ------------------------------------------------------------------ plans

    def plan(self, from_version: int | None, to_version: int | None) -> PlanPublic:
        """What an agent at ``from_version`` (or holding nothing) fetches to reach ``to_version``.

        The cheaper (in bytes) of the delta chain from ``from_version`` and the newest anchor on
        the target's chain plus the deltas after it.

        Raises:
            NotFound: the target, or every route to it, is not registered.
        """
        with self._tx() as db:
            rows = db.execute("SELECT * FROM versions WHERE deleted_at IS NULL").fetchall()
        deltas = {r["version"]: r for r in rows if r["kind"] == "delta"}
        anchors = {r["version"]: r for r in rows if r["kind"] == "anchor"}
        target = to_version if to_version is not None else max((*deltas, *anchors), default=None)
        if target is None or (target not in deltas and target not in anchors):
            raise NotFound(f"version {to_version if to_version is not None else 'latest'} is not registered")
        if from_version == target:
            return PlanPublic(from_version=from_version, to_version=target, steps=[], bytes=0, route="none")
        chain: list[sqlite3.Row] = []  # deltas, newest first, walking base pointers back from the target
        anchor_route: list[sqlite3.Row] | None = None
        delta_route: list[sqlite3.Row] | None = None
        v: int | None = target
        while v is not None:
            if v == from_version:
                delta_route = chain[::-1]
                break
            if anchor_route is None and v in anchors:
                anchor_route = [anchors[v], *chain[::-1]]
                if from_version is None or from_version > v:
                    break  # the delta route could only be longer than this
            if v not in deltas:
                break
            chain.append(deltas[v])
            v = deltas[v]["base_version"]
        candidates: list[tuple[list[sqlite3.Row] | None, Literal["deltas", "anchor"]]] = [
            (delta_route, "deltas"),
            (anchor_route, "anchor"),
        ]
        routes = [(r, name) for r, name in candidates if r is not None]
        if not routes:
            raise NotFound(f"no route from v{from_version} to v{target}: the deltas and anchors it needs are gone")
        best, name = min(routes, key=lambda rn: sum(r["bytes"] for r in rn[0]))
        return PlanPublic(
            from_version=from_version,
            to_version=target,
            steps=[self._public(r) for r in best],
            bytes=sum(r["bytes"] for r in best),
            route=name,
        )

    # ------------------------------------------------------------------ agents

    def heartbeat(self, agent_id: str, hb: AgentHeartbeat, stale_after_s: float) -> AgentPublic:
        """Record an agent's state; returns its fleet view entry."""
        now = self._clock()
        with self._tx(durable=False) as db:
            db.execute(
                "INSERT INTO agents VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(agent_id) DO UPDATE SET "
                "applied_version=excluded.applied_version, state=excluded.state, "
                "last_error=excluded.last_error, timings=excluded.timings, last_seen=excluded.last_seen",
                (agent_id, hb.applied_version, hb.state, hb.last_error, json.dumps(hb.timings), now),
            )
            row = db.execute("SELECT * FROM agents WHERE agent_id=?", (agent_id,)).fetchone()
        return self._agent(row, self._latest, now, stale_after_s)

    @staticmethod
    def _agent(row: sqlite3.Row, latest: int | None, now: float, stale_after_s: float) -> AgentPublic:
        applied = row["applied_version"]
        return AgentPublic(
            agent_id=row["agent_id"],
            applied_version=applied,
            state=row["state"],
            last_error=row["last_error"],
            timings=json.loads(row["timings"]),
            last_seen=_dt(row["last_seen"]),
            lag=None if applied is None or latest is None else latest - applied,
            stale=now - row["last_seen"] > stale_after_s,
        )

    def agents(self, stale_after_s: float) -> AgentsPublic:
        now = self._clock()
        with self._tx() as db:
            rows = db.execute("SELECT * FROM agents ORDER BY agent_id").fetchall()
        latest = self._latest
        return AgentsPublic(agents=[self._agent(r, latest, now, stale_after_s) for r in rows], latest=latest)

    # ------------------------------------------------------------------ retention

    def gc_candidates(self, stale_after_s: float) -> GcPublic:
        """Objects that no live agent and no plan can still need.

        Kept: the newest anchor, every delta above it, and every delta above the lowest version a
        live (not stale) agent has applied. Deletable: older anchors and the deltas at or below
        both. Nothing is deletable while no anchor exists.
        """
        now = self._clock()
        with self._tx() as db:
            rows = db.execute("SELECT * FROM versions WHERE deleted_at IS NULL ORDER BY version, kind DESC").fetchall()
            agents = db.execute("SELECT applied_version, last_seen FROM agents").fetchall()
        anchors = [r["version"] for r in rows if r["kind"] == "anchor"]
        if not anchors:
            return GcPublic(candidates=[], keep_from=None)
        keep_from = max(anchors)
        live = [
            a["applied_version"]
            for a in agents
            if now - a["last_seen"] <= stale_after_s and a["applied_version"] is not None
        ]
        if live:
            keep_from = min(keep_from, min(live))
        candidates = [
            self._public(r)
            for r in rows
            if (r["kind"] == "anchor" and r["version"] < max(anchors))
            or (r["kind"] == "delta" and r["version"] <= keep_from)
        ]
        return GcPublic(candidates=candidates, keep_from=keep_from)

    def mark_deleted(self, obj: VersionPublic, keys: list[str], reason: str) -> None:
        """Record that an object's files were deleted from the store."""
        now = self._clock()
        with self._tx() as db:
            db.execute("UPDATE versions SET deleted_at=? WHERE version=? AND kind=?", (now, obj.version, obj.kind))
            db.execute(
                "INSERT INTO deletions (version, kind, keys, reason, deleted_at) VALUES (?, ?, ?, ?, ?)",
                (obj.version, obj.kind, json.dumps(keys), reason, now),
            )
            self._latest = db.execute(_LATEST_SQL).fetchone()[0]

    def deletions(self) -> list[dict[str, object]]:
        with self._tx() as db:
            rows = db.execute("SELECT * FROM deletions ORDER BY id").fetchall()
        return [dict(r) | {"keys": json.loads(r["keys"])} for r in rows]

    def agent_states(self, stale_after_s: float) -> dict[str, int]:
        """Number of agents per state (``stale`` counted apart)."""
        out: dict[str, int] = {}
        for a in self.agents(stale_after_s).agents:
            key = "stale" if a.stale else a.state
            out[key] = out.get(key, 0) + 1
        return out


class _Transaction:
    """``with registry._tx() as db``: the lock, BEGIN IMMEDIATE, COMMIT or ROLLBACK."""

    def __init__(self, registry: Registry, durable: bool) -> None:
        self._registry, self._durable = registry, durable

    def __enter__(self) -> sqlite3.Connection:
        self._registry._lock.acquire()
        try:
            self._registry._db.execute(f"PRAGMA synchronous={'FULL' if self._durable else 'NORMAL'}")
            self._registry._db.execute("BEGIN IMMEDIATE")
        except BaseException:  # e.g. a closed connection: never leave the lock held
            self._registry._lock.release()
            raise
        return self._registry._db

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self._registry._db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self._registry._lock.release()
