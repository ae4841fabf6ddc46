"""The Wordle environment (examples/wordle/env_server.py, which ``make demo`` and ``make demo-hosts`` start) serves
only the holders of ``WORDLE_ENV_TOKEN``, bounded as the coordinator is, and never starts without its token
unless told to. Attacked from the network: a real ``python -m examples.wordle.env_server`` on 127.0.0.1.

The attack: plain uvicorn answered every route without a credential, kept a head sent one header every 2 s open
for good, and read a 300 MiB body into memory before anything refused it. The promise: the token is checked from
the head (401 before any body byte is read), bodies are capped even with it (413), heads that do not arrive in
time are closed (408), connections are capped per client address (503), and the clients that the demos start
(:func:`~examples.wordle.env_server.env_client`) send the token.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deltasync.testing.launchers import free_port, stop_process_group, wait_until_serving
from examples.wordle.env_server import env_client
from tests.support.sockets import read_until_closed, rss_mib, send_head_then_body

TOKEN = "env-token-0123456789abcdef"
HEAD_S = 1.0
PER_PEER = 3
HUGE = 300 << 20


class _Env:
    """``python -m examples.wordle.env_server`` on a free port with ``args`` and ``token``, its output in a log."""

    def __init__(self, tmp: Path, args: list[str], token: str | None = TOKEN) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"env-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if k != "WORDLE_ENV_TOKEN"}
        if token is not None:
            env["WORDLE_ENV_TOKEN"] = token
        self.cmd = [sys.executable, "-m", "examples.wordle.env_server", "--port", str(self.port), *args]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, env=env, stdout=out, stderr=out, start_new_session=True)

    def wait(self) -> _Env:
        wait_until_serving(
            self.url + "/healthz", self.proc, "the environment", timeout_s=30, interval_s=0.05, log=self.log
        )
        return self

    def rss_mib(self) -> float:
        return rss_mib(self.proc.pid)


@pytest.fixture
def envs() -> Iterator[list[_Env]]:
    started: list[_Env] = []
    yield started
    for env in started:
        stop_process_group(env.proc, 5)


def test_only_the_token_holder_plays_and_its_clients_send_the_token(
    tmp_path: Path, envs: list[_Env], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _Env(tmp_path, [])
    envs.append(env.wait())
    bare = httpx.post(env.url + "/v1/sessions", json={"seed": 1}, timeout=10)
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert bare.json() == {"detail": "the Wordle environment needs its bearer token (WORDLE_ENV_TOKEN)"}
    wrong = httpx.post(env.url + "/v1/sessions", json={"seed": 1}, headers={"Authorization": "Bearer x" * 4})
    assert wrong.status_code == 401
    assert httpx.get(env.url + "/healthz", timeout=10).json()["status"] == "ok"  # the health check stays open

    monkeypatch.setenv("WORDLE_ENV_TOKEN", TOKEN)
    with env_client(env.url) as client:  # what the rollout workers and the trainer use
        obs = client.post("/v1/sessions", json={"seed": 0}).raise_for_status().json()
        step = client.post(f"/v1/sessions/{obs['session_id']}/guess", json={"guess": "crane"}).raise_for_status()
    assert step.json()["valid"]


def test_a_body_without_the_token_is_refused_from_its_head(tmp_path: Path, envs: list[_Env]) -> None:
    env = _Env(tmp_path, [])
    envs.append(env.wait())
    before = env.rss_mib()
    head = f"POST /v1/sessions/{'0' * 32}/guess HTTP/1.1\r\nHost: env\r\nContent-Type: application/json\r\n"
    answer, sent = send_head_then_body(env.port, f"{head}Content-Length: {HUGE}\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 401 ") and b"connection: close" in answer.lower(), answer[:300]
    assert sent < 16 << 20 and env.rss_mib() - before < 20
    # with the token, a body over the cap is refused by its length, before it is read
    with socket.create_connection(("127.0.0.1", env.port)) as sock:
        sock.sendall(f"{head}Authorization: Bearer {TOKEN}\r\nContent-Length: {HUGE}\r\n\r\n".encode())
        answer = read_until_closed(sock, 3)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
    assert answer.endswith(b'{"detail":"request body over 16384 bytes"}')


def test_slow_heads_are_closed_and_one_address_is_capped(tmp_path: Path, envs: list[_Env]) -> None:
    args = ["--request-head-timeout-s", str(HEAD_S), "--max-connections", "64"]
    env = _Env(tmp_path, [*args, "--max-connections-per-peer", str(PER_PEER)])
    envs.append(env.wait())
    slow = []
    try:
        for _ in range(PER_PEER + 1):
            sock = socket.create_connection(("127.0.0.1", env.port), source_address=("127.0.0.2", 0))
            slow.append(sock)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: env\r\n")  # a head never finished
        t0 = time.monotonic()
        refused = read_until_closed(slow[-1], 3)
        assert refused.startswith(b"HTTP/1.1 503 "), refused[:300]
        assert b"too many connections from 127.0.0.2 (3 open, max_connections_per_peer)" in refused
        assert httpx.get(env.url + "/healthz", timeout=5).status_code == 200  # another address gets in meanwhile
        for sock in slow[:-1]:
            sock.sendall(b"X-Slow: 1\r\n")
            answer = read_until_closed(sock, HEAD_S + 3)
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
            assert answer.endswith(b'{"detail":"request head not received within 1 s (request_head_timeout_s)"}')
        assert time.monotonic() - t0 < HEAD_S + 3
    finally:
        for sock in slow:
            sock.close()


def test_it_refuses_to_start_without_its_token_unless_insecure(tmp_path: Path, envs: list[_Env]) -> None:
    bare = _Env(tmp_path, ["--host", "0.0.0.0"], token=None)
    assert bare.proc.wait(30) == 2
    assert (
        "error: the Wordle environment refuses to start without a credential: set WORDLE_ENV_TOKEN (at least 16 "
        "characters; each rollout worker sends it as a bearer token), or pass --insecure to let anyone who reaches "
        f"0.0.0.0:{bare.port} play, read and fork its games (development only)"
    ) in bare.log.read_text()
    both = _Env(tmp_path, ["--insecure"])
    assert both.proc.wait(30) == 2
    assert "--insecure would ignore WORDLE_ENV_TOKEN, which is set: drop one or the other" in both.log.read_text()
    short = _Env(tmp_path, [], token="short")
    assert short.proc.wait(30) == 2
    assert "WORDLE_ENV_TOKEN must be at least 16 characters" in short.log.read_text()
    insecure = _Env(tmp_path, ["--insecure"], token=None)
    envs.append(insecure.wait())
    assert httpx.post(insecure.url + "/v1/sessions", json={"seed": 1}, timeout=10).status_code == 201
    assert (
        "INSECURE: the Wordle environment runs without WORDLE_ENV_TOKEN (--insecure): anyone who reaches "
        f"127.0.0.1:{insecure.port} plays, reads and forks its games and fills its sessions. Never do this on a "
        "shared network."
    ) in insecure.log.read_text()
