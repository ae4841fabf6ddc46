"""How the Wordle demo's services (the environment, the rollout workers) are served: with the coordinator's
bounded protocol (:mod:`deltasync_coordinator.http`), a bearer token checked from the request head, and the same
flags and start-up checks.

A request without the token is refused from its head, before any body byte is read; bodies are capped even with
it; heads, bodies and TLS handshakes that do not arrive in time are closed, and so are answers left unread and
requests pipelined past a small depth; connections are capped overall and per client address below the
open-files limit; and clients are logged by their socket's address. Without its token a service refuses to
start, unless ``--insecure`` (then it says so loudly).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

from deltasync_coordinator.connections import ConnectionLedger, fit_to_open_files, open_files_limit
from deltasync_coordinator.http import Bounds, protocol, proxy_options, refuse, run, tls_context

__all__ = ["MAX_HEADER_BYTES", "MIN_TOKEN_CHARS", "Bearer", "Credential", "add_service_arguments", "serve"]

MAX_HEADER_BYTES = 16 << 10
"""A request's headers, all together: a bearer token and a few short ones."""
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class Credential:
    """A service's bearer token: where it comes from, and the words its messages say it with."""

    env: str
    """The environment variable that holds it (for the service and for its clients)."""
    service: str
    """The service, as a message names it (``"the rollout service"``)."""
    sender: str
    """Who sends it, a singular subject (``"the trainer"``)."""
    may: str
    """What anyone who reaches the service may do without it (``"take groups"``)."""
    does: str
    """The same, said of anyone (``"takes groups and reads its stats"``)."""

    def check(self, token: str) -> None:
        """Raises ValueError for a token too short to authenticate anything (an empty one would turn it off)."""
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"{self.env} must be at least {MIN_TOKEN_CHARS} characters (an empty one would turn authentication off)"
            )

    def from_environment(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
        """The token from :attr:`env`; without one the service does not start, unless ``--insecure`` (then it says
        so loudly). Exits through ``parser.error`` (status 2) with the fix."""
        if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
            parser.error("--ssl-certfile and --ssl-keyfile go together")
        token = os.environ.get(self.env) or None
        if token is not None and args.insecure:
            parser.error(f"--insecure would ignore {self.env}, which is set: drop one or the other")
        if token is None and not args.insecure:
            parser.error(
                f"{self.service} refuses to start without a credential: set {self.env} (at least {MIN_TOKEN_CHARS} "
                f"characters; {self.sender} sends it as a bearer token), or pass --insecure to let anyone who "
                f"reaches {args.host}:{args.port} {self.may} (development only)"
            )
        if token is not None:
            try:
                self.check(token)
            except ValueError as exc:
                parser.error(str(exc))
        else:
            logging.getLogger(__name__).warning(
                "INSECURE: %s runs without %s (--insecure): anyone who reaches %s:%d %s. Never do this on a shared "
                "network.",
                self.service,
                self.env,
                args.host,
                args.port,
                self.does,
            )
        return token


class Bearer:
    """ASGI middleware: every request but ``GET /healthz`` carries the bearer token, checked from the head alone:
    a refused request's body is never read (FastAPI reads a route's body before its dependencies run), and the
    connection closes after the 401 ``{"detail": "<service> needs its bearer token (<env>)"}``."""

    def __init__(self, app: Any, token: str, credential: Credential) -> None:
        self.app, self.expected = app, f"Bearer {token}".encode()
        self.detail = f"{credential.service} needs its bearer token ({credential.env})"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/healthz":
            await self.app(scope, receive, send)
            return
        presented = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(presented) != 1 or not secrets.compare_digest(presented[0], self.expected):
            await refuse(send, 401, self.detail, [(b"www-authenticate", b"Bearer"), (b"connection", b"close")])
            return
        await self.app(scope, receive, send)


def add_service_arguments(
    parser: argparse.ArgumentParser, credential: Credential, *, port: int, max_body_bytes: int
) -> None:
    """Where the service listens, its credential's escape hatch, and the bounds it serves with."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument(
        "--ssl-certfile", help="serve HTTPS with this certificate (PEM): the bearer token crosses the network"
    )
    parser.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help=f"serve without {credential.env}: anyone who reaches --host:--port {credential.does} (development only)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=max_body_bytes, help="larger bodies get 413")
    parser.add_argument(
        "--max-connections", type=int, default=1024, help="open connections (lowered below the open-files limit)"
    )
    parser.add_argument("--max-connections-per-peer", type=int, default=256, help="open connections of one address")
    parser.add_argument("--request-head-timeout-s", type=float, default=10.0, help="a head not received in time: 408")
    parser.add_argument(
        "--request-body-timeout-s", type=float, default=30.0, help="a body not received this long after its head: 408"
    )
    parser.add_argument(
        "--tls-handshake-timeout-s", type=float, default=5.0, help="a TLS handshake not done in time: closed"
    )
    parser.add_argument(
        "--response-write-timeout-s",
        type=float,
        default=30.0,
        help="a connection whose unsent answer has not shrunk this long (its client reads none of it): closed",
    )


def serve(app: Any, args: argparse.Namespace, *, logger_name: str) -> None:
    """Serve ``app`` until interrupted, bounded by the flags of :func:`add_service_arguments` (its refusals and
    timeouts logged under ``logger_name``)."""
    overall, per_peer = fit_to_open_files(args.max_connections, args.max_connections_per_peer, open_files_limit())
    tls = tls_context(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None
    bounds = Bounds(
        max_head_bytes=MAX_HEADER_BYTES,
        head_timeout_s=args.request_head_timeout_s,
        body_timeout_s=args.request_body_timeout_s,
        write_timeout_s=args.response_write_timeout_s,
        tls_handshake_timeout_s=args.tls_handshake_timeout_s,
    )
    http = protocol(bounds, ledger=ConnectionLedger(overall, per_peer, logger_name=logger_name), tls=tls)
    run(app, host=args.host, port=args.port, log_level="warning", http=http, **proxy_options(()))
