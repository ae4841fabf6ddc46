"""The Agent on an in-memory engine (the same apply rules as vLLM's), against a real coordinator in a thread.

Most tests try to break one of the data plane's promises: an engine serves only registered versions of its own
model, in order, and one bad object never stops the agent.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch
from deltasync_coordinator.app import create_app
from deltasync_coordinator.db import backup

from deltasync import (
    ApplyError,
    CoordinatorError,
    IntegrityError,
    LocalStore,
    ObjectWriter,
    RefusalReason,
    SignatureError,
    SigningKey,
    StoreError,
    Trust,
    UpdateRefused,
    read_weights,
    write_anchor,
)
from deltasync.agent import Agent
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.config import AgentConfig
from deltasync.layout import manifest_key
from deltasync.reader import load_object, read_manifest
from deltasync.staging import StagedUpdate, stage_object
from deltasync.targets import EngineClaim, InMemoryTarget
from deltasync.testing.models import qwen3_shapes
from deltasync.testing.stream import UpdateStream
from deltasync.tokens import make_agent_token
from tests.conftest import SMALL_QWEN3, ServerThread, agent_token, assert_bit_equal, coordinator_settings, overwrite
from tests.support.world import World, world


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    return UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=0).bf16()


@pytest.fixture
def w(tmp_path: Path, weights: dict[str, torch.Tensor]):
    with world(tmp_path, weights) as w:
        yield w


class FaultyTarget(InMemoryTarget):
    """An in-memory engine whose next delta goes wrong after its first write (a device fault mid-update)."""

    fail_next = False

    def apply(self, update: StagedUpdate) -> None:
        if self.fail_next and update.objects[0].kind == "delta":
            self.fail_next = False
            d = update.objects[0].deltas[0]
            d.values.view(torch.int16)[0] ^= 1  # written as it is, then the checksums catch it
        super().apply(update)


def test_first_sync_takes_the_anchor_then_deltas_bit_exact(w: World) -> None:
    agent = w.agent()
    first = agent.sync()
    assert (first.from_version, first.to_version, first.route) == (None, 0, "anchor")
    for _ in range(3):
        w.publisher.step()
    result = agent.sync()
    assert (result.from_version, result.to_version, result.route) == (0, 3, "deltas")
    assert_bit_equal(agent.target.weights, w.publisher.truth[3])
    assert agent.target.label == "3" and agent.target.applied == [0, 3]
    [me] = w.publisher.client.agents()
    assert (me.agent_id, me.applied_version, me.state, me.lag) == ("agent-0", 3, "idle", 0)


def test_start_is_explicit_and_engine_state_has_no_side_effects(w: World) -> None:
    target = InMemoryTarget()
    agent = w.agent(target=target, assume_version=0)
    assert agent.engine_state().version is None and not agent.started  # a query only
    assert agent.start().version == 0 and target.label == "0"
    assert agent.sync().route == "none"


def test_a_ledger_restored_from_a_backup_never_moves_the_engine_back(tmp_path: Path, weights) -> None:
    """An agent whose engine serves v7, facing a ledger restored from a backup at v3, never moves the engine
    back to v3 (through an anchor or otherwise), and says why."""
    target = InMemoryTarget()
    with world(tmp_path, weights) as w:
        for v in range(1, 8):
            w.publisher.step(anchor=v == 3)
            if v == 3:
                backup(tmp_path / "ledger.db", tmp_path / "backup-at-v3.db")
        assert w.agent(target=target).sync().to_version == 7
    settings = coordinator_settings(tmp_path, db=tmp_path / "backup-at-v3.db")
    with ServerThread(create_app(settings)) as server:  # the operator restores the backup
        client = CoordinatorClient(server.url, token=agent_token("agent-0"), retry=RetryPolicy(backoff_s=0.01))
        agent = Agent(
            store=LocalStore(tmp_path / "store"),
            coordinator=client,
            target=target,
            config=AgentConfig(staging_dir=str(tmp_path / "again"), retries=0, poll_wait_s=0),
        )
        with pytest.raises(UpdateRefused, match=r"a plan from v7 refused: the ledger's latest is v3") as exc:
            agent.sync()
        assert exc.value.reason is RefusalReason.ROLLBACK
        assert (target.version, target.label, target.applied) == (7, "7", [7])  # still serving v7
        assert "the ledger is behind its store" in str(client.health()["reasons"])  # seen at start-up
        agent._report_failure(exc.value)  # what run() does: the agent reports v7, which the ledger refuses
        health = client.health()
        assert health["status"] == "degraded"
        assert any("agent agent-0 reports v7, above the ledger's latest v3" in r for r in health["reasons"])
        allowed = Agent(
            store=agent.store,
            coordinator=client,
            target=target,
            config=AgentConfig(staging_dir=str(tmp_path / "op"), poll_wait_s=0, allow_rollback=True),
        )
        with pytest.raises(UpdateRefused):  # the ledger still refuses a plan from v7: the operator resets the engine
            allowed.sync()
        client.close()


def test_the_engine_never_goes_below_its_high_water_unless_an_operator_allows_it(w: World) -> None:
    """Forward only: the refusal is the engine's own, before any write."""
    for _ in range(4):
        w.publisher.step(anchor=True)
    target = InMemoryTarget()
    w.agent(target=target).sync()
    assert target.version == 4
    m = read_manifest(w.store, 2, "anchor")
    staged = stage_object(w.tmp / "s", m, w.store.get(manifest_key(2, "anchor")), load_object(w.store, m))
    with pytest.raises(UpdateRefused, match="the update would end at v2, this engine has served v4") as exc:
        target.apply(StagedUpdate(objects=(staged,)))
    assert exc.value.reason is RefusalReason.ROLLBACK and (target.version, target.label) == (4, "4")
    target.init(EngineClaim(agent_id=str(target.owner), allow_rollback=True))  # the operator's, at the claim
    target.apply(StagedUpdate(objects=(staged,)))
    assert (target.version, target.label) == (2, "2")
    assert_bit_equal(target.weights, w.publisher.truth[2])


def test_a_coordinator_of_another_run_is_refused(tmp_path: Path, weights) -> None:
    target = InMemoryTarget()
    with world(tmp_path / "a", weights) as w:
        w.agent(target=target).sync()
        first_run = target.state().run_id
    with world(tmp_path / "b", weights) as w2:  # a new ledger: another run, same model
        agent = w2.agent(target=target)
        with pytest.raises(CoordinatorError, match=f"keeps run run-[0-9a-f]+, .*{first_run}"):
            agent.sync()
        assert target.applied == [0] and target.state().run_id == first_run


def test_a_foreign_model_is_refused_before_any_fetch_and_never_escalates(tmp_path: Path, weights) -> None:
    """A Llama engine pointed at a Qwen2 run: the refusal is an UpdateRefused before any fetch, never an
    ApplyError that escalates to the anchor route (which would write the foreign tensors into the engine)."""
    other = UpdateStream.from_shapes({"model.norm.weight": (64,), "lm_head.weight": (300, 64)}).bf16()
    spec = {n: ("BF16", tuple(t.shape)) for n, t in weights.items()}
    with world(tmp_path, other) as w:
        w.publisher.step()
        target = InMemoryTarget(spec=spec)  # it serves the SMALL_QWEN3 model
        agent = w.agent(target=target)
        fetched: list[str] = []
        original = w.store.get
        w.store.get = lambda key, **kw: (fetched.append(key), original(key, **kw))[1]  # type: ignore[method-assign]
        with pytest.raises(UpdateRefused) as exc:
            agent.sync()
        assert exc.value.reason is RefusalReason.MODEL and "is for another model" in str(exc.value)
        assert not any("shard-" in k for k in fetched)  # refused from the manifest alone
        assert target.weights is None and target.state().healthy and target.applied == []
        assert not agent.needs_anchor  # a refusal never escalates to the anchor route
        agent._report_failure(exc.value)  # what run() does after a failed sync
        [me] = w.publisher.client.agents()
        assert me.state == "refused"


def test_a_failure_past_the_first_write_is_never_served_and_an_anchor_restores_health(w: World) -> None:
    target = FaultyTarget()
    agent = w.agent(target=target)
    agent.sync()
    w.publisher.step(anchor=True)
    target.fail_next = True
    result = agent.sync()  # the delta fails past its first write; the agent restores from the anchor at once
    assert result.route == "anchor" and result.to_version == 1
    assert target.state().healthy and target.label == "1" and not target.paused
    assert_bit_equal(target.weights, w.publisher.truth[1])
    assert target.pauses == 3  # v0, the failed delta, the anchor: resumed only once healthy


def test_an_engine_that_keeps_failing_stays_paused_and_unlabelled(w: World) -> None:
    """After a failure past the first write the engine never serves under the old label: if even the anchor
    fails, it stays paused, labelled unhealthy, and the fleet view says why."""
    target = InMemoryTarget()
    agent = w.agent(target=target)
    agent.sync()
    w.publisher.step()
    target.apply = _always_fail(target)  # type: ignore[method-assign]
    with pytest.raises(ApplyError, match="fails past its first write every time"):
        agent.sync()
    assert target.paused and target.label == "unhealthy" and not target.state().healthy
    agent._report_failure(ApplyError("x"))
    [me] = w.publisher.client.agents()
    assert me.state == "unhealthy"


def _always_fail(target: InMemoryTarget):
    def apply(update: StagedUpdate) -> None:
        target.holding = dataclasses.replace(target.holding, healthy=False)
        target.label = "unhealthy"
        raise ApplyError("simulated: the engine fails past its first write every time")

    return apply


def test_one_hostile_object_never_stops_run(w: World) -> None:
    """Agent.run outlives a hostile object (a 64 GiB sparse manifest would be a MemoryError in 0.3 s) and the
    fleet view says what failed, never a stale 'fetching'."""
    agent = w.agent()
    agent.sync()
    w.publisher.step()
    key = manifest_key(1, "delta")
    good = w.store.get(key)
    path = w.store.root / key
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(64 << 30)  # sparse: 64 GiB of nothing
    stop = threading.Event()
    t = threading.Thread(target=agent.run, args=(stop,))
    t.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            [me] = w.publisher.client.agents()
            if me.state == "error" and me.last_error:
                break
            time.sleep(0.05)
        assert me.state == "error" and "ObjectTooLarge" in me.last_error and "not read" in me.last_error
        assert t.is_alive()  # still running, backing off
        overwrite(w.store, key, good)
        while time.monotonic() < deadline and agent.target.version != 1:
            time.sleep(0.05)
        assert agent.target.version == 1
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()


def test_a_forged_object_in_the_store_is_refused_by_signature_and_ledger(tmp_path: Path, weights) -> None:
    """A forged manifest + shard written straight into the store: `read_weights` never returns the forged
    lm_head (zeros) and `verify` never blesses it; the signature and the ledger refuse it."""
    key = SigningKey.generate()
    with world(tmp_path, weights, signing_key=key) as w:
        w.publisher.step()
        forged = {n: torch.zeros_like(t) for n, t in w.publisher.truth[1].items()}
        attacker = ObjectWriter(store=LocalStore(tmp_path / "evil"), signing_key=SigningKey.generate())
        write_anchor(attacker, forged, version=0)  # consistent objects, signed by the attacker's own key
        write_anchor(attacker, forged, version=1)
        for k in attacker.store.list("v00000001/"):
            overwrite(w.store, k, attacker.store.get(k))
        assert torch.count_nonzero(read_weights(w.store, 1)["model.norm.weight"]) == 0  # the store alone: forged
        signed = Trust(verify_key=key.verify_key)
        with pytest.raises(SignatureError, match=r"signed by key sha256:[0-9a-f]+, the trusted key is"):
            read_manifest(w.store, 1, "anchor", trust=signed)
        with pytest.raises(IntegrityError, match="anchor v1 is not registered with the coordinator"):
            read_manifest(w.store, 1, "anchor", trust=Trust(ledger=w.publisher.client.registered_digest))
        # a trusting reader skips the forged anchor and rebuilds v1 through the genuine delta chain
        assert_bit_equal(read_weights(w.store, 1, trust=signed), w.publisher.truth[1])
        # the attacker drops the signature file: unsigned is refused too
        (w.store.root / "v00000001" / "anchor" / "manifest.sig").unlink()
        with pytest.raises(SignatureError, match="the manifest is not signed"):
            read_manifest(w.store, 1, "anchor", trust=signed)
        # an agent follows the ledger's own objects, signed by the publisher: the forged anchor is never used
        agent = w.agent(public_key=None)
        agent.verify_key = key.verify_key
        assert agent.sync().route == "anchor"
        assert_bit_equal(agent.target.weights, w.publisher.truth[1])
        # ...and when the attacker replaces a registered object, the agent refuses it
        for k in attacker.store.list("v00000000/"):
            overwrite(w.store, k, attacker.store.get(k))
        with pytest.raises(IntegrityError, match="the coordinator registered"):
            w.agent("fresh", public_key=None).sync()


def test_a_restarted_agent_rebuilds_its_host_copy_against_the_ledger(w: World) -> None:
    """An agent restarted while its engine holds v3 rebuilds its host copy against the ledger, never from the
    store unchecked (which could end in IntegrityError in a loop)."""
    target = InMemoryTarget()
    for _ in range(3):
        w.publisher.step()
    w.agent(target=target).sync()
    w.publisher.step(anchor=True)  # v4, with an anchor to fall back to
    k = manifest_key(2, "delta")  # the host rebuild of v3 needs delta v2: an attacker edits its manifest
    data = w.store.get(k).replace(b'"encoding": "packed"', b'"encoding": "packed" ')
    overwrite(w.store, k, data)
    again = w.agent(target=target, integrity_fallback_after=2)  # a restarted agent: no host copy
    with pytest.raises(IntegrityError, match="the coordinator registered"):
        again.sync()
    result = again.sync()  # the second failure in a row: catch up from the anchor instead
    assert result.route == "anchor" and target.version == 4
    assert_bit_equal(target.weights, w.publisher.truth[4])


def test_a_token_minted_with_another_secret_is_refused(w: World) -> None:
    forged = CoordinatorClient(
        w.server.url, token=make_agent_token("another-secret-0123456789", "agent-0"), retry=RetryPolicy(retries=0)
    )
    with pytest.raises(CoordinatorError) as exc:
        forged.heartbeat("agent-0", applied_version=None, state="idle")
    assert exc.value.status_code == 403
    forged.close()


def test_the_shard_cache_resumes_a_remote_fetch_and_a_local_store_is_its_own_cache(
    tmp_path: Path, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    """Shards fetched from a remote store are kept by sha256, so a retried fetch does not fetch them again; from a
    local store they are not copied (re-reading the store costs what reading a cache would)."""
    from deltasync._fetch import ObjectFetcher
    from deltasync.store.hub import HubBucketStore
    from tests.fakes import FakeBucketApi

    remote = HubBucketStore("me/run1", "exp", api=FakeBucketApi(), cache_dir=tmp_path / "hub", backoff_s=0.001)
    for store, cached in ((remote, True), (LocalStore(tmp_path / "local"), False)):
        m = write_anchor(store, tiny_state_dict, version=0)
        cache = tmp_path / f"cache-{cached}"
        fetcher = ObjectFetcher(store, cache, verify_key=None, retries=0, backoff_s=0.0, workers=2, name="a")
        first = fetcher.shards([m])
        assert sorted(p.name for p in cache.iterdir()) == (sorted(e.sha256 for e in m.shards) if cached else [])
        if cached:  # the store is gone: the retry is served from the cache, checked again
            store.get = lambda *a, **k: (_ for _ in ()).throw(StoreError("gone"))  # type: ignore[method-assign]
            assert fetcher.shards([m]) == first
            for p in cache.iterdir():  # and without it, the retry would have failed
                p.unlink()
            with pytest.raises(StoreError, match="gone"):
                fetcher.shards([m])
