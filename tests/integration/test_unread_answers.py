"""A client that sends requests and never reads the answers holds nothing: a real ``deltasync coordinator`` on
127.0.0.1, attacked from other loopback addresses (127.0.0.2 and up) with a tiny receive buffer.

The attack: pipeline thousands of ``GET /healthz`` on each connection and never read. Once the answers exceed
the kernel's buffers, uvicorn's answer waits for a drain that never comes and no clock runs (the read timeouts
stop once a request is parsed, the keep-alive clock starts only after a complete answer), so the connections
held their places under the caps for as long as the client liked and real clients got 503. The promise: at most
``MAX_PIPELINED_REQUESTS`` requests wait on one connection (the next is answered 503 in its turn and the
connection closes), and a connection whose unsent answer does not shrink for ``response_write_timeout_s`` is
aborted, logged and counted (``phase="write"``). A long-poll, which writes nothing while it waits, is untouched.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deltasync_coordinator.http import MAX_PIPELINED_REQUESTS

from deltasync.testing.credentials import PUBLISHER_TOKEN, TOKENS_ENV
from deltasync.testing.launchers import CoordinatorProcess, free_port, stop_process_group, wait_until_serving

WRITE_TIMEOUT_S = 2.0
PER_PEER = 4
ARGS = [
    *("--response-write-timeout-s", str(WRITE_TIMEOUT_S)),
    *("--max-connections-per-peer", str(PER_PEER)),
    *("--max-connections", "36", "--max-long-polls", "1", "--max-wait-s", "10"),
    *("--request-head-timeout-s", "2", "--request-body-timeout-s", "2", "--keep-alive-timeout-s", "2"),
]
PUB = {"Authorization": f"Bearer {PUBLISHER_TOKEN}"}
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: coordinator\r\n\r\n"
OPENAPI = f"GET /openapi.json HTTP/1.1\r\nHost: coordinator\r\nAuthorization: Bearer {PUBLISHER_TOKEN}\r\n\r\n".encode()


@pytest.fixture
def opened() -> Iterator[list[socket.socket]]:
    """The test's sockets, closed at the end whatever happens."""
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


def _never_reading(port: int, source: str, opened: list[socket.socket]) -> socket.socket:
    """A connection from ``source`` with a 1 KiB receive buffer, which the test never reads."""
    sock = socket.socket()
    opened.append(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _healthz_from(port: int, source: str) -> str:
    """The status line a fresh connection from ``source`` gets for ``GET /healthz``."""
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: coordinator\r\nConnection: close\r\n\r\n")
        return sock.recv(4096).split(b"\r\n", 1)[0].decode()


def _wait_admitted(port: int, source: str, timeout_s: float) -> float:
    """Seconds until a fresh connection from ``source`` is answered 200 (its address's cap has room again)."""
    t0 = time.monotonic()
    while (status := _healthz_from(port, source)) != "HTTP/1.1 200 OK":
        assert status == "HTTP/1.1 503 Service Unavailable", status
        assert time.monotonic() - t0 < timeout_s, f"{source} still refused after {timeout_s} s: {status}"
        time.sleep(0.2)
    return time.monotonic() - t0


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


def _read_all(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    out = b""
    while data := sock.recv(65536):
        out += data
    return out


def _read_to_the_end(sock: socket.socket, timeout_s: float) -> None:
    """Read ``sock`` until the server's end closes (EOF or reset); fails if it is still open after ``timeout_s``."""
    with contextlib.suppress(ConnectionResetError):
        _read_all(sock, timeout_s)


def test_a_deep_pipeline_is_answered_up_to_the_cap_then_503_and_closed(
    tmp_path: Path, opened: list[socket.socket]
) -> None:
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=ARGS) as proc:
        # the adversary's shape: thousands pipelined on each connection, never read, the per-address cap full
        held = [_never_reading(proc.port, "127.0.0.2", opened) for _ in range(PER_PEER)]
        for sock in held:
            sock.settimeout(5)
            try:
                sock.sendall(HEALTHZ * 24000)
            except OSError:  # the server closed it after its 503 (a reset once it had stopped reading)
                pass
        # each connection stops at the cap and closes: the address gets in again at once, not after any timeout
        assert _wait_admitted(proc.port, "127.0.0.2", 10) < WRITE_TIMEOUT_S

        # a client that reads sees the answers in order: those within the cap, then the refusal, then the close
        with socket.create_connection(("127.0.0.1", proc.port), source_address=("127.0.0.3", 0)) as sock:
            sock.sendall(HEALTHZ * 200)
            answers = re.findall(rb"HTTP/1\.1 (\d{3}) [^\r]*\r\n(?:[^\r]+\r\n)*\r\n(\{[^}]*\})", _read_all(sock, 10))
        statuses = [status for status, _ in answers]
        assert statuses[-1] == b"503" and set(statuses[:-1]) == {b"200"}, statuses
        assert MAX_PIPELINED_REQUESTS < len(statuses) <= MAX_PIPELINED_REQUESTS + 2, len(statuses)
        assert answers[-1][1].decode() == (
            f'{{"detail":"more than {MAX_PIPELINED_REQUESTS} requests pipelined on one connection '
            "(max_pipelined_requests); send each request after the answer to the one before, or open another "
            'connection"}'
        )
        metrics = httpx.get(proc.url + "/metrics", headers=PUB, timeout=5).text
        refused = 'deltasync_requests_refused_total{reason="max_pipelined_requests"}'
        assert _metric(metrics, refused) == PER_PEER + 1
    assert (
        "WARNING deltasync.coordinator: connection from 127.0.0.3 closed with 503: more than "
        f"{MAX_PIPELINED_REQUESTS} requests pipelined on one connection (max_pipelined_requests)"
    ) in proc.log_path.read_text()


def test_answers_never_read_are_cut_after_the_write_timeout(tmp_path: Path, opened: list[socket.socket]) -> None:
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=ARGS) as proc:
        # within the pipelining cap (a few requests at a time), answers that outgrow the kernel's buffers: each
        # connection's answer then waits in the server, unread
        held = [_never_reading(proc.port, "127.0.0.2", opened) for _ in range(PER_PEER)]
        polls: list[tuple[float, httpx.Response]] = []  # a long-poll writes nothing while it waits: never cut

        def poll() -> None:
            t0 = time.monotonic()
            params = {"after": 0, "wait_s": 2 * WRITE_TIMEOUT_S}
            answer = httpx.get(proc.url + "/v1/versions", params=params, headers=PUB, timeout=30)
            polls.append((time.monotonic() - t0, answer))

        def flood(sock: socket.socket) -> None:
            sock.settimeout(1)
            try:
                for _ in range(100):
                    sock.sendall(OPENAPI * 4)
                    time.sleep(0.05)
            except OSError:  # the server stopped reading (its answer is stuck), or cut the connection
                pass

        senders = [threading.Thread(target=flood, args=(sock,)) for sock in held] + [threading.Thread(target=poll)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(30)
        # within the write timeout (and the time the flood took to get stuck), the address gets in again
        _wait_admitted(proc.port, "127.0.0.2", WRITE_TIMEOUT_S + 8)
        metrics = httpx.get(proc.url + "/metrics", headers=PUB, timeout=5).text
        assert _metric(metrics, 'deltasync_requests_timed_out_total{phase="write"}') == PER_PEER
        assert _metric(metrics, 'deltasync_requests_refused_total{reason="max_pipelined_requests"}') == 0
        for sock in held:
            _read_to_the_end(sock, 5)  # the server's side is gone: what was unsent is dropped
        [(waited_s, answer)] = polls
        assert answer.status_code == 200 and answer.json()["versions"] == [], answer.text
        assert waited_s >= 2 * WRITE_TIMEOUT_S - 0.5
    log = proc.log_path.read_text()
    assert "Exception in ASGI application" not in log, log[-3000:]  # the app saw its client go, wrote no more
    assert re.search(
        r"WARNING deltasync\.coordinator: connection from 127\.0\.0\.2 closed: answer not read within 2 s "
        r"\(response_write_timeout_s; \d+ bytes unsent\)",
        log,
    ), log[-3000:]


def test_the_rollout_service_keeps_taking_through_deep_pipelines_never_read(
    tmp_path: Path, opened: list[socket.socket]
) -> None:
    """The Wordle rollout service serves with the same protocol: 36 connections from 9 addresses (each address at
    its cap, together the overall cap) pipeline ``GET /healthz`` (open without the token) and never read; the
    trainer's authenticated take is answered."""
    token = "rollout-token-0123456789abcdef"
    port = free_port()
    args = ["--port", str(port), "--max-connections", "36", "--max-connections-per-peer", str(PER_PEER)]
    args += ["--request-head-timeout-s", "2", "--request-body-timeout-s", "2", "--response-write-timeout-s", "2"]
    env = {**os.environ, "WORDLE_ROLLOUT_TOKEN": token}
    log = tmp_path / "rollouts.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.rollout_service", *args],
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url + "/healthz", proc, "the rollout service", timeout_s=30, interval_s=0.05, log=log)
        held = [_never_reading(port, f"127.0.0.{2 + i // PER_PEER}", opened) for i in range(9 * PER_PEER)]

        def flood(sock: socket.socket) -> None:
            sock.settimeout(5)
            with contextlib.suppress(OSError):  # the service closed it after its 503
                sock.sendall(HEALTHZ * 24000)

        senders = [threading.Thread(target=flood, args=(sock,)) for sock in held]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(30)
        deadline = time.monotonic() + 10  # each flooding connection closes once its answers within the cap are out
        while True:
            take = httpx.post(
                url + "/v1/take",
                json={"trainer_version": 0, "count": 1, "timeout_s": 5},
                headers={"Authorization": f"Bearer {token}"},
                timeout=10,
            )
            if take.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert take.status_code == 200 and len(take.json()["groups"]) == 1, take.text
    finally:
        stop_process_group(proc, 5)
    assert (
        "connection from 127.0.0.2 closed with 503: more than "
        f"{MAX_PIPELINED_REQUESTS} requests pipelined on one connection (max_pipelined_requests)"
    ) in log.read_text()
