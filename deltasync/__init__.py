"""deltasync: bit-exact sparse weight sync for asynchronous RL."""

from __future__ import annotations

from .diff import compute_delta
from .errors import (
    ApplyError,
    CoordinatorError,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    ObjectNotFound,
    StoreError,
    UnsupportedFormatVersion,
    VersionGapError,
)
from .format import (
    FORMAT_VERSION,
    TensorDelta,
    decode_shard,
    encode_shard,
    read_shard_header,
    tensor_checksum,
)
from .manifest import DeltaManifest, ShardEntry, TensorEntry
from .store import LocalStore, Store, open_store, register_store_scheme
from .versions import list_versions, read_manifest, read_weights, verify_weights, write_anchor, write_delta

__version__ = "0.1.0"

__all__ = [
    "ApplyError",
    "CoordinatorError",
    "DeltaManifest",
    "DeltaSyncError",
    "FORMAT_VERSION",
    "FormatError",
    "IntegrityError",
    "LocalStore",
    "ObjectNotFound",
    "ShardEntry",
    "Store",
    "StoreError",
    "TensorDelta",
    "TensorEntry",
    "UnsupportedFormatVersion",
    "VersionGapError",
    "compute_delta",
    "decode_shard",
    "encode_shard",
    "list_versions",
    "open_store",
    "read_manifest",
    "read_shard_header",
    "read_weights",
    "register_store_scheme",
    "tensor_checksum",
    "verify_weights",
    "write_anchor",
    "write_delta",
]
