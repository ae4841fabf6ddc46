"""What another process holding the coordinators' write lock looks like, on SQLite and on PostgreSQL (the server
itself is :class:`deltasync.testing.postgres.PostgresServer`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["hold_write_lock"]


@contextmanager
def hold_write_lock(db: object) -> Iterator[None]:
    """What another process holding the ledger's write lock looks like: SQLite ``BEGIN EXCLUSIVE`` on another
    connection; PostgreSQL: another session holding the coordinators' write lock."""
    from deltasync_coordinator import pg

    if isinstance(db, pg.PgDatabase):
        import psycopg

        with psycopg.connect(db.url, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (pg._WRITE_LOCK,))
            yield
        return
    import sqlite3

    other = sqlite3.connect(db.real_path, isolation_level=None, timeout=10)  # type: ignore[attr-defined]
    other.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        other.execute("ROLLBACK")
        other.close()
