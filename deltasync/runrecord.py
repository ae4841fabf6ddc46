"""A store's own record of its run: which run owns the store, and which publisher each lease epoch fenced.

::

    run.json                               written once, by the run's first publisher
    epochs/e00000004.json                  one per publisher lease epoch, written when the lease is taken

Each record is one create-only object: a line of JSON and, when the publisher signs, a second line with its
signature (the manifest signature's JSON, over ``b"deltasync-run-v1\\n"`` + the first line and its newline):
a record and its signature can never be torn apart by a crash or two writers.

A reader with the coordinator proves every manifest against the ledger and needs neither. A reader with only
the publisher's key does: one key often serves many runs, and without a record a validly signed object of
another run, planted in this store, would read as this run's. So key-only readers **pin the run**: to
``Trust(run_id=...)`` (``--run-id``) when given, else to the run the store's signed ``run.json`` names, and
refuse every object of another run (:class:`~deltasync.errors.ForeignObject`).

The **fence rule**: a publisher that took the run's lease at epoch ``E`` writes ``epochs/eE.json`` with
``registered_through``, the newest version the ledger had registered when it took the lease. An object written
under an older epoch ``e < E`` at a version above ``registered_through`` was never registered: its writer lost
the lease before (or while) committing it, a frozen publisher's late write. Readers refuse it
(:class:`~deltasync.errors.FencedObject`) and the coordinator's garbage collection deletes it.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass

from .errors import FencedObject, ForeignObject, FormatError, ObjectExists, ObjectNotFound, StoreError
from .manifest import DeltaManifest
from .signing import RUN_CONTEXT, SigningKey, VerifyKey
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
_EPOCH_KEY = re.compile(r"epochs/e(\d{8})\.json")
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
    """The run every object must belong to (``None``: not pinned)."""
    epochs: tuple[EpochRecord, ...] = ()
    """The run's epoch records, ascending."""
    pinned_by: str = ""
    """Where the pin came from, for messages (``--run-id`` or the store's ``run.json``)."""
    unpinned: str | None = None
    """Why a reader that must pin a run could not (the store has no ``run.json``): objects that name a run and
    were written since format 1.3 (whose publishers always record their run) are then refused."""

    def admit(self, manifest: DeltaManifest, *, name: str) -> None:
        """Refuse an object of another run, or one a later publisher of the run fenced.

        Raises:
            ForeignObject: the object names another run (or none) than the pinned one, or the reader must pin a
                run and cannot.
            FencedObject: a later lease epoch fenced the object's writer before it was registered.
        """
        recorded = manifest.run_id is not None and manifest.format_version not in _BEFORE_RECORDS
        if self.run_id is None and self.unpinned is not None and recorded:  # its publisher wrote a run.json
            raise ForeignObject(
                f"{name}: names run {manifest.run_id or '(none)'}, and {self.unpinned}: a reader with only the "
                "publisher's key cannot tell this run's objects from another run's signed by the same key; pin the "
                "run (--run-id RUN, Trust(run_id=...)), or read through the coordinator"
            )
        if self.run_id is not None and manifest.run_id != self.run_id:
            raise ForeignObject(
                f"{name}: belongs to run {manifest.run_id or '(none)'}, this reader is pinned to run {self.run_id} "
                f"({self.pinned_by}): an object of another run in this store; it is never read as this run's"
            )
        for record in reversed(self.epochs):
            if record.fences(manifest):
                through = "no version" if record.registered_through is None else f"v{record.registered_through}"
                raise FencedObject(
                    f"{name}: written under publisher lease epoch {manifest.lease_epoch}, but epoch "
                    f"{record.epoch} took run {record.run_id} when the ledger had registered {through}: a fenced "
                    "publisher's late write, never registered; it is never read (the coordinator's gc deletes it)"
                )


def _record_bytes(obj: dict[str, object]) -> bytes:
    return (json.dumps(obj, sort_keys=True) + "\n").encode()


def _put_record(store: Store, key: str, data: bytes, signing_key: SigningKey | None) -> bool:
    """Create a record (with its signature line); ``False`` if the key is taken (another writer was first)."""
    if signing_key is not None:
        data += signing_key.sign(data, context=RUN_CONTEXT)
    try:
        store.put(key, data)
    except ObjectExists:
        return False
    return True


def _get_record(store: Store, key: str, verify_key: VerifyKey | None) -> dict[str, object] | None:
    """A record's JSON, authenticated by ``verify_key``; ``None`` if there is none."""
    try:
        data = store.get(key, max_bytes=MAX_RECORD_BYTES)
    except ObjectNotFound:
        return None
    name = f"{store.uri}/{key}"
    end = data.find(b"\n") + 1
    body, sig = (data[:end], data[end:] or None) if end else (data, None)
    if verify_key is not None:
        verify_key.verify(body, sig, name=name, context=RUN_CONTEXT)
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


def claim_run(store: Store, run_id: str, signing_key: SigningKey | None) -> None:
    """Record that ``store`` belongs to ``run_id`` (once), or check that it already does.

    Raises:
        ForeignObject: the store's record names another run (publish each run under its own prefix).
    """
    data = _record_bytes({"format_version": FORMAT_VERSION, "run_id": run_id})
    if _put_record(store, RUN_KEY, data, signing_key):
        logger.info("%s: recorded as the store of run %s", store.uri, run_id)
        return
    found = _get_record(store, RUN_KEY, None)
    if found is not None and found["run_id"] != run_id:
        raise ForeignObject(
            f"{store.uri}: the store belongs to run {found['run_id']} ({RUN_KEY}), this publisher's run is "
            f"{run_id}; nothing was written: publish each run under its own store prefix"
        )


def adopt_run(store: Store, signing_key: SigningKey | None) -> str:
    """The run of a publisher without a coordinator: the store's recorded run, or a new one recorded now."""
    found = _get_record(store, RUN_KEY, None)
    if found is not None:
        return str(found["run_id"])
    run_id = new_run_id()
    data = _record_bytes({"format_version": FORMAT_VERSION, "run_id": run_id})
    if _put_record(store, RUN_KEY, data, signing_key):
        logger.info("%s: recorded as the store of run %s", store.uri, run_id)
        return run_id
    found = _get_record(store, RUN_KEY, None)  # another publisher recorded first: its run is the store's
    return run_id if found is None else str(found["run_id"])


def record_epoch(
    store: Store, run_id: str, epoch: int, registered_through: int | None, signing_key: SigningKey | None
) -> None:
    """Record that lease ``epoch`` took ``run_id`` when the ledger had registered ``registered_through``."""
    obj = {"format_version": FORMAT_VERSION, "run_id": run_id, "epoch": epoch, "registered_through": registered_through}
    if not _put_record(store, _epoch_key(epoch), _record_bytes(obj), signing_key):
        logger.warning("%s: epoch %d of run %s is already recorded", store.uri, epoch, run_id)


def _parse_epoch(obj: dict[str, object], key: str, name: str) -> EpochRecord:
    epoch, through = obj.get("epoch"), obj.get("registered_through")
    m = _EPOCH_KEY.fullmatch(key)
    if type(epoch) is not int or m is None or int(m.group(1)) != epoch:
        raise FormatError(f"{name}: 'epoch' must be the int its key names, found {epoch!r}")
    if through is not None and (type(through) is not int or not 0 <= through <= MAX_VERSION):
        raise FormatError(f"{name}: 'registered_through' must be null or a version, found {through!r}")
    return EpochRecord(run_id=str(obj["run_id"]), epoch=epoch, registered_through=through)


def read_run_view(store: Store, *, run_id: str | None, verify_key: VerifyKey | None) -> RunView:
    """The run a key-only reader pins, and the run's epoch records.

    ``run_id`` (the reader's own pin) wins; without it the store's ``run.json`` pins the run when it is signed
    by ``verify_key``. Epoch records not signed by ``verify_key`` (when given) or of another run are ignored,
    with a warning: they cannot fence anything.

    Raises:
        ForeignObject: the store's record names another run than ``run_id``.
        SignatureError: the store's run record is not signed by ``verify_key``.
    """
    record = _get_record(store, RUN_KEY, verify_key)
    recorded = None if record is None else str(record["run_id"])
    if run_id is not None and recorded is not None and recorded != run_id:
        raise ForeignObject(
            f"{store.uri}: the store belongs to run {recorded} ({RUN_KEY}), this reader is pinned to run {run_id}: "
            "point the reader at its own run's store, or pin the run the store holds"
        )
    pin, pinned_by = (run_id, "--run-id") if run_id is not None else (recorded, f"the store's {RUN_KEY}")
    if pin is None:
        missing = f"the store {store.uri} has no run record ({RUN_KEY}: deleted, or never written)"
        return RunView(run_id=None, unpinned=missing if verify_key is not None else None)
    epochs = []
    try:
        keys = store.list(EPOCHS_PREFIX)
    except StoreError as exc:  # a planted file or link where the records go: nothing it holds can fence
        logger.warning("%s/%s: not listed (%s); no epoch records", store.uri, EPOCHS_PREFIX, exc)
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
            logger.warning("%s: ignored (%s)", name, exc)
    ours = tuple(sorted((e for e in epochs if e.run_id == pin), key=lambda e: e.epoch))
    return RunView(run_id=pin, epochs=ours, pinned_by=pinned_by)
