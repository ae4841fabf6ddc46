"""A store's own record of its run: which run owns the store, and which publisher each lease epoch fenced.

::

    run.json                               written once, by the run's first publisher
    epochs/e00000004.json                  one per publisher lease epoch, written when the lease is taken
    epochs/e00000004-<16 hex>.json         the same, where something else already took the key above

Each record is one create-only object: a line of JSON and, when the publisher signs, a second line with its
signature (the manifest signature's JSON, over ``b"deltasync-run-v1\\n"`` + the first line and its newline):
a record and its signature can never be torn apart by a crash or two writers.

A reader with the coordinator proves every manifest against the ledger and needs neither. A reader with only
the publisher's key does: one key often serves many runs, and without a record a validly signed object of
another run, planted in this store, would read as this run's. So key-only readers **pin the run**: to
``Trust(run_id=...)`` (``--run-id``) when given, without reading ``run.json`` at all; else to the run the
store's ``run.json`` names when the key signed it; else (no record, or one the key did not sign, which is
ignored with a warning) to the one run that every object the key signed in the store names. Every object of
another run is refused (:class:`~deltasync.errors.ForeignObject`), and so is every object when the signed
objects name several runs: only ``--run-id`` tells them apart then.

Whoever can write the store without the key can plant keys, never sign one. The publisher therefore refuses a
store whose ``run.json`` its key did not sign (it could not be read as this run's), and an epoch record planted
at its key does not stop the publisher recording its own: it goes to ``epochs/eE-<16 hex>.json`` instead.

The **fence rule**: a publisher that took the run's lease at epoch ``E`` writes ``epochs/eE.json`` with
``registered_through``, the newest version the ledger had registered when it took the lease. An object written
under an older epoch ``e < E`` at a version above ``registered_through`` was never registered: its writer lost
the lease before (or while) committing it, a frozen publisher's late write. Readers refuse it
(:class:`~deltasync.errors.FencedObject`) and the coordinator's garbage collection deletes it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from .errors import (
    FencedObject,
    ForeignObject,
    FormatError,
    ObjectExists,
    ObjectNotFound,
    SignatureError,
    StoreError,
)
from .layout import parse_manifest_key, signature_key
from .manifest import MAX_MANIFEST_BYTES, DeltaManifest
from .signing import MAX_SIGNATURE_BYTES, RUN_CONTEXT, SigningKey, VerifyKey
from .store.base import Store
from .vocab import FORMAT_VERSION, MAX_VERSION

__all__ = [
    "EPOCHS_PREFIX",
    "RUN_KEY",
    "EpochRecord",
    "RunView",
    "adopt_run",
    "claim_run",
    "new_run_id",
    "read_run_view",
    "record_epoch",
]

logger = logging.getLogger(__name__)

RUN_KEY = "run.json"
EPOCHS_PREFIX = "epochs/"
MAX_RECORD_BYTES = 8192
"""Readers refuse larger run or epoch records, signature line included (checked before reading)."""
_EPOCH_KEY = re.compile(r"epochs/e(\d{8})(?:-[0-9a-f]{16})?\.json")
_BEFORE_RECORDS = ("1.0", "1.1", "1.2")
"""Manifest formats written before stores recorded their run (their stores have no ``run.json``)."""
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def new_run_id() -> str:
    """A fresh run identity (the coordinator's ledgers use the same shape)."""
    return f"run-{secrets.token_hex(16)}"


def _epoch_key(epoch: int) -> str:
    return f"{EPOCHS_PREFIX}e{epoch:08d}.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochRecord:
    """One publisher lease epoch of a run, as its publisher recorded it in the store."""

    run_id: str
    """The run."""
    epoch: int
    """The lease epoch (increases with every new holder)."""
    registered_through: int | None
    """The newest version the ledger had registered when this epoch took the lease (``None``: none)."""

    def fences(self, manifest: DeltaManifest) -> bool:
        """Whether ``manifest`` is an older epoch's write that this epoch's takeover left unregistered."""
        return (
            manifest.run_id == self.run_id
            and manifest.lease_epoch is not None
            and manifest.lease_epoch < self.epoch
            and manifest.version > (-1 if self.registered_through is None else self.registered_through)
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RunView:
    """What a key-only reader holds an object against: the pinned run and its recorded epochs."""

    run_id: str | None
    """The run every object must belong to (``None``: not pinned, or pinned lazily by :attr:`signed_runs`)."""
    epochs: tuple[EpochRecord, ...] = ()
    """The epoch records that can fence (signed by the reader's key, when it has one), ascending."""
    pinned_by: str = ""
    """Where the pin came from, for messages (``--run-id`` or the store's ``run.json``)."""
    unpinned: str | None = None
    """Why a reader that must pin a run has no pin from a record (no ``run.json``, or one the key did not sign):
    the run is then the one that every object the key signed names (:attr:`signed_runs`); an object that names a
    run, written since format 1.3 (whose publishers always record their run), is refused when they name several."""
    signed_runs: Callable[[], tuple[str, ...]] | None = None
    """The runs the objects signed by the reader's key name (read once, on the first object that needs them)."""
    store_run: Callable[[], str | None] | None = None
    """The run the store's ``run.json`` names, read only to word a refusal of a reader pinned by ``--run-id``."""
    store_uri: str = ""
    """The store, for messages."""

    def resolve(self) -> tuple[str | None, str]:
        """The pinned run and where the pin came from; reads the signed objects when no record pins the run.

        Raises:
            ForeignObject: no record pins the run, and the objects the key signed name several runs (or none).
        """
        if self.run_id is not None or self.unpinned is None or self.signed_runs is None:
            return self.run_id, self.pinned_by
        runs = self.signed_runs()
        if len(runs) != 1:
            found = f"objects of several runs ({', '.join(runs)}, ...)" if runs else "no object that names a run"
            raise ForeignObject(
                f"{self.unpinned}, and the key signed {found} in it: a reader with only the publisher's key cannot "
                "tell this run's objects from another run's signed by the same key; pin the run (--run-id RUN, "
                "Trust(run_id=...)), or read through the coordinator"
            )
        return runs[0], "the one run the objects signed by the key name"

    def admit(self, manifest: DeltaManifest, *, name: str) -> None:
        """Refuse an object of another run, or one a later publisher of the run fenced.

        Raises:
            ForeignObject: the object names another run (or none) than the pinned one, or the reader must pin a
                run and cannot.
            FencedObject: a later lease epoch fenced the object's writer before it was registered.
        """
        recorded = manifest.run_id is not None and manifest.format_version not in _BEFORE_RECORDS
        pin, pinned_by = self.run_id, self.pinned_by
        if pin is None and self.unpinned is not None and recorded:  # its publisher wrote a run.json
            try:
                pin, pinned_by = self.resolve()
            except ForeignObject as exc:
                raise ForeignObject(f"{name}: names run {manifest.run_id}, and {exc}") from None
        if pin is not None and manifest.run_id != pin:
            held = self.store_run() if self.store_run is not None else None
            if held is not None and held == manifest.run_id:
                raise ForeignObject(
                    f"{self.store_uri}: the store belongs to run {held} ({RUN_KEY}), this reader is pinned to run "
                    f"{pin}: point the reader at its own run's store, or pin the run the store holds ({name} is "
                    f"of run {held})"
                )
            raise ForeignObject(
                f"{name}: belongs to run {manifest.run_id or '(none)'}, this reader is pinned to run {pin} "
                f"({pinned_by}): an object of another run in this store; it is never read as this run's"
            )
        for record in reversed(self.epochs):
            if record.fences(manifest):
                through = "no version" if record.registered_through is None else f"v{record.registered_through}"
                raise FencedObject(
                    f"{name}: written under publisher lease epoch {manifest.lease_epoch}, but epoch "
                    f"{record.epoch} took run {record.run_id} when the ledger had registered {through}: a fenced "
                    "publisher's late write, never registered; it is never read (the coordinator's gc deletes it)"
                )


_warned: set[str] = set()
_MAX_WARNED = 4096


def _warn_once(msg: str, *args: object) -> None:
    """Log a warning once per process: every read of a degraded store opens a new view of it."""
    text = msg % args
    if text in _warned:
        return
    if len(_warned) < _MAX_WARNED:  # past it (a process reading thousands of degraded stores) repeats are logged
        _warned.add(text)
    logger.warning("%s", text)


def _record_bytes(obj: dict[str, object]) -> bytes:
    return (json.dumps(obj, sort_keys=True) + "\n").encode()


def _signed(data: bytes, signing_key: SigningKey | None) -> bytes:
    """A record's object: its line and, with a key, the signature line (Ed25519 is deterministic: the same
    record signed by the same key is the same bytes)."""
    return data if signing_key is None else data + signing_key.sign(data, context=RUN_CONTEXT)


def _put_record(store: Store, key: str, data: bytes, signing_key: SigningKey | None) -> bool:
    """Create a record (with its signature line); ``False`` if the key is taken (another writer was first)."""
    try:
        store.put(key, _signed(data, signing_key))
    except ObjectExists:
        return False
    return True


def _get_record(store: Store, key: str, verify_key: VerifyKey | None) -> dict[str, object] | None:
    """A record's JSON, authenticated by ``verify_key``; ``None`` if there is none.

    Raises:
        SignatureError: ``verify_key`` did not sign it.
        FormatError: it is not a record.
        StoreError: it is too large (ObjectTooLarge), or not a regular file (UnsafeObject).
    """
    try:
        data = store.get(key, max_bytes=MAX_RECORD_BYTES)
    except ObjectNotFound:
        return None
    name = f"{store.uri}/{key}"
    end = data.find(b"\n") + 1
    body, sig = (data[:end], data[end:] or None) if end else (data, None)
    if verify_key is not None:
        if sig is None:
            raise SignatureError(f"{name}: the record is unsigned: no signature line after its JSON")
        verify_key.verify(body, sig, name=name, context=RUN_CONTEXT, what="record")
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FormatError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("run_id"), str) or not _RUN_ID.fullmatch(obj["run_id"]):
        raise FormatError(f"{name}: must be a JSON object with a run identity 'run_id', found {str(obj)[:200]!r}")
    fmt = obj.get("format_version")
    if not isinstance(fmt, str) or not re.fullmatch(r"1\.\d{1,6}", fmt):
        raise FormatError(f"{name}: format_version must be '1.x' (this reader knows 1.x), found {str(fmt)[:40]!r}")
    return obj


def _reason(exc: BaseException, store: Store, key: str) -> str:
    """What was wrong with a record, without its name (or its store's) in front."""
    return str(exc).removeprefix(f"{store.uri}/{key}: ").removeprefix(f"{store.uri}: ")


def _own_run_record(
    store: Store, signing_key: SigningKey | None, run_id: str | None = None
) -> dict[str, object] | None:
    """The store's run record, if a publisher signing with ``signing_key`` (of ``run_id``, when it knows it) can
    take it as its own. A record its key did not sign (replaced, cut, planted) does not stop a publisher whose key
    signed objects of its run in the store already (a restarted publisher): it is ignored, with a warning, and
    the run is the one those objects name.

    Raises:
        ForeignObject: the publisher signs, the record is not signed by its key (or is not a record), and no
            object its key signed in the store names its run (a record planted before its first publish).
        FormatError: the publisher does not sign and the record is malformed.
    """
    if signing_key is None:
        return _get_record(store, RUN_KEY, None)
    name = f"{store.uri}/{RUN_KEY}"
    try:
        return _get_record(store, RUN_KEY, signing_key.verify_key)
    except (FormatError, StoreError) as exc:
        why = _reason(exc, store, RUN_KEY)
        runs = _signed_runs(store, signing_key.verify_key, "", quiet=True)
        ours = run_id if run_id is not None and run_id in runs else runs[0] if len(runs) == 1 and not run_id else None
        if ours is not None:
            logger.warning(
                "%s: not written by this publisher (%s): ignored; the objects its key signed in the store name run "
                "%s, which it goes on publishing (readers with the key ignore the record too)",
                name,
                why,
                ours,
            )
            return {"format_version": FORMAT_VERSION, "run_id": ours}
        raise ForeignObject(
            f"{name}: this publisher did not write the store's run record ({why}); this "
            f"publisher signs with key {signing_key.verify_key.key_id}, and a store writer without the key may have "
            "planted the record (the run id is no secret). Nothing was written. If this store is meant for this "
            f"run, delete {RUN_KEY} and start the publisher again (it writes and signs its own record); else "
            "publish under a fresh store prefix"
        ) from None


def claim_run(store: Store, run_id: str, signing_key: SigningKey | None) -> None:
    """Record that ``store`` belongs to ``run_id`` (once), or check that it already does.

    Raises:
        ForeignObject: the store's record names another run (publish each run under its own prefix), or the
            publisher signs and its key did not sign the record (a planted one).
    """
    data = _record_bytes({"format_version": FORMAT_VERSION, "run_id": run_id})
    if _put_record(store, RUN_KEY, data, signing_key):
        logger.info("%s: recorded as the store of run %s", store.uri, run_id)
        return
    found = _own_run_record(store, signing_key, run_id)
    if found is not None and found["run_id"] != run_id:
        raise ForeignObject(
            f"{store.uri}: the store belongs to run {found['run_id']} ({RUN_KEY}), this publisher's run is "
            f"{run_id}; nothing was written: publish each run under its own store prefix"
        )


def adopt_run(store: Store, signing_key: SigningKey | None) -> str:
    """The run of a publisher without a coordinator: the store's recorded run, or a new one recorded now.

    Raises:
        ForeignObject: the publisher signs and its key did not sign the store's record (a planted one).
    """
    found = _own_run_record(store, signing_key)
    if found is not None:
        return str(found["run_id"])
    run_id = new_run_id()
    data = _record_bytes({"format_version": FORMAT_VERSION, "run_id": run_id})
    if _put_record(store, RUN_KEY, data, signing_key):
        logger.info("%s: recorded as the store of run %s", store.uri, run_id)
        return run_id
    found = _own_run_record(store, signing_key)  # another publisher recorded first: its run is the store's
    return run_id if found is None else str(found["run_id"])


def record_epoch(
    store: Store, run_id: str, epoch: int, registered_through: int | None, signing_key: SigningKey | None
) -> str:
    """Record that lease ``epoch`` took ``run_id`` when the ledger had registered ``registered_through``.

    A record that is not this very one, already at the epoch's key (planted by a store writer: lease epochs
    never repeat), does not stop it: this record then goes to a key of its own (``epochs/eE-<16 hex>.json``).
    Returns the key it is recorded at.
    """
    obj = {"format_version": FORMAT_VERSION, "run_id": run_id, "epoch": epoch, "registered_through": registered_through}
    data = _record_bytes(obj)
    key = _epoch_key(epoch)
    if _put_record(store, key, data, signing_key):
        return key
    try:
        there = store.get(key, max_bytes=MAX_RECORD_BYTES)
    except StoreError:  # too large, a link, or gone again: not this record in any case
        there = None
    if there == _signed(data, signing_key):
        logger.info("%s/%s: epoch %d of run %s is already recorded", store.uri, key, epoch, run_id)
        return key
    other = f"{EPOCHS_PREFIX}e{epoch:08d}-{secrets.token_hex(8)}.json"
    if not _put_record(store, other, data, signing_key):
        raise ObjectExists(f"{store.uri}: {other!r} exists (a random key): epoch {epoch} is not recorded")
    logger.warning(
        "%s/%s: taken by a record this publisher did not write (planted?); epoch %d of run %s is recorded at %s "
        "instead (readers with the key ignore records it did not sign)",
        store.uri,
        key,
        epoch,
        run_id,
        other,
    )
    return other


def _parse_epoch(obj: dict[str, object], key: str, name: str) -> EpochRecord:
    epoch, through = obj.get("epoch"), obj.get("registered_through")
    m = _EPOCH_KEY.fullmatch(key)
    if type(epoch) is not int or m is None or int(m.group(1)) != epoch:
        raise FormatError(f"{name}: 'epoch' must be the int its key names, found {epoch!r}")
    if through is not None and (type(through) is not int or not 0 <= through <= MAX_VERSION):
        raise FormatError(f"{name}: 'registered_through' must be null or a version, found {through!r}")
    return EpochRecord(run_id=str(obj["run_id"]), epoch=epoch, registered_through=through)


def _read_epochs(store: Store, verify_key: VerifyKey | None) -> list[EpochRecord]:
    """Every epoch record that can fence: signed by ``verify_key`` when given; the others are ignored, with a
    warning (they cannot fence anything)."""
    epochs = []
    try:
        keys = store.list(EPOCHS_PREFIX)
    except StoreError as exc:  # a planted file or link where the records go: nothing it holds can fence
        _warn_once("%s/%s: not listed (%s); no epoch records", store.uri, EPOCHS_PREFIX, exc)
        keys = []
    for key in keys:
        if _EPOCH_KEY.fullmatch(key) is None:
            continue
        name = f"{store.uri}/{key}"
        try:
            obj = _get_record(store, key, verify_key)
            if obj is not None:
                epochs.append(_parse_epoch(obj, key, name))
        except (FormatError, StoreError) as exc:  # unsigned, malformed, oversized, a link: it cannot fence
            _warn_once("%s: ignored (%s)", name, _reason(exc, store, key))
    return epochs


def _signed_runs(store: Store, verify_key: VerifyKey, note: str, *, quiet: bool = False) -> tuple[str, ...]:
    """The runs that the objects ``verify_key`` signed in ``store`` name (since format 1.3), sorted; stops at
    two. Every manifest is read (each up to its cap) and its signature checked: the price of a store without a
    run record the key signed. A reader is told (once) which run that pins, unless ``quiet``."""
    runs: set[str] = set()
    try:
        keys = store.list()
    except StoreError as exc:
        logger.warning("%s: not listed (%s); no run can be pinned from its objects", store.uri, exc)
        return ()
    for key in sorted(keys):
        parsed = parse_manifest_key(key)
        if parsed is None:
            continue
        name = f"{store.uri}/{key}"
        try:
            data = store.get(key, max_bytes=MAX_MANIFEST_BYTES)
            sig = store.get(signature_key(*parsed), max_bytes=MAX_SIGNATURE_BYTES)
            verify_key.verify(data, sig, name=name)
            manifest = DeltaManifest.from_json(data, name=name)
        except (FormatError, StoreError):  # unsigned, not the key's, unreadable: it names no run of this key's
            continue
        if manifest.run_id is not None and manifest.format_version not in _BEFORE_RECORDS:
            runs.add(manifest.run_id)
            if len(runs) > 1:
                break
    if len(runs) == 1 and not quiet:
        _warn_once(
            "%s: %spinned to run %s, the one run the objects signed by the key name; pass --run-id RUN "
            "(Trust(run_id=...)) to not depend on what the store holds",
            store.uri,
            note,
            next(iter(runs)),
        )
    return tuple(sorted(runs))


def _recorded_run(store: Store, verify_key: VerifyKey | None) -> str | None:
    """The run ``run.json`` names (signed by ``verify_key`` when given), or ``None``: never raises."""
    try:
        record = _get_record(store, RUN_KEY, verify_key)
    except (FormatError, StoreError):
        return None
    return None if record is None else str(record["run_id"])


def read_run_view(store: Store, *, run_id: str | None, verify_key: VerifyKey | None) -> RunView:
    """The run a key-only reader pins, and the epoch records that can fence its objects.

    ``run_id`` (the reader's own pin) wins, and ``run.json`` is then never relied on (it is read only to word a
    refusal). Without it the store's ``run.json`` pins the run when ``verify_key`` signed it; a record it did not
    sign (or a malformed one) is ignored, with a warning, and so is none at all: the run is then the one run
    every object the key signed names (read when the first object needs it). Epoch records not signed by
    ``verify_key`` (when given) are ignored, with a warning: they cannot fence anything.

    Never raises for what the store holds at ``run.json`` or under ``epochs/``.
    """
    uri = store.uri
    if run_id is not None:
        epochs = [e for e in _read_epochs(store, verify_key) if e.run_id == run_id]
        return RunView(
            run_id=run_id,
            epochs=tuple(sorted(epochs, key=lambda e: e.epoch)),
            pinned_by="--run-id",
            store_run=functools.cache(lambda: _recorded_run(store, verify_key)),
            store_uri=uri,
        )
    try:
        record = _get_record(store, RUN_KEY, verify_key)
        why = f"the store {uri} has no run record ({RUN_KEY}: deleted, or never written)"
    except (FormatError, StoreError) as exc:
        record, reason = None, _reason(exc, store, RUN_KEY)
        why = f"the store's run record {uri}/{RUN_KEY} is ignored ({reason})"
        then = "the run is pinned from the objects the key signed" if verify_key is not None else "no run is pinned"
        _warn_once("%s/%s: ignored (%s); %s", uri, RUN_KEY, reason, then)
    if record is not None:
        pin = str(record["run_id"])
        epochs = [e for e in _read_epochs(store, verify_key) if e.run_id == pin]
        return RunView(
            run_id=pin,
            epochs=tuple(sorted(epochs, key=lambda e: e.epoch)),
            pinned_by=f"the store's {RUN_KEY}",
            store_uri=uri,
        )
    if verify_key is None:
        return RunView(run_id=None, store_uri=uri)
    key, note = verify_key, f"no run record ({RUN_KEY}); " if why.endswith("never written)") else ""
    return RunView(
        run_id=None,
        epochs=tuple(sorted(_read_epochs(store, key), key=lambda e: e.epoch)),  # each fences its own run only
        unpinned=why,
        signed_runs=functools.cache(lambda: _signed_runs(store, key, note)),
        store_uri=uri,
    )
