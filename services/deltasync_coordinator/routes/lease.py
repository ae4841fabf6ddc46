"""The publisher lease: one writer per run, fenced on every registration."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path
from starlette.concurrency import run_in_threadpool

from deltasync.schemas import LeaseCreate, LeasePublic

from ..deps import PUBLISHERS, RegistryDep, errors

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["lease"], dependencies=PUBLISHERS)  # every lease route is the publisher's


@router.post("/lease", responses=errors({409: "another publisher holds the run, or the lease is lost"}, body=True))
async def acquire_lease(body: LeaseCreate, registry: RegistryDep) -> LeasePublic:
    """Take the run's publisher lease, or renew it (``lease_id``). 409 names the holder."""
    return await run_in_threadpool(registry.acquire_lease, body.holder, body.ttl_s, body.lease_id)


@router.delete("/lease/{lease_id}", status_code=204, responses=errors({404: "not the live lease"}))
async def release_lease(registry: RegistryDep, lease_id: Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")]) -> None:
    """Give the lease up (a publisher closing cleanly), so the next one need not wait for it to expire."""
    if not await run_in_threadpool(registry.release_lease, lease_id):
        raise HTTPException(404, f"lease {lease_id[:8]}... is not the live lease")
