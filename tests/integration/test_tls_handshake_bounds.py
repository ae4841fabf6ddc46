"""TLS handshakes count against the coordinator's connection caps and are timed, from the TCP accept.

asyncio (handed ``ssl=`` by uvicorn) waited 60 s for a ClientHello and called the HTTP protocol only after the
handshake, so the connection caps and read timeouts never saw a connection that stayed silent: at an
open-files limit of 512, one address holding 600 such connections made a real agent's ``/healthz`` and
heartbeat fail with ``Connection reset by peer`` for the whole flood, with nothing logged. The same flood over
plain HTTP was served. Now the coordinator's protocol serves TLS itself: each connection is admitted by the
ledger at its accept (past the caps: closed at once), its handshake is bounded by ``tls_handshake_timeout_s``,
and both are logged and counted like the request read timeouts.

A real ``deltasync coordinator`` with a certificate made in the test; the flood comes from another loopback
address (127.0.0.2) so that the per-address cap applies to it and not to the agent on 127.0.0.1.
"""

from __future__ import annotations

import re
import select
import socket
import ssl
import time
from pathlib import Path

import httpx

from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.testing.launchers import CoordinatorProcess
from deltasync.testing.tls import make_certificates
from tests.conftest import PUBLISHER_TOKEN, TOKENS_ENV, agent_token
from tests.support.sockets import connect_from

NOFILE = 128  # caps in force: 64 connections overall, 32 kept from one address
PER_PEER = 20
FLOOD = 150  # more than the open-files limit: before, the server could accept nothing else
HANDSHAKE_S = 2.0
HEAD_S = 1.0
PUB = {"Authorization": f"Bearer {PUBLISHER_TOKEN}"}


def _tls_args(tmp_path: Path) -> tuple[Path, list[str]]:
    ca, cert, key = make_certificates(tmp_path / "tls")
    args = [
        *("--ssl-certfile", str(cert), "--ssl-keyfile", str(key)),
        *("--tls-handshake-timeout-s", str(HANDSHAKE_S)),
        *("--request-head-timeout-s", str(HEAD_S)),
        *("--max-connections-per-peer", str(PER_PEER)),
        *("--max-long-polls", "16"),
    ]
    return ca, args


def _closed_after(socks: list[socket.socket], opened: float, timeout_s: float) -> list[float]:
    """Seconds from ``opened`` until the server closed each socket (EOF or reset); fails if one stays open."""
    pending, closed = list(socks), {}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        readable, _, _ = select.select(pending, [], [], 0.05)
        for sock in readable:
            try:
                data = sock.recv(4096)
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            assert data == b"", f"the server sent {data[:80]!r} to a connection that never sent a ClientHello"
            closed[sock] = time.monotonic() - opened
            pending.remove(sock)
    assert not pending, f"{len(pending)} silent TLS connections still open after {timeout_s} s"
    return [closed[s] for s in socks]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


def test_silent_tls_connections_cannot_starve_an_agent(tmp_path: Path) -> None:
    ca, args = _tls_args(tmp_path)
    prefix = ["prlimit", f"--nofile={NOFILE}:{NOFILE}"]
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=args, prefix=prefix, ca_bundle=ca) as proc:
        port = int(proc.url.rsplit(":", 1)[1])
        opened = time.monotonic()
        flood = connect_from("127.0.0.2", port, FLOOD)  # silent: never a ClientHello
        try:
            with CoordinatorClient(
                proc.url, token=agent_token("edge"), ca_bundle=str(ca), retry=RetryPolicy(retries=0, timeout_s=5)
            ) as agent:
                health = agent.health()
                status = agent.heartbeat("edge", applied_version=None, state="idle")
            answered_s = time.monotonic() - opened
            closed_s = _closed_after(flood, opened, HANDSHAKE_S + 5)
        finally:
            for sock in flood:
                sock.close()
        assert health["status"] == "ok" and status.agent_id == "edge"
        assert answered_s < HANDSHAKE_S, f"the agent was served {answered_s:.1f} s into the flood"
        at_once = [s for s in closed_s if s < HANDSHAKE_S - 0.5]
        timed = [s for s in closed_s if s >= HANDSHAKE_S - 0.2]
        assert len(at_once) == FLOOD - PER_PEER and len(timed) == PER_PEER, sorted(closed_s)
        metrics = httpx.get(proc.url + "/metrics", headers=PUB, verify=ssl.create_default_context(cafile=ca)).text
        assert _metric(metrics, 'deltasync_connections_refused_total{reason="max_connections_per_peer"}') == 130
        assert _metric(metrics, 'deltasync_requests_timed_out_total{phase="handshake"}') == PER_PEER
        assert _metric(metrics, "deltasync_connections_open") == 1  # this scrape
    log = proc.log_path.read_text()
    assert (
        "connection from 127.0.0.2 closed: too many connections from 127.0.0.2 (20 open, max_connections_per_peer); "
        "retry after 1 s" in log
    )
    assert "connection from 127.0.0.2 closed: TLS handshake not completed within 2 s (tls_handshake_timeout_s)" in log
    assert "Uvicorn running on https://127.0.0.1:" in log


def test_after_its_handshake_a_tls_connection_meets_the_read_timeouts(tmp_path: Path) -> None:
    """The handshake's clock ends where the head's begins: a client that completes its handshake and then sends
    nothing is closed after ``request_head_timeout_s``; one that speaks plain HTTP to the TLS port is dropped;
    every place is given back."""
    ca, args = _tls_args(tmp_path)
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=args, ca_bundle=ca) as proc:
        port = int(proc.url.rsplit(":", 1)[1])
        context = ssl.create_default_context(cafile=ca)
        opened = time.monotonic()
        quiet = context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1")
        assert quiet.recv(4096) == b""  # closed without an answer: it asked nothing
        quiet_s = time.monotonic() - opened
        quiet.close()
        assert HEAD_S - 0.2 <= quiet_s < HANDSHAKE_S, quiet_s
        with socket.create_connection(("127.0.0.1", port)) as clear:
            clear.sendall(b"GET /healthz HTTP/1.1\r\nHost: coordinator\r\n\r\n")
            clear.settimeout(HANDSHAKE_S + 2)
            try:
                answer = clear.recv(4096)
            except ConnectionResetError:
                answer = b""
        assert not answer.startswith(b"HTTP/"), answer  # never answered in clear
        time.sleep(0.2)
        metrics = httpx.get(proc.url + "/metrics", headers=PUB, verify=context).text
        assert _metric(metrics, "deltasync_connections_open") == 1  # this scrape
    assert "closed: nothing received within 1 s (request_head_timeout_s)" in proc.log_path.read_text()
