"""The deltasync exception hierarchy.

Every error the library raises on purpose derives from :class:`DeltaSyncError` and from the
nearest builtin, so ``except FileNotFoundError`` or ``except ValueError`` keep working::

    DeltaSyncError
    +-- FormatError(DeltaSyncError, ValueError)        malformed shard or manifest; names file + field
    |   +-- UnsupportedFormatVersion(FormatError)      a major format version this reader does not know
    |   +-- IntegrityError(FormatError)                size, sha256, checksum or ledger digest mismatch
    |       +-- SignatureError(IntegrityError)         a manifest unsigned, or not signed by the trusted key
    |       +-- ForeignObject(IntegrityError)          an object of another run than the pinned one
    |       +-- FencedObject(IntegrityError)           a fenced publisher's late write, never registered
    +-- UpdateRefused(DeltaSyncError)                  refused before any write; ``reason`` says why
    |   +-- VersionGapError(UpdateRefused)             a delta's base is not the version held
    |   +-- AdapterRefused(UpdateRefused)              a staged adapter is not a version of the served one
    +-- StoreError(DeltaSyncError, OSError)            the store could not read or write an object
    |   +-- ObjectNotFound(StoreError, FileNotFoundError)
    |   +-- ObjectExists(StoreError, FileExistsError)  writes are create-only: the key is taken
    |   |   +-- VersionTaken(ObjectExists)             a key of the version being published was taken first
    |   +-- ObjectTooLarge(StoreError)                 larger than the reader's cap (checked before reading)
    |   +-- UnsafeObject(StoreError)                   a symlink, device, fifo or other non-regular file
    +-- CoordinatorError(DeltaSyncError)               the coordinator answered with an error
    |   +-- RunMismatch(CoordinatorError)              the coordinator's run identity is not the pinned one
    |   +-- LeaseError(CoordinatorError)               another publisher holds the run, or this one was fenced
    +-- ApplyError(DeltaSyncError, RuntimeError)       failed past the first write: do not serve until an anchor
    |   +-- MapCorruption(ApplyError)                  building the patch map changed live weights
    |   +-- AdapterWriteFailed(ApplyError)             a LoRA slot's write failed part-way; the adapter left it
    +-- EngineUnproven(DeltaSyncError, ConnectionError) the server at the engine's address did not prove it is it

Messages name the object first, then what was expected, what was found, and what to do.
"""

from __future__ import annotations

import enum

__all__ = [
    "AdapterRefused",
    "AdapterWriteFailed",
    "ApplyError",
    "CoordinatorError",
    "DeltaSyncError",
    "EngineUnproven",
    "FencedObject",
    "ForeignObject",
    "FormatError",
    "IntegrityError",
    "LeaseError",
    "MapCorruption",
    "ObjectExists",
    "ObjectNotFound",
    "ObjectTooLarge",
    "RefusalReason",
    "RunMismatch",
    "SignatureError",
    "StoreError",
    "UnsafeObject",
    "UnsupportedFormatVersion",
    "UpdateRefused",
    "VersionGapError",
    "VersionTaken",
]


class DeltaSyncError(Exception):
    """Base class of every error deltasync raises on purpose."""


class FormatError(DeltaSyncError, ValueError):
    """A shard or manifest is malformed; the message names the file and the field."""


class UnsupportedFormatVersion(FormatError):
    """A shard or manifest declares a major format version this reader does not know."""


class IntegrityError(FormatError):
    """Bytes or a rebuilt tensor do not match the size or digest the manifest (or the ledger) promises."""


class SignatureError(IntegrityError):
    """A manifest has no signature, or one that the trusted public key does not verify."""


class ForeignObject(IntegrityError):
    """An object (or a whole store) belongs to another run than the one the reader or publisher is pinned to."""


class FencedObject(IntegrityError):
    """An object a fenced publisher wrote after a later publisher took the run: never registered, never read."""


class RefusalReason(enum.StrEnum):
    """Why an update was refused before anything was written (:attr:`UpdateRefused.reason`)."""

    BASE = "base"
    """A delta's base is not the version the receiver holds."""
    MODEL = "model"
    """The object is for another model: its fingerprint (names, dtypes, shapes) differs from what is served."""
    RUN = "run"
    """The object belongs to another run than the one the receiver follows."""
    ROLLBACK = "rollback"
    """The object would take the receiver below the highest version it has served (an old ledger?)."""
    UNHEALTHY = "unhealthy"
    """The receiver failed an earlier update past its first write: only an anchor is accepted."""
    MALFORMED = "malformed"
    """A staged file is malformed or disagrees with its manifest."""
    INTEGRITY = "integrity"
    """Applied to what the receiver serves, the update would not give the published checksums (a forged or
    swapped staged file, or weights that are not the base they are labelled): nothing was written."""
    UNSUPPORTED = "unsupported"
    """The engine cannot apply this update exactly (e.g. fused MoE experts on vLLM's CPU build); restart it from
    the new checkpoint instead."""


class UpdateRefused(DeltaSyncError):
    """An update was refused before its first write: the receiver is healthy, its weights and label unchanged.

    Attributes:
        reason: a :class:`RefusalReason`; callers branch on it, never on the message.
    """

    def __init__(self, message: str, *, reason: RefusalReason) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:  # picklable across vLLM's process boundary
        return (_rebuild_refusal, (type(self), str(self), self.reason.value))


def _rebuild_refusal(cls: type[UpdateRefused], message: str, reason: str) -> UpdateRefused:
    if cls is VersionGapError:
        return VersionGapError(message)
    return cls(message, reason=RefusalReason(reason))


class VersionGapError(UpdateRefused):
    """A delta's ``base_version`` is not the version the receiver holds: re-plan from the version it holds."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason=RefusalReason.BASE)


class StoreError(DeltaSyncError, OSError):
    """The store could not read, write, list or delete an object."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """The store holds no object under the requested key."""


class ObjectExists(StoreError, FileExistsError):
    """A create-only write found the key taken: a registered object's bytes never change."""


class VersionTaken(ObjectExists):
    """A key of the version a writer was about to publish was taken by an object it did not write (planted by a
    store writer, or left by another writer): nothing of that version was committed by this writer.

    Attributes:
        key: the taken key.
        version: the version.
        next_free: the first version above it whose keys are all free, where the publisher may move on to it
            (it holds the run's lease), else ``None``.
    """

    def __init__(self, message: str, *, key: str, version: int, next_free: int | None = None) -> None:
        super().__init__(message)
        self.key, self.version, self.next_free = key, version, next_free

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_taken, (str(self), self.key, self.version, self.next_free))


def _rebuild_taken(message: str, key: str, version: int, next_free: int | None) -> VersionTaken:
    return VersionTaken(message, key=key, version=version, next_free=next_free)


class ObjectTooLarge(StoreError):
    """An object is larger than the reader allows; nothing was read."""


class UnsafeObject(StoreError):
    """A key leads to a symlink, a device, a fifo or another non-regular file; deltasync never follows them."""


class CoordinatorError(DeltaSyncError):
    """The coordinator answered with an error, or could not be reached after retries.

    Attributes:
        status_code: the HTTP status, or ``None`` when no response arrived.
        method: the HTTP method of the failed request.
        url: the URL of the failed request.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        method: str = "",
        url: str = "",
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.method = method
        self.url = url


class RunMismatch(CoordinatorError):
    """The coordinator's run identity is not the one this client (or its engine) pinned: another ledger."""


class LeaseError(CoordinatorError):
    """The publisher lease of the run is held by another publisher, or this publisher lost it (fenced)."""

    orphaned: bool = False
    """The lease is held under this client's own holder name, most likely taken by an attempt whose answer was
    lost (a replica that went away mid-request): nobody renews it, so it lapses within its TTL."""


class ApplyError(DeltaSyncError, RuntimeError):
    """Applying failed past the first write: the receiver must not serve until an anchor restores it."""


class MapCorruption(ApplyError):
    """Building the patch map changed live weights it had not swapped: the model serves wrong weights until an
    anchor restores it."""


class AdapterWriteFailed(ApplyError):
    """Writing a served LoRA adapter's slot failed part-way (past the first write): the adapter was deactivated,
    so no request uses a mix; its next use activates the new version whole. Reset the prefix cache as after a
    replace."""


class AdapterRefused(UpdateRefused):
    """A staged LoRA adapter is not a version of the served one (other modules, shapes or rank), or the served
    one is not loaded; nothing was written (reason ``model``, or ``unsupported`` for what cannot be replaced in
    place)."""

    def __init__(self, message: str, *, reason: RefusalReason = RefusalReason.MODEL) -> None:
        super().__init__(message, reason=reason)


class EngineUnproven(DeltaSyncError, ConnectionError):
    """The server at the engine's address did not prove that it holds the engine credential (another process
    holds vLLM's port while vLLM is down, or the agent was given another engine's credential): nothing that grants
    power was sent to it, and it is not driven. The agent reports it and tries again later."""
