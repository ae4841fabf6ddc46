"""The HTTP protocol the coordinator serves with: uvicorn's httptools protocol with a cap on a request's head.

httptools buffers an unfinished header line without limit (uvicorn's ``h11_max_incomplete_event_size`` applies
only to h11), so one connection sending an endless header could grow the server by hundreds of MiB before the
app's own 431 check ever runs. This protocol counts the bytes received while a request's head is incomplete
and answers 431 (naming the run, like every answer) once they pass the cap.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from deltasync.schemas import RUN_HEADER

__all__ = ["protocol", "serve_options"]


class _BoundedHead(HttpToolsProtocol):
    max_head_bytes = 64 << 10
    run_header: tuple[bytes, bytes] | None = None

    _head_bytes = 0
    _in_head = True  # until the first request's headers are complete

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes, self._in_head = 0, True

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            self._refuse(431, f"request head over {self.max_head_bytes} bytes")

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg)

    def _refuse(self, status: int, msg: str) -> None:
        body = json.dumps({"detail": msg}).encode()
        lines = [STATUS_LINE[status]]
        for name, value in [*self.server_state.default_headers, *([self.run_header] if self.run_header else [])]:
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
        self.transport.close()


def protocol(max_head_bytes: int, run_id: str | None = None) -> type[asyncio.Protocol]:
    """An httptools protocol class refusing request heads over ``max_head_bytes`` (pass it as uvicorn's
    ``http``)."""
    header = (RUN_HEADER.lower().encode(), run_id.encode()) if run_id else None
    return type("DeltasyncHttp", (_BoundedHead,), {"max_head_bytes": max_head_bytes, "run_header": header})


def serve_options(app: object) -> dict[str, Any]:
    """uvicorn options for serving a coordinator app built by ``create_app`` (the bounded protocol)."""
    state = app.state  # type: ignore[attr-defined]
    return {"http": protocol(state.settings.max_header_bytes, state.registry.run_id)}
