"""Coordinator settings, read from ``DELTASYNC_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]


class Settings(BaseSettings):
    """Everything the coordinator reads at start-up. Each field is also a ``deltasync coordinator`` flag."""

    model_config = SettingsConfigDict(env_prefix="DELTASYNC_", frozen=True)

    db: Path = Field(Path("deltasync-coordinator.db"), description="SQLite file (created; WAL mode)")
    store: str | None = Field(None, description="store URI, needed for garbage collection")
    publisher_token: SecretStr | None = Field(None, description="bearer token to publish and collect garbage")
    agent_token: SecretStr | None = Field(None, description="bearer token to send heartbeats")
    read_token: SecretStr | None = Field(None, description="extra bearer token for reads")
    read_requires_token: bool = Field(False, description="reads need one of the tokens")
    max_wait_s: float = Field(60.0, gt=0, le=600, description="cap of a long-poll's wait_s")
    agent_stale_after_s: float = Field(60.0, gt=0, description="an agent not seen this long is stale")
    max_body_bytes: int = Field(1 << 20, gt=0, description="larger request bodies get 413")
    max_header_bytes: int = Field(64 << 10, gt=0, description="larger request headers (all together) get 431")
    host: str = Field("127.0.0.1", description="interface `deltasync coordinator` binds")
    port: int = Field(8600, ge=0, le=65535, description="port `deltasync coordinator` binds")
