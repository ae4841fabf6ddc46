"""What the ``deltasync`` engine says it serves (:class:`Label`): the version and its health, the run and the highest
version served, the served version's manifest, the last drift, the version an open session will serve, and the
outcome of the last call. Every part of the engine reads it; the failure rule (:meth:`Label.mark_unhealthy`) and a
finished session (:meth:`Label.serve_staged`) are the only ways it changes version."""

from __future__ import annotations

import time
from typing import Any

from .. import apply
from ..errors import RefusalReason
from ..manifest import DeltaManifest

__all__ = ["Label"]


class Label:
    """One engine's label and the outcome of its last call. Not thread-safe: vLLM drives the engine from the
    worker's RPC loop."""

    def __init__(self) -> None:
        self.version: int | None = None
        """The version served; ``None``: unknown, or unhealthy."""
        self.healthy = True
        """False after a failure past the first write or a drift: only an anchor restores it."""
        self.run_id: str | None = None
        self.high_water: int | None = None
        """The highest version served in this run."""
        self.model_id: str | None = None
        self.detail = ""
        """Why the engine is unhealthy (empty when healthy)."""
        self.manifest: DeltaManifest | None = None
        """The served version's manifest: its published checksums, which every proof reads."""
        self.drift: dict[str, Any] | None = None
        """The last drift found (tensors, version, when, by whom): cleared when an anchor restores the engine."""
        self.staged: apply.Holding | None = None
        """What the open session has written, to be served once it finishes (``None``: nothing staged)."""
        self.staged_manifest: DeltaManifest | None = None
        """The manifest of the open session's last object."""
        self.outcome: dict[str, Any] = {"ok": True, "refused": None, "message": ""}
        """The last call's result (``status()["outcome"]``): with TP > 1 the engine records failures, never raises
        them, and the agent reads each rank's outcome."""

    def assume(self, version: int) -> None:
        """The claim names the version of weights whose version is unknown (the agent's ``assume_version``); a
        version the engine knows, or an unhealthy engine's, is never relabelled."""
        if self.version is None and self.healthy:
            self.version = self.high_water = version

    def stage(self, holding: apply.Holding, manifest: DeltaManifest) -> None:
        """The open session wrote objects up to ``manifest``'s: served from :meth:`serve_staged` on."""
        self.staged, self.staged_manifest = holding, manifest

    def serve_staged(self) -> apply.Holding | None:
        """The session finished: serve what it staged (nothing, if a failure unlabelled the engine meanwhile).
        Returns what is now served, or ``None``."""
        h = self.staged
        if h is None:
            return None
        self.version, self.healthy, self.run_id, self.high_water = h.version, True, h.run_id, h.high_water
        self.model_id = h.model_id
        self.detail = ""
        self.manifest, self.drift = self.staged_manifest, None
        self.staged = None
        return h

    def mark_unhealthy(self, why: str) -> None:
        """The failure rule: serve no known version (and nothing staged) until an anchor restores the engine."""
        self.healthy, self.version, self.staged, self.manifest = False, None, None, None
        self.detail = f"unhealthy: {why}; only an anchor restores this engine"

    def fail_unhealthy(self, why: str) -> None:
        """:meth:`mark_unhealthy`, recorded as the outcome: a failure no RPC raises."""
        self.mark_unhealthy(why)
        self.outcome = {"ok": False, "refused": None, "message": self.detail}

    def report_drift(self, tensors: list[str], *, by: str) -> None:
        """Weights that differ from the served version's published checksums: the version is dropped until an
        anchor restores it, and :attr:`drift` says which tensors and when."""
        version = self.version
        self.drift = {"tensors": sorted(tensors)[:16], "version": version, "at": time.time(), "by": by}
        self.fail_unhealthy(
            f"drift: {len(tensors)} tensors differ from v{version}'s published checksums (e.g. {sorted(tensors)[0]}; "
            f"found by {by})"
        )

    def record(self, refused: RefusalReason | None, message: str) -> dict[str, Any]:
        """A failed call's outcome (``refused``: refused before any write, and why); returns it."""
        self.outcome = {"ok": False, "refused": None if refused is None else refused.value, "message": message}
        return dict(self.outcome)

    def clear_outcome(self) -> None:
        self.outcome = {"ok": True, "refused": None, "message": ""}
