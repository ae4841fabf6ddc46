"""What an agent sends the ``deltasync`` engine: its claim (``init_info``) and an update (``update_info``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

__all__ = ["MODES", "DeltaSyncInitInfo", "DeltaSyncUpdateInfo"]

MODES = ("auto", "inplace", "patches", "reload", "lora")
"""The apply modes (:mod:`deltasync.vllm.engine` says what each does)."""


@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine({"init_info": {...}})``: all optional; only the fields given change."""

    mode: str | None = None
    """``auto`` (the default), ``inplace``, ``patches``, ``reload``, or ``lora`` (the engine serves a LoRA
    adapter's versions on its base model, served from ``adapter_dir``)."""
    base_version: int | None = None
    """The version the served weights are (the agent's ``assume_version``); ignored if one is known."""
    base_path: str | None = None
    """Checkpoint directory for the reload shadow (default: the served model's path)."""
    reprocess_tied: bool | None = None
    """Re-run post-load processing of modules tied to a reloaded one (``lm_head``); default on."""
    raise_errors: bool | None = None
    """Raise refusals and failures from the RPCs (the default), or only record them (TP > 1)."""
    model_id: str | None = None
    """The model id this engine serves; objects naming another are refused."""
    staging_root: str | None = None
    """Accept staged files only from under this directory, with no symlink on the way (the agent's staging)."""
    agent_id: str | None = None
    """The claiming agent (required): the engine obeys the first agent that claims it, and that agent only."""
    run_id: str | None = None
    """The run the claiming agent follows: a claim for another run than the one served is refused."""
    allow_rollback: bool | None = None
    """The operator's permission to go below the highest version served, or to another run (fixed at the claim;
    no update message carries it)."""
    session: str | None = None
    """The claiming agent process's session: another process with the same agent id is refused while it lives."""
    ttl_s: float | None = None
    """How long a silent session stays alive."""
    adapter_dir: str | None = None
    """``lora`` mode: the absolute directory the adapter is served from (its requests' ``lora_path``): the engine
    keeps the served version there (vLLM loads it again from there after an eviction)."""
    model_fingerprint: str | None = None
    """The model the claiming agent's run publishes (its newest anchor's fingerprint; for an adapter run, its
    base's): a claim for another model than the one this engine serves is refused before anything changes."""
    release: bool | None = None
    """The claiming agent gives its claim up (its run is not this engine's); honoured only from the owner's own
    session."""

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"init_info.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "lora" and (not isinstance(self.adapter_dir, str) or not os.path.isabs(self.adapter_dir)):
            raise ValueError(
                f"init_info: mode lora needs adapter_dir, the absolute directory the adapter is served from (its "
                f"requests' lora_path), got {self.adapter_dir!r}"
            )


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights({"update_info": {...}})``: a :class:`~deltasync.staging.StagedUpdate` as JSON."""

    objects: list[dict[str, Any]]
    """The staged objects, in apply order (an update carries no policy: see :class:`DeltaSyncInitInfo`)."""
