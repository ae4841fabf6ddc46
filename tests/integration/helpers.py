"""Helpers for the integration tests: publishing a realistic stream, and a vLLM server with its coordinator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from deltasync import LocalStore
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.testing.launchers import CoordinatorProcess, VllmServerProcess
from deltasync.testing.models import qwen3_effective_checksums
from deltasync.vllm.config import KERNEL_BLOCK_ENV
from tests.conftest import PUBLISHER_TOKEN, TOKENS_ENV, agent_env
from tests.support.world import StreamPublisher

__all__ = ["TOKENS_ENV", "ServerStack", "StreamPublisher", "assert_served", "server_stack", "sidecar_command"]


def sidecar_command(vllm_url: str, coordinator_url: str, store_root: Path, staging: Path) -> list[str]:
    """The ``deltasync agent`` sidecar command the integration tests start."""
    return [
        sys.executable,
        "-m",
        "deltasync.cli",
        "agent",
        "--vllm-url",
        vllm_url,
        "--coordinator",
        coordinator_url,
        "--store",
        str(store_root),
        "--agent-id",
        "sidecar-0",
        "--poll-wait-s",
        "1",
        "--staging-dir",
        str(staging),
        "--backoff-s",
        "0.1",
    ]


def assert_served(
    server: VllmServerProcess, version: int, weights: dict[str, torch.Tensor], num_layers: int = 2
) -> None:
    """vLLM serves ``version``, and its effective weights are ``weights``, bit for bit."""
    with server.admin() as admin:
        assert admin.get("/weight_info").json()["weight_version"] == str(version)
        got = admin.post("/collective_rpc", json={"method": "deltasync_effective"}).json()
    expected = qwen3_effective_checksums(weights, num_layers)
    assert {k: got["results"][0].get(k) for k in expected} == expected, f"v{version}: served weights differ"


class ServerStack:
    """A coordinator process, a vLLM server, a local store and a :class:`StreamPublisher` between them, and the
    agent processes a test starts against them (their output goes to ``agents.log``)."""

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
        self.log = tmp / "agents.log"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.sidecar: subprocess.Popen[bytes] | None = None

    def spawn(self, *args: str, agent_id: str = "sidecar-0") -> subprocess.Popen[bytes]:
        """``python *args`` with agent ``agent_id``'s token in its environment."""
        with open(self.log, "ab") as log:  # the child holds its own descriptor
            proc = subprocess.Popen(
                [sys.executable, *args],
                env={
                    **os.environ,
                    **agent_env(agent_id),
                    "DELTASYNC_ENGINE_TOKEN_FILE": str(self.server.engine_token_file),
                },
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def start_sidecar(self, *extra: str) -> subprocess.Popen[bytes]:
        """``deltasync agent`` for this server (agent id ``sidecar-0``), with ``extra`` flags."""
        cmd = sidecar_command(self.server.url, self.coordinator.url, self.store.root, self.tmp / "staging")
        self.sidecar = self.spawn(*cmd[1:], *extra)
        return self.sidecar

    @contextmanager
    def sidecar_frozen(self) -> Iterator[None]:
        """The sidecar stopped (SIGSTOP) for the block, then continued: a test that drives the engine itself is not
        raced by the agent's own recovery of a session it did not start (which re-claims the engine and clears the
        outcome the test reads). Nothing to do without a running sidecar."""
        sidecar = self.sidecar if self.sidecar is not None and self.sidecar.poll() is None else None
        if sidecar is not None:
            sidecar.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            if sidecar is not None:
                sidecar.send_signal(signal.SIGCONT)

    def kill_sidecar(self) -> None:
        """``kill -9`` the last sidecar started."""
        assert self.sidecar is not None
        self.sidecar.send_signal(signal.SIGKILL)
        self.sidecar.wait(10)

    def wait_applied(self, version: int, timeout_s: float = 120) -> None:
        """Until the sidecar's heartbeat reports ``version`` applied; it must stay alive meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.sidecar is None or self.sidecar.poll() is None, self.log.read_text()[-3000:]
            fleet = {a.agent_id: a for a in self.client.agents()}
            if "sidecar-0" in fleet and fleet["sidecar-0"].applied_version == version:
                return
            time.sleep(0.2)
        raise AssertionError(
            f"the sidecar did not reach v{version}: {self.client.agents()}\n" + self.log.read_text()[-3000:]
        )

    def wait_served(self, version: int, timeout_s: float = 180) -> float:
        """Until the server's ``weight_version`` is ``version``; returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            with self.server.admin() as admin:
                info = admin.get("/weight_info").json()
            if info["weight_version"] == str(version):
                return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"vLLM did not reach v{version}: {self.log.read_text()[-3000:]}")

    def assert_served(self, version: int) -> None:
        assert_served(self.server, version, self.publisher.truth[version])

    def stop_agents(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        self.procs.clear()


@contextmanager
def server_stack(tmp: Path, model_dir: Path) -> Iterator[ServerStack]:
    """A :class:`ServerStack` on ``model_dir`` (lr 1e-6 stream); every process is stopped on exit."""
    store = LocalStore(tmp / "store")
    with (
        CoordinatorProcess(tmp / "ledger.db", store=str(store.root), env=TOKENS_ENV) as coordinator,
        # repacked kernels referenced and read back in blocks of their input columns (2^20 multiply-adds: 4-8 per
        # module of the tiny model), so every audit of these servers goes through the blocks
        VllmServerProcess(model_dir, log=tmp / "vllm.log", env={KERNEL_BLOCK_ENV: str(1 << 20)}) as server,
        CoordinatorClient(
            coordinator.url, token=PUBLISHER_TOKEN, retry=RetryPolicy(retries=30, backoff_s=0.05)
        ) as client,
    ):
        publisher = StreamPublisher(store, client, load_file(model_dir / "model.safetensors"), lr=1e-6)
        stack = ServerStack(tmp, coordinator, server, store, publisher, client)
        try:
            yield stack
        finally:
            stack.stop_agents()
