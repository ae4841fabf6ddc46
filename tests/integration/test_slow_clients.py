"""Slow clients cannot starve the coordinator: a real ``deltasync coordinator`` at an open-files limit
of 512 under a bounded slowloris (hundreds of sockets sending a request head, or a body, a few bytes at a time).

The attack: a head sent one header every 15 s, and 600 unfinished heads against nofile 512. Unbounded, these stay
open forever and make ``/healthz`` and authenticated reads fail with connection resets, with nothing logged. The
promise: heads and bodies that do not arrive in time get 408 and are closed, open connections are capped overall
and per client address below the open-files limit (503, logged at a bounded rate, counted in ``/metrics``), and
the health check, reads and long-polls go on answering.

Client addresses: the attackers connect from other loopback addresses (127.0.0.2 and up; Linux routes all of
127/8 to ``lo``), so the per-address cap applies to them and not to the test's own requests from 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deltasync_coordinator.connections import LOG_BURST

from deltasync.testing.launchers import CoordinatorProcess
from tests.conftest import PUBLISHER_TOKEN, TOKENS_ENV, agent_token
from tests.support.sockets import connect_from

pytestmark = pytest.mark.slow

NOFILE = 512
CAP = NOFILE - 64  # the connection cap the coordinator derives from its open-files limit
HEAD_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 3.0
KEEP_ALIVE_S = 2.0
PER_PEER = 150
DRIP_EVERY_S = 0.5
ARGS = [
    *("--request-head-timeout-s", str(HEAD_TIMEOUT_S)),
    *("--request-body-timeout-s", str(BODY_TIMEOUT_S)),
    *("--keep-alive-timeout-s", str(KEEP_ALIVE_S)),
    *("--max-connections-per-peer", str(PER_PEER)),
    *("--max-long-polls", "64"),
    *("--max-wait-s", "30"),
]
PUB = {"Authorization": f"Bearer {PUBLISHER_TOKEN}"}
AGT = {"Authorization": f"Bearer {agent_token('reader')}"}
AGT_LINE = f"Authorization: Bearer {agent_token('reader')}"
SLOW_HEAD = b"GET /v1/versions HTTP/1.1\r\nHost: coordinator\r\n"
SLOW_BODY = (
    b"POST /v1/agents/slow/heartbeat HTTP/1.1\r\nHost: coordinator\r\nContent-Type: application/json\r\n"
    b"Content-Length: 200\r\n\r\n{"
)


class _Slow:
    """``n`` sockets from ``source`` that each sent ``start`` and then add ``drip`` every :data:`DRIP_EVERY_S`
    (see :func:`_dripping`), and what the server answered on each (read until it closes)."""

    def __init__(self, port: int, source: str, n: int, start: bytes, drip: bytes) -> None:
        self.source, self.drip = source, drip
        self.opened = time.monotonic()
        self.socks = connect_from(source, port, n, start)
        self.answers: dict[socket.socket, bytes] = {}
        self.first_byte_s: dict[socket.socket, float] = {}
        self.closed: set[socket.socket] = set()

    def send_more(self) -> None:
        for sock in self.socks:
            if sock not in self.closed:
                try:
                    sock.send(self.drip)
                except OSError:  # refused or timed out: the server closed it; the reader sees why
                    self.closed.add(sock)

    def read_until_closed(self, timeout_s: float) -> None:
        """Read every socket until the server closes it; fails if one is still open after ``timeout_s``."""
        pending = list(self.socks)
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            readable, _, _ = select.select(pending, [], [], 0.1)
            for sock in readable:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if data:
                    self.first_byte_s.setdefault(sock, time.monotonic() - self.opened)
                    self.answers[sock] = self.answers.get(sock, b"") + data
                else:
                    self.closed.add(sock)
                    pending.remove(sock)
        assert not pending, f"{len(pending)} slow connections from {self.source} still open after {timeout_s} s"

    def statuses(self) -> list[str]:
        return [self.answers.get(s, b"(closed without an answer)").split(b"\r\n", 1)[0].decode() for s in self.socks]

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


@pytest.fixture
def dripping() -> Iterator[list[_Slow]]:
    """A thread that makes every slow group in the list send a little more every :data:`DRIP_EVERY_S`."""
    groups: list[_Slow] = []
    stop = threading.Event()

    def drip() -> None:
        while not stop.wait(DRIP_EVERY_S):
            for group in list(groups):
                group.send_more()

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    yield groups
    stop.set()
    thread.join(5)
    for group in groups:
        group.close()


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


def _detail(answer: bytes) -> str:
    return answer.split(b"\r\n\r\n", 1)[1].decode()


def test_healthz_and_reads_answer_through_a_slowloris_at_nofile_512(tmp_path: Path, dripping: list[_Slow]) -> None:
    prefix = ["prlimit", f"--nofile={NOFILE}:{NOFILE}"]
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=ARGS, prefix=prefix) as proc:
        port = int(proc.url.rsplit(":", 1)[1])
        long_poll: list[httpx.Response] = []  # a legitimate long-poll outlives every read timeout
        poller = threading.Thread(
            target=lambda: long_poll.append(
                httpx.get(proc.url + "/v1/versions", params={"after": 5, "wait_s": 5}, headers=AGT, timeout=30)
            )
        )
        poller.start()

        # 1. One address opens 300 slow heads (twice its cap), another sends 20 heads and then dribbles bodies.
        fresh = httpx.Client(base_url=proc.url, timeout=5, limits=httpx.Limits(max_keepalive_connections=0))
        heads = _Slow(port, "127.0.0.2", 2 * PER_PEER, SLOW_HEAD, b"X-Slow: 1\r\n")
        bodies = _Slow(port, "127.0.0.3", 20, SLOW_BODY, b" ")
        dripping += [heads, bodies]
        with fresh:  # a new connection for each request: new connections get in
            metrics = fresh.get("/metrics", headers=PUB)
            health = fresh.get("/healthz")
            read = fresh.get("/v1/versions", headers=AGT)
        answered_s = time.monotonic() - heads.opened
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        assert read.status_code == 200, read.text
        # they answered while the slow connections were open (held to the per-address cap), before any timed out
        assert _metric(metrics.text, "deltasync_connections_open") >= PER_PEER + 20
        assert answered_s < HEAD_TIMEOUT_S, f"/healthz and a read took {answered_s:.1f} s under the slowloris"

        heads.read_until_closed(HEAD_TIMEOUT_S + 5)
        bodies.read_until_closed(BODY_TIMEOUT_S + 5)
        statuses = heads.statuses()
        assert statuses.count("HTTP/1.1 408 Request Timeout") == PER_PEER, sorted(set(statuses))
        assert statuses.count("HTTP/1.1 503 Service Unavailable") == PER_PEER, sorted(set(statuses))
        timed_out = [s for s in heads.socks if heads.answers[s].startswith(b"HTTP/1.1 408")]
        refused = [s for s in heads.socks if heads.answers[s].startswith(b"HTTP/1.1 503")]
        assert min(heads.first_byte_s[s] for s in timed_out) >= HEAD_TIMEOUT_S - 0.2  # not before the timeout
        assert max(heads.first_byte_s[s] for s in refused) < HEAD_TIMEOUT_S  # refused at once
        assert _detail(heads.answers[timed_out[0]]) == (
            '{"detail":"request head not received within 3 s (request_head_timeout_s)"}'
        )
        assert _detail(heads.answers[refused[0]]) == (
            f'{{"detail":"too many connections from 127.0.0.2 ({PER_PEER} open, max_connections_per_peer); '
            'retry after 1 s"}'
        )
        assert b"\r\nretry-after: 1\r\n" in heads.answers[refused[0]]
        assert b"\r\ndeltasync-run-id: run-" in heads.answers[refused[0]]
        assert bodies.statuses() == ["HTTP/1.1 408 Request Timeout"] * 20
        assert _detail(bodies.answers[bodies.socks[0]]) == (
            '{"detail":"request body not received within 3 s (request_body_timeout_s)"}'
        )
        poller.join(30)
        assert long_poll and long_poll[0].status_code == 200 and long_poll[0].json()["versions"] == []

        # 2. Four addresses, each under its own cap, together over the overall cap: the rest are refused, a
        # health check at the full cap is refused in words (not reset, not left hanging), and answers again
        # once the heads time out.
        spread = [_Slow(port, f"127.0.0.{4 + i}", 140, SLOW_HEAD, b"X-Slow: 1\r\n") for i in range(4)]
        dripping += spread
        at_cap = httpx.get(proc.url + "/healthz", timeout=5)
        assert at_cap.status_code == 503, at_cap.text
        assert at_cap.json()["detail"] == f"too many connections ({CAP} open, max_connections); retry after 1 s"
        for group in spread:
            group.read_until_closed(HEAD_TIMEOUT_S + 5)
        statuses = [status for group in spread for status in group.statuses()]
        held, over = statuses.count("HTTP/1.1 408 Request Timeout"), statuses.count("HTTP/1.1 503 Service Unavailable")
        assert held + over == 4 * 140, sorted(set(statuses))
        assert CAP - 5 <= held <= CAP and over >= 4 * 140 - CAP, (held, over)
        assert httpx.get(proc.url + "/healthz", timeout=5).status_code == 200

        text = httpx.get(proc.url + "/metrics", headers=PUB, timeout=5).text
        assert _metric(text, 'deltasync_connections_refused_total{reason="max_connections_per_peer"}') == PER_PEER
        assert _metric(text, 'deltasync_connections_refused_total{reason="max_connections"}') == over + 1
        assert _metric(text, 'deltasync_requests_timed_out_total{phase="head"}') == PER_PEER + held
        assert _metric(text, 'deltasync_requests_timed_out_total{phase="body"}') == 20
    log = proc.log_path.read_text()
    lines = [line for line in log.splitlines() if "deltasync.coordinator: connection from" in line]
    assert any(
        "connection from 127.0.0.2 closed with 503: too many connections from 127.0.0.2 (150 open, "
        "max_connections_per_peer); retry after 1 s" in line
        for line in lines
    ), log[-3000:]
    assert any(f"closed with 503: too many connections ({CAP} open, max_connections)" in line for line in lines)
    assert any(
        "connection from 127.0.0.2 closed with 408: request head not received within 3 s" in line for line in lines
    )
    assert any(
        "connection from 127.0.0.3 closed with 408: request body not received within 3 s" in line for line in lines
    )
    # over 1,000 refusals and timeouts cost at most LOG_BURST lines of each kind (the metrics count them all)
    assert len(lines) <= 4 * LOG_BURST, len(lines)


def _until_closed(
    socks: list[socket.socket], t0: float, timeout_s: float, drip: socket.socket | None = None
) -> list[tuple[bytes, float]]:
    """What the server sent on each socket, and when (seconds after ``t0``) it closed it; meanwhile ``drip``
    sends a byte every :data:`DRIP_EVERY_S`."""
    data = {s: b"" for s in socks}
    closed: dict[socket.socket, float] = {}
    deadline, dripped = time.monotonic() + timeout_s, time.monotonic()
    while len(closed) < len(socks) and time.monotonic() < deadline:
        if drip is not None and drip not in closed and time.monotonic() - dripped > DRIP_EVERY_S:
            dripped = time.monotonic()
            with contextlib.suppress(OSError):  # closed by the server: the reader sees it
                drip.send(b" ")
        readable, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.1)
        for sock in readable:
            chunk = sock.recv(65536)
            data[sock] += chunk
            if not chunk:
                closed[sock] = time.monotonic() - t0
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} connections still open after {timeout_s} s"
    return [(data[s], closed[s]) for s in socks]


def test_silent_idle_and_half_sent_connections_are_closed(tmp_path: Path) -> None:
    """uvicorn arms no timer before a connection's first byte: a socket that connects and sends nothing stayed
    open for good. It is closed after the head timeout, without an answer (it asked nothing); so is a pipelined
    head left unfinished behind a long-poll (a 408 would read as the long-poll's answer), a body that dribbles on
    after its 413, and a connection idle after the end of such a body (its bytes turned uvicorn's keep-alive
    timer off). A kept-alive connection closes after ``keep_alive_timeout_s``."""
    long_poll = f"GET /v1/versions?after=5&wait_s=20 HTTP/1.1\r\nHost: coordinator\r\n{AGT_LINE}\r\n\r\n"
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=ARGS) as proc:
        port = int(proc.url.rsplit(":", 1)[1])
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        silent, kept, pipelined, oversized, answered_early = socks
        answered_early.sendall(b"POST /v1/versions HTTP/1.1\r\nHost: coordinator\r\nContent-Length: 1100000\r\n\r\n")
        early = answered_early.recv(65536)  # 413 by its Content-Length, before the body is read; then the body
        answered_early.sendall(b" " * 1_100_000)
        t0 = time.monotonic()
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: coordinator\r\n\r\n")
        pipelined.sendall(long_poll.encode() + b"GET /healthz HTTP/1.1\r\nHo")
        oversized.sendall(b"POST /v1/versions HTTP/1.1\r\nHost: coordinator\r\nContent-Length: 10000000\r\n\r\n{")
        answers = _until_closed(socks, t0, max(HEAD_TIMEOUT_S, BODY_TIMEOUT_S) + 5, drip=oversized)
        for sock in socks:
            sock.close()
        (nothing, silent_s), (health, kept_s), (cut, pipelined_s), (too_large, oversized_s), (_, early_s) = answers
        assert nothing == b"" and HEAD_TIMEOUT_S - 0.2 <= silent_s < HEAD_TIMEOUT_S + 2
        assert health.startswith(b"HTTP/1.1 200 OK") and health.endswith(b'"reasons":[]}'), health
        assert KEEP_ALIVE_S - 0.2 <= kept_s < HEAD_TIMEOUT_S
        assert cut == b"" and HEAD_TIMEOUT_S - 0.2 <= pipelined_s < HEAD_TIMEOUT_S + 2
        assert too_large.startswith(b"HTTP/1.1 413 ") and b"request body over 1048576 bytes" in too_large, too_large
        # no second answer (a 408 status line) after the 413; "408" alone also matches a random run id's hex
        assert b"HTTP/1.1 408" not in too_large and BODY_TIMEOUT_S - 0.2 <= oversized_s < BODY_TIMEOUT_S + 2
        assert early.startswith(b"HTTP/1.1 413 ") and HEAD_TIMEOUT_S - 0.2 <= early_s < HEAD_TIMEOUT_S + 2, early
        text = httpx.get(proc.url + "/metrics", headers=PUB, timeout=5).text
        assert _metric(text, 'deltasync_requests_timed_out_total{phase="head"}') == 3
        assert _metric(text, 'deltasync_requests_timed_out_total{phase="body"}') == 1
    log = proc.log_path.read_text()
    assert "connection from 127.0.0.1 closed: nothing received within 3 s (request_head_timeout_s)" in log
    assert "connection from 127.0.0.1 closed: request head not received within 3 s (request_head_timeout_s)" in log
    assert "connection from 127.0.0.1 closed: request body not received within 3 s (request_body_timeout_s)" in log
