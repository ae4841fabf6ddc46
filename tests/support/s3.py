"""A fault-injecting HTTP proxy for the S3 tests, in front of :class:`deltasync.testing.s3.MotoServer` (503
SlowDown, connections cut mid-body, lying sizes), and the variables a test unsets."""

from __future__ import annotations

import dataclasses
import socket
import threading
from typing import Any

__all__ = ["ENDPOINT_ENV", "Fault", "FaultProxy"]

ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN")
"""Variables a test unsets, so that only what it passes decides where requests go."""


@dataclasses.dataclass
class Fault:
    """One rule of a :class:`FaultProxy`: requests whose method is ``method`` (``"*"``: any) and whose path
    contains ``path_contains`` get ``status`` (a canned S3 error, the upstream never sees the request), or are
    forwarded and their response cut ``cut_after`` bytes in, head included (then the client connection is
    closed; 0: the request lands, its answer is lost), or have
    their ``Content-Length`` answer replaced by ``content_length`` (a lying HEAD), or lose the request header
    ``drop_header`` on the way (a service that ignores it), or lose the response header ``drop_response_header``
    on the way back (a service, or something in between, that strips it), or lose the query parameter
    ``drop_query`` (a service that ignores it: ``prefix`` of a listing). ``skip``: how many matching requests
    pass untouched first. ``times``: how many requests the rule takes after those (``None``: every one)."""

    method: str = "*"
    path_contains: str = ""
    status: int | None = None
    cut_after: int | None = None
    content_length: int | None = None
    drop_header: str | None = None
    drop_response_header: str | None = None
    drop_query: str | None = None
    times: int | None = 1
    skip: int = 0
    hits: int = 0


_S3_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    409: (
        "ConditionalRequestConflict",
        "A conflicting conditional operation is currently in progress against this resource. Please try again.",
    ),
    412: ("PreconditionFailed", "At least one of the pre-conditions you specified did not hold"),
}


class FaultProxy:
    """A real TCP proxy thread in front of an HTTP/1.1 server, injecting :class:`Fault` rules.

    Keep-alive on both sides: each request's head and body are read (``Content-Length`` framing), the first
    matching rule applied, and the response framed the same way (``HEAD``, 204 and 304 carry no body).

    ``serialize_writes``: forward one PUT or POST at a time. moto checks ``If-None-Match`` and then writes, with
    no lock between (``moto/s3/responses.py``), on a PUT and on ``CompleteMultipartUpload`` (a POST) alike, so
    two concurrent conditional writes can both succeed there;
    S3 makes the check and the write one step. Serializing writes models S3, while the clients still race.
    """

    def __init__(self, upstream_port: int, *, serialize_writes: bool = False) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.serialize_writes = serialize_writes
        self._write_lock = threading.Lock()
        self.rules: list[Fault] = []
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the serving thread
        except OSError:
            pass
        self._sock.close()
        self._thread.join(5)

    def add(self, **rule: Any) -> Fault:
        fault = Fault(**rule)
        with self._lock:
            self.rules.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.requests.clear()

    def count(self, method: str, path_contains: str = "") -> int:
        with self._lock:
            return sum(1 for m, p in self.requests if m == method and path_contains in p)

    def _match(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.requests.append((method, path))
            for rule in self.rules:
                if rule.method in ("*", method) and rule.path_contains in path:
                    if rule.times is not None and rule.hits >= rule.skip + rule.times:
                        continue
                    rule.hits += 1
                    if rule.hits > rule.skip:
                        return rule
        return None

    def _serve(self) -> None:
        while not self._stop:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    @staticmethod
    def _read_head(sock: socket.socket, buf: bytearray) -> bytes | None:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            buf += chunk
        end = buf.index(b"\r\n\r\n") + 4
        head = bytes(buf[:end])
        del buf[:end]
        return head

    @staticmethod
    def _read_body(sock: socket.socket, buf: bytearray, n: int) -> bytes:
        while len(buf) < n:
            chunk = sock.recv(min(1 << 20, n - len(buf)))
            if not chunk:
                raise ConnectionError("peer closed mid-body")
            buf += chunk
        body = bytes(buf[:n])
        del buf[:n]
        return body

    @staticmethod
    def _length(head: bytes) -> int:
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                return int(value.strip())
        return 0

    def _handle(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while True:
                head = self._read_head(client, cbuf)
                if head is None:
                    return
                body = self._read_body(client, cbuf, self._length(head))
                method, path = head.split(b" ", 2)[:2]
                rule = self._match(method.decode(), path.decode())
                if rule is not None and rule.status is not None:
                    code, message = _S3_ERRORS.get(rule.status, ("Error", "injected"))
                    xml = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message></Error>'
                    data = xml.encode()
                    client.sendall(
                        f"HTTP/1.1 {rule.status} {code}\r\nContent-Type: application/xml\r\n"
                        f"Content-Length: {len(data)}\r\n\r\n".encode()
                        + (b"" if method == b"HEAD" else data)
                    )
                    continue
                if rule is not None and rule.drop_header is not None:
                    drop = rule.drop_header.lower().encode() + b":"
                    head = b"\r\n".join(ln for ln in head.split(b"\r\n") if not ln.lower().startswith(drop))
                if rule is not None and rule.drop_query is not None:
                    line, _, rest = head.partition(b"\r\n")
                    verb, target, version = line.split(b" ", 2)
                    url, _, query = target.partition(b"?")
                    kept = [p for p in query.split(b"&") if p.split(b"=", 1)[0] != rule.drop_query.encode()]
                    target = url + (b"?" + b"&".join(kept) if kept else b"")
                    head = b" ".join([verb, target, version]) + b"\r\n" + rest
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                serialize = self.serialize_writes and method in (b"PUT", b"POST")
                if serialize:
                    self._write_lock.acquire()
                try:
                    upstream.sendall(head + body)
                    rhead = self._read_head(upstream, ubuf)
                    if rhead is None:
                        return
                    status = int(rhead.split(b" ", 2)[1])
                    n = 0 if method == b"HEAD" or status in (204, 304) else self._length(rhead)
                    rbody = self._read_body(upstream, ubuf, n)
                finally:
                    if serialize:
                        self._write_lock.release()
                if rule is not None and rule.content_length is not None:
                    lines = [ln for ln in rhead[:-4].split(b"\r\n") if not ln.lower().startswith(b"content-length:")]
                    rhead = b"\r\n".join([*lines, b"Content-Length: %d" % rule.content_length]) + b"\r\n\r\n"
                if rule is not None and rule.drop_response_header is not None:
                    drop = rule.drop_response_header.lower().encode() + b":"
                    rhead = b"\r\n".join(ln for ln in rhead.split(b"\r\n") if not ln.lower().startswith(drop))
                if rule is not None and rule.cut_after is not None:
                    client.sendall((rhead + rbody)[: rule.cut_after])
                    return
                client.sendall(rhead + rbody)
        except (ConnectionError, OSError):
            return
        finally:
            client.close()
            if upstream is not None:
                upstream.close()
