"""The fleet: each agent's heartbeat, its lag and staleness, expiry of silent agents, and the ledger's alerts
(a ledger behind what its agents report is degraded, never healthy)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from deltasync.schemas import AgentHeartbeat, AgentPublic, AgentsPublic

from .ledger import LedgerDatabase
from .registry import Invalid, Registry, Row

__all__ = ["LAG_BUCKETS", "Fleet"]

logger = logging.getLogger("deltasync.coordinator.fleet")

LAG_BUCKETS = (0, 1, 2, 5, 10, 100)
"""Upper bounds (versions behind) of the aggregate lag histogram in ``/metrics``."""


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


class Fleet:
    """Agents and alerts, over the registry's database."""

    def __init__(self, db: LedgerDatabase, registry: Registry) -> None:
        self.db, self.registry = db, registry
        self._clock = db.clock
        self.drifts = 0
        """Drift reports received by this process (a new drift of an agent counts once)."""
        with db.read() as c:
            self._alerts: dict[str, tuple[int | None, str]] = {
                r["key"]: (r["version"], r["detail"]) for r in c.execute("SELECT * FROM alerts ORDER BY at")
            }

    def heartbeat(self, agent_id: str, hb: AgentHeartbeat, stale_after_s: float) -> AgentPublic:
        """Record an agent's state; returns its fleet view entry.

        Raises:
            Invalid: ``applied_version`` is above the latest version: recorded as an alert (the ledger is then
                degraded: restored from an old backup, or copied without its WAL?) and refused.
        """
        now = self._clock()
        latest = self.registry._latest_checked(hb.applied_version)  # read again on a shared ledger before refusing
        if hb.applied_version is not None and (latest is None or hb.applied_version > latest):
            detail = (
                f"agent {agent_id} reports v{hb.applied_version}, above the ledger's latest "
                f"{'(nothing registered)' if latest is None else f'v{latest}'}: the ledger is behind its agents "
                "(restored from an old backup, or copied without its WAL?)"
            )
            self.raise_alert(f"behind:{agent_id}", detail, hb.applied_version)
            raise Invalid(f"applied_version {hb.applied_version} is above the latest version {latest}; {detail}")
        key = f"drift:{agent_id}"
        if hb.drift is not None:  # an engine served weights that differ from their version: said until re-proven
            if self._alerts.get(key, (None, ""))[1] != f"agent {agent_id}: {hb.drift}":
                self.drifts += 1
                logger.warning("agent %s: %s", agent_id, hb.drift)
            self.raise_alert(key, f"agent {agent_id}: {hb.drift}", hb.applied_version)
        elif key in self._alerts:
            self._clear_alert(key)
        honest = f"behind:{agent_id}" in self._alerts  # it reports a version the ledger has now: its alert goes
        with self.db.tx(durable=False) as c:
            c.execute(
                "INSERT INTO agents VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(agent_id) DO UPDATE SET "
                "applied_version=excluded.applied_version, state=excluded.state, "
                "last_error=excluded.last_error, timings=excluded.timings, last_seen=excluded.last_seen",
                (agent_id, hb.applied_version, hb.state, hb.last_error, json.dumps(hb.timings), now),
            )
            row = c.execute("SELECT * FROM agents WHERE agent_id=?", (agent_id,)).fetchone()
            if honest:
                c.execute("DELETE FROM alerts WHERE key=?", (f"behind:{agent_id}",))
        if honest:
            self._alerts.pop(f"behind:{agent_id}", None)
        return self._agent(row, latest, now, stale_after_s)

    @staticmethod
    def _agent(row: Row, latest: int | None, now: float, stale_after_s: float) -> AgentPublic:
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

    def agents(self, stale_after_s: float, *, limit: int = 100, after: str | None = None) -> AgentsPublic:
        """One page of the fleet, by agent id (``after``: the last id of the previous page)."""
        now = self._clock()
        with self.db.read() as c:
            rows = c.execute(
                "SELECT * FROM agents WHERE agent_id > ? ORDER BY agent_id LIMIT ?", (after or "", limit + 1)
            ).fetchall()
            total = c.execute("SELECT COUNT(*) FROM agents").fetchone()[0]
        latest = self.registry.latest_version()
        page = [self._agent(r, latest, now, stale_after_s) for r in rows[:limit]]
        return AgentsPublic(
            agents=page, latest=latest, next_after=page[-1].agent_id if len(rows) > limit else None, total=total
        )

    def live_applied(self, stale_after_s: float) -> list[int]:
        """The applied versions of live (not stale) agents."""
        now = self._clock()
        with self.db.read() as c:
            rows = c.execute(
                "SELECT applied_version FROM agents WHERE last_seen >= ? AND applied_version IS NOT NULL",
                (now - stale_after_s,),
            ).fetchall()
        return [r[0] for r in rows]

    def stats(self, stale_after_s: float) -> tuple[dict[str, int], list[int]]:
        """Agents per state (``stale`` apart) and the lag histogram (cumulative counts per :data:`LAG_BUCKETS`,
        then +Inf): aggregates only, never one series per agent."""
        now = self._clock()
        latest = self.registry.latest_version()
        with self.db.read() as c:
            rows = c.execute("SELECT state, applied_version, last_seen FROM agents").fetchall()
        states: dict[str, int] = {}
        lags = [0] * (len(LAG_BUCKETS) + 1)
        for state, applied, seen in rows:
            key = "stale" if now - seen > stale_after_s else state
            states[key] = states.get(key, 0) + 1
            if applied is not None and latest is not None:
                lag = latest - applied
                for i, bound in enumerate((*LAG_BUCKETS, float("inf"))):
                    if lag <= bound:
                        lags[i] += 1
        return states, lags

    def expire(self, silent_s: float) -> int:
        """Forget agents not seen for ``silent_s`` (and their alerts), and alerts a registration has cleared;
        returns how many agents."""
        cutoff = self._clock() - silent_s
        with self.db.tx(durable=False) as c:
            gone = [r[0] for r in c.execute("SELECT agent_id FROM agents WHERE last_seen < ?", (cutoff,))]
            c.execute("DELETE FROM agents WHERE last_seen < ?", (cutoff,))
            keys = [f"{k}:{a}" for a in gone for k in ("behind", "drift") if f"{k}:{a}" in self._alerts]
            keys += self._cleared()
            c.executemany("DELETE FROM alerts WHERE key=?", [(k,) for k in keys])
        for key in keys:
            self._alerts.pop(key, None)
        return len(gone)

    def _cleared(self) -> list[str]:
        latest = self.registry.latest_version()
        return [
            key
            for key, (version, _) in self._alerts.items()
            if key.startswith("behind:") and version is not None and latest is not None and latest >= version
        ]

    def alerts(self) -> list[str]:
        """Why the ledger is degraded (empty when healthy), from memory only (never the database: ``/healthz``
        must answer while it is locked). A ``behind:`` alert stops counting once a version at or above the one
        reported is registered, once its agent reports a version the ledger has, or once its agent expires
        (the ledger forgets it at the next expiry round)."""
        cleared = set(self._cleared())
        return [detail for key, (_, detail) in self._alerts.items() if key not in cleared]

    def drifted(self) -> list[tuple[str, str]]:
        """``(agent id, detail)`` of every engine whose weights drifted and are not re-proven yet."""
        return [(k.removeprefix("drift:"), d) for k, (_, d) in self._alerts.items() if k.startswith("drift:")]

    def _clear_alert(self, key: str) -> None:
        self._alerts.pop(key, None)
        with self.db.tx(durable=False) as c:
            c.execute("DELETE FROM alerts WHERE key=?", (key,))

    def raise_alert(self, key: str, detail: str, version: int | None = None) -> None:
        """Record (or refresh) an alert, in memory and in the ledger (it survives a restart)."""
        self._alerts[key] = (version, detail)
        with self.db.tx(durable=False) as c:
            c.execute(
                "INSERT INTO alerts VALUES (?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET "
                "version=excluded.version, detail=excluded.detail, at=excluded.at",
                (key, version, detail, self._clock()),
            )
