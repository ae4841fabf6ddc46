"""Configuration of deltasync's long-running parts (frozen dataclasses; each field is a CLI flag)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from .vocab import MAX_VERSION

__all__ = ["AgentConfig", "PublisherConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    """How an agent polls, fetches, stages and applies. ``deltasync agent --<field-with-dashes>``."""

    agent_id: str = "agent-0"
    """The name the coordinator shows for this agent."""
    poll_wait_s: float = 30.0
    """Long-poll wait for news from the coordinator."""
    max_lag: int | None = None
    """Stop serving (pause the engine) while more than this many versions behind; ``None``: never."""
    staging_dir: str | None = None
    """Where verified shards are cached and raw shards staged for the engine (default: a temporary dir)."""
    fetch_workers: int = 4
    """Shards fetched in parallel."""
    retries: int = 5
    """Attempts after the first, for a fetch or a checksum mismatch, with exponential backoff."""
    backoff_s: float = 0.5
    """First backoff; doubles each attempt (capped at 30 s)."""
    assume_version: int | None = None
    """The engine was started from a checkpoint equal to this version (skips the first anchor)."""
    pause_mode: Literal["keep", "wait", "abort"] = "keep"
    """vLLM server ``/pause`` mode: ``keep`` freezes in-flight requests and continues them after the update."""
    tp_size: int = 1
    """Tensor-parallel size of the engine (>1: failures are recorded, never raised, by the engine; a failure past
    the first write needs a server restart, vLLM #49972)."""
    allow_rollback: bool = False
    """Let the engine go below the highest version it has served, or to another run (an operator's decision,
    logged); by default a coordinator behind the engine, or of another run, is refused."""
    public_key: str | None = None
    """Ed25519 public key file (PEM): every manifest must be signed by the publisher's key."""
    integrity_fallback_after: int = 3
    """Take the anchor route after this many consecutive integrity failures rebuilding the host copy."""
    audit_interval_s: float | None = 60.0
    """Prove the engine's whole served state against its version's published checksums at least this often
    (``None``: only what each update writes); drift unlabels the engine and restores it through an anchor."""
    audit_stall_s: float | None = 0.05
    """How long that proof may hold the engine's workers per call: the state is proven in windows sized to it
    (from the time the last window took), and vLLM serves between them; every element is still proven in each
    pass. ``None`` or 0: the whole state in one call (the workers are held for the whole pass)."""
    apply_mode: Literal["auto", "inplace", "patches", "reload", "lora"] | None = None
    """How a vLLM engine applies updates (``None``: the engine's own ``auto``: ``inplace`` where parameters
    are plain, else ``reload``; ``lora``: the run publishes a LoRA adapter, which the engine serves under
    from ``adapter_dir``); see :mod:`deltasync.vllm.engine`."""
    adapter_dir: str | None = None
    """Apply mode ``lora``: the absolute directory the adapter is served from (its requests' ``lora_path``); the
    engine keeps the served version there."""
    insecure_http: bool = False
    """Send the agent token to a plain ``http://`` coordinator on another host, in clear (an operator's decision,
    logged); by default refused: use ``https://``. Loopback (127.0.0.0/8, ``::1``, ``localhost``) needs no flag."""

    def __post_init__(self) -> None:
        if self.poll_wait_s < 0:
            raise ValueError(f"poll_wait_s must be >= 0, got {self.poll_wait_s}")
        if self.max_lag is not None and self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0 or None, got {self.max_lag}")
        if self.audit_interval_s is not None and not self.audit_interval_s > 0:
            raise ValueError(f"audit_interval_s must be > 0 or None, got {self.audit_interval_s}")
        if self.audit_stall_s is not None and not self.audit_stall_s >= 0:
            raise ValueError(f"audit_stall_s must be >= 0 or None, got {self.audit_stall_s}")
        if self.fetch_workers < 1:
            raise ValueError(f"fetch_workers must be >= 1, got {self.fetch_workers}")
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError(f"retries and backoff_s must be >= 0, got {self.retries} and {self.backoff_s}")
        if self.assume_version is not None and not 0 <= self.assume_version <= MAX_VERSION:
            raise ValueError(f"assume_version must be in [0, {MAX_VERSION}] or None, got {self.assume_version}")
        if self.pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause_mode must be keep, wait or abort, got {self.pause_mode!r}")
        if self.apply_mode not in (None, "auto", "inplace", "patches", "reload", "lora"):
            raise ValueError(f"apply_mode must be auto, inplace, patches, reload or lora, got {self.apply_mode!r}")
        if (self.apply_mode == "lora") != (self.adapter_dir is not None) or not os.path.isabs(self.adapter_dir or "/"):
            raise ValueError(
                "apply_mode lora goes with adapter_dir (an absolute path), and adapter_dir only with it; got "
                f"apply_mode={self.apply_mode!r}, adapter_dir={self.adapter_dir!r}"
            )
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.integrity_fallback_after < 1:
            raise ValueError(f"integrity_fallback_after must be >= 1, got {self.integrity_fallback_after}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PublisherConfig:
    """How a publisher encodes, when it writes anchors, and how much it may queue."""

    encoding: Literal["raw", "packed"] = "packed"
    """Shard encoding (docs/FORMAT.md)."""
    anchor_encoding: Literal["raw", "packed"] | None = None
    """The anchors' encoding, if not ``encoding``: ``raw`` anchors are ~1.4x the bytes of ``packed`` ones (bf16)
    but a cold replica's first sync skips their decode (~4 s per GB of bf16 on one core; docs/SCALING.md, "Anchors:
    raw or packed")."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """The published (inference) dtype; weights are cast while copied."""
    anchor_every: int | None = 20
    """Also write an anchor every this many versions; ``None``: never by count."""
    anchor_bytes_fraction: float | Literal["auto"] | None = "auto"
    """Also write an anchor when the deltas since the last anchor exceed this fraction of its bytes. ``auto``: 0.5
    for a model's weights; 4.0 for a LoRA adapter (``Publisher(adapter=...)``), whose deltas are near-dense, each
    about an anchor's size: 0.5 would write an anchor every other version (a new agent then fetches at most
    about five anchors' bytes, and the ``anchor_every`` cadence still applies)."""
    squash_window: int | None = 64
    """Write squashes (one delta from a lagging agent's version to the latest, in one object) for agents at most
    this many versions behind; ``None``: never. Needs a coordinator (its fleet view says where the agents are)."""
    squash_bases: int = 4
    """Agent versions squashed from at once (those most agents hold); each costs a squash per version while an
    agent stays there."""
    squash_max_fraction: float = 0.25
    """Stop squashing from a version once the elements changed since pass this fraction of the model (the anchor
    route is about as cheap); bounds the publisher's extra memory to ``(squash_bases + 2) x this x elements x
    (8 + dtype bytes)``."""
    queue_size: int = 2
    """Versions copied and waiting while another is written; a full queue blocks ``publish`` (or coalesces)."""
    coalesce: bool = False
    """With a full queue, merge the new version into the newest queued one (one exact delta) instead of blocking."""
    max_shard_bytes: int = 1 << 30
    """Tensors are grouped into shard files of about this size (single process)."""
    zstd_level: int = 1
    """zstd level of ``packed`` (its strategy and window; the match finder is set for byte planes)."""
    start_version: int | None = None
    """The first version to publish; ``None``: one above every version the ledger or the store has seen."""
    signing_key: str | None = None
    """Ed25519 private key file (PEM, ``deltasync keygen``): sign every manifest."""
    model_id: str | None = None
    """A name of the model lineage written into every manifest (agents serving another id refuse it)."""
    lease_ttl_s: float = 30.0
    """The publisher lease (one writer per run) expires this long after the last renewal (renewed every third)."""
    lease_wait_s: float = 0.0
    """Wait up to this long for another publisher's lease to expire at start (0: fail at once, naming it)."""

    def __post_init__(self) -> None:
        if self.encoding not in ("raw", "packed"):
            raise ValueError(f"encoding must be raw or packed, got {self.encoding!r}")
        if self.anchor_encoding not in (None, "raw", "packed"):
            raise ValueError(f"anchor_encoding must be raw, packed or None, got {self.anchor_encoding!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.anchor_every is not None and self.anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1 or None, got {self.anchor_every}")
        if self.anchor_bytes_fraction not in (None, "auto") and not (
            isinstance(self.anchor_bytes_fraction, int | float) and self.anchor_bytes_fraction > 0
        ):
            raise ValueError(f"anchor_bytes_fraction must be > 0, 'auto' or None, got {self.anchor_bytes_fraction!r}")
        if self.squash_window is not None and self.squash_window < 2:
            raise ValueError(f"squash_window must be >= 2 or None, got {self.squash_window}")
        if self.squash_bases < 1:
            raise ValueError(f"squash_bases must be >= 1, got {self.squash_bases}")
        if not 0 < self.squash_max_fraction <= 1:
            raise ValueError(f"squash_max_fraction must be in (0, 1], got {self.squash_max_fraction}")
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")
        if self.max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {self.max_shard_bytes}")
        if self.start_version is not None and not 0 <= self.start_version <= MAX_VERSION:
            raise ValueError(f"start_version must be in [0, {MAX_VERSION}] or None, got {self.start_version}")
        if not 1 <= self.lease_ttl_s <= 3600:
            raise ValueError(f"lease_ttl_s must be in [1, 3600], got {self.lease_ttl_s}")
        if self.lease_wait_s < 0:
            raise ValueError(f"lease_wait_s must be >= 0, got {self.lease_wait_s}")
