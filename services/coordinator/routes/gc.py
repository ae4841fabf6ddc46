"""Retention: which objects can go, and deleting them through the store."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from deltasync.errors import ObjectNotFound
from deltasync.protocol import ErrorPublic, GcPublic, VersionPublic
from deltasync.store import Store, open_store

from ..deps import AUTH_ERRORS, RegistryDep, SettingsDep, require_publisher, require_reader
from ..registry import Registry

__all__ = ["router"]

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["gc"])


@router.get("/gc/candidates", response_model=GcPublic, dependencies=[Depends(require_reader)], responses=AUTH_ERRORS)
async def gc_candidates(registry: RegistryDep, settings: SettingsDep) -> GcPublic:
    """Objects no live agent and no plan can still need (the newest anchor is never one)."""
    return await run_in_threadpool(registry.gc_candidates, settings.agent_stale_after_s)


def _delete_object(store: Store, registry: Registry, obj: VersionPublic) -> None:
    prefix = obj.manifest_key.rsplit("/", 1)[0] + "/"
    keys = [k for k in store.list(prefix) if obj.kind == "anchor" or not k.startswith(prefix + "anchor/")]
    # the manifest first: the object stops being committed before any shard disappears
    ordered = sorted(keys, key=lambda k: k != obj.manifest_key)
    for key in ordered:
        try:
            store.delete(key)
        except ObjectNotFound:  # already gone (an earlier GC was interrupted): nothing to do
            logger.warning("gc: %s was already deleted", key)
    registry.mark_deleted(obj, ordered, reason="gc")
    logger.info("gc: deleted %s v%d (%d files)", obj.kind, obj.version, len(ordered))


def _collect(registry: Registry, store_uri: str, stale_after_s: float) -> GcPublic:
    plan = registry.gc_candidates(stale_after_s)
    store = open_store(store_uri)
    for obj in plan.candidates:
        _delete_object(store, registry, obj)
    return GcPublic(candidates=plan.candidates, deleted=plan.candidates, keep_from=plan.keep_from)


@router.post(
    "/gc",
    response_model=GcPublic,
    dependencies=[Depends(require_publisher)],
    responses={409: {"model": ErrorPublic, "description": "no store configured"}, **AUTH_ERRORS},
)
async def collect_garbage(request: Request, registry: RegistryDep, settings: SettingsDep) -> GcPublic:
    """Delete every candidate from the store (manifest first), recording each deletion."""
    if settings.store is None:
        raise HTTPException(409, "the coordinator has no store configured (DELTASYNC_STORE / --store); cannot delete")
    result = await run_in_threadpool(_collect, registry, settings.store, settings.agent_stale_after_s)
    if result.deleted:
        request.app.state.notifier.notify(registry.latest_version())  # shared answers may list deleted objects
    return result
