"""The HTTP protocol the coordinator serves with: uvicorn's httptools protocol, bounded against slow and greedy
clients.

- **Head size**: httptools buffers an unfinished header line without limit (uvicorn's
  ``h11_max_incomplete_event_size`` applies only to h11), so one connection sending an endless header could grow
  the server by hundreds of MiB before the app's own 431 check ever runs. The bytes received while a request's
  head is incomplete are counted, and 431 answers once they pass ``max_header_bytes``.
- **Read timeouts**: uvicorn waits for a request's head and body for ever (its keep-alive timer runs only
  between requests, and not at all before a connection's first byte), so a client sending one header every
  15 s held its connection, and its open file, for good. A head not received within ``request_head_timeout_s``
  (counted from the connection's opening, or from the first byte after a response) and a body not received
  within ``request_body_timeout_s`` of its head get 408 and the connection closes; a connection that sent nothing
  is closed without an answer (it asked nothing). Only reading is timed: a long-poll waits as long as it asks.
- **Connection caps**: connections past the :class:`~.connections.ConnectionLedger`'s caps (overall and per
  client address, below the open-files limit) are answered 503 at once and closed, before they cost more than
  a moment's descriptor. uvicorn's ``limit_concurrency`` answers only after a complete head, too late.

Every refusal is JSON ``{"detail": ...}`` with ``connection: close`` and names the run, like every answer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from deltasync.schemas import RUN_HEADER

from .connections import ConnectionLedger

__all__ = ["protocol", "serve_options"]


class _GuardedHttp(HttpToolsProtocol):
    max_head_bytes = 64 << 10
    head_timeout_s = 10.0
    body_timeout_s = 30.0
    run_header: tuple[bytes, bytes] | None = None
    ledger = ConnectionLedger(1 << 20, 1 << 20)  # replaced by protocol(): one ledger per served app

    _peer: str | None = None  # the client address, while the ledger counts this connection
    _timer: asyncio.TimerHandle | None = None
    _phase: str | None = None  # "head" or "body": what the timer waits for
    _head_bytes = 0  # received since the head's clock started
    _head_begun = False  # the parser has seen this head's first byte (it may have come with the request before)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = self.client[0] if self.client else "a local socket"
        refusal = self.ledger.admit(peer)
        if refusal is not None:
            self._refuse(503, refusal, [(b"retry-after", b"1")])
            return
        self._peer = peer
        self._start_head_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        if self._peer is not None:
            self.ledger.release(self._peer)
            self._peer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:  # bytes between requests start the next head
            self._start_head_clock()
        if self._phase == "head":
            self._head_bytes += len(data)
        super().data_received(data)
        if self._phase == "head" and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            self._refuse(431, f"request head over {self.max_head_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_head_clock()  # a pipelined head, begun while the previous answer is still going out
        self._head_begun = True

    def on_headers_complete(self) -> None:
        self._stop_clock()
        self._start_clock("body", self.body_timeout_s)  # stopped at once by on_message_complete without a body
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._stop_clock()
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete and not self.transport.is_closing():
            # answered before its body ended (413): the body's bytes cancelled uvicorn's keep-alive timer, so the
            # next head's clock bounds the idle connection
            self._start_head_clock()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg)

    def _start_head_clock(self) -> None:
        if self._timer is None:
            self._head_bytes, self._head_begun = 0, False
            self._start_clock("head", self.head_timeout_s)

    def _start_clock(self, phase: str, timeout_s: float) -> None:
        self._phase = phase
        self._timer = self.loop.call_later(timeout_s, self._timed_out)

    def _stop_clock(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _timed_out(self) -> None:
        phase, peer = self._phase, self._peer or "?"
        self._timer, self._phase = None, None
        if self.transport.is_closing() or phase is None:
            return
        setting = f"request_{phase}_timeout_s"
        timeout_s = self.head_timeout_s if phase == "head" else self.body_timeout_s
        if self.flow.read_paused:  # the server stopped reading (a pipelined request waits its turn): not the client
            self._start_clock(phase, timeout_s)
            return
        if phase == "head" and self._head_bytes == 0 and not self._head_begun:
            self.ledger.record_timeout(phase, peer, None, f"nothing received within {timeout_s:g} s ({setting})")
            self.transport.close()
            return
        detail = f"request {phase} not received within {timeout_s:g} s ({setting})"
        cycle = self.cycle  # a body's own request; for a head, the request before it
        if self.pipeline or (
            cycle is not None and (cycle.response_started if phase == "body" else not cycle.response_complete)
        ):
            # this request was answered already (413 by its Content-Length), or it waits behind an answer still to
            # come (pipelined): a 408 would read as the answer to another request
            self.ledger.record_timeout(phase, peer, None, detail)
            self.transport.close()
            return
        if phase == "body" and cycle is not None:  # the app waits for the body: it hears a disconnect instead
            cycle.disconnected = True
            cycle.message_event.set()
        self.ledger.record_timeout(phase, peer, 408, detail)
        self._refuse(408, detail)

    def _refuse(self, status: int, msg: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        body = json.dumps({"detail": msg}, separators=(",", ":")).encode()
        lines = [STATUS_LINE[status]]
        headers = [*self.server_state.default_headers, *([self.run_header] if self.run_header else []), *(extra or [])]
        for name, value in headers:
            lines.extend([name, b": ", value, b"\r\n"])
        lines.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode() + b"\r\n",
                b"connection: close\r\n\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(lines))
        if self.transport.get_write_buffer_size():  # a client that does not read keeps no descriptor of ours
            self.transport.abort()
        else:
            self.transport.close()


def protocol(
    max_head_bytes: int,
    run_id: str | None = None,
    *,
    ledger: ConnectionLedger | None = None,
    head_timeout_s: float = 10.0,
    body_timeout_s: float = 30.0,
) -> type[asyncio.Protocol]:
    """An httptools protocol class (pass it as uvicorn's ``http``) that refuses request heads over
    ``max_head_bytes`` (431), answers 408 to heads and bodies not received within ``head_timeout_s`` and
    ``body_timeout_s``, and counts its connections in ``ledger`` (503 past its caps; default: a ledger of its own
    without practical caps)."""
    header = (RUN_HEADER.lower().encode(), run_id.encode()) if run_id else None
    attributes = {
        "max_head_bytes": max_head_bytes,
        "run_header": header,
        "ledger": ledger or ConnectionLedger(1 << 20, 1 << 20),
        "head_timeout_s": head_timeout_s,
        "body_timeout_s": body_timeout_s,
    }
    return type("DeltasyncHttp", (_GuardedHttp,), attributes)


def serve_options(app: object) -> dict[str, Any]:
    """uvicorn options for serving a coordinator app built by ``create_app``: the bounded protocol (its
    connections counted in the app's ledger, which ``/metrics`` reports) and the keep-alive timeout."""
    state = app.state  # type: ignore[attr-defined]
    settings = state.settings
    http = protocol(
        settings.max_header_bytes,
        state.registry.run_id,
        ledger=state.connections,
        head_timeout_s=settings.request_head_timeout_s,
        body_timeout_s=settings.request_body_timeout_s,
    )
    return {"http": http, "timeout_keep_alive": settings.keep_alive_timeout_s}
