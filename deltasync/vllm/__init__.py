"""deltasync inside vLLM: the ``deltasync`` weight-transfer backend (imported by vLLM's workers only)."""

from __future__ import annotations

__all__ = ["BACKEND"]

BACKEND = "deltasync"
"""The name to select with ``weight_transfer_config={"backend": "deltasync"}``."""
