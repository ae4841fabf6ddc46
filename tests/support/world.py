"""A trainer stand-in that publishes a realistic stream to a store and registers it under the run's lease, and
a small in-process world (coordinator thread, store, publisher, agents) for agent tests without vLLM."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from deltasync_coordinator.app import create_app

from deltasync import LocalStore, ObjectWriter, compute_delta, write_anchor, write_delta
from deltasync.agent import Agent
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.config import AgentConfig
from deltasync.manifest import DeltaManifest
from deltasync.runrecord import claim_run, record_epoch
from deltasync.schemas import VersionCreate
from deltasync.signing import SigningKey
from deltasync.targets import InMemoryTarget
from deltasync.testing.stream import UpdateStream
from tests.conftest import PUBLISHER_TOKEN, ServerThread, agent_token, coordinator_settings

__all__ = ["StreamPublisher", "World", "world"]


class StreamPublisher:
    """Publishes a realistic update stream to a store and registers it (the test stand-in for a trainer).

    Args:
        store: where objects go.
        client: the publisher's coordinator client (it takes the run's lease), or ``None``: store only.
        weights: the initial weights (published as the anchor of v0).
        signing_key: sign every manifest.
        model_id: name the model in every manifest.
    """

    def __init__(
        self,
        store: LocalStore,
        client: CoordinatorClient | None,
        weights: dict[str, torch.Tensor],
        *,
        lr: float = 1e-6,
        encoding: str = "packed",
        seed: int = 0,
        signing_key: SigningKey | None = None,
        model_id: str | None = None,
    ) -> None:
        self.store, self.client = store, client
        self.lease = client.acquire_lease("stream-publisher", ttl_s=3600) if client is not None else None
        if self.lease is not None:  # as a Publisher does: the store records its run and this lease epoch
            claim_run(store, self.lease.run_id, signing_key)
            through = self.lease.next_version - 1 if self.lease.next_version > 0 else None
            record_epoch(store, self.lease.run_id, self.lease.epoch, through, signing_key)
        self.writer = ObjectWriter(
            store=store,
            encoding=encoding,  # type: ignore[arg-type]
            signing_key=signing_key,
            model_id=model_id,
            run_id=self.lease.run_id if self.lease is not None else None,
            lease_epoch=self.lease.epoch if self.lease is not None else None,
        )
        self.stream = UpdateStream(weights, lr=lr, seed=seed)
        self.snapshot = {k: v.clone() for k, v in weights.items()}
        self.truth: dict[int, dict[str, torch.Tensor]] = {0: {k: v.clone() for k, v in weights.items()}}
        self.base: DeltaManifest = write_anchor(self.writer, weights, version=0)
        self.register(self.base)
        self.version = 0

    def register(self, manifest: DeltaManifest) -> None:
        if self.client is not None:
            self.client.register_version(VersionCreate.for_manifest(manifest), lease=self.lease)

    def step(self, *, anchor: bool = False, only: Callable[[str], bool] | None = None) -> int:
        """Publish the next version (``only``: the tensors it may change; the others keep their values)."""
        curr = self.stream.step()
        if only is not None:
            curr = {k: v if only(k) else self.snapshot[k].clone() for k, v in curr.items()}
        self.version += 1
        changes = compute_delta(self.snapshot, curr, update_prev=True)
        self.base = write_delta(self.writer, changes, state=curr, version=self.version, base=self.base)
        self.register(self.base)
        if anchor:
            self.register(write_anchor(self.writer, curr, version=self.version))
        self.truth[self.version] = curr
        return self.version


@dataclasses.dataclass
class World:
    """A coordinator in a thread, a store, a stream publisher, and agents on in-memory engines."""

    tmp: Path
    server: ServerThread
    store: LocalStore
    publisher: StreamPublisher
    clients: list[CoordinatorClient]

    def client(self, token: str, **kwargs) -> CoordinatorClient:
        c = CoordinatorClient(self.server.url, token=token, retry=RetryPolicy(backoff_s=0.01), **kwargs)
        self.clients.append(c)
        return c

    def agent(self, agent_id: str = "agent-0", *, target: InMemoryTarget | None = None, **config) -> Agent:
        values = dict(agent_id=agent_id, staging_dir=str(self.tmp / agent_id), retries=1, backoff_s=0.01, poll_wait_s=0)
        values.update(config)
        return Agent(
            store=self.store,
            coordinator=self.client(agent_token(agent_id)),
            target=target or InMemoryTarget(),
            config=AgentConfig(**values),
        )


@contextmanager
def world(tmp: Path, weights: dict[str, torch.Tensor], **publisher) -> Iterator[World]:
    """A :class:`World` publishing ``weights`` as v0; everything is closed on exit."""
    with ServerThread(create_app(coordinator_settings(tmp))) as server:
        clients: list[CoordinatorClient] = []
        pub_client = CoordinatorClient(server.url, token=PUBLISHER_TOKEN, retry=RetryPolicy(backoff_s=0.01))
        clients.append(pub_client)
        store = LocalStore(tmp / "store")
        w = World(tmp, server, store, StreamPublisher(store, pub_client, weights, **publisher), clients)
        try:
            yield w
        finally:
            for c in clients:
                c.close()
