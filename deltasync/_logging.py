"""Logging set-up for deltasync's entry points (the library itself never adds handlers)."""

from __future__ import annotations

import logging

__all__ = ["setup_logging"]

LOG_FORMAT = "[deltasync] %(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Send deltasync's log records to stderr in the house format; idempotent."""
    logger = logging.getLogger("deltasync")
    logger.setLevel(level)
    if not any(getattr(h, "_deltasync", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler._deltasync = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
