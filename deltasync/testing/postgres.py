"""A throwaway PostgreSQL server for tests and benchmarks: ``initdb`` into a temporary directory, ``pg_ctl start``
on a free 127.0.0.1 port (as the ``postgres`` user when run as root: PostgreSQL refuses root), an empty database
per test, and everything stopped and removed at the end. (``CREATE DATABASE`` takes 0.5-1 s on the 2 shared
cores, so a database a finished test used is emptied, its sessions ended and its schema dropped, ~50 ms, and
handed to the next test instead.) ``DELTASYNC_TEST_POSTGRES_URL`` names an existing
server instead (its user must be allowed to CREATE DATABASE). Needs the server binaries (Debian's ``postgresql``)
and ``psycopg`` (the ``postgres`` extra, imported inside the methods that connect)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from .launchers import free_port

__all__ = ["URL_ENV", "PostgresServer", "find_binaries"]

URL_ENV = "DELTASYNC_TEST_POSTGRES_URL"


def find_binaries() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl`` (on PATH, or Debian's ``/usr/lib/postgresql/*/bin``)."""
    on_path = shutil.which("pg_ctl")
    if on_path and shutil.which("initdb"):
        found = Path(os.path.realpath(on_path)).parent
        if (found / "initdb").exists() and (found / "postgres").exists():
            return found
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True):
        if Path(d, "initdb").exists() and Path(d, "pg_ctl").exists():
            return Path(d)
    return None


def _server_user() -> str | None:
    """Who runs the server: ``None`` (ourselves) unless we are root, then ``postgres`` (created if missing)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "postgres"], check=True)
    return "postgres"


class PostgresServer:
    """One PostgreSQL server for a test session (or a benchmark): :meth:`create_database` gives each test its own
    database. ``restart`` stops and starts it on the same port and data (a server restart mid-run)."""

    def __init__(self, url: str | None = None) -> None:
        self.external = url
        self.root: Path | None = None
        self.port = 0
        self.user = _server_user()
        self.bin: Path | None = None
        self._recycled: list[str] = []

    # ------------------------------------------------------------------ the server

    def _run(self, *cmd: str, timeout_s: float = 60) -> None:
        assert self.bin is not None
        full = [str(self.bin / cmd[0]), *cmd[1:]]
        if self.user is not None:
            full = ["runuser", "-u", self.user, "--", *full]
        out = subprocess.run(full, capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(full)} failed ({out.returncode}): {out.stdout[-2000:]} {out.stderr[-2000:]}")

    def start(self) -> PostgresServer:
        """``initdb`` and ``pg_ctl start`` on a free port (nothing for an external server); returns ``self``."""
        if self.external is not None:
            return self
        self.bin = find_binaries()
        if self.bin is None:
            raise RuntimeError(
                "no PostgreSQL server binaries (initdb, pg_ctl): install them (apt-get install postgresql; "
                f"scripts/test does), or set {URL_ENV} to a server's URL"
            )
        self.root = Path(tempfile.mkdtemp(prefix="deltasync-pg-"))
        if self.user is not None:
            shutil.chown(self.root, self.user)
        self.port = free_port()
        self._run("initdb", "-D", str(self.root / "data"), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8",
                  "--locale=C")  # fmt: skip
        self._pg_ctl_start()
        return self

    def _pg_ctl_start(self) -> None:
        assert self.root is not None
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off "
            "-c synchronous_commit=on -c max_connections=300 -c shared_buffers=32MB"
        )
        self._run("pg_ctl", "-D", str(self.root / "data"), "-l", str(self.root / "server.log"), "-o", options,
                  "-w", "-t", "60", "start")  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: disconnect everyone, clean shutdown; ``immediate``: like a crash)."""
        if self.root is None:
            return
        if (self.root / "data" / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.root / "data"), "-m", mode, "-w", "-t", "60", "stop")

    def start_again(self) -> None:
        """Start a server :meth:`stop` stopped, on the same port with the same data."""
        if self.external is not None:
            raise RuntimeError(f"cannot restart the server of {URL_ENV}")
        self._pg_ctl_start()

    def close(self) -> None:
        """Stop the server and remove its data. Idempotent."""
        if self.root is None:
            return
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    # ------------------------------------------------------------------ databases

    def url(self, dbname: str = "postgres") -> str:
        """The URL of database ``dbname`` on this server."""
        if self.external is not None:
            return self.external.rsplit("/", 1)[0] + "/" + dbname
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def admin(self, sql: str) -> None:
        """Run ``sql`` (trusted: the caller's own statement) on the administrative database, autocommit."""
        import psycopg

        with psycopg.connect(self.url(self.admin_db), autocommit=True) as conn:
            conn.execute(sql)

    @property
    def admin_db(self) -> str:
        """The database :meth:`admin` connects to (the external URL's, else ``postgres``)."""
        return self.external.rsplit("/", 1)[1].split("?")[0] if self.external else "postgres"

    def create_database(self) -> str:
        """An empty database (new, or one given back and emptied); returns its URL."""
        if self._recycled:
            return self._recycled.pop()
        name = f"deltasync_{uuid.uuid4().hex[:12]}"
        self.admin(f"CREATE DATABASE {name} TEMPLATE template0 STRATEGY FILE_COPY")
        return self.url(name)

    def give_back(self, url: str) -> None:
        """A test is done with ``url``: end its sessions, empty it, keep it for the next test."""
        import psycopg

        name = url.rsplit("/", 1)[1]
        self.admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        self._recycled.append(url)

    def drop_database(self, url: str) -> None:
        """Drop the database of ``url``, ending its sessions."""
        self.admin(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
