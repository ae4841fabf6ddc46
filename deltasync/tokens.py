"""Agent credentials bound to an agent id: ``dsa1.<agent_id>.<mac>``, an HMAC-SHA256 of the id under the
coordinator's secret (``DELTASYNC_AGENT_SECRET``). The coordinator recomputes the MAC, so it stores no token,
and a token works only for the id inside it: a heartbeat for another id is refused (403).

``deltasync token --agent-id vllm-0`` (with ``DELTASYNC_AGENT_SECRET`` set) prints an agent's token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

__all__ = ["AGENT_TOKEN_PREFIX", "agent_id_of", "make_agent_token"]

AGENT_TOKEN_PREFIX = "dsa1."
_AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MIN_SECRET_CHARS = 16


def _mac(secret: str, agent_id: str) -> str:
    digest = hmac.new(secret.encode(), b"deltasync-agent-token\0" + agent_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def make_agent_token(secret: str, agent_id: str) -> str:
    """The token of ``agent_id`` under ``secret``.

    Raises:
        ValueError: the id is not a valid agent id, or the secret is shorter than 16 characters.
    """
    if not _AGENT_ID.fullmatch(agent_id):
        raise ValueError(f"agent id {agent_id!r} must match {_AGENT_ID.pattern}")
    if len(secret) < _MIN_SECRET_CHARS:
        raise ValueError(f"the agent secret must have at least {_MIN_SECRET_CHARS} characters")
    return f"{AGENT_TOKEN_PREFIX}{agent_id}.{_mac(secret, agent_id)}"


def agent_id_of(secret: str, token: str) -> str | None:
    """The agent id a token is valid for under ``secret``, or ``None`` (compared in constant time)."""
    if not token.startswith(AGENT_TOKEN_PREFIX):
        return None
    agent_id, _, mac = token[len(AGENT_TOKEN_PREFIX) :].rpartition(".")
    if not _AGENT_ID.fullmatch(agent_id):
        return None
    return agent_id if hmac.compare_digest(mac.encode(), _mac(secret, agent_id).encode()) else None
