"""The ledger alone (no HTTP): registration rules, plans, retention, migrations, restarts."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from deltasync.protocol import AgentHeartbeat, VersionCreate
from services.coordinator.registry import MIGRATIONS, Conflict, NotFound, Registry
from tests.conftest import version_body


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry(tmp_path: Path, clock: Clock) -> Registry:
    return Registry(tmp_path / "ledger.db", clock=clock)


def reg(registry: Registry, *args, **kwargs):
    return registry.register(VersionCreate(**version_body(*args, **kwargs)))


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
    p = registry.plan(9, 7)  # an agent "ahead" of the target (a rolled-back run) gets the anchor route
    assert p.route == "anchor" and p.steps[0].version == 5


def test_plan_prefers_the_anchor_when_the_chain_costs_more(registry: Registry) -> None:
    reg(registry, 0, "anchor", nbytes=50)
    for v in range(1, 4):
        reg(registry, v, nbytes=100)
    reg(registry, 3, "anchor", nbytes=50)
    p = registry.plan(0, 3)
    assert p.route == "anchor" and [(s.version, s.kind) for s in p.steps] == [(3, "anchor")]
    with pytest.raises(NotFound, match="version 9 is not registered"):
        registry.plan(0, 9)


def test_heartbeats_lag_and_staleness(registry: Registry, clock: Clock) -> None:
    reg(registry, 0, "anchor")
    reg(registry, 1)
    a = registry.heartbeat("a1", AgentHeartbeat(applied_version=0, state="idle", timings={"pause": 0.01}), 60)
    assert a.lag == 1 and not a.stale and a.timings == {"pause": 0.01}
    registry.heartbeat("b2", AgentHeartbeat(applied_version=None, state="fetching"), 60)
    clock.now += 61
    registry.heartbeat("b2", AgentHeartbeat(applied_version=1, state="idle"), 60)
    fleet = {x.agent_id: x for x in registry.agents(60).agents}
    assert fleet["a1"].stale and not fleet["b2"].stale and fleet["b2"].lag == 0
    assert registry.agent_states(60) == {"idle": 1, "stale": 1}


def test_gc_keeps_what_live_agents_and_plans_need(registry: Registry, clock: Clock) -> None:
    assert registry.gc_candidates(60).candidates == []
    reg(registry, 0, "anchor")
    for v in range(1, 10):
        reg(registry, v)
    reg(registry, 4, "anchor")
    reg(registry, 8, "anchor")
    registry.heartbeat("slow", AgentHeartbeat(applied_version=3, state="idle"), 60)
    g = registry.gc_candidates(60)
    assert g.keep_from == 3
    assert [(c.version, c.kind) for c in g.candidates] == [
        (0, "anchor"),
        (1, "delta"),
        (2, "delta"),
        (3, "delta"),
        (4, "anchor"),
    ]
    clock.now += 120  # the slow agent goes stale: only the newest anchor and what follows it stay
    g = registry.gc_candidates(60)
    assert g.keep_from == 8
    kept = {(v.version, v.kind) for v in registry.list_after(-1)} - {(c.version, c.kind) for c in g.candidates}
    assert kept == {(8, "anchor"), (9, "delta")}
    for c in g.candidates:
        registry.mark_deleted(c, [c.manifest_key], "gc")
    assert registry.plan(None, 9).steps[0].version == 8
    assert len(registry.deletions()) == len(g.candidates)
    assert registry.gc_candidates(60).candidates == []


def test_state_survives_a_restart_and_migrations_are_recorded(tmp_path: Path, clock: Clock) -> None:
    r = Registry(tmp_path / "l.db", clock=clock)
    reg(r, 0, "anchor")
    reg(r, 1)
    r.heartbeat("a", AgentHeartbeat(applied_version=1, state="idle"), 60)
    r.close()
    again = Registry(tmp_path / "l.db", clock=clock)
    assert again.latest_version() == 1 and again.agents(60).agents[0].applied_version == 1
    assert again.schema_version == len(MIGRATIONS)
    db = sqlite3.connect(tmp_path / "l.db")
    assert [r[0] for r in db.execute("SELECT version FROM schema_migrations")] == list(range(1, len(MIGRATIONS) + 1))
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_closed_ledger_raises_instead_of_deadlocking(registry: Registry) -> None:
    registry.close()
    for _ in range(2):  # the second call would hang if the first had leaked the lock
        with pytest.raises(sqlite3.ProgrammingError, match="closed database"):
            registry.counts()
