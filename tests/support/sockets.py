"""A client on the network, byte by byte: raw sockets that attack a listener's bounds, and what the server
process spends on them."""

from __future__ import annotations

import socket
from pathlib import Path

__all__ = ["connect_from", "read_until_closed", "rss_mib", "send_head_then_body"]


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sends until it closes the connection (EOF or reset); fails if it neither answers nor closes
    within ``timeout_s``."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(
            f"the server neither answered nor closed within {timeout_s} s (got {data[:200]!r})"
        ) from None
    return data


def send_head_then_body(port: int, head: bytes, body_byte: bytes = b"a") -> tuple[bytes, int]:
    """Send a request ``head`` to ``127.0.0.1:port`` and not one byte of its body, read the answer until the server
    closes, then go on sending the body as an attacker would (``body_byte`` repeated, 1 MiB at a time, up to
    64 MiB) until the closed connection refuses it. Returns the answer and how many body bytes were sent."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        answer = read_until_closed(sock, 3)
        sent = 0
        try:
            while sent < 64 << 20:
                sock.sendall(body_byte * (1 << 20))
                sent += 1 << 20
        except OSError:
            pass
    return answer, sent


def connect_from(source: str, port: int, n: int, first: bytes = b"") -> list[socket.socket]:
    """``n`` non-blocking TCP connections from the loopback address ``source`` (127.0.0.2 and up are other
    clients to a per-address cap) to ``127.0.0.1:port``, each having sent ``first``."""
    socks = []
    for _ in range(n):
        sock = socket.socket()
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))  # completes in the listen backlog, accepted or not
        if first:
            sock.sendall(first)
        sock.setblocking(False)
        socks.append(sock)
    return socks


def rss_mib(pid: int) -> float:
    """The resident memory of process ``pid``, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")
