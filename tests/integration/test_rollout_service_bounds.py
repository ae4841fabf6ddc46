"""The Wordle rollout service (examples/wordle/rollout_server.py) holds the coordinator's bounds against a client
on the network, and never serves without its credential unless told to.

Before, it had none of them: a 512 MiB body sent without the token was read in full before the 401 (FastAPI
reads a route's body before its dependencies run; RSS 466 -> 2,000 MiB); 300 silent connections made the
trainer's authenticated calls fail; a head sent one header every 5 s stayed open; and with
``WORDLE_ROLLOUT_TOKEN`` unset it served anyone, on any ``--host``, without a word. Now the token is checked
from the head (a refused body is never read), bodies are capped even with it, heads, bodies and TLS handshakes
are timed, connections are capped per address below the open-files limit, and it refuses to start without a
token unless ``--insecure``.

The service runs as a real process (:mod:`tests.support.rollout_service`: the production flags and serving
path, a scripted producer in place of vLLM); floods come from 127.0.0.2, the trainer from 127.0.0.1.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from deltasync.testing.launchers import free_port, stop_process_group, wait_until_serving
from deltasync.testing.tls import make_certificates
from examples.wordle.rollouts import RemoteRollouts
from tests.support.sockets import read_until_closed, rss_mib, send_head_then_body

TOKEN = "rollout-token-0123456789abcdef"
HEAD_S = 1.0
PER_PEER = 20
NOFILE = 128
FLOOD = 150
HUGE = 512 << 20


class _Service:
    """``python -m tests.support.rollout_service`` on a free port, with ``args``, its output in ``log``."""

    def __init__(self, tmp: Path, args: list[str], *, token: str | None = TOKEN, prefix: list[str] = ()) -> None:
        self.port = free_port()
        self.log = tmp / f"rollouts-{self.port}.log"
        tls = "--ssl-certfile" in args
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "WORDLE_ROLLOUT_TOKEN"}
        if token is not None:
            env["WORDLE_ROLLOUT_TOKEN"] = token
        cmd = [*prefix, sys.executable, "-m", "tests.support.rollout_service", "--port", str(self.port), *args]
        self._out: IO[bytes] = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, ca: Path | None = None) -> _Service:
        verify: bool | str = str(ca) if ca else True
        wait_until_serving(
            self.url + "/healthz", self.proc, "the rollout service", timeout_s=30, interval_s=0.05, log=self.log,
            verify=verify,
        )  # fmt: skip
        return self

    def stop(self) -> str:
        stop_process_group(self.proc, 5)
        self._out.close()
        return self.log.read_text()

    def rss_mib(self) -> float:
        return rss_mib(self.proc.pid)


@pytest.fixture
def services(tmp_path: Path) -> Iterator[list[_Service]]:
    started: list[_Service] = []
    yield started
    for service in started:
        if service.proc.poll() is None:
            service.stop()


def _start(services: list[_Service], tmp: Path, args: list[str], **kw: object) -> _Service:
    service = _Service(tmp, args, **kw)  # type: ignore[arg-type]
    services.append(service)
    return service


def _take_head(length: int, auth: str | None) -> bytes:
    lines = ["POST /v1/take HTTP/1.1", "Host: rollouts", "Content-Type: application/json", f"Content-Length: {length}"]
    lines += [f"Authorization: {auth}"] if auth is not None else []
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token-wrong-token", f"Bearer {TOKEN}x"])
def test_a_body_without_the_token_is_refused_from_its_head(
    services: list[_Service], tmp_path: Path, auth: str | None
) -> None:
    service = _start(services, tmp_path, []).wait()
    before = service.rss_mib()
    answer, sent = send_head_then_body(service.port, _take_head(HUGE, auth), body_byte=b" ")
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert b"connection: close" in answer.lower() and b"www-authenticate: Bearer" in answer
    assert answer.endswith(b'{"detail":"the rollout service needs its bearer token (WORDLE_ROLLOUT_TOKEN)"}')
    assert sent < 16 << 20 and service.rss_mib() - before < 20


def test_a_body_over_the_cap_is_refused_even_with_the_token(services: list[_Service], tmp_path: Path) -> None:
    service = _start(services, tmp_path, ["--max-body-bytes", "4096"]).wait()
    with socket.create_connection(("127.0.0.1", service.port)) as sock:
        sock.sendall(_take_head(HUGE, f"Bearer {TOKEN}"))
        answer = read_until_closed(sock, 3)
    assert answer.startswith(b"HTTP/1.1 413 ") and answer.endswith(b'{"detail":"request body over 4096 bytes"}')
    with socket.create_connection(("127.0.0.1", service.port)) as sock:  # no Content-Length: counted as read
        head = (
            f"POST /v1/take HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"1000\r\n" + b" " * 4096 + b"\r\n"
        sock.sendall(head.encode() + chunk * 2)
        answer = read_until_closed(sock, 3)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    trainer = RemoteRollouts(service.url, TOKEN)
    assert trainer.take(0, 1)[0]  # the trainer's take is well under the cap
    trainer.stop()


def test_silent_connections_cannot_starve_the_trainer(services: list[_Service], tmp_path: Path) -> None:
    args = ["--max-connections-per-peer", str(PER_PEER), "--request-head-timeout-s", str(HEAD_S)]
    service = _start(services, tmp_path, args, prefix=["prlimit", f"--nofile={NOFILE}:{NOFILE}"]).wait()
    opened = time.monotonic()
    flood = []
    for _ in range(FLOOD):
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.connect(("127.0.0.1", service.port))
        flood.append(sock)
    try:
        trainer = RemoteRollouts(service.url, TOKEN)
        groups, _ = trainer.take(0, 1)
        trainer.stop()
        served_s = time.monotonic() - opened
        answers: dict[socket.socket, tuple[bytes, float]] = {}
        pending = list(flood)
        while pending and time.monotonic() - opened < HEAD_S + 5:
            for sock in select.select(pending, [], [], 0.05)[0]:
                answers[sock] = (read_until_closed(sock, 1), time.monotonic() - opened)
                pending.remove(sock)
        assert not pending, f"{len(pending)} silent connections still open after {HEAD_S + 5} s"
    finally:
        for sock in flood:
            sock.close()
    assert len(groups) == 1 and served_s < HEAD_S, served_s
    refused = [s for a, s in answers.values() if a.startswith(b"HTTP/1.1 503 ")]
    silent = [s for a, s in answers.values() if a == b""]
    assert len(refused) == FLOOD - PER_PEER and max(refused) < HEAD_S, sorted(refused)[-3:]
    assert len(silent) == PER_PEER and min(silent) >= HEAD_S - 0.2, sorted(silent)
    log = service.stop()
    assert (
        "connection from 127.0.0.2 closed with 503: too many connections from 127.0.0.2 (20 open, "
        "max_connections_per_peer); retry after 1 s" in log
    )
    assert "connection from 127.0.0.2 closed: nothing received within 1 s (request_head_timeout_s)" in log


def test_a_head_sent_one_header_at_a_time_is_closed(services: list[_Service], tmp_path: Path) -> None:
    service = _start(services, tmp_path, ["--request-head-timeout-s", str(HEAD_S)]).wait()
    with socket.create_connection(("127.0.0.1", service.port)) as sock:
        t0 = time.monotonic()
        sock.sendall(b"GET /v1/stats HTTP/1.1\r\nHost: rollouts\r\n")
        sock.setblocking(False)
        answer = b""
        while not answer and time.monotonic() - t0 < HEAD_S + 3:
            if select.select([sock], [], [], 0.25)[0]:
                answer = read_until_closed(sock, 1)
                break
            sock.sendall(b"X-Slow: 1\r\n")
        held_s = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert answer.endswith(b'{"detail":"request head not received within 1 s (request_head_timeout_s)"}')
    assert HEAD_S - 0.2 <= held_s < HEAD_S + 1


def test_tls_handshakes_are_timed_and_the_trainer_is_served(services: list[_Service], tmp_path: Path) -> None:
    ca, cert, key = make_certificates(tmp_path / "tls")
    args = ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--tls-handshake-timeout-s", str(HEAD_S)]
    service = _start(services, tmp_path, args).wait(ca)
    with socket.create_connection(("127.0.0.1", service.port)) as silent:  # never sends a ClientHello
        t0 = time.monotonic()
        assert read_until_closed(silent, HEAD_S + 3) == b""
        closed_s = time.monotonic() - t0
    trainer = RemoteRollouts(service.url, TOKEN, str(ca))
    assert len(trainer.take(0, 1)[0]) == 1
    trainer.stop()
    assert HEAD_S - 0.2 <= closed_s < HEAD_S + 1
    assert "TLS handshake not completed within 1 s (tls_handshake_timeout_s)" in service.stop()


@pytest.mark.slow  # three processes, each importing the service (about 3 s each here)
def test_without_its_token_the_service_does_not_start(services: list[_Service], tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "examples.wordle.rollout_server", "--tokenizer", str(tmp_path / "none")]
    cmd += ["--vllm-url", "http://127.0.0.1:1", "--env-url", "http://127.0.0.1:1", "--host", "0.0.0.0"]
    env = {k: v for k, v in os.environ.items() if k != "WORDLE_ROLLOUT_TOKEN"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].endswith(
        "error: the rollout service refuses to start without a credential: set WORDLE_ROLLOUT_TOKEN (at least 16 "
        "characters; the trainer sends it as a bearer token), or pass --insecure to let anyone who reaches "
        "0.0.0.0:8800 take groups (development only)"
    )
    both = subprocess.run([*cmd, "--insecure"], env={**env, "WORDLE_ROLLOUT_TOKEN": TOKEN}, capture_output=True)
    assert both.returncode == 2 and b"--insecure would ignore WORDLE_ROLLOUT_TOKEN" in both.stderr
    insecure = _start(services, tmp_path, ["--insecure"], token=None).wait()  # the operator's explicit choice
    anyone = RemoteRollouts(insecure.url)
    assert len(anyone.take(0, 1)[0]) == 1
    anyone.stop()
    assert (
        "INSECURE: the rollout service runs without WORDLE_ROLLOUT_TOKEN (--insecure): anyone who reaches "
        f"127.0.0.1:{insecure.port} takes groups" in insecure.stop()
    )
