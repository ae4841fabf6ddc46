"""Request dependencies: the ledger objects, settings, and who is calling (bearer tokens).

Every dependency is ``async``: they never block, and FastAPI would run a plain ``def`` in the thread pool (a
thread hop per dependency per request).

Roles: the **publisher** token writes (register, lease, GC) and reads; an **agent** token (``dsa1.<id>.<mac>``,
bound to one agent id by the coordinator's secret) reads and writes only its own heartbeat; the **read**
token reads; the **metrics** token (if set) scrapes ``/metrics``. Every route but ``/healthz`` needs one.
With ``insecure`` nothing is checked (the app logs that loudly at start).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from pydantic import SecretStr

from deltasync.schemas import ErrorPublic
from deltasync.tokens import agent_id_of

from .fleet import Fleet
from .registry import Registry
from .retention import Retention
from .settings import Settings

__all__ = [
    "AGENTS",
    "AUTH_ERRORS",
    "BODY_ERRORS",
    "Caller",
    "FleetDep",
    "PUBLISHERS",
    "READERS",
    "ReaderDep",
    "RegistryDep",
    "RetentionDep",
    "SCRAPERS",
    "SettingsDep",
    "errors",
    "require_agent",
    "require_metrics",
    "require_publisher",
    "require_reader",
]

AUTH_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorPublic, "description": "a token is required and none was sent"},
    403: {"model": ErrorPublic, "description": "the token is not allowed here"},
}
"""OpenAPI documentation of the auth failures, shared by the routers."""

BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorPublic, "description": "the body is not valid JSON"},
    413: {"model": ErrorPublic, "description": "the body is over the size cap"},
}
"""OpenAPI documentation of the failures of routes that take a body."""


def errors(described: Mapping[int, str] | None = None, *, body: bool = False) -> dict[int | str, dict[str, Any]]:
    """A route's documented failures (OpenAPI): each of ``described`` (status -> what it means), a body's
    (``body``), and the auth failures; every one answered as :class:`~deltasync.schemas.ErrorPublic`."""
    out: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorPublic, "description": what} for status, what in (described or {}).items()
    }
    return out | (BODY_ERRORS if body else {}) | AUTH_ERRORS


async def get_registry(request: Request) -> Registry:
    return request.app.state.registry  # type: ignore[no-any-return]


async def get_fleet(request: Request) -> Fleet:
    return request.app.state.fleet  # type: ignore[no-any-return]


async def get_retention(request: Request) -> Retention:
    return request.app.state.retention  # type: ignore[no-any-return]


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


RegistryDep = Annotated[Registry, Depends(get_registry)]
FleetDep = Annotated[Fleet, Depends(get_fleet)]
RetentionDep = Annotated[Retention, Depends(get_retention)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request."""

    role: str
    """``publisher``, ``agent``, ``reader``, ``metrics`` or ``anyone`` (insecure)."""
    agent_id: str | None = None
    """The agent's id, for an agent token."""


def _presented(request: Request, action: str) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise HTTPException(
            401, f"{action} needs a bearer token (Authorization: Bearer ...)", headers={"WWW-Authenticate": "Bearer"}
        )
    return presented


def _equal(presented: str, token: SecretStr | None) -> bool:
    return token is not None and hmac.compare_digest(presented.encode(), token.get_secret_value().encode())


def _identify(settings: Settings, presented: str) -> Caller | None:
    # compare against every credential, always, so timing says nothing about which one nearly matched
    is_publisher = _equal(presented, settings.publisher_token)
    is_reader = _equal(presented, settings.read_token)
    is_metrics = _equal(presented, settings.metrics_token)
    secret = settings.agent_secret.get_secret_value() if settings.agent_secret is not None else ""
    agent = agent_id_of(secret, presented) if secret else None
    if is_publisher:
        return Caller("publisher")
    if agent is not None:
        return Caller("agent", agent)
    if is_reader:
        return Caller("reader")
    if is_metrics:
        return Caller("metrics")
    return None


def _authorize(request: Request, action: str, allowed: set[str], refusal: str) -> Caller:
    """Who sent the request, if their role is ``allowed``; 401 without a token, 403 otherwise."""
    settings: Settings = request.app.state.settings
    if settings.insecure:
        return Caller("anyone")
    caller = _identify(settings, _presented(request, action))
    if caller is None or caller.role not in allowed:
        raise HTTPException(403, refusal)
    return caller


async def require_publisher(request: Request) -> Caller:
    return _authorize(
        request, "publishing", {"publisher"}, "the bearer token is not allowed to publish, lease or collect garbage"
    )


async def require_reader(request: Request) -> Caller:
    return _authorize(
        request, "reading", {"publisher", "agent", "reader"}, "the bearer token is not allowed to read the ledger"
    )


ReaderDep = Annotated[Caller, Depends(require_reader)]


async def require_agent(request: Request, agent_id: str) -> Caller:
    """An agent's own token, for its own ``agent_id`` only."""
    settings: Settings = request.app.state.settings
    if settings.insecure:
        return Caller("anyone", agent_id)
    caller = _identify(settings, _presented(request, "a heartbeat"))
    if caller is None or caller.role != "agent":
        raise HTTPException(403, "heartbeats need the agent's own token (deltasync token --agent-id ID)")
    if caller.agent_id != agent_id:
        raise HTTPException(403, f"this agent token belongs to {caller.agent_id!r}, not to {agent_id!r}")
    return caller


async def require_metrics(request: Request) -> Caller:
    """The scrape token, or any other valid token."""
    return _authorize(
        request,
        "scraping metrics",
        {"publisher", "agent", "reader", "metrics"},
        "the bearer token is not allowed to scrape metrics",
    )


READERS = [Depends(require_reader)]
"""``dependencies`` of a route any reader calls (the publisher, an agent, the read token)."""
PUBLISHERS = [Depends(require_publisher)]
"""``dependencies`` of a route only the publisher calls."""
AGENTS = [Depends(require_agent)]
"""``dependencies`` of a route only the agent it names calls (its own token)."""
SCRAPERS = [Depends(require_metrics)]
"""``dependencies`` of the metrics route (the metrics token, or any other valid token)."""
