"""The publisher lease: one writer per run, fenced on every registration."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path
from starlette.concurrency import run_in_threadpool

from deltasync.schemas import ErrorPublic, LeaseCreate, LeasePublic

from ..deps import AUTH_ERRORS, BODY_ERRORS, RegistryDep, require_publisher
from ..registry import Conflict

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["lease"])


@router.post(
    "/lease",
    response_model=LeasePublic,
    dependencies=[Depends(require_publisher)],
    responses={
        409: {"model": ErrorPublic, "description": "another publisher holds the run, or the lease is lost"},
        **BODY_ERRORS,
        **AUTH_ERRORS,
    },
)
async def acquire_lease(body: LeaseCreate, registry: RegistryDep) -> LeasePublic:
    """Take the run's publisher lease, or renew it (``lease_id``). 409 names the holder."""
    try:
        return await run_in_threadpool(registry.acquire_lease, body.holder, body.ttl_s, body.lease_id)
    except Conflict as exc:
        raise HTTPException(409, str(exc)) from None


@router.delete(
    "/lease/{lease_id}",
    status_code=204,
    dependencies=[Depends(require_publisher)],
    responses={404: {"model": ErrorPublic, "description": "not the live lease"}, **AUTH_ERRORS},
)
async def release_lease(registry: RegistryDep, lease_id: Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")]) -> None:
    """Give the lease up (a publisher closing cleanly), so the next one need not wait for it to expire."""
    if not await run_in_threadpool(registry.release_lease, lease_id):
        raise HTTPException(404, f"lease {lease_id[:8]}... is not the live lease")
