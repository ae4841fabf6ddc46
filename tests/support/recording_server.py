"""A TCP server on this machine that records every byte it receives: what an eavesdropper on the path reads, or a
process that took a server's port while the server was down."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

__all__ = ["RecordingServer"]


def _silent(request: bytes) -> bytes | None:
    return None


class RecordingServer:
    """Accepts connections on ``host`` (a free port), reads one HTTP request from each (its head, and as much body
    as its ``content-length`` says), answers ``answer(request)`` unless that is ``None``, and closes it. Every byte
    read is in :attr:`received` as it arrives.

    Args:
        answer: the bytes sent back for a request (``None``: nothing, the connection is just closed).
        host: the address to listen on (``0.0.0.0`` is no loopback address to deltasync, yet Linux connects it
            here).
    """

    def __init__(self, answer: Callable[[bytes], bytes | None] = _silent, *, host: str = "127.0.0.1") -> None:
        self.answer = answer
        self.received = bytearray()
        self.sock = socket.create_server((host, 0))
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5)
                try:
                    reply = self.answer(self._request(conn))
                    if reply is not None:
                        conn.sendall(reply)
                except OSError:
                    pass  # the client went away or stalled: what it sent is recorded all the same

    def _request(self, conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            if not (chunk := self._recv(conn)):
                return data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lengths = (line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
        length = int(next(lengths, b"0"))
        while len(body) < length and (chunk := self._recv(conn)):
            body += chunk
        return head + b"\r\n\r\n" + body

    def _recv(self, conn: socket.socket) -> bytes:
        chunk = conn.recv(65536)
        self.received += chunk
        return chunk

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread, which close alone does not
        except OSError:
            pass  # not connected: nothing to wake
        self.sock.close()
        self._thread.join(5)

    def __enter__(self) -> RecordingServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
