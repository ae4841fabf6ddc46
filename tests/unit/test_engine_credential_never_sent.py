"""The engine credential never leaves the agent: whoever holds vLLM's port while vLLM is down (any process of the
inference host, where environments run model-written code) learns nothing it can use, and is never driven.

The agent's client signs each administrative request after the server proved it holds the credential
(:class:`deltasync.targets.EngineAuth`); the guard (:class:`deltasync.vllm.guard.EngineGuard`) verifies the
signature over the whole request, refuses replays, and signs its answers."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deltasync.engine_credential import ENGINE_AUTH_HEADER, ENGINE_PROOF_HEADER
from deltasync.errors import EngineUnproven
from deltasync.targets import EngineAuth, HttpVllmTarget
from deltasync.vllm.guard import EngineGuard
from tests.conftest import ServerThread
from tests.support.recording_server import RecordingServer

TOKEN = "engine-credential-for-the-tests-0123456789"


class _Recorder:
    """An ASGI app standing for vLLM's admin routes: answers ``{"path": ..., "body": ...}`` and keeps every
    request's headers and body as the app received them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[bytes, bytes], bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((scope["path"], dict(scope["headers"]), body))
        answer = json.dumps({"path": scope["path"], "body": body.decode()}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})


@contextlib.contextmanager
def _served(app: Any, auth: EngineAuth | None = None) -> Iterator[httpx.Client]:
    """``app`` behind a real uvicorn on 127.0.0.1, and a client of it (signing with ``auth``)."""
    with ServerThread(app, lifespan="off") as server, httpx.Client(base_url=server.url, auth=auth) as client:
        yield client


def _client(app: Any, token: str = TOKEN) -> contextlib.AbstractContextManager[httpx.Client]:
    return _served(app, EngineAuth(token))


def test_a_signed_request_reaches_the_engine_and_its_answer_is_signed() -> None:
    inner = _Recorder()
    with _client(EngineGuard(inner, token=TOKEN)) as client:
        r = client.post("/update_weights?x=1", json={"update_info": {"objects": []}})
        assert r.status_code == 200 and r.json() == {
            "path": "/update_weights",
            "body": '{"update_info":{"objects":[]}}',
        }
        assert ENGINE_PROOF_HEADER.lower() in {k.lower() for k in r.headers}
        assert client.post("/pause").status_code == 200  # the same nonce, the next counter
    for _, headers, _ in inner.seen:
        assert all(TOKEN.encode() not in v for v in headers.values())


def test_a_captured_request_cannot_be_replayed_or_altered() -> None:
    """A caller on the port who saw one signed request (headers and body) sends it again, and with another
    body: neither reaches the engine."""
    inner = _Recorder()
    guard = EngineGuard(inner, token=TOKEN)
    with _client(guard) as client:
        assert client.post("/update_weight_version", json={"new_version": "7"}).status_code == 200
    path, headers, body = inner.seen[-1]
    auth = headers[ENGINE_AUTH_HEADER.lower().encode()].decode()
    with _served(guard) as attacker:
        again = attacker.post(path, content=body, headers={ENGINE_AUTH_HEADER: auth})
        assert again.status_code == 401 and again.json()["code"] == "nonce"
        altered = attacker.post(path, content=b'{"new_version": "99"}', headers={ENGINE_AUTH_HEADER: auth})
        assert altered.status_code == 403 and ENGINE_PROOF_HEADER.lower() not in {k.lower() for k in altered.headers}
    assert len(inner.seen) == 1


def test_a_restarted_engine_refuses_the_old_nonce_and_the_client_proves_it_again() -> None:
    """vLLM restarted (a new guard, a new secret): the agent's next request is refused as stale, signed, and the
    client challenges the new server and goes on, without a failure the agent would see."""
    auth = EngineAuth(TOKEN)
    first, second = _Recorder(), _Recorder()
    for guard, path in ((EngineGuard(first, token=TOKEN), "/pause"), (EngineGuard(second, token=TOKEN), "/resume")):
        with _served(guard, auth) as client:
            assert client.post(path).status_code == 200
    assert [p for p, _, _ in second.seen] == ["/resume"]


def test_a_server_with_another_credential_is_never_driven() -> None:
    inner = _Recorder()
    with _client(EngineGuard(inner, token="another-engines-credential-xyz")) as client:
        with pytest.raises(EngineUnproven, match="did not prove it holds the engine credential"):
            client.post("/pause")
    assert inner.seen == []


def _http(status: int, payload: dict[str, Any], headers: str = "") -> bytes:
    body = json.dumps(payload).encode()
    return (
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{headers}"
        "connection: close\r\n\r\n"
    ).encode() + body


@pytest.fixture(
    params=["401-to-everything", "fake-challenge-answer", "copies-the-challenge", "200-to-everything"],
)
def impostor(request: pytest.FixtureRequest) -> Iterator[RecordingServer]:
    """A process of another user that bound vLLM's port while vLLM is down: it records every byte it receives and
    answers as ``request.param`` says."""

    def answer(raw: bytes) -> bytes:
        if request.param == "401-to-everything":
            return _http(401, {"error": "needs the engine credential (X-DeltaSync-Engine-Token)"})
        if request.param == "200-to-everything":
            return _http(200, {"is_paused": False, "results": []})
        challenge = raw.split(b"challenge=", 1)[1].split(b" ", 1)[0].decode() if b"challenge=" in raw else ""
        if request.param == "copies-the-challenge":
            return _http(200, {"guard": "deltasync", "nonce": challenge, "proof": challenge})
        return _http(200, {"guard": "deltasync", "credential_configured": True, "nonce": "n", "proof": "0" * 64})

    with RecordingServer(answer) as server:
        yield server


def test_an_impostor_on_the_engines_port_never_receives_the_credential(impostor: RecordingServer) -> None:
    """The sidecar's engine (HttpVllmTarget) meets the impostor at start and at every sync: it is reported as
    EngineUnproven, never driven (no pause, no update, no 'restoring it from an anchor'), and the credential is
    in none of the bytes the impostor received."""
    target = HttpVllmTarget(impostor.url, engine_token=TOKEN, timeout_s=5)
    try:
        for _ in range(3):
            with pytest.raises(EngineUnproven):
                target.state()
            with pytest.raises(EngineUnproven):
                target.pause()
    finally:
        target.close()
    received = bytes(impostor.received)
    assert received, "the target never reached the impostor"
    assert TOKEN.encode() not in received and b"X-DeltaSync-Engine-Token" not in received
    assert b"POST /pause" not in received and b"/update_weights" not in received


def test_a_signed_client_reads_inference_routes_too() -> None:
    """An operator's signed client (the Wordle demo's final check) also generates through it: the guard
    verifies and signs every signed request, inference routes included."""
    inner = _Recorder()
    with _client(EngineGuard(inner, token=TOKEN)) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}).json()["path"] == "/v1/completions"
        assert client.get("/health").status_code == 200


def _signed_headers(path: str, body: bytes, *, counter: int, signed_ms: int, nonce: str) -> dict[str, str]:
    import hashlib

    from deltasync.engine_credential import request_mac

    mac = request_mac(TOKEN, (nonce, counter, signed_ms), "POST", path, hashlib.sha256(body).hexdigest())
    return {ENGINE_AUTH_HEADER: f"v1 {nonce} {counter} {signed_ms} {mac}"}


def _nonce(client: httpx.Client) -> str:
    answer = client.get("/deltasync/guard", params={"challenge": "ab" * 16}).json()
    return str(answer["nonce"])


def test_a_relay_cannot_reorder_delay_or_replay_signed_requests() -> None:
    """A relay on vLLM's port holds a signed request back and delivers it after a later one, or late, or twice
    (after the guard has seen many other nonces): each is refused; the engine sees the requests in the order
    they were signed, each once, and only while fresh."""
    import time

    inner = _Recorder()
    guard = EngineGuard(inner, token=TOKEN)
    with _served(guard) as client:
        nonce = _nonce(client)
        now = int(time.time() * 1000)
        held = _signed_headers("/update_weight_version", b"5", counter=1, signed_ms=now, nonce=nonce)
        later = _signed_headers("/update_weight_version", b"6", counter=2, signed_ms=now, nonce=nonce)
        assert client.post("/update_weight_version", content=b"6", headers=later).status_code == 200
        late = client.post("/update_weight_version", content=b"5", headers=held)
        assert late.status_code == 401 and late.json()["code"] == "nonce"  # out of order
        stale = _signed_headers("/pause", b"", counter=3, signed_ms=now - 60_000, nonce=nonce)
        assert client.post("/pause", headers=stale).status_code == 401  # signed a minute ago
        for _ in range(300):  # many other clients' nonces do not push this one's state out
            _nonce(client)
        assert client.post("/update_weight_version", content=b"6", headers=later).status_code == 401  # replay
    assert [body for _, _, body in inner.seen] == [b"6"]


def test_a_junk_signature_costs_no_body_read_and_bodies_are_capped() -> None:
    """A caller without the credential sends large bodies under a made-up or a real (open) nonce: refused by the
    header alone, or by its length, before the body is read."""
    import time

    from deltasync.vllm.guard import MAX_SIGNED_BODY

    inner = _Recorder()
    with _served(EngineGuard(inner, token=TOKEN)) as client:
        big = b"x" * (MAX_SIGNED_BODY + 1)
        junk = client.post("/pause", content=big, headers={ENGINE_AUTH_HEADER: "v1 a.b.c 1 1 00"})
        assert junk.status_code == 401 and junk.json()["code"] == "nonce"
        headers = _signed_headers("/pause", big, counter=1, signed_ms=int(time.time() * 1000), nonce=_nonce(client))
        assert client.post("/pause", content=big, headers=headers).status_code == 413
    assert inner.seen == []


async def _raises(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        raise ValueError("update_info carries allow_rollback: the policy is the claim's")


def test_an_error_in_the_engine_comes_back_signed() -> None:
    """vLLM answers a route that raises with a 500 from Starlette's outermost middleware, outside the guard: the
    guard answers it itself, signed, so the agent reads the engine's refusal instead of taking it for an
    impostor's."""
    with _client(EngineGuard(_raises, token=TOKEN)) as client:
        r = client.post("/update_weights", json={"update_info": {"allow_rollback": True}})
    assert r.status_code == 500 and "the policy is the claim's" in r.json()["error"]
