"""An engine's claim goes to an agent whose run and model the engine admits: an agent of another model's run,
pointed by mistake at a fresh engine, never holds it, so the engine's own agent takes it at once.

Run here on the in-memory engine; the vLLM engine applies the same rules (:func:`deltasync.apply.refuse_model`,
:func:`deltasync.apply.releases_claim`), attacked on a real vLLM in tests/integration/test_lora_engine_drift_and_refusals.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from deltasync_coordinator.app import create_app

from deltasync import DeltaSyncError, LocalStore, RefusalReason, UpdateRefused
from deltasync.agent import Agent
from deltasync.client import CoordinatorClient
from deltasync.config import AgentConfig
from deltasync.targets import InMemoryTarget
from deltasync.testing.models import qwen3_shapes
from deltasync.testing.stream import UpdateStream
from tests.conftest import PUBLISHER_TOKEN, SMALL_QWEN3, ServerThread, agent_token, coordinator_settings
from tests.support.world import StreamPublisher, world


@pytest.fixture
def weights() -> dict:
    return UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=0).bf16()


@pytest.fixture
def other() -> dict:
    return UpdateStream.from_shapes({"model.norm.weight": (64,), "lm_head.weight": (300, 64)}).bf16()


def _spec(weights: dict) -> dict:
    return {n: ("BF16", tuple(t.shape)) for n, t in weights.items()}


def test_an_agent_of_another_models_run_is_refused_at_the_claim(tmp_path: Path, weights, other) -> None:
    """The wrong run has published: its newest anchor names its model, and the engine refuses the claim."""
    target = InMemoryTarget(spec=_spec(weights))
    with world(tmp_path / "right", weights) as right, world(tmp_path / "wrong", other) as wrong:
        wrong.publisher.step()
        right.publisher.step()
        intruder = wrong.agent("wrong-agent", target=target)
        with pytest.raises(UpdateRefused) as exc:
            intruder.sync()
        assert exc.value.reason is RefusalReason.MODEL
        assert str(exc.value).startswith("deltasync: agent 'wrong-agent' follows a run that is for another model")
        assert target.state().agent_id is None and target.weights is None
        result = right.agent("right-agent", target=target).sync()  # at once
        assert result.route == "anchor" and target.version == result.to_version == right.publisher.version
        with pytest.raises(UpdateRefused, match="driven by agent 'right-agent'"):
            intruder.sync()
        assert target.state().agent_id == "right-agent"


def test_an_agent_whose_run_had_published_nothing_loses_the_claim_at_its_first_refused_object(
    tmp_path: Path, weights, other
) -> None:
    """The wrong run was empty when its agent claimed the fresh engine: its first anchor is refused for its model,
    and the claim is released with it."""
    target = InMemoryTarget(spec=_spec(weights))
    with (
        world(tmp_path / "right", weights) as right,
        ServerThread(create_app(coordinator_settings(tmp_path / "wrong"))) as server,
        CoordinatorClient(server.url, token=PUBLISHER_TOKEN) as pub,
        CoordinatorClient(server.url, token=agent_token("wrong-agent")) as coordinator,
    ):
        store = LocalStore(tmp_path / "wrong" / "store")
        config = AgentConfig(agent_id="wrong-agent", staging_dir=str(tmp_path / "stage"), retries=1, poll_wait_s=0)
        intruder = Agent(store=store, coordinator=coordinator, target=target, config=config)
        intruder.start()  # its run has published nothing: no model to tell the engine
        assert target.state().agent_id == "wrong-agent"
        StreamPublisher(store, pub, other)  # now its run publishes its anchor
        with pytest.raises(UpdateRefused) as exc:
            intruder.sync()
        assert exc.value.reason is RefusalReason.MODEL and "is for another model" in str(exc.value)
        assert target.state().agent_id is None and target.weights is None
        result = right.agent("right-agent", target=target).sync()  # at once
        assert target.version == result.to_version == right.publisher.version
        with pytest.raises(UpdateRefused, match="driven by agent 'right-agent'"):
            intruder.sync()  # it tries to claim again
        assert target.state().agent_id == "right-agent"


def test_an_agent_that_cannot_read_its_runs_anchor_does_not_claim_a_fresh_engine(
    tmp_path: Path, weights, other
) -> None:
    """The wrong run's newest anchor cannot be read from here (a store writer spoiled its manifest, or the store
    is unreachable): its agent cannot say what it would serve, and leaves the fresh engine unclaimed."""
    target = InMemoryTarget(spec=_spec(weights))
    with world(tmp_path / "right", weights) as right, world(tmp_path / "wrong", other) as wrong:
        (wrong.store.root / "v00000000" / "anchor" / "manifest.json").write_bytes(b"{}")
        intruder = wrong.agent("wrong-agent", target=target)
        with pytest.raises(DeltaSyncError):
            intruder.sync()
        assert target.state().agent_id is None
        assert right.agent("right-agent", target=target).sync().to_version == right.publisher.version
