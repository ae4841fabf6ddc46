"""A coordinator in this process: uvicorn on a background thread (notebooks, tests, single-machine runs).

Example:
    >>> with Coordinator(db="run/ledger.db", store="run/store") as coord:  # doctest: +SKIP
    ...     client = CoordinatorClient(coord.url, token=coord.publisher_token)
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from deltasync.tokens import make_agent_token

from .app import create_app
from .http import serve_options
from .settings import Settings

__all__ = ["Coordinator"]


class Coordinator:
    """Runs the coordinator on 127.0.0.1 in a daemon thread until :meth:`stop` (or the ``with`` block ends).

    Credentials are generated unless given (the coordinator never runs without them); :meth:`agent_token`
    mints an agent's own token.

    Args:
        db: the SQLite ledger, or a PostgreSQL URL (``postgresql://user:pw@host:port/dbname``).
        store: the store URI (for garbage collection).
        publisher_token: the publisher's token (default: random).
        agent_secret: the HMAC key of agent tokens (default: random).
        port: the port (default: a free one).
        **settings: any other :class:`~deltasync_coordinator.settings.Settings` field.
    """

    def __init__(
        self,
        *,
        db: str | os.PathLike[str],
        store: str | None = None,
        publisher_token: str | None = None,
        agent_secret: str | None = None,
        port: int = 0,
        **settings: Any,
    ) -> None:
        import uvicorn

        self.publisher_token = publisher_token or secrets.token_hex(16)
        self._agent_secret = agent_secret or secrets.token_hex(16)
        if port == 0:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
        self.settings = Settings(
            db=db if isinstance(db, str) and db.startswith(("postgresql://", "postgres://")) else Path(db),
            store=store,
            publisher_token=self.publisher_token,
            agent_secret=self._agent_secret,
            port=port,
            **settings,
        )
        self.app = create_app(self.settings)
        self.url = f"{'https' if self.settings.ssl_certfile is not None else 'http'}://127.0.0.1:{port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning", **serve_options(self.app))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="deltasync-coordinator", daemon=True)

    def agent_token(self, agent_id: str) -> str:
        """The token bound to ``agent_id`` (what ``deltasync token --agent-id`` prints)."""
        return make_agent_token(self._agent_secret, agent_id)

    def start(self, timeout_s: float = 10.0) -> Coordinator:
        """Start serving; returns once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving (the ledger is checkpointed and closed)."""
        self._server.should_exit = True
        self._thread.join(10)

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
