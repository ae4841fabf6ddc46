"""The engine boundary: on a vLLM server's port, only the holder of the engine credential changes the engine.

vLLM authenticates (``--api-key``) only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``; its weight-transfer,
pause, sleep, cache and ``/collective_rpc`` routes share the inference port, which in RL is not private (rollout
workers generate through it; in agentic RL the environment on that host runs code the model wrote).
:class:`EngineGuard`, an ASGI middleware that the ``deltasync`` endpoint plugin installs
(:mod:`deltasync.vllm.endpoints`), lets through only the **inference routes** listed below, exactly as vLLM
configures them (its own API key still applies), and answers every other request, existing route or not, with
401 (no credential) or 403 (a wrong one) unless it carries the engine credential in
``X-DeltaSync-Engine-Token``. It is an allow-list: a route that a later vLLM adds is refused until it is
classified here.

The credential comes from ``DELTASYNC_ENGINE_TOKEN`` or from the file named by ``DELTASYNC_ENGINE_TOKEN_FILE``
(the server's and the agent's environment), never from a command line. A server started without one refuses
every administrative request (fail closed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ENGINE_TOKEN_ENV",
    "ENGINE_TOKEN_FILE_ENV",
    "ENGINE_TOKEN_HEADER",
    "EngineGuard",
    "is_inference_route",
    "load_engine_token",
]

# vLLM configures the "vllm" logger tree in its processes; a "deltasync.*" logger would be silent there.
logger = logging.getLogger("vllm.deltasync.guard")

ENGINE_TOKEN_ENV = "DELTASYNC_ENGINE_TOKEN"
"""The engine credential itself."""
ENGINE_TOKEN_FILE_ENV = "DELTASYNC_ENGINE_TOKEN_FILE"
"""A file holding the engine credential (read once, surrounding white space stripped)."""
ENGINE_TOKEN_HEADER = "X-DeltaSync-Engine-Token"
"""The request header that carries it."""
MIN_TOKEN_CHARS = 16
LOG_BURST = 20
"""Refusals logged one by one per window; the rest are counted (a caller cannot flood the server's log)."""
LOG_WINDOW_S = 60.0

# The inference surface of vLLM 0.32's OpenAI server (vllm/entrypoints/launchers/api_server/routers.py and the
# routers it attaches), classified by reading each handler: these read the model or serve requests and change
# no engine setting, weight, label or worker. Everything else is administrative: the RL routes (/pause,
# /resume, /abort_requests, /*weight*, /update_weight_version, /get_world_size), the dev routes
# (/collective_rpc, /sleep, /wake_up, /is_sleeping, /release_kv_cache_memory, /reset_*_cache, /server_info),
# elastic EP (/scale_elastic_ep, /is_scaling_elastic_ep), runtime LoRA (/v1/load_lora_adapter,
# /v1/unload_lora_adapter), the profiler (/start_profile, /stop_profile), fault tolerance, and any route
# that a plugin or a later vLLM adds.
_INFERENCE: frozenset[tuple[str, str]] = frozenset(
    {
        # health and read-only information
        *(("GET", p) for p in ("/health", "/ping", "/version", "/load", "/metrics", "/v1/models")),
        *(("HEAD", p) for p in ("/health", "/ping", "/version", "/load", "/metrics")),
        ("POST", "/ping"),  # SageMaker's health check
        *(("GET", p) for p in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/kv_event_sources")),
        *(("HEAD", p) for p in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")),
        ("GET", "/deltasync/guard"),  # says the guard is there (deltasync.vllm.endpoints)
        # generation and its helpers
        *(
            ("POST", p)
            for p in (
                "/tokenize",
                "/detokenize",
                "/invocations",
                "/generative_scoring",
                "/v1/systemone",
                "/v1/chat/completions",
                "/v1/chat/completions/batch",
                "/v1/chat/completions/render",
                "/v1/chat/completions/derender",
                "/v1/completions",
                "/v1/completions/render",
                "/v1/completions/derender",
                "/v1/responses",
                "/v1/responses/render",
                "/v1/messages",
                "/v1/messages/count_tokens",
                "/v1/messages/render",
                "/v1/embeddings",
                "/v1/score",
                "/v1/rerank",
                "/v1/classify",
                "/v1/pooling",
                "/v1/audio/transcriptions",
                "/v1/audio/translations",
                "/inference/v1/generate",
                # a caller's own requests, by id, behind vLLM's API key as vLLM configures it
                "/inference/v1/abort_requests",
            )
        ),
    }
)
_INFERENCE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("GET", re.compile(r"/v1/responses/[^/]+")),
    ("POST", re.compile(r"/v1/responses/[^/]+/cancel")),
    ("GET", re.compile(r"/metrics/.*")),  # the Prometheus mount
)
_INFERENCE_WEBSOCKETS = frozenset({"/v1/realtime"})


def is_inference_route(method: str, path: str) -> bool:
    """Whether ``method path`` is on the inference surface (open to whoever vLLM itself lets in)."""
    if method == "WEBSOCKET":
        return path in _INFERENCE_WEBSOCKETS
    if (method, path) in _INFERENCE:
        return True
    return any(m == method and p.fullmatch(path) for m, p in _INFERENCE_PATTERNS)


def load_engine_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The engine credential from ``DELTASYNC_ENGINE_TOKEN`` or ``DELTASYNC_ENGINE_TOKEN_FILE`` (``None``: neither
    is set).

    Raises:
        ValueError: both are set, the file cannot be read, or the credential is shorter than 16 characters.
    """
    env = os.environ if environ is None else environ
    value, path = env.get(ENGINE_TOKEN_ENV), env.get(ENGINE_TOKEN_FILE_ENV)
    if value and path:
        raise ValueError(f"set {ENGINE_TOKEN_ENV} or {ENGINE_TOKEN_FILE_ENV}, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read(4096).strip()
        except OSError as exc:
            raise ValueError(f"{ENGINE_TOKEN_FILE_ENV}={path}: cannot read the engine credential ({exc})") from exc
    if not value:
        return None
    if len(value) < MIN_TOKEN_CHARS:
        where = ENGINE_TOKEN_FILE_ENV if path else ENGINE_TOKEN_ENV
        raise ValueError(
            f"{where}: the engine credential has {len(value)} characters, at least {MIN_TOKEN_CHARS} are needed; "
            'make one with: python -c "import secrets; print(secrets.token_urlsafe(32))"'
        )
    return value


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class EngineGuard:
    """ASGI middleware: inference routes pass; everything else needs the engine credential.

    Args:
        app: the wrapped ASGI application.
        token: the engine credential (default: :func:`load_engine_token`); with none, every administrative
            request is refused.

    Refusals are JSON ``{"error": ...}`` with status 401 (no credential) or 403 (a wrong credential, or none
    configured on the server), and one WARNING line naming the caller's address, method and (escaped) path, at
    most :data:`LOG_BURST` a minute.
    """

    def __init__(self, app: Any, token: str | None = None) -> None:
        self.app = app
        if token is None:
            token = load_engine_token()
        self._digest = None if token is None else _digest(token)
        self.refused = 0
        """Requests refused so far."""
        self._window_start, self._logged, self._suppressed = 0.0, 0, 0
        if self._digest is None:
            logger.warning(
                "deltasync guard: no engine credential (%s or %s): every administrative request is refused",
                ENGINE_TOKEN_ENV,
                ENGINE_TOKEN_FILE_ENV,
            )

    def _log_refusal(self, method: str, path: str, caller: str, status: int) -> None:
        """One WARNING per refusal, the path escaped (a caller cannot forge log lines with ``%0a`` or ``%00``), at
        most :data:`LOG_BURST` a window of :data:`LOG_WINDOW_S`; the rest are counted in the next line."""
        now = time.monotonic()
        if now - self._window_start > LOG_WINDOW_S:
            self._window_start, self._logged = now, 0
        if self._logged >= LOG_BURST:
            self._suppressed += 1
            return
        self._logged += 1
        shown = path[:200].encode("unicode_escape").decode("ascii").replace('"', '\\"')
        more, self._suppressed = self._suppressed, 0
        logger.warning(
            'deltasync guard: refused %s "%s" from %s (%d)%s',
            method,
            shown,
            caller,
            status,
            f"; {more} more refusals not logged" if more else "",
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        method = "WEBSOCKET" if kind == "websocket" else str(scope.get("method", ""))
        path = str(scope.get("path", ""))
        root = str(scope.get("root_path", ""))
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if is_inference_route(method, path) or (
            method == "OPTIONS" and any(is_inference_route(m, path) for m in ("GET", "POST"))
        ):  # OPTIONS (CORS preflight) only where vLLM serves inference: an admin route's existence is not told
            await self.app(scope, receive, send)
            return
        supplied = None
        for key, value in scope.get("headers", ()):
            if key.lower() == ENGINE_TOKEN_HEADER.lower().encode():
                supplied = value.decode("latin-1")
                break
        if (
            self._digest is not None
            and supplied is not None
            and secrets.compare_digest(_digest(supplied), self._digest)
        ):
            await self.app(scope, receive, send)
            return
        if self._digest is None:
            status, why = 403, "this server has no engine credential configured, so no caller may change it"
        elif supplied is None:
            status, why = 401, f"it needs the engine credential ({ENGINE_TOKEN_HEADER})"
        else:
            status, why = 403, f"the engine credential in {ENGINE_TOKEN_HEADER} is wrong"
        self.refused += 1
        client = scope.get("client") or ("?", 0)
        self._log_refusal(method, path, f"{client[0]}:{client[1]}", status)
        message = (
            f"deltasync: {method} {path} is not an inference route: {why}; only the engine's deltasync agent "
            "may change this engine"
        )
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            return
        body = json.dumps({"error": message}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
