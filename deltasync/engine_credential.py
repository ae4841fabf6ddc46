"""The engine credential and what both sides of the engine boundary compute with it: the agent
(:class:`deltasync.targets.EngineAuth`) and the guard in front of vLLM (:mod:`deltasync.vllm.guard`, which says how
the protocol goes). Where the credential comes from, the headers that carry proofs of it, and the proofs; the
credential itself never travels.

Nothing here imports vLLM or an HTTP library: the agent side and the engine side each import this module, never
each other.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

__all__ = [
    "ENGINE_AUTH_HEADER",
    "ENGINE_PROOF_HEADER",
    "ENGINE_TOKEN_ENV",
    "ENGINE_TOKEN_FILE_ENV",
    "ENGINE_TOKEN_HEADER",
    "GUARD_ROUTE",
    "MIN_TOKEN_CHARS",
    "challenge_proof",
    "load_engine_token",
    "request_mac",
    "response_proof",
]

ENGINE_TOKEN_ENV = "DELTASYNC_ENGINE_TOKEN"
"""The engine credential itself."""
ENGINE_TOKEN_FILE_ENV = "DELTASYNC_ENGINE_TOKEN_FILE"
"""A file holding the engine credential (read once, surrounding white space stripped)."""
ENGINE_TOKEN_HEADER = "X-DeltaSync-Engine-Token"
"""The request header that carries it (an operator's tool; deltasync's clients sign instead)."""
ENGINE_AUTH_HEADER = "X-DeltaSync-Engine-Auth"
"""A signed administrative request: ``v1 <nonce> <counter> <ms> <mac>`` (:func:`request_mac`)."""
ENGINE_PROOF_HEADER = "X-DeltaSync-Engine-Proof"
"""The server's signature of its answer to a signed request (:func:`response_proof`)."""
GUARD_ROUTE = "/deltasync/guard"
"""``GET``: open; says that the guard is installed; with ``?challenge=`` the server proves it holds the credential."""
MIN_TOKEN_CHARS = 16
"""The shortest credential accepted."""


def load_engine_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The engine credential from ``DELTASYNC_ENGINE_TOKEN`` or ``DELTASYNC_ENGINE_TOKEN_FILE`` (``None``: neither
    is set).

    Raises:
        ValueError: both are set, the file cannot be read, or the credential is shorter than 16 characters.
    """
    env = os.environ if environ is None else environ
    value, path = env.get(ENGINE_TOKEN_ENV), env.get(ENGINE_TOKEN_FILE_ENV)
    if value and path:
        raise ValueError(f"set {ENGINE_TOKEN_ENV} or {ENGINE_TOKEN_FILE_ENV}, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read(4096).strip()
        except OSError as exc:
            raise ValueError(f"{ENGINE_TOKEN_FILE_ENV}={path}: cannot read the engine credential ({exc})") from exc
    if not value:
        return None
    if len(value) < MIN_TOKEN_CHARS:
        where = ENGINE_TOKEN_FILE_ENV if path else ENGINE_TOKEN_ENV
        raise ValueError(
            f"{where}: the engine credential has {len(value)} characters, at least {MIN_TOKEN_CHARS} are needed; "
            'make one with: python -c "import secrets; print(secrets.token_urlsafe(32))"'
        )
    return value


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode("utf-8"), "\n".join(parts).encode("utf-8"), hashlib.sha256).hexdigest()


def challenge_proof(token: str, challenge: str, nonce: str) -> str:
    """What only a holder of ``token`` answers to the client's ``challenge`` with the server ``nonce``."""
    return _mac(token, "deltasync-engine-proof-v1", challenge, nonce)


def request_mac(token: str, signed: tuple[str, int, int], method: str, target: str, body_sha256: str) -> str:
    """The signature of one administrative request: ``signed`` is (nonce, counter, the client's time in ms);
    ``target`` the path and, after ``?``, the raw query."""
    nonce, counter, signed_ms = signed
    parts = (nonce, str(counter), str(signed_ms), method.upper(), target, body_sha256)
    return _mac(token, "deltasync-engine-request-v1", *parts)


def response_proof(token: str, nonce: str, counter: int, status: int, body_sha256: str) -> str:
    """The server's signature of its answer to the signed request ``(nonce, counter)``."""
    return _mac(token, "deltasync-engine-response-v1", nonce, str(counter), str(status), body_sha256)
