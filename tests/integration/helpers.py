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

import httpx
import torch
from deltasync.protocol import VersionCreate
from deltasync.testing import CoordinatorProcess, UpdateStream, VllmServerProcess, qwen3_effective_checksums
from safetensors.torch import load_file

from deltasync import LocalStore, compute_delta, write_anchor, write_delta
from deltasync.client import CoordinatorClient
from deltasync.manifest import DeltaManifest
from tests.conftest import AGENT_TOKEN, PUBLISHER_TOKEN

TOKENS_ENV = {"DELTASYNC_PUBLISHER_TOKEN": PUBLISHER_TOKEN, "DELTASYNC_AGENT_TOKEN": AGENT_TOKEN}


class StreamPublisher:
    """Publishes a realistic update stream to a store and registers it (the test stand-in for a trainer)."""

    def __init__(
        self,
        store: LocalStore,
        client: CoordinatorClient,
        weights: dict[str, torch.Tensor],
        *,
        lr: float = 1e-6,
        encoding: str = "packed",
        seed: int = 0,
    ) -> None:
        self.store, self.client, self.encoding = store, client, encoding
        self.stream = UpdateStream(weights, lr=lr, seed=seed)
        self.snapshot = {k: v.clone() for k, v in weights.items()}
        self.truth: dict[int, dict[str, torch.Tensor]] = {0: {k: v.clone() for k, v in weights.items()}}
        self.base: DeltaManifest = write_anchor(store, weights, version=0, encoding=encoding)
        self._register(self.base)
        self.version = 0

    def _register(self, manifest: DeltaManifest) -> None:
        self.client.register_version(VersionCreate.for_manifest(manifest))

    def step(self, *, anchor: bool = False) -> int:
        curr = self.stream.step()
        self.version += 1
        changes = compute_delta(self.snapshot, curr, update_prev=True)
        self.base = write_delta(
            self.store, changes, state=curr, version=self.version, base=self.base, encoding=self.encoding
        )  # type: ignore[arg-type]
        self._register(self.base)
        if anchor:
            self._register(write_anchor(self.store, curr, version=self.version, encoding=self.encoding))  # type: ignore[arg-type]
        self.truth[self.version] = curr
        return self.version


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


def assert_served(vllm_url: str, version: int, weights: dict[str, torch.Tensor], num_layers: int = 2) -> None:
    """vLLM serves ``version``, and its effective weights are ``weights``, bit for bit."""
    assert httpx.get(vllm_url + "/weight_info", timeout=30).json()["weight_version"] == str(version)
    got = httpx.post(vllm_url + "/collective_rpc", json={"method": "deltasync_effective"}, timeout=60).json()
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

    def spawn(self, *args: str) -> subprocess.Popen[bytes]:
        """``python *args`` with the tokens in its environment."""
        with open(self.log, "ab") as log:  # the child holds its own descriptor
            proc = subprocess.Popen(
                [sys.executable, *args], env={**os.environ, **TOKENS_ENV}, stdout=log, stderr=subprocess.STDOUT
            )
        self.procs.append(proc)
        return proc

    def start_sidecar(self) -> subprocess.Popen[bytes]:
        """``deltasync agent`` for this server (agent id ``sidecar-0``)."""
        cmd = sidecar_command(self.server.url, self.coordinator.url, self.store.root, self.tmp / "staging")
        self.sidecar = self.spawn(*cmd[1:])
        return self.sidecar

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
            info = httpx.get(self.server.url + "/weight_info", timeout=30).json()
            if info["weight_version"] == str(version):
                return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"vLLM did not reach v{version}: {self.log.read_text()[-3000:]}")

    def assert_served(self, version: int) -> None:
        assert_served(self.server.url, version, self.publisher.truth[version])

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
        VllmServerProcess(model_dir, log=tmp / "vllm.log") as server,
        CoordinatorClient(coordinator.url, token=PUBLISHER_TOKEN, retries=30, backoff_s=0.05) as client,
    ):
        publisher = StreamPublisher(store, client, load_file(model_dir / "model.safetensors"), lr=1e-6)
        stack = ServerStack(tmp, coordinator, server, store, publisher, client)
        try:
            yield stack
        finally:
            stack.stop_agents()
