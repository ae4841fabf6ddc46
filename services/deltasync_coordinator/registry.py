"""The ledger of versions: registrations (fenced by the publisher lease), reads, plans (no FastAPI here).

Every plan issued is recorded, so that garbage collection keeps what an agent is still fetching.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from datetime import UTC, datetime
from typing import Literal

from deltasync.schemas import LeasePublic, PlanPublic, VersionCreate, VersionPublic
from deltasync.vocab import MAX_INT, Kind

from .db import Database

__all__ = ["MIGRATIONS", "Conflict", "Fenced", "Invalid", "NotFound", "Registry"]

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
    # 2: run identity, the publisher lease, issued plans, alerts
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE lease (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        lease_id TEXT NOT NULL,
        epoch INTEGER NOT NULL,
        holder TEXT NOT NULL,
        acquired_at REAL NOT NULL,
        expires_at REAL NOT NULL
    );
    CREATE TABLE plans (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        agent_id TEXT,
        issued_at REAL NOT NULL,
        objects TEXT NOT NULL
    );
    CREATE INDEX plans_issued ON plans (issued_at);
    CREATE TABLE alerts (key TEXT PRIMARY KEY, version INTEGER, detail TEXT NOT NULL, at REAL NOT NULL);
    ALTER TABLE versions ADD COLUMN epoch INTEGER;
    CREATE INDEX agents_seen ON agents (last_seen);
    """,
]
"""Schema migrations, applied in order and recorded in ``schema_migrations``; append, never edit."""

_FIELDS = ("version", "kind", "base_version", "manifest_key", "bytes", "nnz", "tensors", "checksum")


class Conflict(Exception):
    """The request contradicts the ledger (HTTP 409)."""


class Fenced(Conflict):
    """A registration without the live publisher lease (HTTP 409)."""


class NotFound(Exception):
    """No such version or object (HTTP 404)."""


class Invalid(Exception):
    """The request is well-formed but impossible (HTTP 422)."""


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def public(row: sqlite3.Row) -> VersionPublic:
    """A ``versions`` row as its wire model."""
    return VersionPublic(**{k: row[k] for k in _FIELDS}, created_at=_dt(row["created_at"]))


class Registry:
    """Versions, plans and the publisher lease, over a :class:`~deltasync_coordinator.db.Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._clock = db._clock
        with db.tx() as c:
            self._latest: int | None = c.execute(
                "SELECT MAX(version) FROM versions WHERE deleted_at IS NULL"
            ).fetchone()[0]

    @property
    def run_id(self) -> str:
        return self.db.run_id

    # ------------------------------------------------------------------ versions

    def register(self, v: VersionCreate, lease_id: str | None) -> tuple[VersionPublic, bool]:
        """Record a published object. Returns it and whether it was new.

        An identical re-registration is accepted as it is (a retry after a lost answer). A new one needs the
        live publisher lease.

        Raises:
            Fenced: ``lease_id`` is not the live lease (none, expired, or another publisher's).
            Conflict: the same (version, kind) was registered with other fields; a delta's base is not
                registered; or the version is stale (a delta at or below the latest version, an anchor below it
                at a version that has no delta).
        """
        with self.db.tx() as c:
            row = c.execute("SELECT * FROM versions WHERE version=? AND kind=?", (v.version, v.kind)).fetchone()
            if row is not None:
                if {k: row[k] for k in _FIELDS} == v.model_dump(include=set(_FIELDS)):
                    return public(row), False
                raise Conflict(
                    f"{v.kind} v{v.version} is already registered with other fields "
                    f"(checksum {row['checksum']}); a version is never re-published differently"
                )
            now = self._clock()
            lease = c.execute("SELECT * FROM lease WHERE id=1").fetchone()
            if lease is None or lease_id is None or lease["lease_id"] != lease_id or lease["expires_at"] < now:
                holder = (
                    "no publisher holds the run"
                    if lease is None or lease["expires_at"] < now
                    else (f"the lease is held by {lease['holder']!r} (epoch {lease['epoch']})")
                )
                raise Fenced(
                    f"{v.kind} v{v.version} refused: registering needs the run's publisher lease, and {holder}; "
                    "a publisher takes it with POST /v1/lease (the Publisher does this at start)"
                )
            latest = c.execute("SELECT MAX(version) FROM versions").fetchone()[0]  # deleted ones count too
            if v.kind == "delta":
                base = c.execute(
                    "SELECT 1 FROM versions WHERE version=? AND deleted_at IS NULL", (v.base_version,)
                ).fetchone()
                if base is None:
                    raise Conflict(
                        f"delta v{v.version}: its base v{v.base_version} is not registered; publish an anchor instead"
                    )
                if latest is not None and v.version <= latest:
                    raise Conflict(f"delta v{v.version} is stale: v{latest} is already registered")
            elif latest is not None and v.version < latest:
                has_delta = c.execute(
                    "SELECT 1 FROM versions WHERE version=? AND kind='delta'", (v.version,)
                ).fetchone()
                if has_delta is None:
                    raise Conflict(f"anchor v{v.version} is stale: v{latest} is already registered")
            c.execute(
                f"INSERT INTO versions ({', '.join(_FIELDS)}, created_at, epoch) VALUES ({', '.join('?' * 10)})",
                (*(getattr(v, k) for k in _FIELDS), now, lease["epoch"]),
            )
            self._latest = max(v.version, self._latest if self._latest is not None else -1)
            return VersionPublic(**v.model_dump(), created_at=_dt(now)), True

    def latest_version(self) -> int | None:
        """The newest registered (not deleted) version, from memory."""
        return self._latest

    def get(self, version: int, kind: Kind | None = None) -> VersionPublic:
        """The object at ``version`` (the delta when both exist and ``kind`` is not given)."""
        with self.db.tx() as c:
            rows = c.execute(
                "SELECT * FROM versions WHERE version=? AND deleted_at IS NULL ORDER BY kind DESC", (version,)
            ).fetchall()
        rows = [r for r in rows if kind is None or r["kind"] == kind]
        if not rows:
            raise NotFound(f"version {version}{'' if kind is None else f' ({kind})'} is not registered")
        return public(rows[0])

    def list_after(self, after: int, limit: int = 1000) -> list[VersionPublic]:
        """Objects with a version above ``after``, ascending (delta before anchor)."""
        with self.db.tx() as c:
            rows = c.execute(
                "SELECT * FROM versions WHERE version > ? AND deleted_at IS NULL ORDER BY version, kind DESC LIMIT ?",
                (after, limit),
            ).fetchall()
        return [public(r) for r in rows]

    def counts(self) -> tuple[int, int | None]:
        """(objects registered, latest version)."""
        with self.db.tx() as c:
            n = c.execute("SELECT COUNT(*) FROM versions WHERE deleted_at IS NULL").fetchone()[0]
        return n, self._latest

    def max_version_ever(self) -> int | None:
        """The highest version ever registered, deleted ones included."""
        with self.db.tx() as c:
            v: int | None = c.execute("SELECT MAX(version) FROM versions").fetchone()[0]
        return v

    # ------------------------------------------------------------------ plans

    def plan(self, from_version: int | None, to_version: int | None, agent_id: str | None = None) -> PlanPublic:
        """What an agent at ``from_version`` (or holding nothing) fetches to reach ``to_version``.

        The cheaper (in bytes) of the delta chain from ``from_version`` and the newest anchor on the target's
        chain plus the deltas after it. The walk goes back from the target along base pointers, one indexed
        lookup per step, and stops as soon as the delta route can no longer be the cheaper: its cost grows
        with the plan, not with the ledger. An agent's latest plan is recorded (GC keeps its objects for the
        plan lease); a reader's is not.

        Raises:
            Conflict: ``from_version`` is above the latest version (an agent ahead of this ledger).
            NotFound: the target, or every route to it, is not registered.
        """
        latest = self._latest
        if from_version is not None and (latest is None or from_version > latest):
            raise Conflict(
                f"a plan from v{from_version} refused: the ledger's latest is "
                f"{'nothing' if latest is None else f'v{latest}'}; the agent is ahead of this ledger (restored from "
                "an old backup, or another run's coordinator?)"
            )
        target = to_version if to_version is not None else latest
        if from_version is not None and target is not None and target < from_version:
            raise Conflict(
                f"a plan from v{from_version} down to v{target} refused: a plan never goes down (an engine goes "
                "back only when an operator allows it: the agent's --allow-rollback, from an anchor)"
            )
        with self.db.tx() as c:

            def rows_at(v: int) -> dict[str, sqlite3.Row]:
                found = c.execute("SELECT * FROM versions WHERE version=? AND deleted_at IS NULL", (v,)).fetchall()
                return {r["kind"]: r for r in found}

            here = rows_at(target) if target is not None else {}
            if target is None or not here:
                raise NotFound(f"version {to_version if to_version is not None else 'latest'} is not registered")
            if from_version == target:
                return PlanPublic(from_version=from_version, to_version=target, steps=[], bytes=0, route="none")
            chain: list[sqlite3.Row] = []  # deltas, newest first, walking base pointers back from the target
            chain_bytes = 0
            anchor_route: list[sqlite3.Row] | None = None
            anchor_bytes = 0
            delta_route: list[sqlite3.Row] | None = None
            v: int | None = target
            while v is not None:
                at = here if v == target else rows_at(v)
                if v == from_version:
                    delta_route = chain[::-1]
                    break
                if anchor_route is None and "anchor" in at:
                    anchor_route = [at["anchor"], *chain[::-1]]
                    anchor_bytes = at["anchor"]["bytes"] + chain_bytes
                    if from_version is None or from_version > v:
                        break  # the delta route could only be longer than this
                if "delta" not in at or (anchor_route is not None and chain_bytes >= anchor_bytes):
                    break  # no route back, or the delta route already costs more than the anchor's
                chain.append(at["delta"])
                chain_bytes += at["delta"]["bytes"]
                v = at["delta"]["base_version"]
            candidates: list[tuple[list[sqlite3.Row] | None, Literal["deltas", "anchor"]]] = [
                (delta_route, "deltas"),
                (anchor_route, "anchor"),
            ]
            routes = [(r, name) for r, name in candidates if r is not None]
            if not routes:
                raise NotFound(f"no route from v{from_version} to v{target}: the deltas and anchors it needs are gone")
            best, name = min(routes, key=lambda rn: sum(r["bytes"] for r in rn[0]))
            if agent_id is not None:  # an agent's latest plan only: one row per agent, whatever it asks
                c.execute("DELETE FROM plans WHERE agent_id=?", (agent_id,))
                c.execute(
                    "INSERT INTO plans (agent_id, issued_at, objects) VALUES (?, ?, ?)",
                    (agent_id, self._clock(), json.dumps([[r["version"], r["kind"]] for r in best])),
                )
        return PlanPublic(
            from_version=from_version,
            to_version=target,
            steps=[public(r) for r in best],
            bytes=min(sum(r["bytes"] for r in best), MAX_INT),  # saturates: each object is capped, not the sum
            route=name,
        )

    # ------------------------------------------------------------------ the publisher lease

    def acquire_lease(self, holder: str, ttl_s: float, lease_id: str | None) -> LeasePublic:
        """Take the run's publisher lease, or renew it (``lease_id`` = the live one's).

        Raises:
            Conflict: another publisher holds a live lease, or ``lease_id`` is not the live lease (fenced).
        """
        now = self._clock()
        with self.db.tx() as c:
            row = c.execute("SELECT * FROM lease WHERE id=1").fetchone()
            live = row is not None and row["expires_at"] >= now
            if lease_id is not None:
                if not live or row["lease_id"] != lease_id:
                    why = "it expired" if not live else f"{row['holder']!r} holds the run now"
                    raise Fenced(
                        f"the publisher lease {lease_id[:8]}... is lost ({why}); this publisher must stop: another "
                        "one may be publishing the run"
                    )
                c.execute("UPDATE lease SET expires_at=? WHERE id=1", (now + ttl_s,))
                epoch, acquired = row["epoch"], row["lease_id"]
            else:
                if live:
                    raise Conflict(
                        f"the run is being published by {row['holder']!r} (lease epoch {row['epoch']}, expires in "
                        f"{row['expires_at'] - now:.0f} s): one publisher per run; stop it, or wait for its lease "
                        "to expire"
                    )
                last = c.execute("SELECT value FROM meta WHERE key='lease_epoch'").fetchone()
                epoch = (int(last[0]) if last else 0) + 1
                acquired = secrets.token_hex(16)
                c.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('lease_epoch', ?)", (str(epoch),))
                c.execute(
                    "INSERT OR REPLACE INTO lease VALUES (1, ?, ?, ?, ?, ?)",
                    (acquired, epoch, holder, now, now + ttl_s),
                )
            top = c.execute("SELECT MAX(version) FROM versions").fetchone()[0]
            holder_now = holder if lease_id is None else row["holder"]
        return LeasePublic(
            lease_id=acquired,
            epoch=epoch,
            holder=holder_now,
            run_id=self.run_id,
            expires_at=_dt(now + ttl_s),
            next_version=0 if top is None else top + 1,
        )

    def release_lease(self, lease_id: str) -> bool:
        """Give the lease up (a publisher that closes cleanly); ``False`` if it was not the live one."""
        with self.db.tx() as c:
            cur = c.execute("DELETE FROM lease WHERE id=1 AND lease_id=?", (lease_id,))
            return cur.rowcount == 1

    def recent_plan_objects(self, window_s: float) -> set[tuple[int, str]]:
        """(version, kind) of every object in a plan issued within ``window_s``; older plans are forgotten."""
        now = self._clock()
        with self.db.tx() as c:
            c.execute("DELETE FROM plans WHERE issued_at < ?", (now - window_s,))
            rows = c.execute("SELECT objects FROM plans").fetchall()
        return {(v, k) for r in rows for v, k in json.loads(r["objects"])}
