"""The read path of a store: list committed versions, read and authenticate manifests, fetch and decode
objects, and rebuild the weights at any version.

Every read is bounded before it happens: a manifest by :data:`~deltasync.manifest.MAX_MANIFEST_BYTES`, a
shard by the size its manifest declares, a signature by :data:`~deltasync.signing.MAX_SIGNATURE_BYTES`; and a
shard's header is checked against its manifest before any payload is decoded.

Authenticity: the store alone proves nothing (anyone who can write the bucket can write a consistent forged
object). A :class:`Trust` adds either or both of the coordinator's ledger (each manifest's sha256 must equal the
digest the publisher registered) and the publisher's public key (each manifest must carry a valid signature).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from . import apply
from ._safetensors import SafetensorsFile
from ._shard_header import ShardHeader
from ._shard_header import parse_shard as _parse_shard
from .errors import FormatError, IntegrityError, ObjectNotFound, StoreError
from .format import BaseValues, TensorDelta, decode_shard
from .layout import manifest_key, parse_manifest_key, prefix_of, signature_key
from .manifest import MAX_MANIFEST_BYTES, DeltaManifest, ShardEntry
from .runrecord import RunView, read_run_view
from .signing import MAX_SIGNATURE_BYTES, VerifyKey
from .store.base import Store
from .vocab import Kind, ObjectKind

__all__ = [
    "LedgerLookup",
    "Trust",
    "VersionListing",
    "check_shard",
    "check_squash_manifest",
    "decode_object",
    "fetch_object",
    "iter_weights",
    "list_versions",
    "load_object",
    "prove_object",
    "read_chain",
    "read_manifest",
    "read_squash_manifest",
    "read_weights",
]

logger = logging.getLogger(__name__)

LedgerLookup = Callable[[int, Kind], str]
"""``(version, kind) -> "sha256:..."``: the digest the coordinator registered; raises if it has none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Trust:
    """What a reader checks manifests against, beyond their own consistency.

    Example:
        >>> key = VerifyKey.from_file("publisher.pub")  # doctest: +SKIP
        >>> trust = Trust(verify_key=key, ledger=lambda v, kind: client.get_version(v, kind).checksum)  # doctest: +SKIP
        >>> read_weights(store, 12, trust=trust)  # doctest: +SKIP
    """

    verify_key: VerifyKey | None = None
    """Require each manifest to be signed by this key, and (without :attr:`run_id`) to belong to the run the
    store's signed ``run.json`` names (without a record the key signed: the one run its signed objects name)."""
    ledger: LedgerLookup | None = None
    """Require each manifest's sha256 to be the digest the coordinator registered."""
    run_id: str | None = None
    """Require each manifest to belong to this run (one key often signs many runs: pin the one you read). The
    store's ``run.json`` is then never relied on."""

    def run_view(self, store: Store) -> RunView:
        """The run this trust pins in ``store`` and its publisher epochs (see :mod:`deltasync.runrecord`).

        A reader with the ledger needs no record (a fenced or foreign object was never registered), unless it
        pins a run itself. What the store holds at ``run.json`` or under ``epochs/`` never makes this raise: a
        record :attr:`verify_key` did not sign is ignored, with a warning.
        """
        if self.run_id is None and (self.ledger is not None or self.verify_key is None):
            return RunView(run_id=None)
        return read_run_view(store, run_id=self.run_id, verify_key=self.verify_key)

    def check(self, store: Store, version: int, kind: ObjectKind, data: bytes, base_version: int | None = None) -> None:
        """Authenticate a manifest's bytes (a squash's: ``kind`` ``squash`` and its ``base_version``; the ledger
        lookup is the caller's, who has its registered digest, so only the signature is checked here).

        Raises:
            IntegrityError: the sha256 is not the registered digest.
            SignatureError: no valid signature by :attr:`verify_key`.
        """
        name = f"{store.uri}/{manifest_key(version, kind, base_version)}"
        if self.ledger is not None and kind != "squash":
            registered = self.ledger(version, kind)
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            if digest != registered:
                raise IntegrityError(
                    f"{name}: sha256 is {digest}, the coordinator registered {registered}; the store holds other "
                    "bytes than the publisher registered (a forged or corrupted object)"
                )
        if self.verify_key is not None:
            try:
                sig: bytes | None = store.get(signature_key(version, kind, base_version), max_bytes=MAX_SIGNATURE_BYTES)
            except ObjectNotFound:
                sig = None
            self.verify_key.verify(data, sig, name=name)


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
    found: dict[int, tuple[bool, bool]] = {}
    for key in store.list():
        parsed = parse_manifest_key(key)
        if parsed is None:
            continue
        v, kind = parsed
        delta, anchor = found.get(v, (False, False))
        found[v] = (delta or kind == "delta", anchor or kind == "anchor")
    return [VersionListing(version=v, delta=found[v][0], anchor=found[v][1]) for v in sorted(found)]


def read_manifest(store: Store, version: int, kind: Kind = "delta", *, trust: Trust | None = None) -> DeltaManifest:
    """Read, authenticate (with ``trust``) and validate the manifest of a committed object.

    Raises:
        ObjectNotFound: the object is not committed.
        ObjectTooLarge: the manifest is over the cap (nothing read).
        FormatError: the manifest is malformed or describes another object than its key says.
        IntegrityError, SignatureError: ``trust`` refused it.
        ForeignObject, FencedObject: ``trust`` pins a run, and the object is another run's or a fenced
            publisher's.
    """
    return _read_manifest(store, version, kind, trust, None if trust is None else trust.run_view(store))


def read_squash_manifest(
    store: Store, version: int, base_version: int, *, checksum: str | None = None, trust: Trust | None = None
) -> DeltaManifest:
    """Read and authenticate the manifest of the squash ``base_version -> version``: a delta in every byte, read
    from the squash's own keys, so it must be exactly that delta (kind ``delta``, these versions).

    Args:
        checksum: the digest the coordinator registered for it (``sha256:...``); checked when given.
        trust: its signature (and run) are checked as a delta's; its ledger is not asked (pass ``checksum``).

    Raises:
        ObjectNotFound: no squash is committed there.
        IntegrityError: its sha256 is not ``checksum``.
        FormatError: it is malformed, or describes another object than its key says.
        SignatureError, ForeignObject, FencedObject: ``trust`` refused it.
    """
    key = manifest_key(version, "squash", base_version)
    name = f"{store.uri}/{key}"
    data = store.get(key, max_bytes=MAX_MANIFEST_BYTES)
    if checksum is not None:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if digest != checksum:
            raise IntegrityError(
                f"{name}: sha256 is {digest}, the coordinator registered {checksum}; the store holds other bytes "
                "than the publisher registered (a forged or corrupted squash)"
            )
    if trust is not None:
        trust.check(store, version, "squash", data, base_version)
    manifest = check_squash_manifest(DeltaManifest.from_json(data, name=name), version, base_version, name=name)
    if trust is not None:
        trust.run_view(store).admit(manifest, name=name)
    return manifest


def check_squash_manifest(manifest: DeltaManifest, version: int, base_version: int, *, name: str) -> DeltaManifest:
    """``manifest`` (read from the squash ``base_version -> version``'s key) marked as a squash, once it is proven to
    be that delta.

    Raises:
        FormatError: it describes another object (an anchor, or a delta of other versions: copied there?).
    """
    got = (manifest.kind, manifest.base_version, manifest.version)
    if got != ("delta", base_version, version):
        raise FormatError(
            f"{name}: manifest describes {manifest.kind} v{manifest.base_version} -> v{manifest.version}, expected "
            f"the delta v{base_version} -> v{version} of this squash's key (a file copied to the wrong place?)"
        )
    return dataclasses.replace(manifest, squash=True)


def _read_manifest(store: Store, version: int, kind: Kind, trust: Trust | None, view: RunView | None) -> DeltaManifest:
    key = manifest_key(version, kind)
    data = store.get(key, max_bytes=MAX_MANIFEST_BYTES)
    if trust is not None:
        trust.check(store, version, kind, data)
    manifest = DeltaManifest.from_json(data, name=f"{store.uri}/{key}")
    if manifest.version != version or manifest.kind != kind:
        raise FormatError(
            f"{store.uri}/{key}: manifest describes {manifest.kind} v{manifest.version}, "
            f"expected {kind} v{version} (a file copied to the wrong place?)"
        )
    if view is not None:
        view.admit(manifest, name=f"{store.uri}/{key}")
    return manifest


def check_shard(data: bytes | bytearray | memoryview, entry: ShardEntry, *, name: str) -> None:
    """Raise IntegrityError unless ``data`` has the size and sha256 the manifest promises."""
    if len(data) != entry.bytes:
        raise IntegrityError(f"{name}: size is {len(data)} bytes, the manifest says {entry.bytes}; refetch it")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise IntegrityError(f"{name}: sha256 is {digest}, the manifest says {entry.sha256}; refetch it")


def fetch_object(store: Store, manifest: DeltaManifest) -> list[bytes]:
    """The shards of an object, each read with the manifest's size as its cap and checked (size, sha256).

    Raises:
        ObjectNotFound: a shard is missing.
        ObjectTooLarge: a shard is larger than its manifest says (nothing read).
        IntegrityError: a shard's size or sha256 differs.
    """
    prefix = prefix_of(manifest)
    out = []
    for entry in manifest.shards:
        data = store.get(prefix + entry.file, max_bytes=entry.bytes)
        check_shard(data, entry, name=f"{store.uri}/{prefix}{entry.file}")
        out.append(data)
    return out


def prove_object(store: Store, manifest: DeltaManifest) -> None:
    """Every shard of an object is in the store with the size and sha256 its manifest promises, hashed as a
    stream (memory stays flat, whatever the object's size).

    Raises:
        ObjectNotFound: a shard is missing.
        IntegrityError: a shard's size or sha256 differs.
    """
    prefix = prefix_of(manifest)
    for entry in manifest.shards:
        key = prefix + entry.file
        size = store.size(key)
        if size != entry.bytes:
            raise IntegrityError(f"{store.uri}/{key}: size is {size} bytes, the manifest says {entry.bytes}")
        h = hashlib.sha256()
        with store.open(key) as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        if h.hexdigest() != entry.sha256:
            raise IntegrityError(f"{store.uri}/{key}: sha256 is {h.hexdigest()}, the manifest says {entry.sha256}")


def _check_header_against_manifest(
    manifest: DeltaManifest, index: int, data: bytearray | memoryview, name: str
) -> tuple[ShardHeader, SafetensorsFile]:
    """A shard's header (read without its payload) must describe what the manifest says this shard holds;
    returns the parsed shard for the decoder."""
    parsed = _parse_shard(data, name)
    header = parsed[0]
    want = (manifest.kind, manifest.encoding, manifest.base_version, manifest.version)
    got = (header.kind, header.encoding, header.base_version, header.target_version)
    if got != want:
        raise FormatError(f"{name}: shard is {got} (kind, encoding, base, target), the manifest says {want}")
    for t, info in header.tensors.items():
        e = manifest.tensors.get(t)
        if e is None or e.shape != info.shape or e.dtype != info.dtype or index not in e.shards or info.nnz > e.nnz:
            raise FormatError(
                f"{name}: tensor {t!r} ({info.dtype} {list(info.shape)}, nnz {info.nnz}) does not "
                f"match the manifest's entry {e}"
            )
    return parsed


def decode_object(
    manifest: DeltaManifest,
    shards: Sequence[bytes | bytearray | memoryview],
    *,
    where: str,
    base: Mapping[str, torch.Tensor] | BaseValues | None = None,
    checked: bool = False,
) -> list[TensorDelta]:
    """Check and decode every shard of an object against its manifest; nothing is applied.

    Each shard's size and sha256 are checked, then its header against the manifest (so a shard can never
    make the decoder allocate more than the manifest declares), then its payload is decoded, and finally
    the decoded entries are checked against the manifest as a whole (:func:`deltasync.apply.check_decoded`).

    Args:
        manifest: the object's manifest.
        shards: the bytes of ``manifest.shards``, in order.
        where: the object's location, for messages (``store uri/prefix``).
        base: the base version's tensors, or where to read them (``packed`` deltas are coded against them).
        checked: every shard's size and sha256 were checked against ``manifest`` already (an agent's fetcher
            checks them as it fetches; ``bytes`` cannot change since): not hashed a second time (a mutable buffer,
            or one of another size, is hashed all the same). A ``bytearray`` or writable ``memoryview`` is decoded in
            place (the caller's to give up).

    Raises:
        IntegrityError: a shard's size or sha256 differs from the manifest.
        FormatError: a shard is malformed or disagrees with the manifest.
    """
    pairs = list(zip(manifest.shards, shards, strict=True))
    for entry, data in pairs:  # every shard checked before any is decoded (against a base read from an engine)
        if not (checked and isinstance(data, bytes) and len(data) == entry.bytes):  # only immutable bytes stay checked
            check_shard(data, entry, name=f"{where}{entry.file}")
    out: list[TensorDelta] = []
    for i, (entry, data) in enumerate(pairs):
        name = f"{where}{entry.file}"
        buf: bytearray | memoryview
        if isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly):
            buf = data
        else:
            buf = bytearray(data)
        parsed = _check_header_against_manifest(manifest, i, buf, name)
        _, deltas = decode_shard(buf, name=name, base=base, parsed=parsed)
        out.extend(deltas.values())
    apply.check_decoded(manifest, out, where=where)
    return out


def load_object(
    store: Store, manifest: DeltaManifest, base: Mapping[str, torch.Tensor] | None = None
) -> list[TensorDelta]:
    """Fetch, check and decode every shard of an object (see :func:`decode_object`); nothing is applied."""
    prefix = prefix_of(manifest)
    return decode_object(manifest, fetch_object(store, manifest), where=f"{store.uri}/{prefix}", base=base)


def read_chain(store: Store, version: int, *, trust: Trust | None = None) -> list[DeltaManifest]:
    """Manifests to rebuild ``version``: the newest anchor on its delta chain, then the deltas.

    An anchor that cannot be read or authenticated, or that belongs to another run than ``trust`` pins, is
    passed over for the delta at the same version (a planted or damaged anchor must not hide an intact chain).
    The chain must be of one model and one run, and each delta must claim, for every tensor it leaves
    unchanged, exactly the checksums of the object before it.

    Raises:
        ObjectNotFound: a version on the chain has neither a delta nor an anchor.
        FormatError: the chain mixes models or runs, or a delta contradicts its base.
        ForeignObject, FencedObject: a delta on the chain is another run's or a fenced publisher's.
    """
    view = None if trust is None else trust.run_view(store)
    chain: list[DeltaManifest] = []
    v = version
    while True:
        has_delta = store.exists(manifest_key(v, "delta"))
        if store.exists(manifest_key(v, "anchor")):
            try:
                chain.append(_read_manifest(store, v, "anchor", trust, view))
                break
            except (FormatError, StoreError) as exc:
                if not has_delta:
                    raise
                logger.warning("%s: anchor v%d is unusable (%s); rebuilding through the delta chain", store.uri, v, exc)
        if not has_delta:
            needed = f" (needed to rebuild v{version})" if v != version else ""
            raise ObjectNotFound(f"{store.uri}: version {v} is not committed{needed}")
        m = _read_manifest(store, v, "delta", trust, view)
        chain.append(m)
        assert m.base_version is not None
        v = m.base_version
    chain.reverse()
    _check_chain(store, chain)
    return chain


def _check_chain(store: Store, chain: list[DeltaManifest]) -> None:
    first = chain[0]
    runs = {m.run_id for m in chain if m.run_id is not None}
    if len(runs) > 1:
        raise FormatError(f"{store.uri}: the chain to v{chain[-1].version} mixes objects of runs {sorted(runs)}")
    for prev, m in zip(chain, chain[1:], strict=False):
        if m.model_fingerprint != first.model_fingerprint:
            raise FormatError(
                f"{store.uri}: {m.kind} v{m.version} is for another model than anchor v{first.version} "
                f"(fingerprints {m.model_fingerprint[:19]}... and {first.model_fingerprint[:19]}...); "
                "the chain mixes objects of two models"
            )
        changed = [n for n, e in m.tensors.items() if e.nnz == 0 and e.checksums != prev.tensors[n].checksums]
        if changed:
            raise FormatError(
                f"{store.uri}: delta v{m.version} leaves {changed[0]!r} unchanged but claims other checksums than "
                f"v{prev.version} for it ({len(changed)} tensors); the delta does not belong on this base"
            )


def iter_weights(
    store: Store, version: int, *, trust: Trust | None = None, verify: bool = True
) -> Iterator[tuple[DeltaManifest, dict[str, torch.Tensor]]]:
    """Each object on ``version``'s chain and the full state once it is applied, in order. The state is one set
    of tensors updated in place from object to object (no copy of the model per step): clone what you keep."""
    chain = read_chain(store, version, trust=trust)
    into = apply.TensorsReceiver(verify=verify)
    for m in chain:
        where = f"{store.uri}/{prefix_of(m)}"

        def read(m: DeltaManifest = m) -> list[TensorDelta]:  # decoded against the objects before it
            return load_object(store, m, base=into.tensors)

        # admitted already: read_chain checked the chain is one run's and one model's, each delta on its base
        apply.apply_update([apply.Step(m, where, read)], into)
        assert into.tensors is not None
        yield m, into.tensors


def read_weights(
    store: Store, version: int, *, trust: Trust | None = None, verify: bool = True
) -> dict[str, torch.Tensor]:
    """Rebuild the full state dict at ``version``.

    Starts from the newest anchor on the version's delta chain and applies each delta in order. With
    ``verify``, every tensor an object touches is checked against that object's checksums, so the result
    provably equals what the publisher held; with ``trust``, every manifest is authenticated first.

    Raises:
        ObjectNotFound: the version, or one its chain needs, is not committed.
        IntegrityError, FormatError: a shard is corrupt or a rebuilt tensor differs.
        SignatureError: ``trust`` has a key and a manifest is not signed by it.
    """
    steps = list(iter_weights(store, version, trust=trust, verify=verify))
    manifest, state = steps[-1]
    if set(state) != set(manifest.tensors):
        raise FormatError(f"{store.uri}: v{version} lists other tensors than its chain rebuilt")
    return {name: state[name] for name in manifest.tensors}
