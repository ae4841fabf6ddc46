"""The coordinator's SQLite file: one owner, checked at start, closed cleanly, backed up online; and
:func:`open_database`, which opens the ledger ``--db`` names (a SQLite path, or a PostgreSQL URL: ``pg.py``).

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
import logging
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from .ledger import Busy, DamagedLedger, LedgerDatabase, LedgerLocked, Replaced, check_recorded_schema

logger = logging.getLogger("deltasync.coordinator")

__all__ = ["Database", "backup", "open_database"]


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "database is locked" in str(exc)


_SIDE_FILES = ("-wal", "-shm", "-journal", ".lock")
_SQLITE_MAGIC = b"SQLite format 3\x00"
_HELD_LOCK_FDS: list[int] = []
"""Descriptors of failed lock attempts, never closed: closing any descriptor of a SQLite file drops every POSIX
lock this process's SQLite connections hold on it (fcntl semantics), and another ``Database`` of this process
may have the file open."""


def _holder(path: Path) -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "path": str(path),
    }


class _FileLock:
    """An exclusive ``flock`` on the database file itself, so it binds the file (its inode), whatever path reaches
    it: a hard link, a symlink, ``..`` or a removed lock file cannot start a second coordinator on it. (``flock``
    and SQLite's own ``fcntl`` locks are independent on Linux; on NFS, where ``flock`` is emulated with ``fcntl``,
    SQLite itself is unsafe.) The holder is recorded in the database's ``meta`` table once migrated."""

    def __init__(self, db: Path) -> None:
        self.fd: int | None = os.open(db, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _HELD_LOCK_FDS.append(self.fd)
            self.fd = None
            raise LedgerLocked(
                f"{db} is in use by another coordinator ({_read_holder(db)}); one coordinator owns a SQLite ledger: "
                "stop it first, or use a PostgreSQL ledger for several coordinators"
            ) from None
        self.inode = _inode(os.fstat(self.fd))

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)  # after SQLite closed its connections (see _HELD_LOCK_FDS)
            self.fd = None


def _inode(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _read_holder(db: Path) -> str:
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            row = con.execute("SELECT value FROM meta WHERE key='holder'").fetchone()
        finally:
            con.close()
        return row[0] if row else "holder unknown"
    except sqlite3.Error:
        return "holder unknown"


def _check_path(path: Path) -> Path:
    """The real path of a ledger file, refused early when it cannot be one (clear errors, not tracebacks)."""
    if path.name.endswith(_SIDE_FILES):
        raise DamagedLedger(
            f"{path}: this is one of SQLite's side files, not a ledger; pass the database file itself "
            f"(without {', '.join(_SIDE_FILES)})"
        )
    real = Path(os.path.realpath(path))
    if real.is_dir():
        raise DamagedLedger(f"{path}: is a directory; pass a database file path, e.g. {path / 'ledger.db'}")
    if real.exists():
        if not real.is_file():
            raise DamagedLedger(f"{path}: not a regular file; pass a database file path")
        with open(real, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
        if head and head != _SQLITE_MAGIC:
            raise DamagedLedger(
                f"{path}: not a SQLite database (it starts with {head[:8]!r}); is this the right path? A damaged "
                "ledger is restored from a backup (docs/RELIABILITY.md)"
            )
    return real


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

    shared = False
    """One coordinator owns a SQLite ledger: its in-memory latest version is the truth."""
    errors: tuple[type[BaseException], ...] = (sqlite3.DatabaseError,)
    """A failing database raises these (answered 503 and shown in ``/healthz``, never 500)."""

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
        self.real_path = _check_path(self.path)
        self.timeout_s, self._clock, self.clock = timeout_s, clock, clock
        self.describe = str(self.path)
        self._migrations, self._exclusive = migrations, exclusive
        self._lock = threading.Lock()
        self._probe: sqlite3.Connection | None = None
        self.closed = True
        self.checkpointed = False
        """Whether the last :meth:`close` left every commit in the main file."""
        self.open()

    def open(self) -> None:
        """(Re)open the file: take the lock, check integrity, migrate. A no-op when open (an ASGI server may run
        the app's lifespan more than once; each shutdown closes, the next startup reopens)."""
        if not self.closed:
            return
        migrations = self._migrations
        self.real_path = _check_path(self.path)
        self._lockfile = _FileLock(self.real_path) if self._exclusive else None
        try:
            self._db = sqlite3.connect(
                self.real_path, check_same_thread=False, isolation_level=None, timeout=self.timeout_s
            )
            self._db.row_factory = sqlite3.Row
            self._check_integrity()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._durable = True
            self._db.execute("PRAGMA foreign_keys=ON")
            self.schema_version = self._migrate(migrations)
            self.inode = _inode(os.stat(self.real_path))
            with self.tx() as db:
                db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('run_id', ?)", (f"run-{uuid.uuid4().hex}",))
                self.run_id: str = db.execute("SELECT value FROM meta WHERE key='run_id'").fetchone()[0]
                if self._exclusive:
                    holder = json.dumps(_holder(self.path))
                    db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('holder', ?)", (holder,))
            if self._exclusive:  # into the main file: a refused second coordinator reads it without our WAL
                self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.DatabaseError as exc:
            self._release_after_failure()
            raise DamagedLedger(
                f"{self.path}: cannot be opened as a ledger ({exc}); restore it from a backup"
            ) from None
        except BaseException:
            self._release_after_failure()
            raise
        self.closed = False

    def _release_after_failure(self) -> None:
        try:
            self._db.close()
        except (AttributeError, sqlite3.Error):
            pass
        if self._lockfile is not None:
            self._lockfile.release()
            self._lockfile = None

    def file_replaced(self) -> str | None:
        """Why the file this ledger writes is no longer the one at its path (removed or replaced while running:
        every commit from now on would be lost at the next start), or ``None``."""
        try:
            now = _inode(os.stat(self.real_path))
        except FileNotFoundError:
            return f"{self.path} was removed while this coordinator ran; stop it and restore the ledger"
        if now != self.inode:
            return f"{self.path} was replaced by another file while this coordinator ran; stop it and restart"
        return None

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
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and "schema_migrations" not in tables:
            raise DamagedLedger(
                f"{self.path}: a SQLite database of something else (tables {sorted(tables)[:5]}), not a deltasync "
                "ledger; pass another path"
            )
        db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at REAL)")
        done = {r[0] for r in db.execute("SELECT version FROM schema_migrations")}
        check_recorded_schema(str(self.path), tables, done, migrations, copy="a backup", how="docs/RELIABILITY.md")
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
        if durable and (replaced := self.file_replaced()):  # a commit there would be lost at the next start
            raise Replaced(replaced)
        if not self._lock.acquire(timeout=self.timeout_s):
            raise Busy(f"the ledger is busy (no turn within {self.timeout_s:g} s)")
        try:
            try:
                if durable != self._durable:  # a pragma per mode change, not per transaction
                    self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
                    self._durable = durable
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

    def read(self) -> AbstractContextManager[sqlite3.Connection]:
        """A read transaction: on SQLite the same as :meth:`tx` (one connection, one turn at a time)."""
        return self.tx()

    def notify_versions(self, c: Any, latest: int | None, *, exact: bool = False) -> None:
        """Nothing to do: no other coordinator shares this file (long-polls are woken in process)."""

    def listen(self, on_latest: Callable[[int | None, bool], None]) -> None:
        """Nothing to listen to: no other coordinator writes this file."""

    def probe(self, timeout_s: float = 1.0) -> str | None:
        """Whether a write could start now: ``None`` if so, else why not (its own connection, short timeout)."""
        try:
            if self._probe is None:
                self._probe = sqlite3.connect(
                    self.real_path, check_same_thread=False, isolation_level=None, timeout=timeout_s
                )
            self._probe.execute("BEGIN IMMEDIATE")
            self._probe.execute("ROLLBACK")
            return None
        except sqlite3.Error as exc:
            if _is_busy(exc):
                return f"the ledger database is locked (no write within {timeout_s:g} s)"
            return f"the ledger database fails ({exc})"

    def _checkpoint(self) -> bool:
        """``wal_checkpoint(TRUNCATE)`` (it waits up to ``timeout_s`` for other processes' readers); whether the
        main file alone now holds every commit (logged loudly when not: the ``-wal`` file is then part of the
        ledger)."""
        try:
            busy, log, done = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.Error as exc:
            logger.error("ledger %s: checkpoint failed (%s)", self.path, exc)
            return False
        if not busy and log in (0, done):
            return True
        logger.error(
            "ledger %s: NOT checkpointed: another process holds the database open (%d of %d WAL frames copied); "
            "the %s-wal file is part of the ledger until a coordinator checkpoints it: copy both files, or use "
            "`deltasync coordinator backup`",
            self.path,
            done,
            log,
            self.path.name,
        )
        return False

    def close(self) -> None:
        """Checkpoint the WAL into the main file (checked: see :attr:`checkpointed`), close, and release the
        lock. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self._probe is not None:
                self._probe.close()
                self._probe = None
            self.checkpointed = self._checkpoint()
            try:
                self._db.close()
            except sqlite3.ProgrammingError:  # already closed
                pass
            if self._lockfile is not None:
                self._lockfile.release()
                self._lockfile = None


def open_database(
    db: str | os.PathLike[str], migrations: dict[str, list[str]], *, timeout_s: float = 5.0
) -> LedgerDatabase:
    """The ledger ``db`` names: a PostgreSQL URL (``postgresql://user:pw@host:port/dbname``) or a SQLite path.

    Args:
        migrations: each backend's numbered migrations, by name (``sqlite``, ``postgres``).

    Raises:
        LedgerLocked, DamagedLedger: as :class:`Database` (SQLite) or ``PgDatabase`` (foreign or newer schema).
        Busy: the PostgreSQL server did not answer.
    """
    if isinstance(db, str) and db.startswith(("postgresql://", "postgres://")):
        try:
            from .pg import PgDatabase
        except ImportError as exc:
            raise ImportError(f"a PostgreSQL ledger needs psycopg: pip install 'deltasync[postgres]' ({exc})") from None
        return PgDatabase(db, migrations["postgres"], timeout_s=timeout_s)
    return Database(db, migrations["sqlite"], timeout_s=timeout_s)


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
    if not dest.parent.is_dir():
        raise FileNotFoundError(f"{dest.parent}: no such directory for the backup; create it first")
    if not Path(source).is_file():
        raise FileNotFoundError(f"{source}: no such ledger")
    src = sqlite3.connect(f"file:{os.path.realpath(source)}?mode=ro", uri=True, timeout=30)
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
