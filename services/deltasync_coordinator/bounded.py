"""One connection of the bounded HTTP protocol: uvicorn's httptools protocol with its head, body and write
clocks, its place in the connection ledger, its pipelining cap and TLS served from the TCP accept.
:mod:`.http` says what each bound is for, and builds the protocol class for one served app
(:func:`~.http.protocol`)."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import MutableMapping, Sequence
from typing import Any

import httptools
from starlette.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from .connections import ConnectionLedger

__all__ = ["MAX_PIPELINED_REQUESTS", "BoundedHttp", "refuse"]

_Scope = MutableMapping[str, Any]

logger = logging.getLogger("deltasync.coordinator")

_MAX_STRAY_BYTES = 64 << 10
"""Raw bytes kept for the TLS layer before it takes the transport over: a ClientHello is far smaller."""
MAX_PIPELINED_REQUESTS = 16
"""Requests that may wait on one connection behind the answer in progress (HTTP clients rarely pipeline at all)."""


class _PipelineFull(Exception):
    """Raised from a parser callback to stop httptools at the request past the pipelining cap."""


class BoundedHttp(HttpToolsProtocol):
    """One connection held to the bounds :func:`~.http.protocol` sets as class attributes (a subclass per served
    app)."""

    max_head_bytes = 64 << 10
    head_timeout_s = 10.0
    body_timeout_s = 30.0
    run_header: tuple[bytes, bytes] | None = None
    ledger = ConnectionLedger(1 << 20, 1 << 20)  # replaced by protocol(): one ledger per served app

    write_timeout_s = 30.0
    max_pipelined_requests = MAX_PIPELINED_REQUESTS
    tls: ssl.SSLContext | None = None  # serve TLS, the handshake bounded by tls_handshake_timeout_s
    tls_handshake_timeout_s = 5.0

    _peer: str | None = None  # the client address, while the ledger counts this connection
    _timer: asyncio.TimerHandle | None = None
    _phase: str | None = None  # "head" or "body": what the timer waits for
    _head_bytes = 0  # received since the head's clock started
    _head_begun = False  # the parser has seen this head's first byte (it may have come with the request before)
    _raw: asyncio.Transport | None = None  # the TCP transport until its TLS handshake is done
    _handshake: asyncio.Task[None] | None = None
    _tls_phase: str | None = None  # "accepted" (the raw transport is ours), "handshake" (start_tls has it)
    _stray: bytes = b""  # raw bytes received in phase "accepted", for the TLS layer
    _early: bytes = b""  # decrypted bytes that arrived between the handshake's end and the HTTP start
    _write_timer: asyncio.TimerHandle | None = None  # runs while the transport has paused our writing
    _unsent = 0  # bytes waiting in the transport when the write clock last started
    _answering: RequestResponseCycle | None = None  # the request whose app runs (uvicorn's `cycle` is the last parsed)
    _pipeline_full = False  # a request past max_pipelined_requests is queued for a 503: nothing more is parsed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.tls is not None and not transport.get_extra_info("sslcontext"):
            self._accept_tls(transport)
            return
        super().connection_made(transport)
        peer = self.client[0] if self.client else "a local socket"
        refusal = self.ledger.admit(peer)
        if refusal is not None:
            self._refuse(503, refusal, [(b"retry-after", b"1")])
            return
        self._peer = peer
        if self.tls is None:
            # paused as soon as a byte waits in user space: every write the client does not drain is timed,
            # a close waiting for its last bytes too (TLS: the layer's own buffer; its close is bounded by
            # the layer's shutdown timeout)
            transport.set_write_buffer_limits(high=0, low=0)
        self._start_head_clock()

    def _accept_tls(self, raw: asyncio.Transport) -> None:
        """Count the connection from its TCP accept, before its handshake: a client that never sends a
        ClientHello holds a place under the caps for ``tls_handshake_timeout_s`` at most, and one past them is
        closed at once."""
        peername = raw.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "a local socket"
        if self.ledger.admit(peer, status=None) is not None:
            raw.abort()
            return
        raw.pause_reading()  # asyncio honours it; uvloop starts reading after connection_made anyway (data_received)
        self._peer, self._raw, self._tls_phase = peer, raw, "accepted"
        self.connections.add(self)  # uvicorn's shutdown reaches it through shutdown() below
        self._handshake = self.loop.create_task(self._start_tls(raw, peer))

    async def _start_tls(self, raw: asyncio.Transport, peer: str) -> None:
        assert self.tls is not None
        timeout_s = self.tls_handshake_timeout_s
        if self._stray:  # start_tls has set its TLS layer as raw's protocol when this runs: hand it these first
            self.loop.call_soon(self._hand_over_stray, raw)
        self._tls_phase = "handshake"
        try:
            transport = await self.loop.start_tls(
                raw, self, self.tls, server_side=True, ssl_handshake_timeout=timeout_s
            )
        except ConnectionAbortedError:  # the handshake timer fired
            self.ledger.record_timeout(
                "handshake", peer, None, f"TLS handshake not completed within {timeout_s:g} s (tls_handshake_timeout_s)"
            )
            self._end_handshake()
            return
        except Exception as exc:  # noqa: BLE001 - not TLS, or gone mid-handshake: it asked nothing of HTTP
            logger.debug("TLS handshake with %s failed: %r", peer, exc)
            self._end_handshake()
            return
        except BaseException:  # cancelled: the server is stopping
            self._end_handshake()
            raise
        if self._raw is None or transport is None or transport.is_closing():  # lost as it completed
            self._end_handshake()
            return
        self._raw = self._handshake = self._tls_phase = None
        super().connection_made(transport)
        self._start_head_clock()
        early, self._early = self._early, b""
        if early:
            self.data_received(early)

    def _hand_over_stray(self, raw: asyncio.Transport) -> None:
        """The bytes uvloop delivered here before the TLS layer took the transport (a ClientHello sent at once),
        into that layer, ahead of anything it reads itself (it keeps them until its own connection_made)."""
        layer, data, self._stray = raw.get_protocol(), self._stray, b""
        if layer is self or raw.is_closing():
            return
        if hasattr(layer, "get_buffer"):  # asyncio's TLS layer and uvloop's are buffered protocols
            while data:
                buffer = memoryview(layer.get_buffer(len(data)))
                n = min(len(buffer), len(data))
                buffer[:n] = data[:n]
                layer.buffer_updated(n)  # type: ignore[attr-defined]
                data = data[n:]
        else:
            layer.data_received(data)  # type: ignore[attr-defined]

    def _end_handshake(self) -> None:
        """A connection that closes before it speaks HTTP: uvicorn's protocol never saw it; only the ledger did.
        Idempotent."""
        raw, self._raw, self._handshake, self._tls_phase = self._raw, None, None, None
        if raw is not None:
            raw.abort()
        self.connections.discard(self)
        if self._peer is not None:
            self.ledger.release(self._peer)
            self._peer = None

    def shutdown(self) -> None:
        if self._raw is not None:  # still in its handshake: nothing to finish
            self._raw.abort()
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:  # never spoke HTTP: refused before its handshake, or lost during it
            if self._handshake is not None and self._tls_phase == "accepted":
                self._handshake.cancel()  # lost before start_tls began
            self._end_handshake()
            return
        self._stop_clock()
        self._stop_write_clock()
        self._disconnect_answering()
        if self._peer is not None:
            self.ledger.release(self._peer)
            self._peer = None
        super().connection_lost(exc)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._answering = cycle
        super()._start_asgi_task(cycle, app)

    def _disconnect_answering(self) -> None:
        """Tell the request being answered that its client is gone. uvicorn tells only the last request parsed,
        so an answer in progress behind which others were pipelined would go on writing to a closed transport
        (uvloop raises there)."""
        cycle = self._answering
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()

    def pause_writing(self) -> None:
        if self.flow is None:  # the TLS layer's own writes, before HTTP started, need no flow control
            return
        super().pause_writing()
        if self._write_timer is None:
            self._unsent = self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        if self.flow is None:
            return
        self._stop_write_clock()
        super().resume_writing()

    def _stop_write_clock(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        """Writing has been paused for ``write_timeout_s``. If the unsent bytes shrank meanwhile, the client reads,
        slowly: the clock starts again. If not, it read nothing of its answer for that long and none can reach it:
        the connection is aborted (its unsent bytes dropped), counted and logged like a read timeout."""
        unsent = self.transport.get_write_buffer_size()
        if unsent < self._unsent:
            self._unsent = unsent
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_timed_out)
            return
        self._write_timer = None
        detail = f"answer not read within {self.write_timeout_s:g} s (response_write_timeout_s; {unsent} bytes unsent)"
        self.ledger.record_timeout("write", self._peer or "?", None, detail)
        self._disconnect_answering()  # before connection_lost runs, the app may write again
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._tls_phase is not None:
            if self._tls_phase == "accepted":  # TLS bytes from the raw transport, before start_tls took it over
                self._stray += data
                self._raw.pause_reading()  # type: ignore[union-attr]
                if len(self._stray) > _MAX_STRAY_BYTES:
                    self._end_handshake()
            else:  # decrypted by the TLS layer: what came with the client's last handshake message
                self._early += data
            return
        if self._pipeline_full:  # the parser stopped at the refused request: what follows is never read
            return
        if self.cycle is None or self.cycle.response_complete:  # bytes between requests start the next head
            self._start_head_clock()
        if self._phase == "head":
            self._head_bytes += len(data)
        self._feed(data)
        if self._phase == "head" and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            self._refuse(431, f"request head over {self.max_head_bytes} bytes")

    def _feed(self, data: bytes) -> None:
        """uvicorn's ``data_received``, where a stop at the pipelining cap is no parse error (its 503 is queued)."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._pipeline_full:
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_head_clock()  # a pipelined head, begun while the previous answer is still going out
        self._head_begun = True

    def on_headers_complete(self) -> None:
        self._stop_clock()
        self._start_clock("body", self.body_timeout_s)  # stopped at once by on_message_complete without a body
        super().on_headers_complete()
        if len(self.pipeline) > self.max_pipelined_requests:
            # this request (queued last) is answered 503 in its turn, without its body; the connection closes
            # after that answer, and the parser stops here: no further request costs memory or an answer
            cycle, _ = self.pipeline[0]
            self.pipeline[0] = (cycle, self._refuse_pipelined)  # type: ignore[assignment]
            self._stop_clock()
            self._pipeline_full = True
            self.ledger.record_request_refusal(
                "max_pipelined_requests", self._peer or "?", 503, self._pipelined_detail()
            )
            raise _PipelineFull

    def on_message_complete(self) -> None:
        self._stop_clock()
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete and not self.transport.is_closing():
            # answered before its body ended (413): the body's bytes cancelled uvicorn's keep-alive timer, so the
            # next head's clock bounds the idle connection
            self._start_head_clock()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg)

    def _pipelined_detail(self) -> str:
        return (
            f"more than {self.max_pipelined_requests} requests pipelined on one connection (max_pipelined_requests); "
            "send each request after the answer to the one before, or open another connection"
        )

    async def _refuse_pipelined(self, scope: _Scope, receive: Any, send: Any) -> None:
        """The ASGI app of the request past ``max_pipelined_requests`` (counted and logged when it was parsed)."""
        headers = [(b"connection", b"close"), (b"retry-after", b"1"), *([self.run_header] if self.run_header else [])]
        await refuse(send, 503, self._pipelined_detail(), headers)

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


async def refuse(send: Any, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer ``{"detail": detail}`` with ``status`` (and ``headers``) from an ASGI middleware."""
    extra = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
    await JSONResponse({"detail": detail}, status_code=status, headers=extra)({"type": "http"}, _no_receive, send)


async def _no_receive() -> _Scope:
    return {"type": "http.disconnect"}
