"""Operations: health and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from deltasync.protocol import HealthPublic

from ..deps import RegistryDep

__all__ = ["router"]

router = APIRouter(tags=["ops"])


@router.get("/healthz", response_model=HealthPublic)
async def healthz(registry: RegistryDep) -> HealthPublic:
    """Liveness and the ledger's latest version (it reads the database)."""
    await run_in_threadpool(registry.counts)  # touch the database: a broken file fails the check
    return HealthPublic(status="ok", latest=registry.latest_version(), schema_version=registry.schema_version)


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    body = await run_in_threadpool(generate_latest, request.app.state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
