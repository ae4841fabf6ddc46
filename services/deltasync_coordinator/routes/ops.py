"""Operations: health (from memory), Prometheus metrics, and the OpenAPI schema (behind a token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from deltasync.schemas import HealthPublic

from ..deps import READERS, SCRAPERS, errors

__all__ = ["router"]

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz(request: Request) -> HealthPublic:
    """Liveness and the ledger's state, answered from memory (a background probe watches the database):
    ``degraded`` with its reasons when the database is busy or failing, or the ledger is behind its agents or
    its store."""
    state = request.app.state
    reasons = [*state.health.reasons]
    return HealthPublic(
        status="degraded" if reasons else "ok",
        latest=state.registry.latest_version(),
        run_id=state.registry.run_id,
        schema_version=state.db.schema_version,
        reasons=reasons,
    )


@router.get(
    "/metrics",
    response_class=Response,
    dependencies=SCRAPERS,
    responses=errors() | {200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def metrics(request: Request) -> Response:
    """Prometheus text format: aggregates only (no per-agent series)."""
    body = await run_in_threadpool(generate_latest, request.app.state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/openapi.json", dependencies=READERS, responses=errors())
async def openapi(request: Request) -> dict[str, Any]:
    """The OpenAPI schema of this API."""
    schema: dict[str, Any] = request.app.openapi()
    return schema
