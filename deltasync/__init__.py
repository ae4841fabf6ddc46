"""deltasync: bit-exact sparse weight sync for asynchronous RL.

The trainer publishes (:class:`Publisher`), a coordinator keeps the ledger (``deltasync coordinator``),
and agents keep engines current (:class:`Agent`). ``Publisher``, ``Agent`` and ``CoordinatorClient`` are
imported lazily, so ``import deltasync`` stays light (no torch.distributed, no httpx until used).
"""

from __future__ import annotations

import typing as _typing
from importlib import metadata as _metadata

from .diff import compute_delta
from .errors import (
    ApplyError,
    CoordinatorError,
    DeltaSyncError,
    FencedObject,
    ForeignObject,
    FormatError,
    IntegrityError,
    LeaseError,
    ObjectExists,
    ObjectNotFound,
    ObjectTooLarge,
    RefusalReason,
    RunMismatch,
    SignatureError,
    StoreError,
    UnsafeObject,
    UnsupportedFormatVersion,
    UpdateRefused,
    VersionGapError,
)
from .format import TensorDelta, decode_shard, encode_shard, read_shard_header, tensor_checksum
from .manifest import AdapterEntry, DeltaManifest, ShardEntry, TensorEntry, model_fingerprint
from .reader import Trust, list_versions, read_manifest, read_weights
from .signing import SigningKey, VerifyKey
from .store import LocalStore, Store, open_store, register_store_scheme
from .vocab import FORMAT_VERSION
from .writer import ObjectWriter, write_anchor, write_delta

if _typing.TYPE_CHECKING:
    from .agent import Agent
    from .client import CoordinatorClient, RetryPolicy
    from .publisher import Publisher
    from .targets import InMemoryTarget

try:
    __version__ = _metadata.version("deltasync")
    """The installed distribution's version (pyproject.toml): the one version string."""
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

_LAZY = {
    "Agent": "deltasync.agent",
    "CoordinatorClient": "deltasync.client",
    "InMemoryTarget": "deltasync.targets",
    "Publisher": "deltasync.publisher",
    "RetryPolicy": "deltasync.client",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deltasync' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AdapterEntry",
    "Agent",
    "ApplyError",
    "CoordinatorClient",
    "CoordinatorError",
    "DeltaManifest",
    "DeltaSyncError",
    "FORMAT_VERSION",
    "FencedObject",
    "ForeignObject",
    "FormatError",
    "InMemoryTarget",
    "IntegrityError",
    "LeaseError",
    "LocalStore",
    "ObjectExists",
    "ObjectNotFound",
    "ObjectTooLarge",
    "ObjectWriter",
    "Publisher",
    "RefusalReason",
    "RetryPolicy",
    "RunMismatch",
    "ShardEntry",
    "SignatureError",
    "SigningKey",
    "Store",
    "StoreError",
    "TensorDelta",
    "TensorEntry",
    "Trust",
    "UnsafeObject",
    "UnsupportedFormatVersion",
    "UpdateRefused",
    "VerifyKey",
    "VersionGapError",
    "compute_delta",
    "decode_shard",
    "encode_shard",
    "list_versions",
    "model_fingerprint",
    "open_store",
    "read_manifest",
    "read_shard_header",
    "read_weights",
    "register_store_scheme",
    "tensor_checksum",
    "write_anchor",
    "write_delta",
]
