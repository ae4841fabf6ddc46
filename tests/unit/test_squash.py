"""Squashes: a lagging agent catches up in one object (a delta from its own version to the latest), bit-exact,
verified like any delta; a tampered, planted or foreign squash is refused; the plan takes the fewest bytes; GC
deletes superseded squashes and never one still needed.

Each test drives the real Publisher and a real coordinator (in a thread) with agents on in-memory engines.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from deltasync_coordinator.app import create_app

from deltasync import IntegrityError, LocalStore, read_weights
from deltasync.agent import Agent
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.config import AgentConfig, PublisherConfig
from deltasync.errors import FormatError
from deltasync.layout import manifest_key, object_prefix
from deltasync.publisher import Publisher
from deltasync.reader import read_squash_manifest
from deltasync.targets import InMemoryTarget
from deltasync.testing.models import qwen3_shapes
from deltasync.testing.stream import UpdateStream
from tests.conftest import PUBLISHER_TOKEN, SMALL_QWEN3, ServerThread, agent_token, assert_bit_equal, overwrite
from tests.conftest import coordinator_settings as settings

WINDOW = 6


@dataclass
class Run:
    """A publisher, its coordinator and store, the truth of every version, and agents."""

    tmp: Path
    url: str
    store: LocalStore
    publisher: Publisher
    client: CoordinatorClient
    stream: UpdateStream
    truth: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    clients: list[CoordinatorClient] = field(default_factory=list)

    def step(self) -> int:
        version = self.publisher.publish(self.stream.master)
        self.publisher.flush()  # the squashes of this version are written (and registered) too
        self.truth[version] = self.stream.bf16()
        self.stream.step()
        return version

    def agent(self, agent_id: str) -> Agent:
        c = CoordinatorClient(self.url, token=agent_token(agent_id), retry=RetryPolicy(backoff_s=0.01))
        self.clients.append(c)
        config = AgentConfig(agent_id=agent_id, staging_dir=str(self.tmp / agent_id), retries=0, poll_wait_s=0)
        return Agent(store=self.store, coordinator=c, target=InMemoryTarget(), config=config)


@contextmanager
def run(tmp: Path, **config: object) -> Iterator[Run]:
    options: dict[str, object] = {"anchor_every": None, "anchor_bytes_fraction": None, "squash_window": WINDOW}
    options.update(config)
    with ServerThread(create_app(settings(tmp))) as server:
        client = CoordinatorClient(server.url, token=PUBLISHER_TOKEN, retry=RetryPolicy(backoff_s=0.01))
        store = LocalStore(tmp / "store")
        stream = UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=0, lr=3e-6)
        try:
            with Publisher(store, client, PublisherConfig(**options)) as pub:  # type: ignore[arg-type]
                r = Run(tmp, server.url, store, pub, client, stream)
                try:
                    yield r
                finally:
                    for c in r.clients:
                        c.close()
        finally:
            client.close()


def _chain_bytes(client: CoordinatorClient, start: int, stop: int) -> int:
    return sum(client.get_version(v, "delta").bytes for v in range(start + 1, stop + 1))


@pytest.mark.parametrize("lag", [2, 4, WINDOW])
def test_a_lagging_agent_catches_up_in_one_squash_bit_exact(tmp_path: Path, lag: int) -> None:
    with run(tmp_path) as r:
        r.step()
        held = r.step()
        agent = r.agent("lagging")
        assert agent.sync().to_version == held  # the agent says it holds `held`, then stops syncing
        for _ in range(lag):
            latest = r.step()
        plan = r.client.plan(held)
        assert plan.route == "squash" and len(plan.steps) == 1, plan
        (step,) = plan.steps
        assert (step.kind, step.base_version, step.version) == ("squash", held, latest)
        chain = _chain_bytes(r.client, held, latest)
        assert plan.bytes <= min(chain, r.client.get_version(0, "anchor").bytes)
        result = agent.sync()
        assert (result.route, result.to_version, result.bytes) == ("squash", latest, plan.bytes)
        assert_bit_equal(agent.target.weights, r.truth[latest])
        assert_bit_equal(read_weights(r.store, latest), r.truth[latest])  # the chain itself is untouched


def test_beyond_the_window_the_agent_takes_the_cheapest_route_with_a_tail_bit_exact(tmp_path: Path) -> None:
    with run(tmp_path) as r:
        held = r.step()
        agent = r.agent("far")
        agent.sync()
        for _ in range(WINDOW + 2):
            latest = r.step()
        plan = r.client.plan(held)
        # the last squash written from `held` (at the window's end) plus the deltas after it, if that is cheaper
        assert plan.route != "squash" or [s.kind for s in plan.steps] == ["squash", "delta", "delta"]
        anchor = r.client.get_version(0, "anchor").bytes
        assert plan.bytes <= min(_chain_bytes(r.client, held, latest), anchor)
        result = agent.sync()
        assert (result.route, result.to_version) == (plan.route, latest)
        assert_bit_equal(agent.target.weights, r.truth[latest])


def test_no_squash_without_a_lagging_agent_and_none_for_a_lag_of_one(tmp_path: Path) -> None:
    with run(tmp_path) as r:
        agent = r.agent("keeping-up")
        for _ in range(4):
            r.step()
            agent.sync()
        assert r.publisher.squashes == []
        assert not [k for k in r.store.list() if "/squash-" in k]


def test_a_tampered_squash_is_refused_and_the_engine_keeps_its_version(tmp_path: Path) -> None:
    with run(tmp_path) as r:
        r.step()
        held = r.step()
        agent = r.agent("victim")
        agent.sync()
        for _ in range(3):
            latest = r.step()
        prefix = object_prefix(latest, "squash", held)
        shard = next(k for k in r.store.list(prefix) if k.endswith(".safetensors"))
        data = bytearray(r.store.get(shard))
        data[-1] ^= 1  # one bit of a value
        overwrite(r.store, shard, bytes(data))
        with pytest.raises(IntegrityError, match=r"squash-\d{8}/shard-\d{5}\.safetensors: sha256 is"):
            agent.sync()
        assert agent.engine_state().version == held
        assert_bit_equal(agent.target.weights, r.truth[held])


def test_a_squash_planted_by_a_store_writer_is_refused(tmp_path: Path) -> None:
    """A writer without the key replaces the registered squash's manifest by a consistent one of its own (the
    real delta of the latest version, copied there): its digest is not the registered one."""
    with run(tmp_path) as r:
        held = r.step()
        agent = r.agent("victim")
        agent.sync()
        r.step()
        latest = r.step()
        planted = r.store.get(manifest_key(latest, "delta"))
        overwrite(r.store, manifest_key(latest, "squash", held), planted)
        with pytest.raises(IntegrityError, match="the coordinator registered"):
            agent.sync()
        assert agent.engine_state().version == held
        # read without the ledger, the planted manifest is still not this squash: it names other versions
        with pytest.raises(FormatError, match=rf"expected the delta v{held} -> v{latest} of this squash's key"):
            read_squash_manifest(r.store, latest, held)


def test_gc_deletes_superseded_squashes_and_keeps_the_one_a_lagging_agent_needs(tmp_path: Path) -> None:
    with run(tmp_path) as r:
        held = r.step()
        agent = r.agent("lagging")
        agent.sync()
        for _ in range(4):
            latest = r.step()
        squashes = [(m.base_version, m.version) for m in r.publisher.squashes]
        assert squashes == [(held, v) for v in range(held + 2, latest + 1)]
        report = r.client.collect_garbage()
        gone = {(o.base_version, o.version) for o in report.deleted if o.kind == "squash"}
        assert gone == {(held, v) for v in range(held + 2, latest)}  # superseded by the newest from `held`
        assert r.store.exists(manifest_key(latest, "squash", held))
        for base, v in gone:
            assert not r.store.list(object_prefix(v, "squash", base))
            assert r.store.exists(manifest_key(v, "delta"))  # a delta's own keys are not a squash's
        assert agent.sync().route == "squash"  # the one still needed served its agent
        assert_bit_equal(agent.target.weights, r.truth[latest])
        # caught up: no live agent holds the squash's base any longer (its recorded plan lapses with the lease)
        report = r.client.collect_garbage()
        assert (held, latest) not in {(o.base_version, o.version) for o in report.candidates if o.kind == "squash"}


def test_a_squash_an_agent_was_planned_stays_while_the_window_slides_on(tmp_path: Path) -> None:
    """The agent's plan names the squash ``held -> v``; the publisher then writes ``held -> v+1`` (superseding it)
    and GC runs before the agent fetches: the planned squash is kept for the plan lease, and the fetch succeeds."""
    with run(tmp_path) as r:
        held = r.step()
        agent = r.agent("slow-reader")
        agent.sync()
        r.step()
        planned_to = r.step()
        plan = agent.coordinator.plan(held)  # recorded for this agent
        assert (plan.route, plan.steps[0].version) == ("squash", planned_to)
        latest = r.step()
        assert r.client.plan(held).steps[0].version == latest  # the window moved on
        report = r.client.collect_garbage()
        assert (held, planned_to) not in {(o.base_version, o.version) for o in report.deleted if o.kind == "squash"}
        update, staged = agent.stager.prepare(plan, agent.engine_state(), {})
        agent.stager.cleanup(staged)
        assert [o.version for o in update.objects] == [planned_to]


def test_a_crash_mid_squash_leaves_nothing_an_agent_sees_and_gc_removes_it(tmp_path: Path) -> None:
    with run(tmp_path) as r:
        held = r.step()
        r.agent("lagging").sync()
        latest = r.step()
        # a squash whose publisher died after its shards, before its manifest (the commit marker)
        orphan = object_prefix(latest, "squash", held)
        r.store.put(orphan + "shard-00000.safetensors", b"half a squash")
        assert r.client.plan(held).route in ("deltas", "anchor")  # never registered: never planned
        r.step()  # the publisher moved on: the orphan lies below the newest registered version
        report = r.client.collect_garbage()
        assert orphan in report.leftovers
        assert not r.store.list(orphan)


def test_the_plan_takes_the_fewest_bytes_among_chain_anchor_and_squash(tmp_path: Path) -> None:
    with run(tmp_path) as r:
        r.step()
        held = r.step()
        r.agent("lagging").sync()
        for _ in range(3):
            latest = r.step()
        squash = r.client.plan(held)
        chain = _chain_bytes(r.client, held, latest)
        anchor = r.client.get_version(0, "anchor").bytes + _chain_bytes(r.client, 0, latest)
        assert squash.route == "squash" and squash.bytes == min(squash.bytes, chain, anchor)
        assert squash.bytes < chain  # the union of 3 deltas, coded once, is smaller than the 3 deltas
        # from a version no squash starts at, the plan is the chain's or the anchor's, whichever is fewer bytes
        other = r.client.plan(held + 1)
        assert other.route in ("deltas", "anchor")
        assert other.bytes == min(_chain_bytes(r.client, held + 1, latest), anchor)


def test_an_adapter_run_does_not_write_an_anchor_every_other_version(tmp_path: Path) -> None:
    from deltasync.manifest import AdapterEntry

    entry = AdapterEntry(r=4, lora_alpha=8, target_modules=("q_proj",), base_fingerprint="sha256:" + "0" * 64)
    g = torch.Generator().manual_seed(0)
    names = [f"base_model.model.layers.{i}.q_proj.lora_{ab}.weight" for i in range(2) for ab in "AB"]
    state = {n: torch.randn(16, 4, generator=g) for n in names}

    def anchors(fraction: object) -> int:
        store = LocalStore(tmp_path / f"adapter-{fraction}")
        config = PublisherConfig(anchor_every=None, anchor_bytes_fraction=fraction)  # type: ignore[arg-type]
        with Publisher(store, config=config, adapter=entry) as pub:
            for step in range(10):
                for t in state.values():
                    t.add_(torch.randn(t.shape, generator=g) * 1e-2)  # near-dense: every element moves
                pub.publish(state, step)
        return sum(m.kind == "anchor" for m in pub.published)

    assert anchors(0.5) >= 5  # the model's fraction: about every other version
    assert anchors("auto") <= 3  # the first, and at most one every several versions
