"""The coordinator's PostgreSQL ledger: several coordinators on one database, writes serialized, news pushed.

* **Several coordinators per database** (the point of it): every durable write transaction takes one
  transaction-scoped advisory lock first, so writers are serialized across every coordinator exactly as
  SQLite's ``BEGIN IMMEDIATE`` serializes them in one: a version is registered once, lease epochs never repeat,
  a fenced publisher is refused through any coordinator. Reads and heartbeats take no lock.
* **Refuse a foreign or newer schema.** Tables without ``schema_migrations``, a schema version above the
  ones this deltasync knows, or a recorded migration whose tables are gone: :class:`DamagedLedger`. (There is
  no ``integrity_check``: PostgreSQL checks its own pages; initialise clusters with ``--data-checksums``.)
* **Never stall.** ``lock_timeout`` and ``statement_timeout`` are ``timeout_s``, the pool waits ``timeout_s``
  for a connection, and a lost server is reported at once: :class:`Busy` (HTTP 503 with Retry-After). A broken
  connection is dropped from the pool; the next transaction connects anew (a restarted server recovers).
* **News across coordinators.** A registration (or a GC deletion) sends ``NOTIFY deltasync_versions`` inside
  its transaction (delivered at commit); every coordinator LISTENs on its own connection and wakes its
  long-polls. After a lost connection it reconnects and re-reads the latest version (nothing is missed).
* **Backups** are ``pg_dump`` (consistent while coordinators run); ``deltasync coordinator backup`` is SQLite's.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from .ledger import Busy, DamagedLedger, check_recorded_schema

__all__ = ["CHANNEL", "PgDatabase", "is_postgres_url", "redact"]

logger = logging.getLogger("deltasync.coordinator")

CHANNEL = "deltasync_versions"
"""The NOTIFY channel of version changes; the payload is ``<coordinator instance> <latest or empty> <+ or =>``
(``+``: a registration, the latest is at least this; ``=``: a deletion, the latest is exactly this)."""
_WRITE_LOCK = 0x64656C74  # "delt": the advisory lock every durable write transaction takes
_MIGRATE_LOCK = 0x64656C75  # held (session-level) while one coordinator migrates
_POOL_SIZE = 8
_BUSY_ERRORS = (
    pg_errors.LockNotAvailable,  # lock_timeout: another coordinator holds the write lock too long
    pg_errors.QueryCanceled,  # statement_timeout
    pg_errors.SerializationFailure,
    pg_errors.DeadlockDetected,
)


def is_postgres_url(db: object) -> bool:
    """Whether ``--db`` names a PostgreSQL database (``postgresql://`` or ``postgres://``), not a SQLite file."""
    return isinstance(db, str) and db.startswith(("postgresql://", "postgres://"))


def redact(url: str) -> str:
    """The URL without its password (for logs and messages: credentials are never logged)."""
    return re.sub(r"^(postgres(?:ql)?://[^:/@]*):[^@/]*@", r"\1:***@", url)


class _Row:
    """A result row readable by column name and by position, and unpackable (as ``sqlite3.Row``)."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: dict[str, int], values: Sequence[Any]) -> None:
        self._index, self._values = index, values

    def __getitem__(self, key: int | str) -> Any:
        return self._values[self._index[key]] if isinstance(key, str) else self._values[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> list[str]:
        return list(self._index)


def _rows(cursor: psycopg.Cursor[Any]) -> Callable[[Sequence[Any]], _Row]:
    index = {d.name: i for i, d in enumerate(cursor.description or ())}
    return lambda values: _Row(index, values)


class _Tx:
    """What a transaction's body sees: ``execute`` and ``executemany`` with SQLite's ``?`` placeholders (the
    ledger's SQL is written once for both backends)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        return self._conn.execute(sql.replace("?", "%s"), params)

    def executemany(self, sql: str, seq: Sequence[Sequence[Any]]) -> None:
        with self._conn.cursor() as cur:
            cur.executemany(sql.replace("?", "%s"), seq)


class PgDatabase:
    """The ledger on PostgreSQL: a small connection pool, migrations, run identity and version notifications.

    Thread-safe: each transaction takes a pooled connection for its duration; callers run them in a thread
    pool. Several processes may open one database.

    Args:
        url: ``postgresql://user:password@host:port/dbname`` (libpq's URL; ``?sslmode=...`` and the like pass on).
        migrations: the PostgreSQL variants of the ledger's numbered migrations.
        timeout_s: how long a transaction waits for a connection, a lock or a statement before :class:`Busy`.
        clock: seconds since the epoch (tests pass a fake one).
        pool_size: connections kept open at most (each is a server process).
    """

    shared = True
    """Several coordinators may share this ledger: the in-memory latest version follows NOTIFY."""
    errors: tuple[type[BaseException], ...] = (psycopg.DatabaseError, psycopg.OperationalError)
    """A failing database raises these (answered 503 and shown in ``/healthz``, never 500)."""

    def __init__(
        self,
        url: str,
        migrations: list[str],
        *,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        pool_size: int = _POOL_SIZE,
    ) -> None:
        self.url, self.describe = url, redact(url)
        self.timeout_s, self._clock, self.clock = timeout_s, clock, clock
        self._migrations, self._pool_size = migrations, pool_size
        self._idle: queue.LifoQueue[psycopg.Connection[Any]] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._probe_conn: psycopg.Connection[Any] | None = None
        self._listener: threading.Thread | None = None
        self._stop = threading.Event()
        self.instance = uuid.uuid4().hex[:12]
        """This coordinator's name in its notifications (its own are not delivered back to it)."""
        self.closed = True
        self.checkpointed = True
        """Always: a PostgreSQL commit is durable when it returns; nothing is left to copy at shutdown."""
        self.open()

    # ------------------------------------------------------------------ connections

    def _connect(self, timeout_s: float | None = None) -> psycopg.Connection[Any]:
        ms = int((timeout_s or self.timeout_s) * 1000)
        try:
            return psycopg.connect(
                self.url,
                autocommit=True,
                connect_timeout=max(1, round(timeout_s or self.timeout_s)),
                options=f"-c lock_timeout={ms} -c statement_timeout={ms} -c idle_in_transaction_session_timeout={ms}",
                row_factory=_rows,
                application_name=f"deltasync-coordinator-{self.instance}",
            )
        except psycopg.OperationalError as exc:
            raise Busy(f"the ledger database {self.describe} is unreachable ({_first_line(exc)})") from None

    def open(self) -> None:
        """Connect, migrate (one coordinator at a time), and read or create the run identity. A no-op when open."""
        if not self.closed:
            return
        self._stop.clear()
        conn = self._connect()
        try:
            conn.execute("SELECT pg_advisory_lock(%s)", (_MIGRATE_LOCK,))
            try:
                self.schema_version = self._migrate(conn)
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES ('run_id', %s) ON CONFLICT (key) DO NOTHING",
                    (f"run-{uuid.uuid4().hex}",),
                )
                row = conn.execute("SELECT value FROM meta WHERE key='run_id'").fetchone()
                assert row is not None
                self.run_id: str = row[0]
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATE_LOCK,))
        except psycopg.OperationalError as exc:
            conn.close()
            raise Busy(f"the ledger database {self.describe} failed while opening ({_first_line(exc)})") from None
        except BaseException:
            conn.close()
            raise
        self._release(conn)
        self.closed = False

    def _migrate(self, conn: psycopg.Connection[Any]) -> int:
        migrations = self._migrations
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
            )
        }
        if tables and "schema_migrations" not in tables:
            raise DamagedLedger(
                f"{self.describe}: a database of something else (tables {sorted(tables)[:5]}), not a deltasync "
                "ledger; pass another database (create one: createdb deltasync)"
            )
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION)"
        )
        done = {r[0] for r in conn.execute("SELECT version FROM schema_migrations")}
        check_recorded_schema(
            self.describe, tables, done, migrations, copy="a dump", how="pg_dump; docs/RELIABILITY.md"
        )
        for number, sql in enumerate(migrations, start=1):
            if number in done:
                continue
            with conn.transaction():
                for statement in sql.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute("INSERT INTO schema_migrations VALUES (%s, %s)", (number, self._clock()))
        return len(migrations)

    def _take(self) -> psycopg.Connection[Any]:
        if self.closed:
            raise psycopg.InterfaceError("the ledger is closed")
        if not self._slots.acquire(timeout=self.timeout_s):
            raise Busy(f"the ledger is busy (no connection free within {self.timeout_s:g} s)")
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        try:
            return self._connect()
        except BaseException:
            self._slots.release()
            raise

    def _release(self, conn: psycopg.Connection[Any], *, slot: bool = False) -> None:
        if conn.closed or conn.broken or self.closed:
            conn.close()
        else:
            self._idle.put(conn)
        if slot:
            self._slots.release()

    # ------------------------------------------------------------------ transactions

    @contextmanager
    def tx(self, *, durable: bool = True) -> Iterator[_Tx]:
        """A transaction. ``durable`` (the default: every write of versions, leases and plans) takes the write
        lock shared by every coordinator on this database, so its reads and writes are serialized with theirs;
        ``durable=False`` (heartbeats, alerts, expiry) takes no lock and commits without waiting for the WAL
        flush (``synchronous_commit=off``: a server crash may lose the last heartbeats, never a version).

        Raises:
            Busy: no connection, lock or answer within ``timeout_s``, or the server is unreachable.
        """
        begin = "BEGIN" if durable else "BEGIN; SET LOCAL synchronous_commit = off"
        with self._transaction(begin, lock=durable) as c:
            yield c

    @contextmanager
    def read(self) -> Iterator[_Tx]:
        """A read-only transaction on one snapshot (``REPEATABLE READ``); it takes no lock."""
        with self._transaction("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", lock=False) as c:
            yield c

    @contextmanager
    def _transaction(self, begin: str, *, lock: bool) -> Iterator[_Tx]:
        conn = self._take()
        try:
            try:
                try:
                    conn.execute(begin)
                except psycopg.OperationalError:  # a pooled connection the server dropped (restarted?): nothing
                    conn.close()  # ran on it, so one fresh connection may try again
                    conn = self._connect()
                    conn.execute(begin)
                if lock:
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))
            except psycopg.Error as exc:
                _rollback(conn)
                raise _busy(exc, self.describe, self.timeout_s) from None
            try:
                yield _Tx(conn)
            except psycopg.Error as exc:
                _rollback(conn)
                if isinstance(exc, (*_BUSY_ERRORS, psycopg.OperationalError)):
                    raise _busy(exc, self.describe, self.timeout_s) from None
                raise
            except BaseException:
                _rollback(conn)
                raise
            try:
                conn.execute("COMMIT")
            except psycopg.Error as exc:  # the outcome is unknown if the server went away: a retry finds out
                _rollback(conn)
                raise _busy(exc, self.describe, self.timeout_s) from None
        finally:
            self._release(conn, slot=True)

    def notify_versions(self, c: _Tx, latest: int | None, *, exact: bool = False) -> None:
        """Tell every coordinator on this database, at commit, that the latest version is now ``latest``: at least
        (a registration: notifications may arrive after a newer registration of the receiver's own), or
        ``exact`` (a deletion lowered it)."""
        payload = f"{self.instance} {'' if latest is None else latest} {'=' if exact else '+'}"
        c.execute("SELECT pg_notify(?, ?)", (CHANNEL, payload))

    def file_replaced(self) -> str | None:
        """Never: there is no file (SQLite's check that its file is still the one at its path)."""
        return None

    def probe(self, timeout_s: float = 1.0) -> str | None:
        """Whether a write could start now (the write lock within ``timeout_s``): ``None``, else why not."""
        try:
            if self._probe_conn is None or self._probe_conn.closed or self._probe_conn.broken:
                self._probe_conn = self._connect(timeout_s)
            conn = self._probe_conn
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))
            return None
        except Busy as exc:
            return str(exc)
        except _BUSY_ERRORS:
            return f"the ledger database is locked (no write within {timeout_s:g} s)"
        except psycopg.Error as exc:
            if self._probe_conn is not None:
                self._probe_conn.close()
                self._probe_conn = None
            return f"the ledger database {self.describe} fails ({_first_line(exc)})"

    # ------------------------------------------------------------------ notifications

    def listen(self, on_latest: Callable[[int | None, bool], None]) -> None:
        """Call ``on_latest(latest, exact)`` (from a daemon thread) whenever another coordinator changes the latest
        version (``exact``: it is this, else at least this), and once after each (re)connection with the latest
        read anew (nothing is missed)."""
        if self._listener is not None and self._listener.is_alive():
            return
        self._listener = threading.Thread(
            target=self._listen, args=(on_latest,), name="deltasync-ledger-listen", daemon=True
        )
        self._listener.start()

    def _listen(self, on_latest: Callable[[int | None, bool], None]) -> None:
        first = True
        while not self._stop.is_set():
            try:
                conn = self._connect()
            except Busy as exc:
                logger.warning("ledger notifications: %s; retrying", exc)
                self._stop.wait(1.0)
                continue
            try:
                conn.execute(f"LISTEN {CHANNEL}")
                # what happened before we listened (at start: since the registry read it; later: while the
                # connection was lost), read once we listen, so that nothing falls between the two
                row = conn.execute("SELECT MAX(version) FROM versions WHERE deleted_at IS NULL").fetchone()
                on_latest(row[0] if row else None, False)
                if not first:
                    logger.info("ledger notifications: reconnected to %s", self.describe)
                first = False
                while not self._stop.is_set():
                    for note in conn.notifies(timeout=0.5):
                        instance, latest, how = (note.payload.split(" ") + ["", ""])[:3]
                        if instance != self.instance:
                            on_latest(int(latest) if latest else None, how == "=")
            except psycopg.Error as exc:  # the server restarted or the network broke: reconnect and catch up
                if not self._stop.is_set():
                    logger.warning("ledger notifications lost (%s); reconnecting", _first_line(exc))
                    self._stop.wait(0.5)
            finally:
                conn.close()

    def close(self) -> None:
        """Stop listening and close every connection. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._listener is not None:
            self._listener.join(5)
            self._listener = None
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                break
        if self._probe_conn is not None:
            self._probe_conn.close()
            self._probe_conn = None


def _rollback(conn: psycopg.Connection[Any]) -> None:
    if conn.closed or conn.broken:
        return
    try:
        conn.execute("ROLLBACK")
    except psycopg.Error:  # the connection is dropped below: nothing more to undo on it
        conn.close()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _busy(exc: psycopg.Error, where: str, timeout_s: float) -> Busy:
    if isinstance(exc, _BUSY_ERRORS):
        return Busy(
            f"the ledger database is locked by another coordinator or session, or slow (no turn within "
            f"{timeout_s:g} s: {_first_line(exc)})"
        )
    return Busy(f"the ledger database {where} is unreachable ({_first_line(exc)})")
