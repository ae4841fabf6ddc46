"""The coordinator's SQLite file: one owner, checked at start, closed cleanly, backed up online.

* **One coordinator per database.** An exclusive ``flock`` on ``<db>.lock`` (holder: pid, host, start time);
  a second coordinator exits naming the holder.
* **Refuse a damaged file.** ``PRAGMA integrity_check`` at start; any finding is a clear error.
* **Never lose a commit on shutdown.** ``close`` checkpoints the WAL into the main file (TRUNCATE) and closes,
  so copying only ``ledger.db`` afterwards copies everything.
* **Never stall.** A request waits at most ``timeout_s`` for the database (busy timeout and the in-process
  lock); then :class:`Busy` (HTTP 503 with Retry-After).
* **Online backup.** :func:`backup` copies a live ledger consistently (SQLite's backup API).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["Busy", "DamagedLedger", "Database", "LedgerLocked", "backup"]


class Busy(Exception):
    """The database did not answer within the timeout (HTTP 503; retry)."""


class LedgerLocked(RuntimeError):
    """Another coordinator holds this database."""


class DamagedLedger(RuntimeError):
    """The database file fails SQLite's integrity check, or is not a database."""


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "database is locked" in str(exc)


class _LockFile:
    """``flock`` on ``<db>.lock``; the file names the holder."""

    def __init__(self, db: Path) -> None:
        self.path = db.with_name(db.name + ".lock")
        self.file: IO[str] | None = open(self.path, "a+")  # noqa: SIM115 - held for the process's life
        try:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "{}"
            self.file.close()
            self.file = None
            raise LedgerLocked(
                f"{db} is in use by another coordinator ({holder}); one coordinator owns a SQLite ledger: stop it "
                "first, or use a PostgreSQL ledger for several coordinators"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        holder_info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.file.write(json.dumps(holder_info))
        self.file.flush()

    def release(self) -> None:
        if self.file is not None:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)
            self.file.close()
            self.file = None


class Database:
    """The ledger's SQLite connection (WAL), its lock file, migrations and run identity.

    Thread-safe: one connection guarded by a lock; every transaction is short, and callers run them in a
    thread pool, never holding a connection while they wait.

    Args:
        path: the SQLite file (created).
        migrations: schema migrations, applied in order and recorded in ``schema_migrations``.
        timeout_s: how long a transaction waits for the lock or the database before :class:`Busy`.
        clock: seconds since the epoch (tests pass a fake one).
        exclusive: take the one-coordinator lock (tools that only read or back up pass False).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        migrations: list[str],
        *,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        exclusive: bool = True,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.timeout_s, self._clock = timeout_s, clock
        self._lock = threading.Lock()
        self._lockfile = _LockFile(self.path) if exclusive else None
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=timeout_s)
            self._db.row_factory = sqlite3.Row
            self._check_integrity()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self.schema_version = self._migrate(migrations)
            with self.tx() as db:
                db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('run_id', ?)", (f"run-{uuid.uuid4().hex}",))
                self.run_id: str = db.execute("SELECT value FROM meta WHERE key='run_id'").fetchone()[0]
        except BaseException:
            if self._lockfile is not None:
                self._lockfile.release()
            raise
        self._probe: sqlite3.Connection | None = None

    def _check_integrity(self) -> None:
        try:
            rows = [r[0] for r in self._db.execute("PRAGMA integrity_check").fetchall()]
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise DamagedLedger(
                f"{self.path}: not a usable SQLite database ({exc}); restore it from a backup "
                "(`deltasync coordinator backup` makes one; docs/RELIABILITY.md)"
            ) from None
        if rows != ["ok"]:
            self._db.close()
            raise DamagedLedger(
                f"{self.path}: the integrity check found {len(rows)} problems ({'; '.join(rows[:3])}); the ledger "
                "is damaged: restore it from a backup (docs/RELIABILITY.md)"
            )

    def _migrate(self, migrations: list[str]) -> int:
        db = self._db
        db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at REAL)")
        done = {r[0] for r in db.execute("SELECT version FROM schema_migrations")}
        for number, sql in enumerate(migrations, start=1):
            if number in done:
                continue
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in sql.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO schema_migrations VALUES (?, ?)", (number, self._clock()))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return len(migrations)

    @contextmanager
    def tx(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """A write transaction: the lock, ``BEGIN IMMEDIATE``, COMMIT or ROLLBACK. ``durable=False`` commits
        without an fsync (WAL: it survives a process crash, only a power loss could undo it), for heartbeats.

        Raises:
            Busy: the lock or the database was not free within ``timeout_s``.
        """
        if not self._lock.acquire(timeout=self.timeout_s):
            raise Busy(f"the ledger is busy (no turn within {self.timeout_s:g} s)")
        try:
            try:
                self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if _is_busy(exc):
                    raise Busy(f"the ledger database is locked by another process ({exc})") from None
                raise
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            try:
                self._db.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                self._db.execute("ROLLBACK")
                if _is_busy(exc):
                    raise Busy(f"the ledger database is locked by another process ({exc})") from None
                raise
        finally:
            self._lock.release()

    def probe(self, timeout_s: float = 1.0) -> str | None:
        """Whether a write could start now: ``None`` if so, else why not (its own connection, short timeout)."""
        try:
            if self._probe is None:
                self._probe = sqlite3.connect(
                    self.path, check_same_thread=False, isolation_level=None, timeout=timeout_s
                )
            self._probe.execute("BEGIN IMMEDIATE")
            self._probe.execute("ROLLBACK")
            return None
        except sqlite3.Error as exc:
            if _is_busy(exc):
                return f"the ledger database is locked (no write within {timeout_s:g} s)"
            return f"the ledger database fails ({exc})"

    def close(self) -> None:
        """Checkpoint the WAL into the main file, close, and release the lock. Idempotent."""
        with self._lock:
            if self._probe is not None:
                self._probe.close()
                self._probe = None
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._db.close()
            except sqlite3.ProgrammingError:  # already closed
                pass
            if self._lockfile is not None:
                self._lockfile.release()
                self._lockfile = None


def backup(source: str | os.PathLike[str], dest: str | os.PathLike[str]) -> int:
    """A consistent copy of a ledger, taken while a coordinator runs (SQLite's online backup API).

    Returns:
        The number of pages copied.

    Raises:
        FileExistsError: ``dest`` exists (a backup never overwrites).
        DamagedLedger: ``source`` is not a database.
    """
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} exists; a backup never overwrites a file")
    if not Path(source).is_file():
        raise FileNotFoundError(f"{source}: no such ledger")
    src = sqlite3.connect(f"file:{Path(source).absolute()}?mode=ro", uri=True, timeout=30)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.partial")
    out = sqlite3.connect(tmp)
    done = False
    try:
        pages = [0]

        def progress(status: int, remaining: int, total: int) -> None:
            pages[0] = total

        src.backup(out, pages=1024, progress=progress)
        rows = [r[0] for r in out.execute("PRAGMA integrity_check").fetchall()]
        if rows != ["ok"]:
            raise DamagedLedger(f"{source}: the backup fails its integrity check ({rows[:3]})")
        out.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
        done = True
    except sqlite3.DatabaseError as exc:
        raise DamagedLedger(f"{source}: cannot back it up ({exc})") from None
    finally:
        out.close()
        src.close()
        if not done:
            tmp.unlink(missing_ok=True)
    try:
        os.link(tmp, dest)  # create-only
    finally:
        tmp.unlink(missing_ok=True)
    return pages[0]
