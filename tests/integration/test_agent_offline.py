"""The in-process agent keeps an offline vLLM (CPU, reload mode) bit-exact over a realistic stream, and the
real engine refuses what it must refuse (another model; a failure past the first write)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from deltasync_coordinator.app import create_app
from safetensors.torch import load_file

from deltasync import (
    ApplyError,
    LocalStore,
    ObjectWriter,
    RefusalReason,
    UpdateRefused,
    VersionGapError,
    write_anchor,
)
from deltasync.agent import Agent
from deltasync.client import CoordinatorClient
from deltasync.config import AgentConfig
from deltasync.layout import manifest_key
from deltasync.reader import load_object, read_manifest
from deltasync.staging import StagedUpdate, stage_object
from deltasync.targets import UNHEALTHY_LABEL, OfflineLLMTarget
from deltasync.testing.models import build_tiny_model, qwen3_effective_checksums
from tests.conftest import PUBLISHER_TOKEN, ServerThread, agent_token, coordinator_settings, overwrite
from tests.integration.fresh_engine import fresh_run, generate
from tests.support.staging import stage_as_published
from tests.support.world import StreamPublisher

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
LAYERS = 2
PROMPTS = ["Guess the five letter word:", "crane slate audio", "Feedback: G Y X X G. Next guess"]
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)  # > 128 tokens: 2+ KV blocks


@dataclasses.dataclass
class World:
    store: LocalStore
    publisher: StreamPublisher
    agent_client: CoordinatorClient
    tmp: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("offline")
    with ServerThread(create_app(coordinator_settings(tmp))) as server:
        with (
            CoordinatorClient(server.url, token=PUBLISHER_TOKEN) as pub,
            CoordinatorClient(server.url, token=agent_token("offline-0")) as agt,
        ):
            store = LocalStore(tmp / "store")
            publisher = StreamPublisher(store, pub, load_file(tiny_model_dir / "model.safetensors"), lr=1e-6)
            yield World(store=store, publisher=publisher, agent_client=agt, tmp=tmp)


@pytest.fixture(scope="module")
def agent(vllm_engine: Any, world: World) -> Agent:
    config = AgentConfig(agent_id="offline-0", staging_dir=str(world.tmp / "staging"), retries=1, backoff_s=0.01)
    return Agent.for_llm(vllm_engine, store=world.store, coordinator=world.agent_client, config=config)


def effective(llm: Any) -> dict[str, str]:
    return llm.collective_rpc("deltasync_effective")[0]


def assert_engine_at(llm: Any, world: World, version: int) -> None:
    assert llm.get_weight_version() == str(version)
    expected = qwen3_effective_checksums(world.publisher.truth[version], LAYERS)
    got = effective(llm)
    differ = sorted(k for k in expected if got.get(k) != expected[k])
    assert not differ, f"v{version}: effective weights differ from the trainer's: {differ}"


def status(llm: Any) -> dict[str, Any]:
    return llm.collective_rpc("deltasync_status")[0]


def test_twenty_versions_bit_exact_with_catch_up_and_anchors(
    vllm_engine: Any, world: World, agent: Agent, tiny_model_dir: Path
) -> None:
    pub = world.publisher
    first = agent.sync()  # the engine's version is unknown ('default'): it starts from the newest anchor
    assert (first.from_version, first.to_version, first.route) == (None, 0, "anchor")
    assert_engine_at(vllm_engine, world, 0)
    assert status(vllm_engine)["run_id"] == pub.lease.run_id  # the engine follows this run now
    routes = []
    for _ in range(6):  # one delta at a time
        pub.step(anchor=pub.version + 1 == 5)
        routes.append(agent.sync().route)
        assert_engine_at(vllm_engine, world, pub.version)
    assert routes == ["deltas"] * 6
    generate(vllm_engine, [LONG_PROMPT])  # fills the prefix cache with v6 KV
    for _ in range(6):  # a lagging agent: v6 -> v12 in one pause
        pub.step(anchor=pub.version + 1 == 10)
    result = agent.sync()
    assert (result.from_version, result.to_version) == (6, 12)
    assert result.timings["pause"] > 0 and result.timings["fetch"] >= 0
    assert_engine_at(vllm_engine, world, 12)
    for _ in range(8):
        pub.step(anchor=pub.version + 1 in (15, 20))
    assert agent.sync().to_version == 20
    assert_engine_at(vllm_engine, world, 20)
    [me] = world.agent_client.agents()
    assert (me.agent_id, me.applied_version, me.lag, me.state) == ("offline-0", 20, 0, "idle")
    assert "pause" in me.timings

    # a fresh engine on the v20 checkpoint generates exactly the same, the long prompt included (prefix cache reset)
    ours = generate(vllm_engine, PROMPTS + [LONG_PROMPT])
    fresh = fresh_run(tiny_model_dir, pub.truth[20], world.tmp / "v20-checkpoint", PROMPTS + [LONG_PROMPT])
    for a, b in zip(ours, fresh["outputs"], strict=True):
        assert a["ids"] == b["ids"]
        assert a["logprobs"] == b["logprobs"]  # exactly equal, not approximately
    assert fresh["effective"][0] == effective(vllm_engine)


def _staged(world: World, version: int, kind: str, directory: str):
    m = read_manifest(world.store, version, kind)  # type: ignore[arg-type]
    data = world.store.get(manifest_key(version, kind))  # type: ignore[arg-type]
    obj = stage_object(  # under the agent's staging directory: the engine reads files from nowhere else
        world.tmp / "staging" / directory,
        m,
        data,
        load_object(world.store, m, base=None if kind == "anchor" else _host(world, m)),
    )
    return dataclasses.replace(obj, manifest=None, deltas=None)  # the engine reads the files, as over RPC


def _published(world: World, version: int, kind: str, directory: str):
    """An object staged as published: the manifest and the shards as fetched (the engine decodes them)."""
    return stage_as_published(world.store, world.tmp / "staging" / directory, version, kind)  # type: ignore[arg-type]


def test_the_engine_decodes_published_objects_and_refuses_any_other(
    vllm_engine: Any, world: World, agent: Agent
) -> None:
    """The engine decodes what its agent stages as fetched against what it serves (here its reload shadow): the
    agent keeps no copy of the model. A staged shard that is not the published one, a delta on another base,
    or a staged manifest of another version is refused before any write."""
    new = world.publisher.step()
    assert status(vllm_engine)["decodes"] is True
    assert agent.sync().to_version == new and agent.host is None
    assert_engine_at(vllm_engine, world, new)
    target = OfflineLLMTarget(vllm_engine)
    before = effective(vllm_engine)
    nxt = world.publisher.step()
    flipped = _published(world, nxt, "delta", "published-flipped")
    shard = Path(flipped.shard_paths[0])
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(UpdateRefused, match="sha256 is") as exc:
        target.apply(StagedUpdate(objects=(flipped,)))
    assert exc.value.reason is RefusalReason.MALFORMED
    with pytest.raises(VersionGapError, match=f"this engine holds v{new}"):
        target.apply(StagedUpdate(objects=(_published(world, new - 1, "delta", "published-stale"),)))
    other = _published(world, nxt, "delta", "published-other-manifest")
    Path(other.manifest_path).write_bytes(world.store.get(manifest_key(new, "delta")))
    with pytest.raises(UpdateRefused, match="the staged manifest is delta v") as exc:
        target.apply(StagedUpdate(objects=(other,)))
    assert exc.value.reason is RefusalReason.MALFORMED
    assert effective(vllm_engine) == before and status(vllm_engine)["healthy"]  # nothing written
    target.apply(StagedUpdate(objects=(_published(world, nxt, "delta", "published-good"),)))
    assert_engine_at(vllm_engine, world, nxt)
    assert agent.sync().route == "none"


def _host(world: World, m):
    from deltasync import read_weights

    return read_weights(world.store, m.base_version)


def test_a_delta_on_the_wrong_base_is_refused_and_the_old_weights_keep_serving(
    vllm_engine: Any, world: World, agent: Agent
) -> None:
    at = world.publisher.version
    stale = _staged(world, at - 3, "delta", "stale")
    with pytest.raises(VersionGapError, match=f"this engine holds v{at}"):
        OfflineLLMTarget(vllm_engine).apply(StagedUpdate(objects=(stale,)))
    assert_engine_at(vllm_engine, world, at)
    assert status(vllm_engine)["healthy"] and status(vllm_engine)["outcome"]["refused"] == "base"


def test_a_corrupt_delta_is_never_applied_and_the_agent_recovers(vllm_engine: Any, world: World, agent: Agent) -> None:
    at = world.publisher.version
    new = world.publisher.step()
    key = f"v{new:08d}/shard-00000.safetensors"
    good = world.store.get(key)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x40
    overwrite(world.store, key, bytes(bad))
    # the agent links a local store's shards unread for an engine that decodes: the engine's own hash refuses it
    with pytest.raises(UpdateRefused, match="sha256 is") as exc:
        agent.sync()
    assert exc.value.reason is RefusalReason.MALFORMED
    assert_engine_at(vllm_engine, world, at)  # nothing was applied; v{at} keeps serving
    overwrite(world.store, key, good)
    assert agent.sync().to_version == new
    assert_engine_at(vllm_engine, world, new)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> LocalStore:
    """Another model's run (a wider Qwen3: other shapes, the same names) in its own store: anchor v0, delta v1."""
    tmp = tmp_path_factory.mktemp("foreign")
    other = build_tiny_model(
        tmp / "model",
        seed=1,
        config={
            "vocab_size": 512,
            "hidden_size": 192,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
        },
    )
    store = LocalStore(tmp / "store")
    publisher = StreamPublisher(store, None, load_file(other / "model.safetensors"), lr=1e-5)
    for _ in range(40):  # more versions than the engine's run will have: a plan from its version exists
        publisher.step()
    return store


def test_another_models_anchor_and_delta_are_refused_before_any_write(
    vllm_engine: Any, world: World, foreign: LocalStore
) -> None:
    """An anchor of another model, with the real engine, is refused before it reaches the engine (embed_tokens,
    lm_head, norms): the engine never reports unhealthy while serving its old label, and a later good anchor
    leaves it healthy."""
    at = world.publisher.version
    target = OfflineLLMTarget(vllm_engine)
    before = effective(vllm_engine)
    fake_world = World(store=foreign, publisher=world.publisher, agent_client=world.agent_client, tmp=world.tmp)
    for obj in (_staged(fake_world, 0, "anchor", "foreign-anchor"), _staged(fake_world, 1, "delta", "foreign-delta")):
        with pytest.raises(UpdateRefused) as exc:
            target.apply(StagedUpdate(objects=(obj,)))
        assert exc.value.reason in (RefusalReason.MODEL, RefusalReason.BASE)
        assert not isinstance(exc.value, ApplyError)
        assert status(vllm_engine)["healthy"] and vllm_engine.get_weight_version() == str(at)
        assert not status(vllm_engine)["session_active"]
    assert status(vllm_engine)["outcome"]["refused"] in ("model", "base")
    anchor_refusal = None
    with pytest.raises(UpdateRefused) as exc:
        target.apply(StagedUpdate(objects=(_staged(fake_world, 0, "anchor", "foreign-anchor-2"),)))
    anchor_refusal = exc.value
    assert anchor_refusal.reason is RefusalReason.MODEL and "is for another model" in str(anchor_refusal)
    assert "tensors differ, e.g. 'model." in str(anchor_refusal)
    assert effective(vllm_engine) == before  # nothing written
    assert_engine_at(vllm_engine, world, at)


def test_a_failure_past_the_first_write_unlabels_the_engine_until_an_anchor_restores_it(
    vllm_engine: Any, world: World, agent: Agent
) -> None:
    """After any failure past the first write, the engine never serves under the old label; a
    successful anchor restores health."""
    at = world.publisher.version
    new = world.publisher.step(anchor=True)
    target = OfflineLLMTarget(vllm_engine)
    good = _staged(world, new, "delta", "tampered")
    # the staged manifest promises other checksums than the staged values give: found only after writing
    manifest = json.loads(Path(good.manifest_path).read_text())
    name = next(n for n, t in manifest["tensors"].items() if t["nnz"])
    manifest["tensors"][name]["checksums"][0][2] = "xxh3_128:" + "0" * 32
    Path(good.manifest_path).write_text(json.dumps(manifest))
    with pytest.raises(ApplyError, match="differ from the published checksums"):
        target.apply(StagedUpdate(objects=(good,)))
    st = status(vllm_engine)
    assert not st["healthy"] and st["version"] is None and "only an anchor restores this engine" in st["detail"]
    assert vllm_engine.get_weight_version() == UNHEALTHY_LABEL  # never the old label
    assert not st["session_active"]  # vLLM's session flag was cleared: no dangling session
    with pytest.raises(UpdateRefused) as exc:  # a delta is refused now
        target.apply(StagedUpdate(objects=(_staged(world, new, "delta", "again"),)))
    assert exc.value.reason is RefusalReason.UNHEALTHY
    result = agent.sync()  # the agent sees an unhealthy engine and takes the anchor route
    assert result.route == "anchor" and result.to_version == new
    assert status(vllm_engine)["healthy"]
    assert_engine_at(vllm_engine, world, new)
    assert at < new


def test_the_offline_target_closes_its_own_dangling_session(vllm_engine: Any, world: World, agent: Agent) -> None:
    """A dangling update session (vLLM leaves its update flag set when finish raises) is closed by the agent
    without a restart."""
    at = world.publisher.version
    vllm_engine.start_weight_update()  # a caller that died inside a session
    assert status(vllm_engine)["session_active"]
    new = world.publisher.step()
    assert agent.sync().to_version == new  # recovered: closed, then synced
    assert not status(vllm_engine)["session_active"]
    assert_engine_at(vllm_engine, world, new)
    assert at < new


def test_an_agent_pointed_at_another_models_run_reports_refused_and_keeps_serving(
    vllm_engine: Any, world: World, agent: Agent, foreign: LocalStore, tmp_path: Path
) -> None:
    """Another model, end to end: the agent refuses before fetching a shard and never takes the anchor route."""
    at = world.publisher.version
    with ServerThread(create_app(coordinator_settings(tmp_path))) as server:
        with CoordinatorClient(server.url, token=PUBLISHER_TOKEN) as pub:
            lease = pub.acquire_lease("other-run", ttl_s=60)
            from deltasync import list_versions
            from deltasync.schemas import VersionCreate

            for listing in list_versions(foreign):
                for kind in ("delta", "anchor"):
                    if getattr(listing, kind):
                        m = read_manifest(foreign, listing.version, kind)  # type: ignore[arg-type]
                        data = foreign.get(manifest_key(listing.version, kind))  # type: ignore[arg-type]
                        pub.register_version(VersionCreate.for_manifest(m, data), lease=lease)
        # the engine's own agent, restarted by an operator against another model's run (another agent id is
        # refused even earlier: an engine obeys the one agent that claimed it)
        with CoordinatorClient(server.url, token=agent_token("offline-0")) as client:
            config = AgentConfig(agent_id="offline-0", staging_dir=str(tmp_path / "s"), retries=0, allow_rollback=True)
            stray = Agent.for_llm(vllm_engine, store=foreign, coordinator=client, config=config)
            stray.session = agent.session  # the same agent process, reconfigured (another would be refused sooner)
            with pytest.raises(UpdateRefused) as exc:  # even an operator's allow_rollback never takes another model
                stray.sync()
            assert exc.value.reason is RefusalReason.MODEL and not stray.needs_anchor
    assert_engine_at(vllm_engine, world, at)
    assert status(vllm_engine)["healthy"]


def test_a_writer_for_another_model_cannot_forge_the_fingerprint(world: World, tmp_path: Path) -> None:
    """The fingerprint is computed from the tensors a manifest lists, so a foreign object cannot claim ours."""
    other = ObjectWriter(store=LocalStore(tmp_path / "x"))
    m = write_anchor(other, {"model.norm.weight": torch.ones(7, dtype=torch.bfloat16)}, version=0)
    assert m.model_fingerprint != world.publisher.base.model_fingerprint
