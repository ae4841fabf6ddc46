"""The deltasync exception hierarchy.

Every error the library raises on purpose derives from :class:`DeltaSyncError` and from the
nearest builtin, so ``except FileNotFoundError`` or ``except ValueError`` keep working::

    DeltaSyncError
    +-- FormatError(DeltaSyncError, ValueError)        malformed shard or manifest; names file + field
    |   +-- UnsupportedFormatVersion(FormatError)      a major format version this reader does not know
    |   +-- IntegrityError(FormatError)                sha256, size or tensor checksum mismatch
    +-- VersionGapError(DeltaSyncError)                a delta's base is not the version held
    +-- StoreError(DeltaSyncError, OSError)            the store could not read or write an object
    |   +-- ObjectNotFound(StoreError, FileNotFoundError)
    +-- CoordinatorError(DeltaSyncError)               the coordinator answered with an error
    +-- ApplyError(DeltaSyncError, RuntimeError)       a partial apply: do not serve until resynced

Messages name the object first, then what was expected, what was found, and what to do.
"""

from __future__ import annotations

__all__ = [
    "ApplyError",
    "CoordinatorError",
    "DeltaSyncError",
    "FormatError",
    "IntegrityError",
    "ObjectNotFound",
    "StoreError",
    "UnsupportedFormatVersion",
    "VersionGapError",
]


class DeltaSyncError(Exception):
    """Base class of every error deltasync raises on purpose."""


class FormatError(DeltaSyncError, ValueError):
    """A shard or manifest is malformed; the message names the file and the field."""


class UnsupportedFormatVersion(FormatError):
    """A shard or manifest declares a major format version this reader does not know."""


class IntegrityError(FormatError):
    """Bytes or a rebuilt tensor do not match the size or digest the manifest promises."""


class VersionGapError(DeltaSyncError):
    """A delta's ``base_version`` is not the version the receiver holds: resync from an anchor."""


class StoreError(DeltaSyncError, OSError):
    """The store could not read, write, list or delete an object."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """The store holds no object under the requested key."""


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


class ApplyError(DeltaSyncError, RuntimeError):
    """Applying a delta failed part-way: the receiver must not serve until it has resynced."""
