"""Pydantic models of the coordinator's HTTP API (docs/PROTOCOL.md), shared by service and client.

Only JSON crosses this boundary, never weights. Names follow their role: ``*Create`` is a request body,
``*Public`` a response. Every integer is capped at 2**63 - 1 and every float must be finite (NaN and
Infinity are refused with 422), so nothing that passes validation can break the ledger or a client.
"""

from __future__ import annotations

import builtins
import hashlib
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .layout import manifest_key
from .manifest import DeltaManifest
from .vocab import MAX_INT, MAX_VERSION, AgentState, ObjectKind

__all__ = [
    "AGENT_ID_PATTERN",
    "MAX_ERROR_CHARS",
    "RUN_HEADER",
    "LEASE_HEADER",
    "AgentHeartbeat",
    "AgentPublic",
    "AgentsPublic",
    "ErrorPublic",
    "GcPublic",
    "HealthPublic",
    "LeaseCreate",
    "LeasePublic",
    "PlanPublic",
    "VersionCreate",
    "VersionPublic",
    "VersionsPublic",
]

RUN_HEADER = "Deltasync-Run-Id"
"""Every coordinator response names the run (the ledger's identity) in this header; clients pin it."""
LEASE_HEADER = "Deltasync-Lease"
"""A publisher's registrations carry its lease id in this header (fencing)."""
AGENT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_ERROR_CHARS = 2048
"""``last_error`` is at most this long (agents truncate; the coordinator refuses longer with 422)."""

Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Seconds = Annotated[float, Field(ge=0, le=1e9)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class VersionCreate(_Model):
    """``POST /v1/versions``: a published object (a delta, an anchor, or a squash: a delta over several versions
    beside the chain) the publisher committed."""

    version: Version
    kind: ObjectKind
    base_version: Version | None = Field(None, description="what a delta or squash applies to; null for an anchor")
    manifest_key: str = Field(
        max_length=256,
        pattern=r"^v\d{8}/(anchor/|squash-\d{8}/)?manifest\.json$",
        description="store key of the manifest",
    )
    bytes: Count = Field(description="bytes of all shard files")
    nnz: Count = Field(description="elements stored (changed ones, or all for an anchor)")
    tensors: Count = Field(description="tensors in the model")
    checksum: str = Field(pattern=r"^sha256:[0-9a-f]{64}$", description="sha256 of manifest.json")

    @field_validator("base_version")
    @classmethod
    def _base_matches_kind(cls, base: int | None, info: ValidationInfo) -> int | None:
        kind, version = info.data.get("kind"), info.data.get("version")
        if kind in ("delta", "squash") and (base is None or (version is not None and base >= version)):
            raise ValueError(f"a {kind} needs base_version < version ({version}), got {base}")
        if kind == "anchor" and base is not None:
            raise ValueError(f"an anchor has no base_version, got {base}")
        return base

    @field_validator("manifest_key")
    @classmethod
    def _key_matches_version(cls, key: str, info: ValidationInfo) -> str:
        kind, version, base = info.data.get("kind"), info.data.get("version"), info.data.get("base_version")
        if version is not None and kind is not None and (kind != "squash" or base is not None):
            expected = manifest_key(version, kind, base)
            if key != expected:
                raise ValueError(f"manifest_key must be {expected} for {kind} v{version}")
        return key

    @classmethod
    def for_manifest(cls, manifest: DeltaManifest, manifest_bytes: builtins.bytes | None = None) -> VersionCreate:
        """The registration of a committed object (``checksum``: sha256 of its ``manifest.json`` bytes)."""
        data = manifest.to_json() if manifest_bytes is None else manifest_bytes
        kind: ObjectKind = "squash" if manifest.squash else manifest.kind
        return cls(
            version=manifest.version,
            kind=kind,
            base_version=manifest.base_version,
            manifest_key=manifest_key(manifest.version, kind, manifest.base_version),
            bytes=manifest.total_bytes,
            nnz=manifest.nnz,
            tensors=len(manifest.tensors),
            checksum="sha256:" + hashlib.sha256(data).hexdigest(),
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
    steps: list[VersionPublic] = Field(
        description="an anchor first (if any), or a squash first (if any), then deltas, in apply order"
    )
    bytes: int = Field(description="total bytes to fetch")
    route: Literal["none", "deltas", "anchor", "squash"] = Field(description="none: already there")


class LeaseCreate(_Model):
    """``POST /v1/lease``: take (or renew, with ``lease_id``) the run's one publisher lease."""

    holder: str = Field(min_length=1, max_length=256, description="who publishes: host, pid, job")
    ttl_s: float = Field(ge=1, le=3600, description="the lease expires this long after the last renewal")
    lease_id: str | None = Field(None, pattern=r"^[0-9a-f]{32}$", description="renew this lease")


class LeasePublic(_Model):
    """The publisher lease: one writer per run, fenced by ``lease_id`` on every registration."""

    lease_id: str
    epoch: int = Field(description="increases with every new holder (a fencing token)")
    holder: str
    run_id: str
    expires_at: datetime
    next_version: int = Field(description="one above every version this ledger has ever registered")


class AgentHeartbeat(_Model):
    """``POST /v1/agents/{agent_id}/heartbeat``."""

    applied_version: Version | None = Field(description="the version the engine serves; null if none yet")
    state: AgentState
    last_error: str | None = Field(None, max_length=MAX_ERROR_CHARS)
    timings: dict[Annotated[str, Field(max_length=64)], Seconds] = Field(
        default_factory=dict, max_length=32, description="seconds, e.g. pause (finite, >= 0)"
    )
    drift: str | None = Field(
        None,
        max_length=MAX_ERROR_CHARS,
        description="the engine's weights differ from its version's published checksums: which tensors, and "
        "when; sent until a whole-state proof passes again",
    )


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
    """``GET /v1/agents``: one page of the fleet, by agent id."""

    agents: list[AgentPublic]
    latest: int | None
    next_after: str | None = Field(None, description="pass as ?after= for the next page; null on the last")
    total: int = Field(0, description="agents in the fleet")


class GcPublic(_Model):
    """``GET /v1/gc/candidates`` and ``POST /v1/gc``: objects no live agent or plan can still need."""

    candidates: list[VersionPublic]
    deleted: list[VersionPublic] = Field(default_factory=list)
    keep_from: int | None = Field(description="deltas above this version and the kept anchor are kept")
    kept_anchor: int | None = Field(None, description="the anchor proven present and intact before any deletion")
    problems: list[str] = Field(default_factory=list, description="why something was not deleted")
    leftovers: list[str] = Field(
        default_factory=list,
        description="object prefixes the ledger never registered, deleted (or, for a dry run, that would be): a "
        "fenced publisher's late writes and a crashed one's shards",
    )


class HealthPublic(_Model):
    """``GET /healthz``: answered from memory."""

    status: Literal["ok", "degraded"]
    latest: int | None
    run_id: str
    schema_version: int
    reasons: list[str] = Field(default_factory=list, description="why degraded")


class ErrorPublic(_Model):
    """Every 4xx/5xx body."""

    detail: str
