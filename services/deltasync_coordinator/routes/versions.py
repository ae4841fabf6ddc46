"""Versions: register (fenced by the publisher lease), read, long-poll, and plans."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from deltasync.schemas import LEASE_HEADER, PlanPublic, VersionCreate, VersionPublic, VersionsPublic
from deltasync.vocab import MAX_VERSION, Kind

from ..deps import PUBLISHERS, READERS, ReaderDep, RegistryDep, errors
from ..registry import Registry
from ..settings import Settings

__all__ = ["VersionNotifier", "router"]

router = APIRouter(prefix="/v1", tags=["versions"])
_LEASE_PARAMETER = {
    "name": LEASE_HEADER,
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "the publisher lease id (fencing); a new registration needs the live one",
}


class VersionNotifier:
    """Wakes long-pollers when the ledger changes; lives on the event loop and holds no DB connection.

    Answers are shared between the pollers that ask the same question after the same change: a
    hundred agents woken by one publish cost one query, not a hundred. At most :attr:`MAX_SHARED` questions
    are kept per change (others are answered uncached), and an answer computed across a change is never kept
    for the next one.
    """

    MAX_SHARED = 64

    def __init__(self, max_waiters: int) -> None:
        self._event = asyncio.Event()
        self._answers: dict[tuple[int, int], asyncio.Future[list[VersionPublic]]] = {}
        self._bodies: dict[tuple[int, int], tuple[bytes, int]] = {}
        self.latest: int | None = None
        self.generation = 0
        self.max_waiters, self.waiters = max_waiters, 0

    def current(self) -> asyncio.Event:
        """The event the next change sets (take it before querying, so no wake-up is missed)."""
        return self._event

    def notify(self, latest: int | None) -> None:
        """The ledger changed: wake every waiter and forget shared answers."""
        self.latest = latest
        self.generation += 1
        self._answers.clear()
        self._bodies.clear()
        self._event.set()
        self._event = asyncio.Event()

    async def list_after(self, registry: Registry, after: int, limit: int) -> list[VersionPublic]:
        """``registry.list_after`` shared by concurrent callers until the next change."""
        key = (after, limit)
        answer = self._answers.get(key)
        if answer is None:
            answer = asyncio.ensure_future(run_in_threadpool(registry.list_after, after, limit))
            if len(self._answers) < self.MAX_SHARED:
                self._answers[key] = answer
                answer.add_done_callback(lambda f: f.exception() and self._answers.pop(key, None))  # no failures kept
        return await asyncio.shield(answer)  # a caller that goes away does not cancel the others

    async def page(self, registry: Registry, after: int, limit: int) -> tuple[bytes, int]:
        """The JSON of ``VersionsPublic`` above ``after`` and its number of versions, serialized once per change
        and shared (a hundred woken pollers send the same bytes)."""
        generation, latest = self.generation, self.latest
        key = (after, limit)
        cached = self._bodies.get(key)
        if cached is not None:
            return cached
        rows = await self.list_after(registry, after, limit)
        top = max([latest or -1, *(r.version for r in rows)])
        body = VersionsPublic(versions=rows, latest=None if top < 0 else top).model_dump_json().encode()
        if generation == self.generation and len(self._bodies) < self.MAX_SHARED:  # not across a change
            self._bodies[key] = (body, len(rows))
        return body, len(rows)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (its long-poll slot is then freed at once)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post(
    "/versions",
    response_model=VersionPublic,
    status_code=201,
    dependencies=PUBLISHERS,
    openapi_extra={
        "parameters": [
            {
                "name": LEASE_HEADER,
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": "the publisher lease id (fencing)",
            }
        ]
    },
    responses=errors({409: "conflicting, stale, base unknown, or without the lease"}, body=True)
    | {200: {"model": VersionPublic, "description": "identical re-registration"}},
)
async def register_version(body: VersionCreate, request: Request) -> Response:
    """Register a committed object (after its manifest is in the store). Idempotent; a new object needs the
    live publisher lease (``Deltasync-Lease`` header)."""
    registry: Registry = request.app.state.registry
    lease = request.headers.get(LEASE_HEADER)
    record, created = await run_in_threadpool(registry.register, body, lease)
    if created and body.kind != "squash":  # a squash is no new version: nothing for a long-poll
        request.app.state.notifier.notify(registry.latest_version())
    return Response(record.model_dump_json(), status_code=201 if created else 200, media_type="application/json")


@router.get(
    "/versions",
    response_model=VersionsPublic,
    dependencies=READERS,
    responses=errors({503: "too many long-polls; retry after Retry-After"}),
)
async def list_versions(
    request: Request,
    after: Annotated[int, Query(ge=-1, le=MAX_VERSION, description="only versions above this")] = -1,
    wait_s: Annotated[
        float, Query(ge=0, le=3600, allow_inf_nan=False, description="long-poll: wait up to this (capped)")
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
) -> Response:
    """Versions above ``after``. With ``wait_s``: answer as soon as one exists, else ``[]`` after the wait."""
    notifier: VersionNotifier = request.app.state.notifier
    registry: Registry = request.app.state.registry
    settings: Settings = request.app.state.settings
    if wait_s > 0 and notifier.waiters >= notifier.max_waiters:
        raise HTTPException(
            503,
            f"{notifier.waiters} long-polls are waiting, the cap is {notifier.max_waiters}; retry shortly",
            headers={"Retry-After": "2"},
        )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait_s, settings.max_wait_s)
    notifier.waiters += 1
    gone: asyncio.Future[None] | None = None
    try:
        while True:
            event = notifier.current()
            if notifier.latest is None or notifier.latest > after or wait_s == 0:
                body, n = await notifier.page(registry, after, limit)
                if n or wait_s == 0:
                    return Response(body, media_type="application/json")
            remaining = deadline - loop.time()
            if remaining <= 0:
                empty = VersionsPublic(versions=[], latest=notifier.latest).model_dump_json()
                return Response(empty, media_type="application/json")
            gone = gone or asyncio.ensure_future(_disconnected(request))
            woken = asyncio.ensure_future(event.wait())
            await asyncio.wait((woken, gone), timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if gone.done():
                return Response(status_code=499)  # nobody to answer; the slot is free again
    finally:
        notifier.waiters -= 1
        if gone is not None:
            gone.cancel()


@router.get("/versions/latest", dependencies=READERS, responses=errors({404: "nothing registered"}))
async def latest_version(registry: RegistryDep) -> VersionPublic:
    """The newest registered object (the delta when a version has both)."""
    latest = registry.latest_version()
    if latest is None:
        raise HTTPException(404, "no version is registered yet")
    return await run_in_threadpool(registry.get, latest)


@router.get("/versions/{version}", dependencies=READERS, responses=errors({404: "unknown version"}))
async def get_version(
    registry: RegistryDep,
    version: Annotated[int, Path(ge=0, le=MAX_VERSION)],
    kind: Kind | None = None,
) -> VersionPublic:
    """One registered object (the delta when the version has both and ``kind`` is not given)."""
    return await run_in_threadpool(registry.get, version, kind)


@router.get(
    "/plan",
    responses=errors({404: "no route to the target", 409: "from is above the latest version (the agent is ahead)"}),
)
async def plan(
    registry: RegistryDep,
    caller: ReaderDep,
    from_version: Annotated[int | None, Query(alias="from", ge=0, le=MAX_VERSION)] = None,
    to_version: Annotated[int | None, Query(alias="to", ge=0, le=MAX_VERSION)] = None,
) -> PlanPublic:
    """What an agent at ``from`` (omit it if it holds nothing) fetches to reach ``to`` (default: latest).
    Recorded: garbage collection keeps a recent plan's objects."""
    return await run_in_threadpool(registry.plan, from_version, to_version, caller.agent_id)
