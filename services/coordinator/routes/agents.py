"""Agents: heartbeats and the fleet view."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path
from starlette.concurrency import run_in_threadpool

from deltasync.protocol import AgentHeartbeat, AgentPublic, AgentsPublic

from ..deps import AUTH_ERRORS, BODY_ERRORS, RegistryDep, SettingsDep, require_agent, require_reader

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["agents"])


@router.post(
    "/agents/{agent_id}/heartbeat",
    response_model=AgentPublic,
    dependencies=[Depends(require_agent)],
    responses={**AUTH_ERRORS, **BODY_ERRORS},
)
async def heartbeat(
    body: AgentHeartbeat,
    registry: RegistryDep,
    settings: SettingsDep,
    agent_id: Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")],
) -> AgentPublic:
    """Record an agent's applied version, state, last error and timings."""
    return await run_in_threadpool(registry.heartbeat, agent_id, body, settings.agent_stale_after_s)


@router.get("/agents", response_model=AgentsPublic, dependencies=[Depends(require_reader)], responses=AUTH_ERRORS)
async def agents(registry: RegistryDep, settings: SettingsDep) -> AgentsPublic:
    """The fleet: each agent's applied version, lag behind the latest, state, and staleness."""
    return await run_in_threadpool(registry.agents, settings.agent_stale_after_s)
