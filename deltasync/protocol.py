"""Pydantic models of the coordinator's HTTP API (docs/PROTOCOL.md), shared by service and client.

Only JSON crosses this boundary, never weights. Names follow their role: ``*Create`` is a request
body, ``*Public`` a response.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .manifest import DeltaManifest

__all__ = [
    "MAX_VERSION",
    "AgentHeartbeat",
    "AgentPublic",
    "AgentsPublic",
    "AgentState",
    "ErrorPublic",
    "GcPublic",
    "HealthPublic",
    "PlanPublic",
    "VersionCreate",
    "VersionKind",
    "VersionPublic",
    "VersionsPublic",
]

MAX_VERSION = 99_999_999
"""Versions are ``v{N:08d}`` in the store."""

VersionKind = Literal["delta", "anchor"]
AgentState = Literal["idle", "fetching", "applying", "error", "paused"]
Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
AgentId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class VersionCreate(_Model):
    """``POST /v1/versions``: a published object (a delta or an anchor) the publisher committed."""

    version: Version
    kind: VersionKind
    base_version: Version | None = Field(None, description="what a delta applies to; null for an anchor")
    manifest_key: str = Field(
        max_length=256, pattern=r"^v\d{8}/(anchor/)?manifest\.json$", description="store key of the manifest"
    )
    bytes: int = Field(ge=0, description="bytes of all shard files")
    nnz: int = Field(ge=0, description="elements stored (changed ones, or all for an anchor)")
    tensors: int = Field(ge=0, description="tensors in the model")
    checksum: str = Field(pattern=r"^sha256:[0-9a-f]{64}$", description="sha256 of manifest.json")

    @field_validator("base_version")
    @classmethod
    def _base_matches_kind(cls, base: int | None, info: ValidationInfo) -> int | None:
        kind, version = info.data.get("kind"), info.data.get("version")
        if kind == "delta" and (base is None or (version is not None and base >= version)):
            raise ValueError(f"a delta needs base_version < version ({version}), got {base}")
        if kind == "anchor" and base is not None:
            raise ValueError(f"an anchor has no base_version, got {base}")
        return base

    @field_validator("manifest_key")
    @classmethod
    def _key_matches_version(cls, key: str, info: ValidationInfo) -> str:
        kind, version = info.data.get("kind"), info.data.get("version")
        if version is not None and kind is not None:
            expected = f"v{version:08d}/" + ("anchor/" if kind == "anchor" else "") + "manifest.json"
            if key != expected:
                raise ValueError(f"manifest_key must be {expected} for {kind} v{version}")
        return key

    @classmethod
    def for_manifest(cls, manifest: DeltaManifest) -> VersionCreate:
        """The registration of a committed object (``checksum``: sha256 of its ``manifest.json``)."""
        prefix = f"v{manifest.version:08d}/" + ("anchor/" if manifest.kind == "anchor" else "")
        return cls(
            version=manifest.version,
            kind=manifest.kind,
            base_version=manifest.base_version,
            manifest_key=prefix + "manifest.json",
            bytes=manifest.total_bytes,
            nnz=manifest.nnz,
            tensors=len(manifest.tensors),
            checksum="sha256:" + hashlib.sha256(manifest.to_json()).hexdigest(),
        )


class VersionPublic(VersionCreate):
    """A registered object."""

    created_at: datetime


class VersionsPublic(_Model):
    """A list of registered objects, ascending by (version, kind)."""

    versions: list[VersionPublic]
    latest: int | None = Field(description="the newest registered version, or null if none")


class PlanPublic(_Model):
    """``GET /v1/plan``: what an agent at ``from_version`` fetches to reach ``to_version``, in order."""

    from_version: int | None
    to_version: int
    steps: list[VersionPublic] = Field(description="an anchor first (if any), then deltas, in apply order")
    bytes: int = Field(description="total bytes to fetch")
    route: Literal["none", "deltas", "anchor"] = Field(description="none: already there")


class AgentHeartbeat(_Model):
    """``POST /v1/agents/{agent_id}/heartbeat``."""

    applied_version: Version | None = Field(description="the version the engine serves; null if none yet")
    state: AgentState
    last_error: str | None = Field(None, max_length=4096)
    timings: dict[str, float] = Field(default_factory=dict, max_length=32, description="seconds, e.g. pause")


class AgentPublic(_Model):
    """One agent in the fleet view."""

    agent_id: str
    applied_version: int | None
    state: AgentState
    last_error: str | None
    timings: dict[str, float]
    last_seen: datetime
    lag: int | None = Field(description="latest - applied_version; null when either is unknown")
    stale: bool = Field(description="not seen for longer than the stale timeout")


class AgentsPublic(_Model):
    """``GET /v1/agents``."""

    agents: list[AgentPublic]
    latest: int | None


class GcPublic(_Model):
    """``GET /v1/gc/candidates`` and ``POST /v1/gc``: objects no live agent or plan can still need."""

    candidates: list[VersionPublic]
    deleted: list[VersionPublic] = Field(default_factory=list)
    keep_from: int | None = Field(description="deltas above this version and the newest anchor are kept")


class HealthPublic(_Model):
    """``GET /healthz``."""

    status: Literal["ok"]
    latest: int | None
    schema_version: int


class ErrorPublic(_Model):
    """Every 4xx/5xx body."""

    detail: str
