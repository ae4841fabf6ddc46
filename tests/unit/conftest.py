"""Unit-test fixtures: a coordinator app over httpx.ASGITransport."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.asgi import Coordinator, make_settings, open_coordinator


@pytest.fixture
async def sqlite_coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    """A coordinator app on a SQLite file (for the cases about the file itself)."""
    app, http = await open_coordinator(make_settings(tmp_path))
    async with http:
        yield Coordinator(app, http)
    app.state.db.close()


@pytest.fixture
async def coord(tmp_path: Path, ledger_db: Path | str) -> AsyncIterator[Coordinator]:
    """A coordinator app on each backend (SQLite, then PostgreSQL)."""
    app, http = await open_coordinator(make_settings(tmp_path, db=ledger_db))
    async with http:
        yield Coordinator(app, http)
    app.state.db.close()
