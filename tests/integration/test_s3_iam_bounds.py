"""The multi-host demo's store (``python -m deltasync.testing.s3_iam``, which every host reaches) is bounded as the
coordinator is, attacked from the network: a real server on 127.0.0.1, its caps and timeouts lowered.

The attack: werkzeug's threaded development server gave each connection a thread for as long as its client
liked (300 half-sent heads held 300 threads), and read an unsigned body before refusing it. The promise: heads
that do not arrive in time get 408 and close, one address is capped (503), the server's threads do not grow
with its connections, a body the guard refuses (unsigned, or over ``--max-body-bytes`` by its Content-Length) is
refused from the head before a byte of it is read, and signed S3 requests still work.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltasync.testing.launchers import free_port, stop_process_group
from deltasync.testing.s3_iam import read_credentials
from tests.support.sockets import read_until_closed, send_head_then_body

BUCKET = "wordle-run"
HEAD_S = 1.0
PER_PEER = 20
MAX_BODY = 1 << 20
HUGE = 200 << 20


class _Store:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.credentials = tmp / "credentials"
        self.log = tmp / "s3.log"
        args = ["--host", "127.0.0.1", "--port", str(self.port), "--bucket", BUCKET, "--grant", "trainer=write"]
        args += ["--credentials", str(self.credentials), "--max-body-bytes", str(MAX_BODY)]
        args += ["--request-head-timeout-s", str(HEAD_S), "--max-connections-per-peer", str(PER_PEER)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "deltasync.testing.s3_iam", *args],
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the store did not listen within 60 s"
                time.sleep(0.1)

    def status(self, field: str) -> int:
        line = next(x for x in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1])


@pytest.fixture
def store(tmp_path: Path) -> Iterator[_Store]:
    server = _Store(tmp_path)
    yield server
    stop_process_group(server.proc, 5)


def test_half_sent_heads_hold_no_thread_and_time_out(store: _Store) -> None:
    threads = store.status("Threads:")
    held = []
    try:
        for _ in range(3 * PER_PEER):
            sock = socket.create_connection(("127.0.0.1", store.port), source_address=("127.0.0.2", 0))
            held.append(sock)
            sock.sendall(f"GET /{BUCKET} HTTP/1.1\r\nHost: store\r\n".encode())
        time.sleep(0.3)
        assert store.status("Threads:") <= threads + 2  # werkzeug: one more thread for each
        refused = read_until_closed(held[-1], 3)
        assert refused.startswith(b"HTTP/1.1 503 ") and b"max_connections_per_peer" in refused, refused[:300]
        answers = [read_until_closed(sock, HEAD_S + 3) for sock in held[:PER_PEER]]
    finally:
        for sock in held:
            sock.close()
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), {a[:40] for a in answers}
    assert answers[0].endswith(b'{"detail":"request head not received within 1 s (request_head_timeout_s)"}')


@pytest.mark.parametrize(
    ("authorization", "status", "code"),
    [
        ("", b"403", b"AccessDenied"),  # anonymous
        (
            "AWS4-HMAC-SHA256 Credential=AKIA/20260101/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;x-amz-date, Signature=00",
            b"400",
            b"EntityTooLarge",
        ),  # signed-looking, over the cap: refused by its length
    ],
)
def test_a_refused_body_is_never_read(store: _Store, authorization: str, status: bytes, code: bytes) -> None:
    rss = store.status("VmRSS:")
    head = f"PUT /{BUCKET}/run/x HTTP/1.1\r\nHost: store\r\nX-Amz-Date: 20260101T000000Z\r\nContent-Length: {HUGE}\r\n"
    head += f"Authorization: {authorization}\r\n" if authorization else ""
    answer, sent = send_head_then_body(store.port, f"{head}\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 " + status + b" ") and b"<Code>" + code + b"</Code>" in answer, answer[:400]
    assert b"connection: close" in answer.lower()
    assert sent < 16 << 20 and (store.status("VmRSS:") - rss) < 20 << 10  # KiB


def test_signed_requests_still_reach_moto(store: _Store, monkeypatch: pytest.MonkeyPatch) -> None:
    from deltasync.store import open_store

    for name, value in read_credentials(store.credentials / "trainer.env").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", store.url)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    s3 = open_store(f"s3://{BUCKET}/run")
    s3.put("published", b"the trainer's")
    assert s3.list() == ["published"] and s3.get("published") == b"the trainer's"


def test_each_store_lists_with_the_credentials_in_force_when_it_was_made(
    store: _Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two stores in one process, made under other credentials: the second lists with its own (boto3's default
    session keeps the first credentials it resolves; a store listing as another user is a wrong answer)."""
    from deltasync.errors import StoreError
    from deltasync.store import open_store

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", store.url)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODY0000000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-key")
    with pytest.raises(StoreError, match="InvalidAccessKeyId"):
        open_store(f"s3://{BUCKET}/run").list()
    for name, value in read_credentials(store.credentials / "trainer.env").items():
        monkeypatch.setenv(name, value)
    s3 = open_store(f"s3://{BUCKET}/run")
    s3.put("published", b"the trainer's")
    assert s3.list() == ["published"]
