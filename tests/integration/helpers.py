"""Helpers for the integration tests: publishing a realistic stream."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import torch

from deltasync import LocalStore, compute_delta, write_anchor, write_delta
from deltasync.client import CoordinatorClient
from deltasync.manifest import DeltaManifest
from deltasync.protocol import VersionCreate
from deltasync.testing import UpdateStream, qwen3_effective_checksums


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
