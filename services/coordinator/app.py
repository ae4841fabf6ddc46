"""The coordinator's FastAPI app factory: ``uvicorn services.coordinator.app:create_app --factory``."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from deltasync._logging import setup_logging

from .registry import Registry
from .routes import agents, gc, ops, versions
from .settings import Settings

__all__ = ["create_app"]

logger = logging.getLogger("deltasync.coordinator")


class _SizeLimits:
    """Refuse request headers over ``max_header_bytes`` (431) and bodies over ``max_bytes`` (413): by
    Content-Length, and by reading the body (at most ``max_bytes + 1``) before the app sees it, so a chunked
    upload cannot get past."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_header_bytes: int) -> None:
        self.app, self.max_bytes, self.max_header_bytes = app, max_bytes, max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(len(k) + len(v) for k, v in scope["headers"]) > self.max_header_bytes:
            await _refuse(send, 431, f"request headers over {self.max_header_bytes} bytes")
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _refuse(send, 413, f"request body over {self.max_bytes} bytes")
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await _refuse(send, 413, f"request body over {self.max_bytes} bytes")
                return
        replayed = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for the disconnect
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


async def _refuse(send: Send, status: int, detail: str) -> None:
    await JSONResponse({"detail": detail}, status_code=status)({"type": "http"}, _no_receive, send)


async def _no_receive() -> MutableMapping[str, Any]:
    return {"type": "http.disconnect"}


class _Metrics:
    """Prometheus metrics; gauges are read from the ledger at scrape time."""

    def __init__(self, registry: Registry, settings: Settings) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "deltasync_request_seconds",
            "HTTP request latency",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
        )
        ledger, stale_after_s = registry, settings.agent_stale_after_s

        class _Ledger:
            def collect(self) -> Iterator[Metric]:
                n, latest = ledger.counts()
                yield GaugeMetricFamily("deltasync_latest_version", "newest registered version", value=latest or 0)
                yield CounterMetricFamily("deltasync_versions_registered", "objects in the ledger", value=n)
                states = GaugeMetricFamily("deltasync_agents", "agents by state", labels=["state"])
                for state, count in sorted(ledger.agent_states(stale_after_s).items()):
                    states.add_metric([state], count)
                yield states
                lag = GaugeMetricFamily("deltasync_agent_lag_versions", "latest minus applied", labels=["agent"])
                for a in ledger.agents(stale_after_s).agents:
                    if a.lag is not None:
                        lag.add_metric([a.agent_id], a.lag)
                yield lag

        self.registry.register(_Ledger())


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the coordinator app. Opens (and migrates) the SQLite ledger now.

    Args:
        settings: defaults to reading ``DELTASYNC_*`` environment variables.
    """
    settings = settings or Settings()
    setup_logging()
    registry = Registry(settings.db)
    app = FastAPI(
        title="deltasync coordinator",
        version="1",
        description="Version ledger for deltasync: small JSON only, never weights. See docs/PROTOCOL.md.",
    )
    app.state.settings = settings
    app.state.registry = registry
    app.state.notifier = versions.VersionNotifier()
    app.state.notifier.latest = registry.latest_version()
    app.state.metrics = _Metrics(registry, settings)
    for router in (versions.router, agents.router, gc.router, ops.router):
        app.include_router(router)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # several routes may share a path: list every method they allow
            methods = {
                m
                for r in app.router.routes
                if isinstance(r, APIRoute) and r.matches(request.scope)[0] != Match.NONE
                for m in r.methods
            }
            headers["Allow"] = ", ".join(sorted(methods))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)

    @app.middleware("http")
    async def _observe(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        app.state.metrics.latency.labels(request.method, path, str(response.status_code)).observe(
            time.perf_counter() - t0
        )
        return response

    app.add_middleware(_SizeLimits, max_bytes=settings.max_body_bytes, max_header_bytes=settings.max_header_bytes)
    for role, action in (("publisher", "publish and delete versions"), ("agent", "send heartbeats")):
        if getattr(settings, f"{role}_token") is None:
            logger.warning("no %s token is set: anyone who reaches this port can %s", role, action)
    logger.info(
        "coordinator ready: db=%s schema=%d latest=%s",
        settings.db,
        registry.schema_version,
        app.state.notifier.latest,
    )
    return app
