"""Request dependencies: the registry, settings, and bearer-token checks."""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from pydantic import SecretStr

from deltasync.protocol import ErrorPublic

from .registry import Registry
from .settings import Settings

__all__ = [
    "AUTH_ERRORS",
    "BODY_ERRORS",
    "RegistryDep",
    "SettingsDep",
    "require_agent",
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


def get_registry(request: Request) -> Registry:
    return request.app.state.registry  # type: ignore[no-any-return]


def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


RegistryDep = Annotated[Registry, Depends(get_registry)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def _check(request: Request, allowed: list[SecretStr | None], action: str) -> None:
    tokens = [t.get_secret_value().encode() for t in allowed if t is not None]
    if not tokens:  # no token configured for this role: open (the app warned at start-up)
        return
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise HTTPException(
            401,
            f"{action} needs a bearer token (Authorization: Bearer ...)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    # compare against every token, always, so timing says nothing about which one nearly matched
    matches = [hmac.compare_digest(presented.encode(), t) for t in tokens]
    if not any(matches):
        raise HTTPException(403, f"the bearer token is not allowed to {action}")


def require_publisher(request: Request, settings: SettingsDep) -> None:
    _check(request, [settings.publisher_token], "publish or collect garbage")


def require_agent(request: Request, settings: SettingsDep) -> None:
    _check(request, [settings.agent_token], "send heartbeats")


def require_reader(request: Request, settings: SettingsDep) -> None:
    if settings.read_requires_token:
        _check(request, [settings.read_token, settings.agent_token, settings.publisher_token], "read")
