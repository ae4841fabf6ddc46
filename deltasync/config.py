"""Configuration of deltasync's long-running parts (frozen dataclasses; each field is a CLI flag)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["AgentConfig"]


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
    """Tensor-parallel size of the engine (>1: a failed apply is fatal, vLLM issue 49972)."""

    def __post_init__(self) -> None:
        if self.poll_wait_s < 0:
            raise ValueError(f"poll_wait_s must be >= 0, got {self.poll_wait_s}")
        if self.max_lag is not None and self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0 or None, got {self.max_lag}")
        if self.fetch_workers < 1:
            raise ValueError(f"fetch_workers must be >= 1, got {self.fetch_workers}")
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError(f"retries and backoff_s must be >= 0, got {self.retries} and {self.backoff_s}")
        if self.assume_version is not None and self.assume_version < 0:
            raise ValueError(f"assume_version must be >= 0 or None, got {self.assume_version}")
        if self.pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause_mode must be keep, wait or abort, got {self.pause_mode!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
