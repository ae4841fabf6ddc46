"""No automatic garbage collection inside an agent's update (deltasync._gc): a full collection of a process that
hosts vLLM's front end took 25-340 ms here and landed in every few syncs, inside the before-the-pause time."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltasync._gc import quiet_gc
from deltasync.staging import StagedUpdate
from deltasync.targets import InMemoryTarget
from deltasync.testing.models import qwen3_shapes
from deltasync.testing.stream import UpdateStream
from tests.conftest import SMALL_QWEN3, assert_bit_equal
from tests.support.world import World, world


@pytest.fixture(autouse=True)
def _gc_back_on():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_quiet_gc_nests_and_restores_what_it_found() -> None:
    gc.enable()
    with quiet_gc():
        assert not gc.isenabled()
        with quiet_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer section still runs
    assert gc.isenabled()
    gc.disable()  # a process that runs without the collector keeps it off
    with quiet_gc():
        pass
    assert not gc.isenabled()


def test_quiet_gc_sections_overlapping_across_threads_turn_it_on_once_the_last_ends() -> None:
    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with quiet_gc():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with quiet_gc():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's section is still open
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_quiet_gc_turns_it_back_on_after_an_error() -> None:
    gc.enable()
    with pytest.raises(RuntimeError), quiet_gc():
        raise RuntimeError("boom")
    assert gc.isenabled()


class WatchingTarget(InMemoryTarget):
    """Records whether the collector was on while the agent staged and applied each update."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def apply(self, update: StagedUpdate) -> None:
        self.seen.append(gc.isenabled())
        super().apply(update)


class FailingTarget(WatchingTarget):
    fail_next = False

    def apply(self, update: StagedUpdate) -> None:
        if self.fail_next and update.objects[0].kind == "delta":
            self.fail_next = False
            update.objects[0].deltas[0].values.view(torch.int16)[0] ^= 1  # caught past the first write
        super().apply(update)


@pytest.fixture
def w(tmp_path: Path) -> Iterator[World]:
    with world(tmp_path, UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=0).bf16()) as w:
        yield w


def test_an_agent_update_runs_without_automatic_collections_and_leaves_the_collector_on(w: World) -> None:
    gc.enable()
    target = WatchingTarget()
    agent = w.agent(target=target)
    agent.sync()
    w.publisher.step()
    agent.sync()
    assert target.seen == [False, False]
    assert gc.isenabled()
    assert_bit_equal(target.weights, w.publisher.truth[1])


def test_the_collector_is_back_on_after_a_failed_update_and_its_restore(w: World) -> None:
    gc.enable()
    target = FailingTarget()
    agent = w.agent(target=target)
    agent.sync()
    w.publisher.step(anchor=True)
    target.fail_next = True
    result = agent.sync()
    assert result.route == "anchor" and target.state().healthy
    assert gc.isenabled()
    assert_bit_equal(target.weights, w.publisher.truth[1])
