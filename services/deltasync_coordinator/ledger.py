"""The ledger's contract, whichever database holds it (SQLite: :mod:`.db`; PostgreSQL: :mod:`.pg`): what the
registry, fleet and retention need of it (:class:`LedgerDatabase`), the errors both backends raise, and the one
check of a recorded schema that both run at start."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["Busy", "DamagedLedger", "LedgerDatabase", "LedgerLocked", "Replaced", "check_recorded_schema"]

_CREATE_TABLE = re.compile(r"CREATE TABLE (?:IF NOT EXISTS )?(\w+)", re.IGNORECASE)


class Busy(Exception):
    """The database did not answer within the timeout (HTTP 503; retry)."""


class Replaced(Busy):
    """The ledger file was removed or replaced while the coordinator ran (HTTP 503: nothing is committed to an
    unlinked file; health says why)."""


class LedgerLocked(RuntimeError):
    """Another coordinator holds this database."""


class DamagedLedger(RuntimeError):
    """The database file fails SQLite's integrity check, or is not a database."""


def check_recorded_schema(
    where: str, tables: set[str], done: set[int], migrations: Sequence[str], *, copy: str, how: str
) -> None:
    """Refuse a ledger (either backend) whose recorded schema this deltasync cannot serve: a schema version newer
    than it knows, or recorded migrations whose tables are gone (a damaged ledger can keep the record and lose a
    table). ``copy`` and ``how`` say what to restore from (``"a backup"``, ``"docs/RELIABILITY.md"``)."""
    if done and max(done) > len(migrations):
        raise DamagedLedger(
            f"{where}: schema version {max(done)} was written by a newer deltasync (this one knows "
            f"{len(migrations)}); upgrade deltasync, or restore {copy} made by this version"
        )
    created = {m.group(1) for sql in migrations[: max(done, default=0)] for m in _CREATE_TABLE.finditer(sql)}
    missing = created - tables
    if missing:
        raise DamagedLedger(
            f"{where}: migrations are recorded but tables {sorted(missing)} are missing; the ledger is damaged: "
            f"restore it from {copy} ({how})"
        )


@runtime_checkable
class LedgerDatabase(Protocol):
    """What the registry, fleet and retention need of a ledger database: ``db.Database`` (SQLite) and
    ``pg.PgDatabase`` (PostgreSQL). A transaction's body runs ``execute``/``executemany`` with ``?`` placeholders
    and reads rows by column name or position."""

    shared: bool
    """Whether other coordinators may write the same ledger (then the in-memory latest follows :meth:`listen`)."""
    describe: str
    """The ledger's name for logs and messages (a URL without its password)."""
    errors: tuple[type[BaseException], ...]
    """The exceptions of a failing database (answered 503 and shown in ``/healthz``, never 500)."""
    run_id: str
    schema_version: int
    timeout_s: float
    closed: bool
    checkpointed: bool
    clock: Callable[[], float]

    def open(self) -> None: ...
    def close(self) -> None: ...
    def tx(self, *, durable: bool = True) -> AbstractContextManager[Any]: ...
    def read(self) -> AbstractContextManager[Any]: ...
    def probe(self, timeout_s: float = 1.0) -> str | None: ...
    def file_replaced(self) -> str | None: ...
    def notify_versions(self, c: Any, latest: int | None, *, exact: bool = False) -> None: ...
    def listen(self, on_latest: Callable[[int | None, bool], None]) -> None: ...
