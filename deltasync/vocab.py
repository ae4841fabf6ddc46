"""deltasync's vocabulary: the names and limits every module shares (kinds, encodings, dtypes, version cap).

One spelling each: a published object is of :data:`Kind` ``"delta"`` or ``"anchor"``; a shard is encoded
``"raw"`` or ``"packed"``; a tensor entry is ``"sparse"`` or ``"dense"``. Versions are integers in
``[0, MAX_VERSION]`` (the store writes them as ``v{version:08d}``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "AGENT_STATES",
    "DTYPES",
    "DTYPE_NAMES",
    "ENCODINGS",
    "FORMAT_VERSION",
    "KINDS",
    "MAX_INT",
    "MAX_TENSOR_NUMEL",
    "MAX_VERSION",
    "META_PREFIX",
    "OBJECT_KINDS",
    "CHECKPOINT_NAME",
    "AgentState",
    "Encoding",
    "Kind",
    "Layout",
    "ObjectKind",
    "bits_dtype",
    "wide_dtypes",
]

FORMAT_VERSION = "1.5"
"""``major.minor`` of shards and manifests: readers reject another major version and accept any minor
version of theirs (1.1 added the model fingerprint and run identity, 1.2 the sketch of every tensor, 1.3 the
lease epoch and run records, 1.4 the LoRA adapter a manifest's tensors are, 1.5 the digest of the adapter's base
weights; docs/FORMAT.md)."""

MAX_VERSION = 99_999_999
"""The largest version: keys are ``v{version:08d}``."""

MAX_INT = 2**63 - 1
"""The largest integer any count, size or version crosses the wire or the ledger with (SQLite's INTEGER)."""

MAX_TENSOR_NUMEL = 2**40
"""The largest tensor a shard or manifest may describe (a sanity cap against absurd headers)."""

META_PREFIX = "deltasync."
"""Prefix of the deltasync keys in a shard's safetensors ``__metadata__``."""

Kind = Literal["delta", "anchor"]
"""A published object: a ``delta`` (applies on exactly its base version) or an ``anchor`` (every tensor)."""
KINDS: tuple[Kind, ...] = ("delta", "anchor")

ObjectKind = Literal["delta", "anchor", "squash"]
"""Where an object lies in the store and the ledger: a :data:`Kind`, or a ``squash``, a delta ``base_version ->
version`` over several versions that the publisher writes beside the chain (its manifest and shards are a delta's,
``kind`` ``delta``; only its keys and its ledger table differ, so it never collides with the version's own delta)."""
OBJECT_KINDS: tuple[ObjectKind, ...] = ("delta", "anchor", "squash")

Encoding = Literal["raw", "packed"]
"""A shard's encoding: ``raw`` (any safetensors reader) or ``packed`` (gap-coded, byte planes, zstd)."""
ENCODINGS: tuple[Encoding, ...] = ("raw", "packed")

Layout = Literal["sparse", "dense"]
"""A tensor entry: ``sparse`` (indices + values) or ``dense`` (every element of its span)."""

AgentState = Literal["idle", "fetching", "applying", "paused", "error", "refused", "unhealthy"]
"""What an agent reports: ``refused`` = it will not follow the coordinator (another run, a rollback, another
model) and keeps serving; ``unhealthy`` = its engine failed past the first write and does not serve until an
anchor restores it."""
AGENT_STATES: tuple[AgentState, ...] = ("idle", "fetching", "applying", "paused", "error", "refused", "unhealthy")

CHECKPOINT_NAME = re.compile(r"[^\x00-\x1f\x7f:]{1,1024}")
"""A tensor's checkpoint name: 1 to 1024 characters, no ``:`` (the shard entries' separator) and no control
characters (they would make names ambiguous in messages and fingerprints)."""

DTYPES: dict[str, torch.dtype] = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
"""The dtypes deltasync publishes, by safetensors name."""
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def bits_dtype(dtype_name: str) -> type[np.signedinteger[Any]]:
    """The signed integer type that views a float dtype's bit patterns."""
    return np.int32 if dtype_name == "F32" else np.int16


def wide_dtypes(dtype_name: str) -> tuple[type[np.signedinteger[Any]], type[np.unsignedinteger[Any]]]:
    """Signed and unsigned types wide enough for an ordinal difference of ``dtype_name``."""
    return (np.int64, np.uint64) if dtype_name == "F32" else (np.int32, np.uint32)
