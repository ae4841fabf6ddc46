"""Versions: register (fenced by the publisher lease), read, long-poll, and plans."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Header, HTTPException, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from deltasync.schemas import LEASE_HEADER, ErrorPublic, PlanPublic, VersionCreate, VersionPublic, VersionsPublic
from deltasync.vocab import MAX_VERSION, Kind

from ..deps import AUTH_ERRORS, BODY_ERRORS, ReaderDep, RegistryDep, SettingsDep, require_publisher, require_reader
from ..registry import Conflict, NotFound, Registry

__all__ = ["VersionNotifier", "router"]

router = APIRouter(prefix="/v1", tags=["versions"])


class VersionNotifier:
    """Wakes long-pollers when the ledger changes; lives on the event loop and holds no DB connection.

    Answers are shared between the pollers that ask the same question after the same change: a
    hundred agents woken by one publish cost one query, not a hundred.
    """

    def __init__(self, max_waiters: int) -> None:
        self._event = asyncio.Event()
        self._answers: dict[tuple[int, int], asyncio.Future[list[VersionPublic]]] = {}
        self.latest: int | None = None
        self.max_waiters, self.waiters = max_waiters, 0

    def current(self) -> asyncio.Event:
        """The event the next change sets (take it before querying, so no wake-up is missed)."""
        return self._event

    def notify(self, latest: int | None) -> None:
        """The ledger changed: wake every waiter and forget shared answers."""
        self.latest = latest
        self._answers.clear()
        self._event.set()
        self._event = asyncio.Event()

    async def list_after(self, registry: Registry, after: int, limit: int) -> list[VersionPublic]:
        """``registry.list_after`` shared by concurrent callers until the next change."""
        key = (after, limit)
        answer = self._answers.get(key)
        if answer is None:
            answer = self._answers[key] = asyncio.ensure_future(run_in_threadpool(registry.list_after, after, limit))
            answer.add_done_callback(lambda f: f.exception() and self._answers.pop(key, None))  # never cache a failure
        return await asyncio.shield(answer)  # a caller that goes away does not cancel the others


@router.post(
    "/versions",
    response_model=VersionPublic,
    status_code=201,
    dependencies=[Depends(require_publisher)],
    responses={
        200: {"model": VersionPublic, "description": "identical re-registration"},
        409: {"model": ErrorPublic, "description": "conflicting, stale, base unknown, or without the lease"},
        **BODY_ERRORS,
        **AUTH_ERRORS,
    },
)
async def register_version(
    body: VersionCreate,
    request: Request,
    response: Response,
    registry: RegistryDep,
    lease: Annotated[str | None, Header(alias=LEASE_HEADER, max_length=64)] = None,
) -> VersionPublic:
    """Register a committed object (after its manifest is in the store). Idempotent; a new object needs the
    live publisher lease (``Deltasync-Lease`` header)."""
    try:
        record, created = await run_in_threadpool(registry.register, body, lease)
    except Conflict as exc:
        raise HTTPException(409, str(exc)) from None
    if created:
        request.app.state.notifier.notify(registry.latest_version())
    else:
        response.status_code = 200
    return record


@router.get(
    "/versions",
    response_model=VersionsPublic,
    dependencies=[Depends(require_reader)],
    responses={
        503: {"model": ErrorPublic, "description": "too many long-polls; retry after Retry-After"},
        **AUTH_ERRORS,
    },
)
async def list_versions(
    request: Request,
    registry: RegistryDep,
    settings: SettingsDep,
    after: Annotated[int, Query(ge=-1, le=MAX_VERSION, description="only versions above this")] = -1,
    wait_s: Annotated[
        float, Query(ge=0, le=3600, allow_inf_nan=False, description="long-poll: wait up to this (capped)")
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
) -> VersionsPublic:
    """Versions above ``after``. With ``wait_s``: answer as soon as one exists, else ``[]`` after the wait."""
    notifier: VersionNotifier = request.app.state.notifier
    if wait_s > 0 and notifier.waiters >= notifier.max_waiters:
        raise HTTPException(
            503,
            f"{notifier.waiters} long-polls are waiting, the cap is {notifier.max_waiters}; retry shortly",
            headers={"Retry-After": "2"},
        )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait_s, settings.max_wait_s)
    notifier.waiters += 1
    try:
        while True:
            event = notifier.current()
            if notifier.latest is None or notifier.latest > after or wait_s == 0:
                rows = await notifier.list_after(registry, after, limit)
                if rows or wait_s == 0:
                    return VersionsPublic(versions=rows, latest=notifier.latest)
            remaining = deadline - loop.time()
            if remaining <= 0:
                return VersionsPublic(versions=[], latest=notifier.latest)
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                pass
    finally:
        notifier.waiters -= 1


@router.get(
    "/versions/latest",
    response_model=VersionPublic,
    dependencies=[Depends(require_reader)],
    responses={404: {"model": ErrorPublic, "description": "nothing registered"}, **AUTH_ERRORS},
)
async def latest_version(registry: RegistryDep) -> VersionPublic:
    """The newest registered object (the delta when a version has both)."""
    latest = registry.latest_version()
    if latest is None:
        raise HTTPException(404, "no version is registered yet")
    return await run_in_threadpool(registry.get, latest)


@router.get(
    "/versions/{version}",
    response_model=VersionPublic,
    dependencies=[Depends(require_reader)],
    responses={404: {"model": ErrorPublic, "description": "unknown version"}, **AUTH_ERRORS},
)
async def get_version(
    registry: RegistryDep,
    version: Annotated[int, Path(ge=0, le=MAX_VERSION)],
    kind: Kind | None = None,
) -> VersionPublic:
    """One registered object (the delta when the version has both and ``kind`` is not given)."""
    try:
        return await run_in_threadpool(registry.get, version, kind)
    except NotFound as exc:
        raise HTTPException(404, str(exc)) from None


@router.get(
    "/plan",
    response_model=PlanPublic,
    responses={
        404: {"model": ErrorPublic, "description": "no route to the target"},
        409: {"model": ErrorPublic, "description": "from is above the latest version (the agent is ahead)"},
        **AUTH_ERRORS,
    },
)
async def plan(
    registry: RegistryDep,
    caller: ReaderDep,
    from_version: Annotated[int | None, Query(alias="from", ge=0, le=MAX_VERSION)] = None,
    to_version: Annotated[int | None, Query(alias="to", ge=0, le=MAX_VERSION)] = None,
) -> PlanPublic:
    """What an agent at ``from`` (omit it if it holds nothing) fetches to reach ``to`` (default: latest).
    Recorded: garbage collection keeps a recent plan's objects."""
    try:
        return await run_in_threadpool(registry.plan, from_version, to_version, caller.agent_id)
    except NotFound as exc:
        raise HTTPException(404, str(exc)) from None
    except Conflict as exc:
        raise HTTPException(409, str(exc)) from None
