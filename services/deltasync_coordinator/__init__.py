"""The deltasync coordinator: a FastAPI service over a SQLite ledger of versions, plans and agents.

``create_app`` builds the ASGI app (``uvicorn deltasync_coordinator.app:create_app --factory``);
``Coordinator`` runs one in this process.
"""

from __future__ import annotations

from .server import Coordinator

__all__ = ["Coordinator"]
