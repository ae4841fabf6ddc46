"""The coordinator's FastAPI app factory: ``uvicorn deltasync_coordinator.app:create_app --factory``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltasync._logging import setup_logging
from deltasync.errors import ObjectNotFound
from deltasync.reader import list_versions
from deltasync.schemas import RUN_HEADER
from deltasync.store import open_store

from .connections import KEPT_FOR_OTHERS, ConnectionLedger, fit_to_open_files, open_files_limit
from .db import open_database
from .fleet import LAG_BUCKETS, Fleet
from .http import SizeLimits
from .ledger import Busy, LedgerDatabase
from .registry import LEDGER_MIGRATIONS, Conflict, NotFound, Registry
from .retention import Retention
from .routes import agents, gc, lease, ops, versions
from .settings import Settings, check_credentials

__all__ = ["create_app", "follow_latest"]

logger = logging.getLogger("deltasync.coordinator")

_PROBE_EVERY_S = 1.0
_EXPIRE_EVERY_S = 60.0


async def _no_receive() -> MutableMapping[str, Any]:
    return {"type": "http.disconnect"}


class _Observe:
    """Pure ASGI (no per-request task, unlike ``@app.middleware``), outermost: names the run in every response's
    ``Deltasync-Run-Id`` header (refusals of the size limits included), records request latency by route, and
    turns an exception that escaped a route into a JSON answer on a connection that stays open: 503 for a
    failing ledger database (recorded for ``/healthz``), else 500 naming the error (the log has the traceback)."""

    def __init__(
        self, app: ASGIApp, run_id: str, latency: Histogram, health: _Health, db_errors: tuple[type[BaseException], ...]
    ) -> None:
        self.app, self.latency, self.health, self.db_errors = app, latency, health, db_errors
        self.header = (RUN_HEADER.lower().encode(), run_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        except Exception as exc:  # noqa: BLE001 - answered here; the traceback goes to the log
            if isinstance(exc, self.db_errors):
                code, detail = 503, f"the ledger database fails ({exc}); restore it from a backup (docs/RELIABILITY.md)"
                self.health.db_problem = detail
            else:
                code, detail = 500, f"internal error ({type(exc).__name__}: {exc}); the coordinator's log has more"
            logger.exception("%s %s failed", scope["method"], scope["path"])
            if status[0]:  # the answer had started: nothing more can be said on this connection
                raise
            await JSONResponse({"detail": detail}, status_code=code)(scope, _no_receive, send_with_header)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.latency.labels(scope["method"], route, str(status[0] or 500)).observe(time.perf_counter() - t0)


class _Health:
    """Why the coordinator is degraded, kept in memory so ``/healthz`` never waits for the database."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.db_problem: str | None = None

    @property
    def reasons(self) -> list[str]:
        return [*([self.db_problem] if self.db_problem else []), *self.fleet.alerts()]


def _metrics(
    registry: Registry, fleet: Fleet, settings: Settings, connections: ConnectionLedger
) -> tuple[CollectorRegistry, Histogram]:
    """Prometheus metrics; ledger gauges are read at scrape time, and the fleet only as aggregates."""
    out = CollectorRegistry()
    latency = Histogram(
        "deltasync_request_seconds",
        "HTTP request latency",
        ["method", "route", "status"],
        registry=out,
        buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
    )

    class _Ledger:
        def collect(self) -> Iterator[Metric]:
            n, latest = registry.counts()
            yield GaugeMetricFamily("deltasync_latest_version", "newest registered version", value=latest or 0)
            yield CounterMetricFamily("deltasync_versions_registered", "objects in the ledger", value=n)
            states, lags = fleet.stats(settings.agent_stale_after_s)
            by_state = GaugeMetricFamily("deltasync_agents", "agents by state", labels=["state"])
            for state, count in sorted(states.items()):
                by_state.add_metric([state], count)
            yield by_state
            lag = HistogramMetricFamily("deltasync_agent_lag_versions", "latest minus applied, over the fleet")
            buckets = [(str(b), c) for b, c in zip((*LAG_BUCKETS, "+Inf"), lags, strict=True)]
            lag.add_metric([], buckets, sum_value=None)
            yield lag
            yield CounterMetricFamily(
                "deltasync_engine_drifts",
                "engines found serving weights that differ from their version",
                value=fleet.drifts,
            )
            drifted = GaugeMetricFamily(
                "deltasync_engine_drift", "1 per engine whose drift is not re-proven yet", labels=["agent", "detail"]
            )
            for agent, detail in fleet.drifted():  # only drifted engines: a handful of series, never the fleet
                drifted.add_metric([agent, detail[:200]], 1)
            yield drifted
            yield GaugeMetricFamily("deltasync_connections_open", "open HTTP connections", value=connections.open)
            yield _counter(
                "deltasync_connections_refused",
                "connections refused with 503 past max_connections or max_connections_per_peer",
                "reason",
                connections.refused,
            )
            yield _counter(
                "deltasync_requests_refused",
                "requests refused with 503 on an admitted connection: past max_pipelined_requests waiting on it",
                "reason",
                connections.refused_requests,
            )
            yield _counter(
                "deltasync_requests_timed_out",
                "connections closed because a TLS handshake, a request head or a body did not arrive in time, or "
                "an answer was not read in time",
                "phase",
                connections.timed_out,
            )

    out.register(_Ledger())
    return out, latency


def _counter(name: str, documentation: str, label: str, counts: Mapping[str, int]) -> Metric:
    """A counter family with one series per ``label`` value."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, count in counts.items():
        family.add_metric([value], count)
    return family


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the coordinator app. Opens the ledger now: a SQLite file (takes its one-coordinator lock, checks
    its integrity, migrates it) or a PostgreSQL database (connects, refuses a foreign or newer schema, migrates
    it; other coordinators may share it, and their registrations wake this one's long-polls).

    Args:
        settings: defaults to reading ``DELTASYNC_*`` environment variables.

    Raises:
        InsecureConfiguration: no credentials and not ``insecure``.
        LedgerLocked: another coordinator holds the database.
        DamagedLedger: the database fails its integrity check, or holds a foreign or newer schema.
        Busy: the PostgreSQL server does not answer.
    """
    settings = settings or Settings()
    check_credentials(settings)
    setup_logging()
    db = open_database(settings.db, LEDGER_MIGRATIONS, timeout_s=settings.db_timeout_s)
    registry = Registry(db)
    fleet = Fleet(db, registry)
    health = _Health(fleet)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db.open()  # reopened if an earlier lifespan of this app closed it
        _follow_other_coordinators(app, db, registry)
        tasks = [asyncio.create_task(_probe(db, health)), asyncio.create_task(_expire(fleet, settings))]
        if settings.store is not None:
            tasks.append(asyncio.create_task(_check_store(settings.store, settings.s3_endpoint, registry, fleet)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            db.close()  # SQLite: checkpoint the WAL into the main file and release the lock
            if db.checkpointed:
                logger.info("coordinator stopped: ledger %s checkpointed and closed", db.describe)
            else:
                logger.error(
                    "coordinator stopped: ledger %s closed WITHOUT a complete checkpoint (see above)", db.describe
                )

    app = FastAPI(
        title="deltasync coordinator",
        version="1",
        description="Version ledger for deltasync: small JSON only, never weights. See docs/PROTOCOL.md.",
        openapi_url=None,  # served by ops.router behind a token
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.settings, app.state.db, app.state.registry, app.state.fleet = settings, db, registry, fleet
    app.state.retention = Retention(
        db, registry, fleet, stale_after_s=settings.agent_stale_after_s, plan_lease_s=settings.plan_lease_s
    )
    app.state.health = health
    app.state.notifier = versions.VersionNotifier(settings.max_long_polls)
    app.state.notifier.latest = registry.latest_version()
    app.state.connections = _connection_ledger(settings)
    metrics_registry, latency = _metrics(registry, fleet, settings, app.state.connections)
    app.state.metrics = type("Metrics", (), {"registry": metrics_registry})()
    for router in (versions.router, lease.router, agents.router, gc.router, ops.router):
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

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes each input back, which fails on NaN (a 500) and can be large: name the
        # field and the rule only
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(Busy)
    async def _busy(request: Request, exc: Busy) -> JSONResponse:
        health.db_problem = str(exc)
        return JSONResponse({"detail": f"{exc}; retry"}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(Conflict)
    @app.exception_handler(NotFound)
    async def _refused(request: Request, exc: Exception) -> JSONResponse:
        # the registry's refusals, answered alike from every route (the routes stay thin)
        return JSONResponse({"detail": str(exc)}, status_code=409 if isinstance(exc, Conflict) else 404)

    app.add_middleware(SizeLimits, max_bytes=settings.max_body_bytes, max_header_bytes=settings.max_header_bytes)
    app.add_middleware(  # the outermost
        _Observe, run_id=registry.run_id, latency=latency, health=health, db_errors=db.errors
    )
    if settings.insecure:
        logger.warning(
            "INSECURE: the coordinator runs without credentials (--insecure): anyone who reaches %s:%d can "
            "register versions, delete them through GC and forge any agent's heartbeat. Never do this on a "
            "shared network.",
            settings.host,
            settings.port,
        )
    logger.info(
        "coordinator ready: db=%s run=%s schema=%d latest=%s",
        db.describe,
        registry.run_id,
        db.schema_version,
        app.state.notifier.latest,
    )
    return app


def _connection_ledger(settings: Settings) -> ConnectionLedger:
    """The connection caps in force, below this process's open-files limit (logged when lowered, and a warning
    when the long-polls would leave too little of them)."""
    nofile = open_files_limit()
    overall, per_peer = fit_to_open_files(settings.max_connections, settings.max_connections_per_peer, nofile)
    if overall < settings.max_connections:
        logger.info(
            "max_connections %d lowered to %d: the open-files limit is %d (raise it with ulimit -n)",
            settings.max_connections,
            overall,
            nofile,
        )
    if settings.max_long_polls > overall - KEPT_FOR_OTHERS:
        logger.warning(
            "max_long_polls %d leaves %d of the %d connections the open-files limit %d allows to other requests: "
            "lower --max-long-polls or raise the open-files limit (ulimit -n)",
            settings.max_long_polls,
            max(0, overall - settings.max_long_polls),
            overall,
            nofile,
        )
    return ConnectionLedger(overall, per_peer)


def follow_latest(registry: Registry, latest: int | None, exact: bool) -> bool:
    """Another coordinator's news of the latest version, into this one's memory; whether it moved. A
    registration's news (``exact`` false: the latest is at least this) may arrive after this coordinator
    registered a newer one itself: it never moves the latest back. A deletion's (``exact``) may lower it."""
    if not exact and registry._latest is not None and (latest is None or latest < registry._latest):
        return False
    registry._latest = latest
    return True


def _follow_other_coordinators(app: FastAPI, db: LedgerDatabase, registry: Registry) -> None:
    """On a shared (PostgreSQL) ledger, another coordinator's registration wakes this one's long-polls: the
    database's notification moves the in-memory latest and the notifier, on the event loop."""
    if not db.shared:
        return
    loop = asyncio.get_running_loop()

    def on_latest(latest: int | None, exact: bool) -> None:
        if not follow_latest(registry, latest, exact):
            return
        try:
            loop.call_soon_threadsafe(app.state.notifier.notify, latest)
        except RuntimeError:  # the loop is closing: nobody is waiting any more
            pass

    db.listen(on_latest)


async def _probe(db: LedgerDatabase, health: _Health) -> None:
    """Watch the database from a thread, so ``/healthz`` answers from memory and says when it is busy."""
    while True:
        t0 = time.monotonic()
        try:
            problem = db.file_replaced() or await asyncio.wait_for(run_in_threadpool(db.probe), timeout=5)
        except TimeoutError:
            problem = "the ledger database did not answer a probe within 5 s"
        health.db_problem = problem
        await asyncio.sleep(max(0.0, _PROBE_EVERY_S - (time.monotonic() - t0)))


async def _expire(fleet: Fleet, settings: Settings) -> None:
    while True:
        try:
            n = await run_in_threadpool(fleet.expire, settings.agent_expire_after_s)
            if n:
                logger.info("forgot %d agents silent for %.0f s", n, settings.agent_expire_after_s)
        except Busy as exc:  # the next round retries; the probe reports the database
            logger.warning("agent expiry skipped: %s", exc)
        await asyncio.sleep(min(_EXPIRE_EVERY_S, max(0.5, settings.agent_expire_after_s / 4)))


async def _check_store(uri: str, s3_endpoint: str | None, registry: Registry, fleet: Fleet) -> None:
    """A ledger behind its store (copied without its WAL, restored from a backup) is degraded, not healthy."""
    try:
        committed = await run_in_threadpool(lambda: list_versions(open_store(uri, s3_endpoint=s3_endpoint)))
    except ObjectNotFound:  # a new run: nothing published yet
        return
    except Exception as exc:  # noqa: BLE001 - a store we cannot list is reported, the service runs on
        logger.warning("cannot list the store %s to compare it with the ledger: %s", uri, exc)
        return
    top = committed[-1].version if committed else None
    latest = registry.latest_version()
    if top is not None and (latest is None or top > latest):
        fleet.raise_alert(
            "behind:store",
            f"the store holds committed v{top}, above the ledger's latest "
            f"{'(nothing)' if latest is None else f'v{latest}'}: the ledger is behind its store (copied without its "
            "WAL, or restored from a backup?)",
            top,
        )
