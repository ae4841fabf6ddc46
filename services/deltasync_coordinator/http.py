"""The HTTP protocol the coordinator serves with: uvicorn's httptools protocol, bounded against slow and greedy
clients (the Wordle demo's rollout service serves with it too).

- **Head size**: httptools buffers an unfinished header line without limit (uvicorn's
  ``h11_max_incomplete_event_size`` applies only to h11), so one connection sending an endless header could grow
  the server by hundreds of MiB before the app's own 431 check ever runs. The bytes received while a request's
  head is incomplete are counted, and 431 answers once they pass ``max_header_bytes``.
- **Read timeouts**: uvicorn waits for a request's head and body for ever (its keep-alive timer runs only
  between requests, and not at all before a connection's first byte), so a client sending one header every
  15 s held its connection, and its open file, for good. A head not received within ``request_head_timeout_s``
  (counted from the connection's opening, or from the first byte after a response) and a body not received
  within ``request_body_timeout_s`` of its head get 408 and the connection closes; a connection that sent nothing
  is closed without an answer (it asked nothing). The app is not timed: a long-poll waits as long as it asks.
- **Connection caps**: connections past the :class:`~.connections.ConnectionLedger`'s caps (overall and per
  client address, below the open-files limit) are answered 503 at once and closed, before they cost more than
  a moment's descriptor. uvicorn's ``limit_concurrency`` answers only after a complete head, too late.
- **Unread answers**: a client that sends requests and never reads the answers leaves them in the server's
  buffers; uvicorn then waits for a drain that never comes, with no clock running (reading is done, and the
  keep-alive timer starts only after a complete answer), so such connections would hold their places under the
  caps for good. Writing is timed: on a plain connection the transport asks the protocol to pause as soon as any
  byte waits in user space (its high-water mark is 0), and on TLS once its own buffer is full; a connection
  that stays paused for ``response_write_timeout_s`` while its unsent bytes do not shrink (an answer in
  progress, or a close waiting for its last bytes) is aborted. A client that reads, however slowly, moves the
  clock on; a long-poll writes nothing while it waits, so it is never paused.
- **Pipelined requests**: uvicorn parses every request of a received chunk and queues each one behind the
  answer in progress, and resumes reading whenever the app reads a body. At most ``max_pipelined_requests``
  wait on one connection: the next is answered 503, in order after them, and the connection closes after that
  answer; nothing after it is parsed.
- **TLS**: asyncio (given ``ssl=`` by uvicorn) waits 60 s for a handshake and calls the HTTP protocol only
  once it is done, so connections that never send a ClientHello held descriptors past every cap above,
  unlogged. Here the protocol serves TLS itself: it counts the connection in the ledger at its TCP accept
  (past the caps it is closed at once: a 503 in clear would mean nothing to a TLS client), then upgrades it
  with ``loop.start_tls`` bounded by ``tls_handshake_timeout_s`` (closed and logged like a head timeout after
  it). Give uvicorn no ``ssl_*`` options: :func:`serve_options` and :func:`run` carry TLS.
- **Client addresses** are the socket's peer. uvicorn believes ``X-Forwarded-For`` from 127.0.0.1 by default
  (its ``forwarded_allow_ips``), so a loopback client could have its refusals logged under any address;
  :func:`proxy_options` trusts the header only from the proxies an operator lists, and then takes only the hop
  before them.
- **Bodies** (:class:`SizeLimits`, ASGI): over ``max_body_bytes`` get 413, by Content-Length before a byte of
  the body is read, and while reading one without it.

Every refusal the protocol answers is JSON ``{"detail": ...}`` with ``connection: close`` and names the run,
like every answer (a TLS connection past the caps is closed before its handshake: it could read no answer).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import ssl
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn

from deltasync.schemas import RUN_HEADER

from .bounded import MAX_PIPELINED_REQUESTS, BoundedHttp, refuse
from .connections import ConnectionLedger

__all__ = [
    "MAX_PIPELINED_REQUESTS",
    "Bounds",
    "SizeLimits",
    "parse_trusted_proxies",
    "protocol",
    "proxy_options",
    "refuse",
    "run",
    "serve_options",
    "tls_context",
]

_Scope = MutableMapping[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Bounds:
    """What one connection served by :func:`protocol` may take (see the module docstring)."""

    max_head_bytes: int = 64 << 10
    """A request head (all its bytes while unfinished) over this gets 431."""
    head_timeout_s: float = 10.0
    """A request head not received this long after the connection opened (or after the first byte that follows
    an answer) gets 408."""
    body_timeout_s: float = 30.0
    """A request body not received this long after its head gets 408."""
    write_timeout_s: float = 30.0
    """A connection whose unsent answer has not shrunk for this long is aborted (its client reads nothing)."""
    tls_handshake_timeout_s: float = 5.0
    """With TLS: a handshake not done this long after the TCP accept is closed."""
    max_pipelined_requests: int = MAX_PIPELINED_REQUESTS
    """Requests that may wait on one connection behind the one being answered; the next gets 503."""

    def __post_init__(self) -> None:
        for name in ("max_head_bytes", "head_timeout_s", "body_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.tls_handshake_timeout_s > 0:
            raise ValueError(f"tls_handshake_timeout_s must be > 0, got {self.tls_handshake_timeout_s}")
        if self.max_pipelined_requests < 1:
            raise ValueError(f"max_pipelined_requests must be >= 1, got {self.max_pipelined_requests}")


def protocol(
    bounds: Bounds,
    run_id: str | None = None,
    *,
    ledger: ConnectionLedger | None = None,
    tls: ssl.SSLContext | None = None,
) -> type[asyncio.Protocol]:
    """An httptools protocol class (pass it as uvicorn's ``http``) that holds each connection to ``bounds``:
    refuses request heads over ``max_head_bytes`` (431), answers 408 to heads and bodies not received within
    ``head_timeout_s`` and ``body_timeout_s``, aborts connections whose answers wait unread for
    ``write_timeout_s``, answers 503 to a request past ``max_pipelined_requests`` waiting on one connection, and
    counts its connections in ``ledger`` (503 past its caps; default: a ledger of its own without practical caps).
    Every answer it writes itself names ``run_id`` when given. With ``tls`` (:func:`tls_context`) it serves TLS
    itself, counted from the TCP accept, each handshake bounded by ``tls_handshake_timeout_s``; then give uvicorn
    no ``ssl_*`` options."""
    header = (RUN_HEADER.lower().encode(), run_id.encode()) if run_id else None
    attributes = {
        "max_head_bytes": bounds.max_head_bytes,
        "run_header": header,
        "ledger": ledger or ConnectionLedger(1 << 20, 1 << 20),
        "head_timeout_s": bounds.head_timeout_s,
        "body_timeout_s": bounds.body_timeout_s,
        "tls": tls,
        "tls_handshake_timeout_s": bounds.tls_handshake_timeout_s,
        "write_timeout_s": bounds.write_timeout_s,
        "max_pipelined_requests": bounds.max_pipelined_requests,
    }
    return type("DeltasyncHttp", (BoundedHttp,), attributes)


def tls_context(certfile: str | os.PathLike[str], keyfile: str | os.PathLike[str]) -> ssl.SSLContext:
    """A server context for :func:`protocol`: the certificate chain and its key (PEM), TLS 1.2 or later.

    Raises:
        OSError: a file is missing or unreadable; ``ssl.SSLError``: not a certificate and its key.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile, keyfile)
    return context


def parse_trusted_proxies(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"10.0.0.5, 10.1.0.0/16"`` (or a list) -> the proxies whose ``X-Forwarded-For`` is believed.

    Raises:
        ValueError: an entry that is not an IP address or network (``*`` too: trusting every address would let
            any client name its own).
    """
    parts = value.split(",") if isinstance(value, str) else list(value or ())
    out: list[str] = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        try:
            out.append(str(ipaddress.ip_address(part) if "/" not in part else ipaddress.ip_network(part, strict=False)))
        except ValueError:
            raise ValueError(
                f"trusted proxy {part!r} is not an IP address or network (e.g. 10.0.0.5 or 10.1.0.0/16); list the "
                "addresses of the reverse proxies in front of this service, never '*'"
            ) from None
    return tuple(out)


def proxy_options(trusted_proxies: Sequence[str]) -> dict[str, Any]:
    """uvicorn options for client addresses: the socket's peer, unless it is one of ``trusted_proxies``
    (:func:`parse_trusted_proxies`); then the ``X-Forwarded-For`` hop just before the trusted ones."""
    if not trusted_proxies:
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": list(trusted_proxies)}


def serve_options(app: object) -> dict[str, Any]:
    """uvicorn options for serving a coordinator app built by ``create_app``: the bounded protocol (its
    connections counted in the app's ledger, which ``/metrics`` reports; TLS when the settings name a
    certificate), the keep-alive timeout, and whose ``X-Forwarded-For`` is believed."""
    state = app.state  # type: ignore[attr-defined]
    settings = state.settings
    tls = None if settings.ssl_certfile is None else tls_context(settings.ssl_certfile, settings.ssl_keyfile)
    bounds = Bounds(
        max_head_bytes=settings.max_header_bytes,
        head_timeout_s=settings.request_head_timeout_s,
        body_timeout_s=settings.request_body_timeout_s,
        write_timeout_s=settings.response_write_timeout_s,
        tls_handshake_timeout_s=settings.tls_handshake_timeout_s,
    )
    http = protocol(bounds, state.registry.run_id, ledger=state.connections, tls=tls)
    return {
        "http": http,
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        **proxy_options(parse_trusted_proxies(settings.trusted_proxies)),
    }


class _Server(uvicorn.Server):
    """uvicorn's server, announcing ``https://`` when the protocol serves TLS (uvicorn, given no ``ssl_*``
    options, would say ``http://``)."""

    def _log_started_message(self, listeners: Sequence[Any]) -> None:
        http = self.config.http
        if not getattr(http, "tls", None):
            super()._log_started_message(listeners)
            return
        host = self.config.host
        port = self.config.port or listeners[0].getsockname()[1]
        logging.getLogger("uvicorn.error").info(
            "Uvicorn running on https://%s:%d (TLS served by the bounded protocol; Press CTRL+C to quit)",
            f"[{host}]" if ":" in host else host,
            port,
        )


def run(app: Any, **options: Any) -> None:
    """``uvicorn.run(app, **options)`` for an app served with :func:`protocol` (``options["http"]``)."""
    server = _Server(uvicorn.Config(app, **options))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        raise SystemExit(3)


class SizeLimits:
    """ASGI middleware refusing request headers over ``max_header_bytes`` (431) and bodies over ``max_bytes``
    (413): by Content-Length, and by reading the body (at most ``max_bytes + 1``) before the app sees it, so a
    chunked upload cannot get past. ``close``: refusals end the connection (else the rest of a body refused by
    its Content-Length is read and dropped, bounded by the body timeout)."""

    def __init__(self, app: Any, max_bytes: int, max_header_bytes: int, close: bool = False) -> None:
        self.app, self.max_bytes, self.max_header_bytes = app, max_bytes, max_header_bytes
        self.headers = [(b"connection", b"close")] if close else []

    async def __call__(self, scope: _Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(len(k) + len(v) for k, v in scope["headers"]) > self.max_header_bytes:
            await refuse(send, 431, f"request headers over {self.max_header_bytes} bytes", self.headers)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await refuse(send, 413, f"request body over {self.max_bytes} bytes", self.headers)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await refuse(send, 413, f"request body over {self.max_bytes} bytes", self.headers)
                return
        replayed = False

        async def replay() -> _Scope:
            nonlocal replayed
            if replayed:
                return await receive()  # type: ignore[no-any-return]  # after the body: wait for the disconnect
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)
