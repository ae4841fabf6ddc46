"""Coordinator settings, read from ``DELTASYNC_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .connections import KEPT_FOR_OTHERS
from .http import parse_trusted_proxies

__all__ = ["InsecureConfiguration", "Settings", "check_credentials"]


_MIN_SECRET_CHARS = 16


class InsecureConfiguration(ValueError):
    """The coordinator would start without credentials and ``insecure`` was not given."""


def _timeout(default: float, most: float, description: str) -> Any:
    """A connection timeout setting: more than 0, at most ``most`` seconds."""
    return Field(default, gt=0, le=most, description=description)


class Settings(BaseSettings):
    """Everything the coordinator reads at start-up. Each field is also a ``deltasync coordinator`` flag
    (secrets only from the environment).

    Fails closed: without ``publisher_token`` and ``agent_secret`` it refuses to start, unless ``insecure``.
    """

    model_config = SettingsConfigDict(env_prefix="DELTASYNC_", frozen=True)

    db: Path | str = Field(
        Path("deltasync-coordinator.db"),
        description="SQLite file (created; WAL mode; one coordinator), or a PostgreSQL URL "
        "postgresql://user:password@host:port/dbname (several coordinators may share it)",
    )
    store: str | None = Field(None, description="store URI, needed for garbage collection")
    s3_endpoint: str | None = Field(None, description="endpoint of an S3-compatible service, for an s3:// store")
    publisher_token: SecretStr | None = Field(None, description="bearer token to publish, lease and collect garbage")
    agent_secret: SecretStr | None = Field(
        None, description="HMAC key of the per-agent tokens (`deltasync token --agent-id ID`)"
    )
    read_token: SecretStr | None = Field(None, description="extra bearer token for read-only clients")
    metrics_token: SecretStr | None = Field(None, description="bearer token of the Prometheus scraper (else any)")
    insecure: bool = Field(False, description="run without any credential (development only; logged loudly)")
    max_wait_s: float = Field(60.0, gt=0, le=600, description="cap of a long-poll's wait_s")
    max_long_polls: int = Field(512, ge=1, le=100_000, description="concurrent long-polls; more get 503")
    agent_stale_after_s: float = Field(60.0, gt=0, description="an agent not seen this long is stale")
    agent_expire_after_s: float = Field(86_400.0, gt=0, description="an agent not seen this long is forgotten")
    plan_lease_s: float = Field(600.0, ge=0, description="GC keeps every object of a plan issued this recently")
    db_timeout_s: float = Field(5.0, gt=0, le=600, description="a request waits this long for the database; 503 after")
    max_body_bytes: int = Field(1 << 20, gt=0, description="larger request bodies get 413")
    max_header_bytes: int = Field(64 << 10, gt=0, description="larger request headers (all together) get 431")
    max_connections: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="open connections; more are refused with 503 (lowered to the open-files limit less 64)",
    )
    max_connections_per_peer: int = Field(
        1024,
        ge=1,
        description="open connections from one client address (a proxy or NAT is one); more are refused with 503 "
        "(kept 32 below max_connections)",
    )
    request_head_timeout_s: float = _timeout(
        10.0,
        600,
        "a request head not received this long after the connection opened (or after its first byte, between "
        "requests) gets 408 and the connection closes",
    )
    request_body_timeout_s: float = _timeout(
        30.0, 3600, "a request body not received this long after its head gets 408"
    )
    response_write_timeout_s: float = _timeout(
        30.0,
        3600,
        "a connection whose unsent answer has not shrunk for this long (its client reads none of it) is closed",
    )
    keep_alive_timeout_s: float = _timeout(5.0, 600, "a kept-alive connection idle this long is closed")
    tls_handshake_timeout_s: float = _timeout(
        5.0,
        600,
        "with ssl_certfile: a TLS handshake not completed this long after the connection opened is closed (every "
        "connection counts against the connection caps from its TCP accept)",
    )
    trusted_proxies: str = Field(
        "",
        description="comma-separated addresses or networks of reverse proxies whose X-Forwarded-For is believed "
        "(only the hop before them is used); by default none: every client is the socket's peer",
    )
    host: str = Field("127.0.0.1", description="interface `deltasync coordinator` binds")
    port: int = Field(8600, ge=0, le=65535, description="port `deltasync coordinator` binds")
    ssl_certfile: Path | None = Field(None, description="serve HTTPS with this certificate (PEM)")
    ssl_keyfile: Path | None = Field(None, description="the certificate's private key (PEM)")

    @field_validator("db", mode="before")
    @classmethod
    def _db_kind(cls, value: object) -> object:
        """A PostgreSQL URL stays a string (a ``Path`` would fold its ``//``); anything else is a SQLite path."""
        if isinstance(value, str) and value.startswith(("postgresql://", "postgres://")):
            return value
        return Path(value) if isinstance(value, str) else value

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies(cls, value: str) -> str:
        return ",".join(parse_trusted_proxies(value))

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: give both or neither")
        return self

    @model_validator(mode="after")
    def _room_for_long_polls(self) -> Settings:
        if self.max_connections < self.max_long_polls + KEPT_FOR_OTHERS:
            raise ValueError(
                f"max_connections ({self.max_connections}) must exceed max_long_polls ({self.max_long_polls}) by at "
                f"least {KEPT_FOR_OTHERS}: every long-poll holds a connection, and health checks and publishers "
                "need some too; raise max_connections or lower max_long_polls"
            )
        return self


def check_credentials(settings: Settings) -> None:
    """Fail closed: no publisher token or agent secret, no coordinator (unless ``insecure``).

    Raises:
        InsecureConfiguration: naming the variables to set.
    """
    values = {
        name: getattr(settings, name).get_secret_value() if getattr(settings, name) is not None else ""
        for name in ("publisher_token", "agent_secret", "read_token", "metrics_token")
    }
    missing = [f"DELTASYNC_{name.upper()}" for name in ("publisher_token", "agent_secret") if not values[name]]
    if settings.insecure:
        given = [f"DELTASYNC_{n.upper()}" for n, v in values.items() if v]
        if given:
            raise InsecureConfiguration(
                f"--insecure (DELTASYNC_INSECURE) would ignore the credentials set ({', '.join(given)}): drop "
                "one or the other"
            )
        return
    if missing:
        raise InsecureConfiguration(
            f"the coordinator refuses to start without credentials: set {' and '.join(missing)} (the agent "
            "secret signs per-agent tokens: `deltasync token --agent-id ID`), or pass --insecure for a "
            "throwaway development ledger"
        )
    for name, value in values.items():
        if value and (len(value.strip()) < _MIN_SECRET_CHARS or value != value.strip()):
            raise InsecureConfiguration(
                f"DELTASYNC_{name.upper()} must have at least {_MIN_SECRET_CHARS} characters and no surrounding "
                'whitespace (make one with: python -c "import secrets; print(secrets.token_urlsafe(32))")'
            )
