"""Retention: which objects can go, and deleting them through the store (after proving the kept anchor)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from starlette.concurrency import run_in_threadpool

from deltasync.schemas import GcPublic
from deltasync.store import open_store

from ..deps import PUBLISHERS, READERS, RetentionDep, SettingsDep, errors

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["gc"])


@router.get("/gc/candidates", dependencies=READERS, responses=errors())
async def gc_candidates(retention: RetentionDep) -> GcPublic:
    """Objects no live agent and no recent plan can still need, from the ledger alone (the newest anchor is
    assumed intact; ``POST /v1/gc?dry_run=true`` proves it first)."""
    return await run_in_threadpool(retention.candidates)


@router.post("/gc", dependencies=PUBLISHERS, responses=errors({409: "no store configured"}))
async def collect_garbage(
    request: Request,
    retention: RetentionDep,
    settings: SettingsDep,
    dry_run: Annotated[bool, Query(description="prove the kept anchor and list what would go; delete nothing")] = False,
) -> GcPublic:
    """Prove the kept anchor intact, then delete every candidate (manifest first), recording each deletion."""
    if settings.store is None:
        raise HTTPException(409, "the coordinator has no store configured (DELTASYNC_STORE / --store); cannot delete")
    store = open_store(settings.store, s3_endpoint=settings.s3_endpoint)
    result = await run_in_threadpool(retention.collect, store, dry_run=dry_run)
    if result.deleted:  # shared long-poll answers may list deleted objects
        request.app.state.notifier.notify(request.app.state.registry.latest_version())
    return result
