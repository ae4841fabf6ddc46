"""Versions in a store: write a delta or an anchor (shards first, manifest last), list them,
and rebuild the weights at any version from the newest anchor on its chain plus the deltas."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass

import torch

from ._header import DTYPE_NAMES, DTYPES, Encoding, Kind
from .errors import FormatError, IntegrityError, ObjectNotFound
from .format import DEFAULT_ZSTD_LEVEL, TensorDelta, decode_shard, encode_shard, tensor_checksum
from .manifest import DeltaManifest, ShardEntry, TensorEntry
from .store.base import Store

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "VersionListing",
    "apply_deltas",
    "apply_object",
    "assemble_anchor",
    "check_shard",
    "commit_manifest",
    "decode_object",
    "group_by_size",
    "list_versions",
    "load_object",
    "manifest_key",
    "object_prefix",
    "put_shard",
    "shard_entry",
    "read_chain",
    "read_manifest",
    "read_weights",
    "verify_weights",
    "write_anchor",
    "write_delta",
]

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
DEFAULT_MAX_SHARD_BYTES = 1 << 30
"""Tensors are grouped into shards of about this many raw bytes (a tensor is never split)."""

_MANIFEST_KEY = re.compile(r"v(\d{8})/(anchor/)?manifest\.json")


def object_prefix(version: int, kind: Kind) -> str:
    """Key prefix of a published object: ``v00000012/`` (delta) or ``v00000012/anchor/``."""
    if not 0 <= version <= 99_999_999:
        raise ValueError(f"version must be in [0, 99999999], got {version}")
    return f"v{version:08d}/" + ("anchor/" if kind == "anchor" else "")


def manifest_key(version: int, kind: Kind) -> str:
    """Key of an object's manifest (its commit marker)."""
    return object_prefix(version, kind) + MANIFEST_FILE


@dataclass(frozen=True, kw_only=True, slots=True)
class VersionListing:
    """The committed objects of one version in a store."""

    version: int
    """The version."""
    delta: bool
    """A delta to this version is committed."""
    anchor: bool
    """An anchor at this version is committed."""


def list_versions(store: Store) -> list[VersionListing]:
    """Committed versions (those with a manifest), ascending; uncommitted files are ignored."""
    found: dict[int, VersionListing] = {}
    for key in store.list():
        m = _MANIFEST_KEY.fullmatch(key)
        if m is None:
            continue
        v = int(m.group(1))
        prev = found.get(v, VersionListing(version=v, delta=False, anchor=False))
        found[v] = dataclasses.replace(prev, anchor=True) if m.group(2) else dataclasses.replace(prev, delta=True)
    return [found[v] for v in sorted(found)]


def read_manifest(store: Store, version: int, kind: Kind = "delta") -> DeltaManifest:
    """Read and validate the manifest of a committed object.

    Raises:
        ObjectNotFound: the object is not committed.
        FormatError: the manifest is malformed or describes another object than its key says.
    """
    key = manifest_key(version, kind)
    manifest = DeltaManifest.from_json(store.get(key), name=f"{store.uri}/{key}")
    if manifest.version != version or manifest.kind != kind:
        raise FormatError(
            f"{store.uri}/{key}: manifest describes {manifest.kind} v{manifest.version}, "
            f"expected {kind} v{version} (a file copied to the wrong place?)"
        )
    return manifest


def shard_entry(index: int, data: bytes) -> ShardEntry:
    """The manifest entry of shard ``index`` (its file name, size and sha256)."""
    return ShardEntry(file=f"shard-{index:05d}.safetensors", bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def put_shard(store: Store, version: int, kind: Kind, index: int, data: bytes) -> ShardEntry:
    """Write one shard of an object and return its manifest entry (size and sha256)."""
    entry = shard_entry(index, data)
    store.put(object_prefix(version, kind) + entry.file, data)
    return entry


def commit_manifest(store: Store, manifest: DeltaManifest) -> None:
    """Write an object's manifest; call it only after every shard is written (commit marker)."""
    store.put(manifest_key(manifest.version, manifest.kind), manifest.to_json())


def group_by_size(deltas: list[TensorDelta], max_shard_bytes: int) -> list[list[TensorDelta]]:
    """Split entries, in order, into groups of about ``max_shard_bytes`` raw bytes (never splitting one)."""
    groups: list[list[TensorDelta]] = [[]]
    size = 0
    for d in deltas:
        n = d.nnz * (d.values.element_size() + (0 if d.indices is None else 4))
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(d)
        size += n
    return groups if groups[0] else []


def _write_object(
    store: Store,
    deltas: list[TensorDelta],
    tensors: dict[str, TensorEntry],
    *,
    kind: Kind,
    version: int,
    base_version: int | None,
    encoding: Encoding,
    max_shard_bytes: int,
    zstd_level: int,
) -> DeltaManifest:
    t0 = time.perf_counter()
    shards, blobs = [], []
    for i, group in enumerate(group_by_size(deltas, max_shard_bytes)):
        data = encode_shard(
            group,
            kind=kind,
            encoding=encoding,
            target_version=version,
            base_version=base_version,
            zstd_level=zstd_level,
        )
        shards.append(shard_entry(i, data))
        blobs.append((object_prefix(version, kind) + shards[-1].file, data))
        for d in group:
            tensors[d.ckpt_name] = dataclasses.replace(tensors[d.ckpt_name], shards=(i,), nnz=d.nnz)
    store.put_many(blobs)  # one batch for the shards; the manifest (the commit marker) follows
    manifest = DeltaManifest(
        kind=kind,
        version=version,
        base_version=base_version,
        encoding=encoding,
        shards=tuple(shards),
        tensors=tensors,
    )
    commit_manifest(store, manifest)
    logger.info(
        "published %s v%d: %d tensors, nnz=%d, %.2f MiB, %.0f ms",
        kind,
        version,
        len(deltas),
        manifest.nnz,
        manifest.total_bytes / 2**20,
        (time.perf_counter() - t0) * 1e3,
    )
    return manifest


def write_anchor(
    store: Store,
    state: Mapping[str, torch.Tensor],
    *,
    version: int,
    encoding: Encoding = "packed",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    zstd_level: int = DEFAULT_ZSTD_LEVEL,
) -> DeltaManifest:
    """Publish a full snapshot of ``state`` as the anchor of ``version``.

    Shards are written first and the manifest last, so a crash leaves no visible anchor.
    """
    deltas, tensors = [], {}
    for name, t in state.items():
        t = t.detach().contiguous()
        checksum = tensor_checksum(t)
        deltas.append(
            TensorDelta(ckpt_name=name, shape=tuple(t.shape), dtype=t.dtype, indices=None, values=t, checksum=checksum)
        )
        tensors[name] = TensorEntry(
            shape=tuple(t.shape),
            dtype=DTYPE_NAMES.get(t.dtype, str(t.dtype)),
            nnz=t.numel(),
            shards=(),
            checksums=((0, t.numel(), checksum),),
        )
    return _write_object(
        store,
        deltas,
        tensors,
        kind="anchor",
        version=version,
        base_version=None,
        encoding=encoding,
        max_shard_bytes=max_shard_bytes,
        zstd_level=zstd_level,
    )


def write_delta(
    store: Store,
    changes: Mapping[str, TensorDelta],
    *,
    state: Mapping[str, torch.Tensor],
    version: int,
    base: DeltaManifest,
    encoding: Encoding = "packed",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    zstd_level: int = DEFAULT_ZSTD_LEVEL,
) -> DeltaManifest:
    """Publish the delta ``base.version -> version``.

    Args:
        store: where to write.
        changes: the changed tensors, as :func:`deltasync.diff.compute_delta` returns them.
        state: the new weights (used for the checksums of the changed tensors).
        version: the new version, greater than ``base.version``.
        base: the manifest of the base version (delta or anchor): unchanged tensors keep its
            checksums, and the model must have the same names, shapes and dtypes.

    Raises:
        ValueError: ``changes`` names a tensor the base lacks or with another shape or dtype.
    """
    if version <= base.version:
        raise ValueError(f"version {version} must be greater than the base version {base.version}")
    tensors = {n: dataclasses.replace(e, nnz=0, shards=()) for n, e in base.tensors.items()}
    deltas = []
    for name, d in changes.items():
        entry = tensors.get(name)
        if entry is None or entry.shape != d.shape or entry.dtype != DTYPE_NAMES.get(d.dtype):
            raise ValueError(
                f"tensor {name!r} ({DTYPE_NAMES.get(d.dtype)} {list(d.shape)}) does not match base "
                f"v{base.version} ({entry and [entry.dtype, list(entry.shape)]}); publish an anchor"
            )
        checksum = tensor_checksum(state[name])
        tensors[name] = dataclasses.replace(entry, checksums=((0, entry.numel, checksum),))
        deltas.append(dataclasses.replace(d, checksum=checksum))
    return _write_object(
        store,
        deltas,
        tensors,
        kind="delta",
        version=version,
        base_version=base.version,
        encoding=encoding,
        max_shard_bytes=max_shard_bytes,
        zstd_level=zstd_level,
    )


def check_shard(data: bytes, entry: ShardEntry, *, name: str) -> None:
    """Raise IntegrityError unless ``data`` has the size and sha256 the manifest promises."""
    if len(data) != entry.bytes:
        raise IntegrityError(f"{name}: size is {len(data)} bytes, the manifest says {entry.bytes}; refetch it")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise IntegrityError(f"{name}: sha256 is {digest}, the manifest says {entry.sha256}; refetch it")


def decode_object(
    manifest: DeltaManifest, shards: list[bytes], *, where: str, base: Mapping[str, torch.Tensor] | None = None
) -> list[TensorDelta]:
    """Check (size, sha256) and decode every shard of an object against its manifest; nothing is applied.

    Args:
        manifest: the object's manifest.
        shards: the bytes of ``manifest.shards``, in order.
        where: the object's location, for messages (``store uri/prefix``).
        base: the base version's tensors (``packed`` deltas are coded against them).

    Raises:
        IntegrityError: a shard's size or sha256 differs from the manifest.
        FormatError: a shard is malformed or disagrees with the manifest.
    """
    out: list[TensorDelta] = []
    nnz: dict[str, int] = {}
    for i, (entry, data) in enumerate(zip(manifest.shards, shards, strict=True)):
        name = f"{where}{entry.file}"
        check_shard(data, entry, name=name)
        header, deltas = decode_shard(bytearray(data), name=name, base=base)
        want = (manifest.kind, manifest.encoding, manifest.base_version, manifest.version)
        got = (header.kind, header.encoding, header.base_version, header.target_version)
        if got != want:
            raise FormatError(f"{name}: shard is {got} (kind, encoding, base, target), the manifest says {want}")
        for t, d in deltas.items():
            e = manifest.tensors.get(t)
            if e is None or e.shape != d.shape or e.dtype != DTYPE_NAMES[d.dtype] or i not in e.shards:
                raise FormatError(f"{name}: tensor {t!r} does not match the manifest's entry {e}")
            nnz[t] = nnz.get(t, 0) + d.nnz
        out.extend(deltas.values())
    for t, e in manifest.tensors.items():
        if nnz.get(t, 0) != e.nnz:
            raise FormatError(
                f"{where}: tensor {t!r} has {nnz.get(t, 0)} elements in the shards, the manifest says {e.nnz}"
            )
    return out


def load_object(
    store: Store, manifest: DeltaManifest, base: Mapping[str, torch.Tensor] | None = None
) -> list[TensorDelta]:
    """Fetch, check (size, sha256) and decode every shard of an object; nothing is applied.

    Raises:
        IntegrityError: a shard's size or sha256 differs from the manifest.
        FormatError: a shard is malformed or disagrees with the manifest.
    """
    prefix = object_prefix(manifest.version, manifest.kind)
    shards = [store.get(prefix + entry.file) for entry in manifest.shards]
    return decode_object(manifest, shards, where=f"{store.uri}/{prefix}", base=base)


def apply_deltas(state: MutableMapping[str, torch.Tensor], deltas: Iterable[TensorDelta]) -> None:
    """Write decoded deltas into ``state`` in place.

    Not transactional: validate everything first (``decode_shard`` does); a failure part-way
    leaves ``state`` partly updated.

    Raises:
        FormatError: a delta names a tensor ``state`` lacks, or with another shape or dtype.
    """
    for d in deltas:
        t = state.get(d.ckpt_name)
        if t is None or tuple(t.shape) != d.shape or t.dtype != d.dtype:
            found = "nothing" if t is None else f"{DTYPE_NAMES.get(t.dtype, t.dtype)} {list(t.shape)}"
            raise FormatError(
                f"tensor {d.ckpt_name!r}: the delta is for {DTYPE_NAMES[d.dtype]} {list(d.shape)}, "
                f"the weights hold {found} (a delta for another model?)"
            )
        flat = t.view(-1)
        if d.indices is not None:
            flat[d.indices] = d.values
        elif d.span is not None:
            flat[d.span[0] : d.span[1]] = d.values
        else:
            t.copy_(d.values)


def verify_weights(
    state: Mapping[str, torch.Tensor], manifest: DeltaManifest, names: Iterable[str] | None = None
) -> None:
    """Check tensors against the manifest's checksums (all tensors, or only ``names``).

    Raises:
        IntegrityError: a tensor is missing or differs; the message lists them.
    """
    bad = []
    for name in manifest.tensors if names is None else names:
        entry, t = manifest.tensors[name], state.get(name)
        if t is None:
            bad.append(f"{name} (missing)")
            continue
        for start, stop, digest in entry.checksums:
            if tensor_checksum(t, (start, stop)) != digest:
                bad.append(f"{name}[{start}:{stop}]")
    if bad:
        raise IntegrityError(
            f"v{manifest.version}: {len(bad)} tensors differ from the published checksums: "
            f"{', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}"
        )


def read_chain(store: Store, version: int) -> list[DeltaManifest]:
    """Manifests to rebuild ``version``: the newest anchor on its delta chain, then the deltas.

    Raises:
        ObjectNotFound: a version on the chain has neither a delta nor an anchor.
    """
    chain: list[DeltaManifest] = []
    v = version
    while True:
        if store.exists(manifest_key(v, "anchor")):
            chain.append(read_manifest(store, v, "anchor"))
            return chain[::-1]
        if not store.exists(manifest_key(v, "delta")):
            needed = f" (needed to rebuild v{version})" if v != version else ""
            raise ObjectNotFound(f"{store.uri}: version {v} is not committed{needed}")
        m = read_manifest(store, v, "delta")
        chain.append(m)
        assert m.base_version is not None
        v = m.base_version


def assemble_anchor(deltas: Iterable[TensorDelta]) -> dict[str, torch.Tensor]:
    """Full tensors from an anchor's dense entries (whole tensors, or spans written by several ranks)."""
    state: dict[str, torch.Tensor] = {}
    for d in deltas:
        if d.span is None:
            state[d.ckpt_name] = d.values
        else:
            full = state.setdefault(d.ckpt_name, torch.empty(d.shape, dtype=d.dtype))
            full.view(-1)[d.span[0] : d.span[1]] = d.values
    return state


def apply_object(
    state: dict[str, torch.Tensor] | None, manifest: DeltaManifest, deltas: list[TensorDelta], *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """Apply a decoded object: an anchor builds a new state; a delta updates ``state`` in place.

    With ``verify``, every tensor the object touches is checked against its checksums afterwards.
    Not transactional: on an error ``state`` may be partly updated (rebuild it with :func:`read_weights`).

    Returns:
        The state at ``manifest.version``.

    Raises:
        FormatError: a delta for another model; IntegrityError: a checksum differs.
    """
    if manifest.kind == "anchor":
        state = assemble_anchor(deltas)
        for name, e in manifest.tensors.items():
            state.setdefault(name, torch.empty(e.shape, dtype=DTYPES[e.dtype]))
        if verify:
            verify_weights(state, manifest)
        return state
    if state is None:
        raise ValueError(f"delta v{manifest.version} needs the weights of v{manifest.base_version}")
    apply_deltas(state, deltas)
    if verify:
        verify_weights(state, manifest, names={d.ckpt_name for d in deltas})
    return state


def read_weights(store: Store, version: int, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Rebuild the full state dict at ``version``.

    Starts from the newest anchor on the version's delta chain and applies each delta in order.
    With ``verify``, every tensor an object touches is checked against that object's checksums,
    so the result provably equals what the publisher held.

    Raises:
        ObjectNotFound: the version, or one its chain needs, is not committed.
        IntegrityError, FormatError: a shard is corrupt or a rebuilt tensor differs.
    """
    chain = read_chain(store, version)
    state: dict[str, torch.Tensor] | None = None
    for m in chain:
        state = apply_object(state, m, load_object(store, m, base=state), verify=verify)
    assert state is not None
    if set(state) != set(chain[-1].tensors):
        raise FormatError(f"{store.uri}: v{version} lists other tensors than its anchor v{chain[0].version}")
    return {name: state[name] for name in chain[-1].tensors}
