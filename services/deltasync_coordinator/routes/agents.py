"""Agents: heartbeats (each agent only its own) and the fleet view (paginated)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request
from starlette.concurrency import run_in_threadpool

from deltasync.schemas import AGENT_ID_PATTERN, AgentHeartbeat, AgentPublic, AgentsPublic

from ..deps import AGENTS, READERS, FleetDep, SettingsDep, errors
from ..fleet import Fleet
from ..registry import Invalid

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["agents"])


@router.post("/agents/{agent_id}/heartbeat", dependencies=AGENTS, responses=errors(body=True))
async def heartbeat(
    body: AgentHeartbeat, request: Request, agent_id: Annotated[str, Path(pattern=AGENT_ID_PATTERN)]
) -> AgentPublic:
    """Record an agent's applied version, state, last error and timings (its own token only). An
    ``applied_version`` above the latest is 422 (and degrades the coordinator: its ledger is behind)."""
    fleet: Fleet = request.app.state.fleet
    try:
        return await run_in_threadpool(fleet.heartbeat, agent_id, body, request.app.state.settings.agent_stale_after_s)
    except Invalid as exc:  # a validation error of the field, in FastAPI's own 422 shape
        detail = [{"loc": ["body", "applied_version"], "msg": str(exc), "type": "value_error"}]
        raise HTTPException(422, detail) from None


@router.get("/agents", dependencies=READERS, responses=errors())
async def agents(
    fleet: FleetDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[str | None, Query(max_length=128, description="the next_after of the previous page")] = None,
) -> AgentsPublic:
    """One page of the fleet: each agent's applied version, lag behind the latest, state, and staleness."""
    return await run_in_threadpool(fleet.agents, settings.agent_stale_after_s, limit=limit, after=after)
