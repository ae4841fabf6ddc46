"""The agent's side of the engine boundary: administrative requests to a vLLM server signed with the engine
credential, never carrying it (the protocol is in :mod:`deltasync.vllm.guard`, its proofs in
:mod:`deltasync.engine_credential`)."""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections.abc import Generator

import httpx

from ..engine_credential import (
    ENGINE_AUTH_HEADER,
    ENGINE_PROOF_HEADER,
    GUARD_ROUTE,
    challenge_proof,
    request_mac,
    response_proof,
)
from ..errors import EngineUnproven

__all__ = ["EngineAuth"]


class EngineAuth(httpx.Auth):
    """``httpx`` authentication for a vLLM server guarded by deltasync: before its first request (and whenever the
    server says its nonce is stale) the client challenges the server to prove that it holds the credential, and
    sends nothing else to one that cannot; each request is then signed, and each answer must carry the server's
    signature. The credential itself never leaves this process, so a process that holds vLLM's port while vLLM is
    down learns nothing it could use.

    Thread-safe: one instance may sign the requests of several threads.

    Args:
        token: the engine credential (as the server was started with).

    Raises (from the request that met it):
        EngineUnproven: the server did not prove it holds the credential, or answered without its signature.
    """

    requires_request_body = True
    requires_response_body = True

    def __init__(self, token: str) -> None:
        self._token = token
        self._lock = threading.Lock()
        self._nonce: str | None = None
        self._counter = 0

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        for attempt in range(2):
            with self._lock:
                nonce = self._nonce
            if nonce is None:
                nonce = yield from self._challenge(request)
            with self._lock:
                self._counter += 1
                counter = self._counter
            target = request.url.raw_path.decode("ascii")
            body = hashlib.sha256(request.content).hexdigest()
            signed_ms = int(time.time() * 1000)
            mac = request_mac(self._token, (nonce, counter, signed_ms), request.method, target, body)
            request.headers[ENGINE_AUTH_HEADER] = f"v1 {nonce} {counter} {signed_ms} {mac}"
            response = yield request
            response.read()
            if response.status_code == 401 and _code(response) == "nonce" and attempt == 0:
                # the server restarted, the nonce aged, or a request came out of order: nothing of this answer is
                # believed; the next attempt proves the server again before it signs anything
                with self._lock:
                    if self._nonce == nonce:
                        self._nonce = None
                continue
            self._verify(request, response, nonce, counter)
            return

    def _challenge(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, str]:
        challenge = secrets.token_hex(16)
        probe = httpx.Request(
            "GET", request.url.copy_with(raw_path=f"{GUARD_ROUTE}?challenge={challenge}".encode("ascii"))
        )
        response = yield probe
        response.read()
        where = f"{request.url.scheme}://{request.url.netloc.decode('ascii')}"
        try:
            answer = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            answer = None
        if response.status_code != 200 or not isinstance(answer, dict):
            raise EngineUnproven(
                f"{where}: GET {GUARD_ROUTE} answered {response.status_code} {response.text[:200]!r}, not the "
                "deltasync guard's challenge answer: not a vLLM server started with VLLM_PLUGINS=deltasync (or "
                "another process holds its port); nothing was sent to it"
            )
        nonce, proof = answer.get("nonce"), answer.get("proof")
        if not isinstance(nonce, str) or not isinstance(proof, str) or len(nonce) > 256:
            raise EngineUnproven(
                f"{where}: the guard has no engine credential configured (or did not answer the challenge): "
                "start vLLM with DELTASYNC_ENGINE_TOKEN or DELTASYNC_ENGINE_TOKEN_FILE; nothing was sent to it"
            )
        if not secrets.compare_digest(challenge_proof(self._token, challenge, nonce), proof):
            raise EngineUnproven(
                f"{where}: the server did not prove it holds the engine credential (a wrong answer to the "
                "challenge): another process may hold vLLM's port, or it was started with another credential; "
                "nothing was sent to it"
            )
        with self._lock:
            self._nonce = nonce
        return nonce

    def _verify(self, request: httpx.Request, response: httpx.Response, nonce: str, counter: int) -> None:
        want = response_proof(
            self._token, nonce, counter, response.status_code, hashlib.sha256(response.content).hexdigest()
        )
        got = response.headers.get(ENGINE_PROOF_HEADER, "")
        if not secrets.compare_digest(want, got):
            with self._lock:
                self._nonce = None  # whoever answered, the next request proves the server again
            raise EngineUnproven(
                f"{request.method} {request.url}: the answer ({response.status_code}) is not signed by the engine: "
                "another process may hold vLLM's port; not believed"
            )


def _code(response: httpx.Response) -> str | None:
    try:
        answer = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return answer.get("code") if isinstance(answer, dict) else None
