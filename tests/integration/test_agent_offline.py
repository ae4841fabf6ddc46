"""The in-process agent keeps an offline vLLM (CPU, reload mode) bit-exact over a realistic stream."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from deltasync.testing import qwen3_effective_checksums
from deltasync_coordinator.app import create_app
from deltasync_coordinator.settings import Settings
from safetensors.torch import load_file, save_file

from deltasync import ApplyError, IntegrityError, LocalStore, TensorDelta, VersionGapError, encode_shard
from deltasync.agent import Agent
from deltasync.client import CoordinatorClient
from deltasync.config import AgentConfig
from deltasync.targets import OfflineLLMTarget
from tests.conftest import AGENT_TOKEN, PUBLISHER_TOKEN, ServerThread
from tests.integration.fresh_engine import generate
from tests.integration.helpers import StreamPublisher

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
    settings = Settings(
        db=tmp / "c.db", store=str(tmp / "store"), publisher_token=PUBLISHER_TOKEN, agent_token=AGENT_TOKEN
    )
    with ServerThread(create_app(settings)) as server:
        with (
            CoordinatorClient(server.url, token=PUBLISHER_TOKEN) as pub,
            CoordinatorClient(server.url, token=AGENT_TOKEN) as agt,
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


def test_twenty_versions_bit_exact_with_catch_up_and_anchors(
    vllm_engine: Any, world: World, agent: Agent, tiny_model_dir: Path
) -> None:
    pub = world.publisher
    first = agent.sync()  # the engine's version is unknown ('default'): it starts from the newest anchor
    assert (first.from_version, first.to_version, first.route) == (None, 0, "anchor")
    assert_engine_at(vllm_engine, world, 0)
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
    ckpt = world.tmp / "v20-checkpoint"
    shutil.copytree(tiny_model_dir, ckpt)
    save_file(pub.truth[20], str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.fresh_engine", str(ckpt), json.dumps(PROMPTS + [LONG_PROMPT])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    fresh = json.loads(lines[-1][len("RESULT ") :])
    for a, b in zip(ours, fresh["outputs"], strict=True):
        assert a["ids"] == b["ids"]
        assert a["logprobs"] == b["logprobs"]  # exactly equal, not approximately
    assert fresh["effective"][0] == effective(vllm_engine)


def test_a_delta_on_the_wrong_base_is_refused_and_the_old_weights_keep_serving(
    vllm_engine: Any, world: World, agent: Agent
) -> None:
    at = world.publisher.version
    stale = world.tmp / "stale.safetensors"
    w = world.publisher.truth[at]
    d = TensorDelta(
        ckpt_name="model.norm.weight",
        shape=tuple(w["model.norm.weight"].shape),
        dtype=torch.bfloat16,
        indices=torch.tensor([0]),
        values=torch.tensor([2.0], dtype=torch.bfloat16),
        checksum="xxh3_128:" + "0" * 32,
    )
    stale.write_bytes(encode_shard([d], kind="delta", encoding="raw", base_version=at - 3, target_version=at + 1))
    with pytest.raises(VersionGapError, match=f"this engine holds v{at}"):
        OfflineLLMTarget(vllm_engine).apply(
            [{"files": [str(stale)], "kind": "delta", "base_version": at - 3, "target_version": at + 1}],
            weight_version=at + 1,
        )
    assert_engine_at(vllm_engine, world, at)
    assert vllm_engine.collective_rpc("deltasync_status")[0]["healthy"]


def test_a_corrupt_delta_is_never_applied_and_the_agent_recovers(vllm_engine: Any, world: World, agent: Agent) -> None:
    at = world.publisher.version
    new = world.publisher.step()
    key = f"v{new:08d}/shard-00000.safetensors"
    good = world.store.get(key)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x40
    world.store.put(key, bytes(bad))
    with pytest.raises(IntegrityError, match="sha256 is"):
        agent.sync()
    assert_engine_at(vllm_engine, world, at)  # nothing was applied; v{at} keeps serving
    world.store.put(key, good)
    assert agent.sync().to_version == new
    assert_engine_at(vllm_engine, world, new)


def test_a_delta_for_another_model_fails_clearly(vllm_engine: Any, world: World) -> None:
    at = world.publisher.version
    other = world.tmp / "other-model.safetensors"
    d = TensorDelta(
        ckpt_name="model.norm.weight",
        shape=(64,),
        dtype=torch.bfloat16,
        indices=torch.tensor([3]),
        values=torch.tensor([1.5], dtype=torch.bfloat16),
        checksum="xxh3_128:" + "0" * 32,
    )
    other.write_bytes(encode_shard([d], kind="delta", encoding="raw", base_version=at, target_version=at + 1))
    with pytest.raises(
        ApplyError,
        match=r"'model.norm.weight' is torch.bfloat16 \[128\] here, the delta has "
        r"torch.bfloat16 \[64\] \(a delta for another model\?\)",
    ):
        OfflineLLMTarget(vllm_engine).apply(
            [{"files": [str(other)], "kind": "delta", "base_version": at, "target_version": at + 1}],
            weight_version=at + 1,
        )
    assert_engine_at(vllm_engine, world, at)
    assert vllm_engine.collective_rpc("deltasync_status")[0]["healthy"]
