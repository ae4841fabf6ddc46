"""The sidecar agent keeps a real vLLM server bit-exact: real coordinator, server and sidecar processes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from deltasync import LocalStore
from deltasync.client import CoordinatorClient
from deltasync.testing import CoordinatorProcess, VllmServerProcess
from tests.conftest import AGENT_TOKEN, PUBLISHER_TOKEN
from tests.integration.helpers import StreamPublisher, assert_served, sidecar_command

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
LAYERS = 2


class Stack:
    def __init__(
        self,
        tmp: Path,
        coordinator: CoordinatorProcess,
        server: VllmServerProcess,
        store: LocalStore,
        publisher: StreamPublisher,
        client: CoordinatorClient,
    ) -> None:
        self.tmp, self.coordinator, self.server, self.store = tmp, coordinator, server, store
        self.publisher, self.client = publisher, client
        self.sidecar: subprocess.Popen[bytes] | None = None

    def start_sidecar(self) -> None:
        cmd = sidecar_command(self.server.url, self.coordinator.url, self.store.root, self.tmp / "staging")
        log = open(self.tmp / "sidecar.log", "ab")  # noqa: SIM115 (the process owns it)
        env = {**os.environ, "DELTASYNC_AGENT_TOKEN": AGENT_TOKEN}
        self.sidecar = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def kill_sidecar(self) -> None:
        assert self.sidecar is not None
        self.sidecar.send_signal(signal.SIGKILL)
        self.sidecar.wait(10)

    def wait_applied(self, version: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.sidecar is None or self.sidecar.poll() is None, (self.tmp / "sidecar.log").read_text()[-3000:]
            fleet = {a.agent_id: a for a in self.client.agents()}
            if "sidecar-0" in fleet and fleet["sidecar-0"].applied_version == version:
                return
            time.sleep(0.2)
        raise AssertionError(
            f"the sidecar did not reach v{version}: {self.client.agents()}\n"
            + (self.tmp / "sidecar.log").read_text()[-3000:]
        )

    def assert_served(self, version: int) -> None:
        assert_served(self.server.url, version, self.publisher.truth[version])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("server")
    env = {"DELTASYNC_PUBLISHER_TOKEN": PUBLISHER_TOKEN, "DELTASYNC_AGENT_TOKEN": AGENT_TOKEN}
    store = LocalStore(tmp / "store")
    with (
        CoordinatorProcess(tmp / "ledger.db", store=str(store.root), env=env) as coordinator,
        VllmServerProcess(tiny_model_dir, log=tmp / "vllm.log") as server,
        CoordinatorClient(coordinator.url, token=PUBLISHER_TOKEN) as client,
    ):
        publisher = StreamPublisher(store, client, load_file(tiny_model_dir / "model.safetensors"), lr=1e-6)
        s = Stack(tmp, coordinator, server, store, publisher, client)
        try:
            yield s
        finally:
            if s.sidecar is not None and s.sidecar.poll() is None:
                s.sidecar.terminate()
                s.sidecar.wait(30)


def test_a_late_sidecar_catches_up_from_the_anchor_then_follows(stack: Stack) -> None:
    pub = stack.publisher
    for _ in range(4):
        pub.step(anchor=pub.version + 1 == 3)
    stack.start_sidecar()  # late: the server serves its startup weights ('default'), v0..v4 are published
    stack.wait_applied(4)
    stack.assert_served(4)
    for _ in range(4):
        pub.step()
        time.sleep(0.3)
    stack.wait_applied(8)
    stack.assert_served(8)
    completion = httpx.post(
        stack.server.url + "/v1/completions",
        timeout=60,
        json={"model": stack.server.model, "prompt": "Guess the five letter word:", "max_tokens": 8, "temperature": 0},
    )
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] is not None


def test_a_sidecar_killed_mid_stream_resumes_at_the_engines_real_version(stack: Stack) -> None:
    pub = stack.publisher
    for _ in range(3):
        pub.step()
    time.sleep(0.5)  # the sidecar is fetching or applying
    stack.kill_sidecar()
    served = httpx.get(stack.server.url + "/weight_info", timeout=30).json()["weight_version"]
    for _ in range(2):
        pub.step(anchor=pub.version + 1 == 12)
    stack.start_sidecar()
    stack.wait_applied(pub.version)
    stack.assert_served(pub.version)
    assert int(served) in range(8, pub.version + 1)
    paused = httpx.get(stack.server.url + "/is_paused", timeout=30).json()
    assert paused.get("is_paused") is False
