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

**The credential never leaves the agent.** Whoever holds vLLM's port while vLLM is down (a restart, a crash: any
process on the host may bind it) would receive a credential sent in a header. deltasync's own clients
(:class:`deltasync.targets.EngineAuth`) therefore prove, and ask the server to prove, knowledge of it instead:

1. ``GET /deltasync/guard?challenge=C`` (C: the client's random hex) answers a server nonce N and
   ``HMAC(credential, "deltasync-engine-proof-v1" C N)``: a server that cannot compute it is not the engine, and
   the client stops there, having revealed nothing;
2. every administrative request carries ``X-DeltaSync-Engine-Auth: v1 N K T M`` with a counter K (above the last
   one accepted under N), the client's time T and ``M = HMAC(credential, ... N K T method path?query
   sha256(body))``: the request, not the credential, is authenticated; a captured one cannot be altered,
   replayed, reordered, or delayed by more than :data:`REQUEST_WINDOW_S`;
3. every answer to an authenticated request carries ``X-DeltaSync-Engine-Proof: HMAC(credential, ... N K status
   sha256(body))``: the client believes no answer the engine did not sign.

Nonces are stateless (an HMAC under a secret of this server process, with their time): a restarted server
refuses its predecessor's nonces (401, signed, ``"code": "nonce"``) and the client asks for a new one. The bare
``X-DeltaSync-Engine-Token`` header is still accepted, for an operator's one-off ``curl`` on the engine's own host.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from typing import Any
from urllib.parse import parse_qs

from ..engine_credential import (
    ENGINE_AUTH_HEADER,
    ENGINE_PROOF_HEADER,
    ENGINE_TOKEN_ENV,
    ENGINE_TOKEN_FILE_ENV,
    ENGINE_TOKEN_HEADER,
    GUARD_ROUTE,
    challenge_proof,
    load_engine_token,
    request_mac,
    response_proof,
)

__all__ = ["EngineGuard", "is_inference_route"]

# vLLM configures the "vllm" logger tree in its processes; a "deltasync.*" logger would be silent there.
logger = logging.getLogger("vllm.deltasync.guard")

NONCE_TTL_S = 3600.0
"""How long a server nonce signs requests (a client asks for a new one when refused)."""
MAX_SIGNED_BODY = 1 << 20
"""A signed request's body is read whole to be verified (the agent's are a few KiB): larger ones are refused (413)
before they are read, and only under a nonce this server issued."""
REQUEST_WINDOW_S = 30.0
"""A signed request is accepted within this many seconds of the time it was signed at (the agent and vLLM share a
host, and its clock), and only after every request signed before it under the same nonce."""
_CHALLENGE = re.compile(r"[0-9a-f]{32,128}")
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


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class _Nonces:
    """Server nonces: stateless to issue (anyone may ask), checked by their own HMAC under a secret of this
    process and their age. Requests signed under a nonce must come in the order they were signed (a counter
    above the last one accepted) and within :data:`REQUEST_WINDOW_S` of their own time: whoever relays them (a
    process on vLLM's port) can delay one by that much at most, never reorder two, never replay one. The last
    counter is kept per nonce while a request signed under it could still be fresh; only valid signatures (the
    credential's holders) add to that state."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)
        self._last: dict[str, tuple[int, float]] = {}  # nonce -> (last counter accepted, when)

    def issue(self) -> str:
        body = f"{int(time.time()):x}.{secrets.token_hex(16)}"
        return f"{body}.{hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()[:32]}"

    def valid(self, nonce: str) -> bool:
        parts = nonce.split(".")
        if len(parts) != 3:
            return False
        body = f"{parts[0]}.{parts[1]}"
        want = hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()[:32]
        try:
            age = time.time() - int(parts[0], 16)
        except ValueError:
            return False
        return secrets.compare_digest(want, parts[2]) and -60 <= age <= NONCE_TTL_S

    def accept(self, nonce: str, counter: int, signed_ms: int) -> bool:
        """Record a validly signed request; False if it is out of order, replayed, or not fresh."""
        now = time.time()
        if abs(now - signed_ms / 1000) > REQUEST_WINDOW_S:
            return False
        for key in [k for k, (_, at) in self._last.items() if now - at > 2 * REQUEST_WINDOW_S]:
            del self._last[key]  # any request still signed under it is stale by its own time
        last, _ = self._last.get(nonce, (0, now))
        if counter <= last:
            return False
        self._last[nonce] = (counter, now)
        return True


class EngineGuard:
    """ASGI middleware: inference routes pass; everything else needs the engine credential.

    Args:
        app: the wrapped ASGI application.
        token: the engine credential (default: :func:`load_engine_token`); with none, every administrative
            request is refused.

    Refusals are JSON ``{"error": ...}`` with status 401 (no credential) or 403 (a wrong credential, or none
    configured on the server), and one WARNING line naming the caller's address, method and (escaped) path, at
    most :data:`LOG_BURST` a minute. The address is the socket's peer: the endpoint plugin sets
    ``FORWARDED_ALLOW_IPS=""`` (unless the operator set it) before vLLM configures uvicorn, whose default
    believes ``X-Forwarded-For`` from 127.0.0.1 (:mod:`deltasync.vllm.endpoints`).
    """

    def __init__(self, app: Any, token: str | None = None) -> None:
        self.app = app
        if token is None:
            token = load_engine_token()
        self._digest = None if token is None else _digest(token)
        self._token = token
        self._nonces = _Nonces()
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
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        if method == "GET" and path == GUARD_ROUTE and b"challenge=" in scope.get("query_string", b""):
            await self._answer_challenge(scope, send)
            return
        signed = headers.get(ENGINE_AUTH_HEADER.lower().encode())
        if signed is not None and kind == "http" and self._token is not None:  # any route: its answer is signed
            await self._signed(scope, receive, send, method, path, signed.decode("latin-1"), headers)
            return
        if is_inference_route(method, path) or (
            method == "OPTIONS" and any(is_inference_route(m, path) for m in ("GET", "POST"))
        ):  # OPTIONS (CORS preflight) only where vLLM serves inference: an admin route's existence is not told
            await self.app(scope, receive, send)
            return
        raw = headers.get(ENGINE_TOKEN_HEADER.lower().encode())
        supplied = None if raw is None else raw.decode("latin-1")
        if (
            self._digest is not None
            and supplied is not None
            and secrets.compare_digest(_digest(supplied), self._digest)
        ):
            await self.app(scope, receive, send)
            return
        await self._refuse(scope, send, kind, method, path, supplied is not None or signed is not None)

    async def _answer_challenge(self, scope: dict[str, Any], send: Any) -> None:
        """``GET /deltasync/guard?challenge=C``: a fresh nonce and the proof that this server holds the credential
        (none where it has none: then no client drives it)."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        challenge = (query.get("challenge") or [""])[0]
        if not _CHALLENGE.fullmatch(challenge):
            await _send_json(send, 400, {"error": "deltasync: challenge must be 32 to 128 lowercase hex digits"})
            return
        answer: dict[str, Any] = {"guard": "deltasync", "credential_configured": self._token is not None}
        if self._token is not None:
            nonce = self._nonces.issue()
            answer.update(nonce=nonce, proof=challenge_proof(self._token, challenge, nonce))
        await _send_json(send, 200, answer)

    async def _signed(
        self,
        scope: dict[str, Any],
        receive: Any,
        send: Any,
        method: str,
        path: str,
        auth: str,
        headers: dict[bytes, bytes],
    ) -> None:
        """A request signed with the credential (:func:`request_mac`): verified over its whole body, passed on
        once, and its answer signed (:func:`response_proof`)."""
        assert self._token is not None
        fields = auth.split(" ")
        length = headers.get(b"content-length", b"0")
        if len(fields) != 5 or fields[0] != "v1" or not (fields[2] + fields[3] + length.decode()).isdigit():
            await self._refuse(scope, send, "http", method, path, True)
            return
        if not self._nonces.valid(fields[1]):  # before a byte of the body is read: only nonces this server issued
            stale = "deltasync: this server did not issue that nonce, or it expired: ask for a new one (a challenge)"
            await _send_json(send, 401, {"error": stale, "code": "nonce"})
            return
        _, nonce, counter_text, signed_ms, mac = fields
        too_large = {"error": f"deltasync: a signed request's body is at most {MAX_SIGNED_BODY} bytes"}
        if int(length) > MAX_SIGNED_BODY:  # refused by its length, before a byte of it is read
            await _send_json(send, 413, too_large)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_SIGNED_BODY:
                await _send_json(send, 413, too_large)
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        body = b"".join(chunks)
        query = scope.get("query_string", b"").decode("latin-1")
        raw_path = scope.get("raw_path")  # as the client sent it, percent-encoded: what it signed
        signed_path = raw_path.decode("latin-1") if isinstance(raw_path, bytes) else path
        target = f"{signed_path}?{query}" if query else signed_path
        counter = int(counter_text)
        signed = (nonce, counter, int(signed_ms))
        want = request_mac(self._token, signed, method, target, hashlib.sha256(body).hexdigest())
        if not secrets.compare_digest(want, mac):
            await self._refuse(scope, send, "http", method, path, True)
            return
        if not self._nonces.accept(nonce, counter, int(signed_ms)):
            detail = {
                "error": "deltasync: a signed request out of order, replayed, or signed more than "
                f"{REQUEST_WINDOW_S:g} s ago: sign it again (after a new challenge)",
                "code": "nonce",
            }
            await _send_signed(send, self._token, nonce, counter, 401, detail)
            return
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            message: dict[str, Any] = await receive()
            return message

        start: dict[str, Any] = {}
        parts: list[bytes] = []

        async def sign(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            data = b"".join(parts)
            proof = response_proof(self._token or "", nonce, counter, start["status"], hashlib.sha256(data).hexdigest())
            kept = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            kept += [
                (b"content-length", str(len(data)).encode()),
                (ENGINE_PROOF_HEADER.lower().encode(), proof.encode()),
            ]
            await send({**start, "headers": kept})
            await send({"type": "http.response.body", "body": data})

        try:
            await self.app(scope, replay, sign)
        except Exception as exc:
            # an error the app did not answer itself: vLLM's own 500 would come from Starlette's outermost
            # middleware, unsigned, and the agent would rightly not believe it; the guard answers it, signed
            if start:
                raise  # the answer had begun: the connection is cut, as without the guard
            logger.warning("deltasync guard: %s %s failed in the engine: %s: %s", method, path, type(exc).__name__, exc)
            error = {"error": f"deltasync: {method} {path} failed in the engine: {type(exc).__name__}: {exc}"[:2000]}
            await _send_signed(send, self._token, nonce, counter, 500, error)

    async def _refuse(
        self, scope: dict[str, Any], send: Any, kind: str, method: str, path: str, supplied: bool
    ) -> None:
        if self._digest is None:
            status, why = 403, "this server has no engine credential configured, so no caller may change it"
        elif not supplied:
            status, why = 401, f"it needs the engine credential ({ENGINE_TOKEN_HEADER})"
        else:
            status, why = (
                403,
                f"the engine credential ({ENGINE_TOKEN_HEADER}, or the signature in {ENGINE_AUTH_HEADER}) is wrong",
            )
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


async def _send_json(
    send: Any, status: int, payload: dict[str, Any], extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_signed(send: Any, token: str, nonce: str, counter: int, status: int, payload: dict[str, Any]) -> None:
    """An answer of the guard itself to a signed request, signed as the app's answers are."""
    body = json.dumps(payload).encode()
    proof = response_proof(token, nonce, counter, status, hashlib.sha256(body).hexdigest())
    await _send_json(send, status, payload, [(ENGINE_PROOF_HEADER.lower().encode(), proof.encode())])
