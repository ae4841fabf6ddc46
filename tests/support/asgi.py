"""A coordinator app over httpx.ASGITransport (no network), with a publisher lease and helpers."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch
from deltasync_coordinator.app import create_app

from deltasync import LocalStore, compute_delta, write_anchor, write_delta
from deltasync.schemas import VersionCreate
from tests.conftest import AGENT_TOKEN, PUBLISHER_TOKEN, agent_token, coordinator_settings, version_body

PUB = {"Authorization": f"Bearer {PUBLISHER_TOKEN}"}
AGT = {"Authorization": f"Bearer {AGENT_TOKEN}"}  # agent-0's own token


def auth(agent_id: str) -> dict[str, str]:
    """The Authorization header of agent ``agent_id``."""
    return {"Authorization": f"Bearer {agent_token(agent_id)}"}


def make_settings(tmp_path: Path, **over):
    return coordinator_settings(tmp_path, max_wait_s=2.0, agent_stale_after_s=60.0, max_body_bytes=4096, **over)


class Coordinator:
    """An app over ASGITransport, its client, and a publisher lease for registrations."""

    def __init__(self, app, http: httpx.AsyncClient) -> None:
        self.app, self.http, self.lease = app, http, None

    async def take_lease(self) -> str:
        r = await self.http.post("/v1/lease", json={"holder": "test", "ttl_s": 60}, headers=PUB)
        assert r.status_code == 200, r.text
        self.lease = r.json()["lease_id"]
        return self.lease

    async def publish(self, *args, **kwargs) -> httpx.Response:
        """Register a made-up object (``version_body``)."""
        return await self.register(version_body(*args, **kwargs))

    async def register(self, body: dict) -> httpx.Response:
        if self.lease is None:
            await self.take_lease()
        return await self.http.post("/v1/versions", json=body, headers=PUB | {"Deltasync-Lease": self.lease})

    async def register_manifest(self, manifest) -> None:
        """Register a real committed object, with its manifest's digest."""
        r = await self.register(VersionCreate.for_manifest(manifest).model_dump(mode="json"))
        assert r.status_code in (200, 201), r.text


async def open_coordinator(settings) -> tuple:
    app = create_app(settings)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator")
    return app, http


async def weights_store(c: Coordinator, store: LocalStore, n: int, anchors: tuple[int, ...]) -> dict:
    """Publish v0 (anchor) .. vn to ``store`` and register them; returns the manifests by (version, kind)."""
    weights = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    base = write_anchor(store, weights, version=0)
    out = {(0, "anchor"): base}
    await c.register_manifest(base)
    prev = {k: v.clone() for k, v in weights.items()}
    for v in range(1, n + 1):
        curr = {"w": prev["w"].clone()}
        curr["w"][v] = v
        base = write_delta(store, compute_delta(prev, curr, update_prev=True), state=curr, version=v, base=base)
        out[(v, "delta")] = base
        await c.register_manifest(base)
        if v in anchors:
            out[(v, "anchor")] = write_anchor(store, curr, version=v)
            await c.register_manifest(out[(v, "anchor")])
    return out
