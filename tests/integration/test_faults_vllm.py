"""Faults and load with a real vLLM server (CPU): the sidecar killed mid-fetch and mid-apply, and 100 lightweight
agents beside the real one while 60 versions are published (docs/RELIABILITY.md)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltasync.agent import Agent
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.config import AgentConfig
from deltasync.targets import InMemoryTarget
from tests.conftest import agent_token, assert_bit_equal
from tests.integration.helpers import ServerStack, server_stack

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerStack]:
    with server_stack(tmp_path_factory.mktemp("faults-vllm"), tiny_model_dir) as stack:
        yield stack


@pytest.mark.parametrize("point", ["fetch", "apply"])
def test_sidecar_killed_mid_fetch_or_mid_apply_converges(world: ServerStack, point: str) -> None:
    pub = world.publisher
    for _ in range(2):
        pub.step()
    marker = world.tmp / f"paused-{point}"
    proc = world.spawn(
        "-m",
        "tests.integration.fault_scripts",
        "agent",
        world.server.url,
        world.coordinator.url,
        str(world.store.root),
        str(world.tmp / f"staging-{point}"),
        "--pause",
        point,
        "--marker",
        str(marker),
    )
    deadline = time.monotonic() + 120
    try:
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, world.log.read_text()[-3000:]
            time.sleep(0.05)
    finally:  # never left running into the next test (its agent id would be taken)
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if point == "apply":  # the server was left paused, inside an update session
        assert world.server.admin_json("GET", "/is_paused")["is_paused"] is True
    for _ in range(2):
        pub.step()
    t0 = time.monotonic()
    world.start_sidecar()
    try:  # the sidecar stops whatever happens: left running it holds the engine's claim against the next test
        # applied, not only labelled: the label is set inside the pause and the engine resumes just after, so the
        # agent's report of the version (sent after the resume) is what says the engine serves it again
        world.wait_applied(pub.version, timeout_s=180)
        recovery_s = time.monotonic() - t0
        world.assert_served(pub.version)
        assert world.server.admin_json("GET", "/is_paused")["is_paused"] is False
        # recover() asks the workers before it calls /finish_weight_update: with no session open, finish raises
        # in every worker (and with TP > 1 desyncs vLLM's executor, vLLM #49972)
        assert "without a matching start_weight_update" not in (world.tmp / "vllm.log").read_text()
    finally:
        world.stop_agents()
    print(
        f"\nRELIABILITY sidecar kill -9 mid-{point}: restarted sidecar served v{pub.version} bit-exact after "
        f"{recovery_s:.1f} s (incl. interpreter start)"
    )


# 24 versions across three anchors keep this near half a minute in the full suite on 2 cores (the coordinator
# serves ~500 requests per version here); 60 (anchors every 20) took 75-150 s there, 120 took 552 s, and 300
# (anchors every 100) passed by hand in 11.5 minutes.
LOAD_VERSIONS, LOAD_ANCHOR_EVERY = 24, 8


def test_load_100_light_agents_and_the_real_one(world: ServerStack) -> None:
    pub = world.publisher
    world.start_sidecar()
    stop = threading.Event()
    clients = [
        CoordinatorClient(
            world.coordinator.url,
            token=agent_token(f"light-{i:03d}"),
            retry=RetryPolicy(retries=40, backoff_s=0.05, timeout_s=30),
        )
        for i in range(100)
    ]
    agents = [
        Agent(
            store=world.store,
            coordinator=c,
            target=InMemoryTarget(),
            config=AgentConfig(
                agent_id=f"light-{i:03d}",
                staging_dir=str(world.tmp / "light" / str(i)),
                poll_wait_s=5,
                retries=2,
                backoff_s=0.05,
            ),
        )
        for i, c in enumerate(clients)
    ]
    threads = [threading.Thread(target=a.run, args=(stop,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    try:  # the agents stop whatever happens: threads left running would disturb every later test
        first, t0 = pub.version + 1, time.monotonic()
        for step in range(LOAD_VERSIONS):
            pub.step(anchor=(step + 1) % LOAD_ANCHOR_EVERY == 0)
        publish_s = time.monotonic() - t0
        last = pub.version
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and any(a.target.version != last for a in agents):
            time.sleep(0.2)
        converge_s = time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    world.wait_served(last)
    world.assert_served(last)
    lagging = [a.config.agent_id for a in agents if a.target.version != last]
    assert not lagging, lagging
    for a in agents[::10]:
        assert_bit_equal(a.target.weights, pub.truth[last])
    fleet = {a.agent_id: a for a in world.client.agents()}
    assert len(fleet) >= 101 and all(fleet[a.config.agent_id].applied_version == last for a in agents)
    registered = [v.version for v in world.client.wait_for_versions(first - 1, wait_s=0) if v.kind == "delta"]
    assert registered == list(range(first, last + 1))  # 0 lost versions
    for c in clients:
        c.close()
    world.stop_agents()
    print(
        f"\nRELIABILITY load: 100 light agents + 1 vLLM agent, {LOAD_VERSIONS} versions published in {publish_s:.0f} s; "
        f"every light agent at v{last} after {converge_s:.0f} s (bit-exact sample of 10), vLLM bit-exact; "
        f"0 versions lost"
    )
