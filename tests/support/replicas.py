"""Real HTTP servers on 127.0.0.1 that stand in for a coordinator replica going wrong, for failover tests.

A :class:`ReplicaStub` is a tiny ``http.server`` in a thread. By default it forwards every request to a real
coordinator (so two stubs in front of one coordinator are two replicas of one ledger); its ``mode`` makes it
fail the way a replica does: refuse connections, hang without sending a byte, answer 503, answer HTML, send
bytes that are not HTTP, or cut the connection after the request reached the ledger (the registration
committed, the answer lost).
"""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx

__all__ = ["MODES", "ReplicaStub", "refused_url"]

MODES = ("forward", "hang", "busy", "html", "garbage", "cut", "cut_after_forward", "cut_long_poll")
"""What a stub does with a request:

* ``forward``: pass it to the coordinator and its answer back (a healthy replica);
* ``hang``: accept it and never send a byte (until the stub closes);
* ``busy``: ``503`` without a run header (a proxy in front of a dead replica);
* ``html``: ``200`` with an HTML page and no run header (a wrong URL: some other web server);
* ``garbage``: bytes that are not HTTP, then close;
* ``cut``: close the connection without an answer (the replica died before doing anything);
* ``cut_after_forward``: forward it (it takes effect in the ledger), then close without an answer;
* ``cut_long_poll``: a long-poll (``wait_s`` > 0) is held for ``cut_after_s`` then cut (its replica died
  mid-poll); anything else is forwarded."""

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


def refused_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a replica that is down)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


class ReplicaStub:
    """A stand-in replica in front of the coordinator at ``target`` (``None``: nothing to forward to).

    Attributes:
        url: where it listens.
        mode: one of :data:`MODES`; may be changed while it runs. ``mode_for`` overrides it per request.
        hits: ``(method, path)`` of every request it received, in order.
    """

    def __init__(self, target: str | None = None, mode: str = "forward", *, cut_after_s: float = 0.3) -> None:
        assert mode in MODES, mode
        self.target, self.mode, self.cut_after_s = target, mode, cut_after_s
        self.mode_for: Callable[[str, str], str | None] = lambda method, path: None
        self.after_forward: Callable[[str, str], None] = lambda method, path: None
        """Called with (method, path) once a forwarded request is answered, before the answer is passed on (or
        the connection cut): e.g. kill the coordinator behind it."""
        self.hits: list[tuple[str, str]] = []
        self._released = threading.Event()
        self._forward = httpx.Client(timeout=120)
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _handle(self) -> None:
                stub._serve(self)

            do_GET = do_POST = do_DELETE = do_PUT = _handle  # noqa: N815 - http.server's names

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> ReplicaStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._released.set()  # let hanging handlers return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        self._forward.close()

    def _serve(self, h: http.server.BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        path = h.path.split("?")[0]
        self.hits.append((h.command, path))
        mode = self.mode_for(h.command, path) or self.mode
        if mode == "cut_long_poll":
            long_poll = h.command == "GET" and path == "/v1/versions" and "wait_s=0" not in h.path
            mode = "cut_after_forward" if long_poll else "forward"
            if long_poll:
                self._released.wait(self.cut_after_s)
                return self._cut(h)
        if mode == "hang":
            self._released.wait(60)
            return self._cut(h)
        if mode == "cut":
            return self._cut(h)
        if mode == "garbage":
            h.wfile.write(b"\x00\xff\xfeNOT HTTP AT ALL\r\n\r\n")
            return self._cut(h)
        if mode == "busy":
            return self._answer(h, 503, {"content-type": "application/json"}, b'{"detail": "stub: replica down"}')
        if mode == "html":
            return self._answer(h, 200, {"content-type": "text/html"}, b"<html><body>hello</body></html>")
        assert self.target is not None, "forwarding needs a target"
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        r = self._forward.request(h.command, self.target + h.path, headers=headers, content=body)
        self.after_forward(h.command, path)
        if mode == "cut_after_forward":
            return self._cut(h)
        self._answer(h, r.status_code, {k: v for k, v in r.headers.items() if k.lower() not in _HOP}, r.content)

    @staticmethod
    def _answer(h: http.server.BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def _cut(h: http.server.BaseHTTPRequestHandler) -> None:
        h.close_connection = True
        try:
            h.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
