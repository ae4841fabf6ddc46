"""The credentials test and benchmark coordinators run with: public, so never use them anywhere else."""

from __future__ import annotations

from ..tokens import make_agent_token

__all__ = ["AGENT_SECRET", "AGENT_TOKEN", "PUBLISHER_TOKEN", "TOKENS_ENV", "agent_env", "agent_token"]

PUBLISHER_TOKEN = "pub-secret-token"
AGENT_SECRET = "agent-secret-0123456789abcdef"
"""The coordinator's HMAC key for agent tokens."""
AGENT_TOKEN = make_agent_token(AGENT_SECRET, "agent-0")
"""The token of agent id ``agent-0`` (the AgentConfig default)."""
TOKENS_ENV = {"DELTASYNC_PUBLISHER_TOKEN": PUBLISHER_TOKEN, "DELTASYNC_AGENT_SECRET": AGENT_SECRET}
"""What a coordinator process is started with."""


def agent_token(agent_id: str) -> str:
    """The token bound to ``agent_id`` under the test coordinators' secret."""
    return make_agent_token(AGENT_SECRET, agent_id)


def agent_env(agent_id: str) -> dict[str, str]:
    """The environment of an agent process with id ``agent_id``."""
    return {"DELTASYNC_AGENT_TOKEN": agent_token(agent_id)}
