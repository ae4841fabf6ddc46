"""What an agent checks of the run it follows against its engine's, before it changes anything there: the
coordinator's run (another ledger is refused), the model the run publishes (which the agent's claim names, so an
engine of another model refuses it), and that a plan never takes the engine below what it has served.

The agent (:mod:`deltasync.agent`) asks; these checks read the coordinator and the store, never the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .client import CoordinatorClient, SyncPlan
from .config import AgentConfig
from .errors import CoordinatorError, DeltaSyncError, RefusalReason, RunMismatch, UpdateRefused
from .reader import Trust, read_manifest
from .store.base import Store
from .targets.base import EngineState

__all__ = ["RunChecks"]

logger = logging.getLogger("deltasync.agent")


class RunChecks:
    """The forward-only rules of one agent: one run, one model, never below the engine's high-water mark.

    Args:
        coordinator: the agent's coordinator.
        store: where the run's objects are.
        config: the agent's id and its ``allow_rollback``.
        trust: what manifests read from the store are checked against (the agent's, at the time of the read).
    """

    def __init__(
        self, coordinator: CoordinatorClient, store: Store, config: AgentConfig, trust: Callable[[], Trust]
    ) -> None:
        self.coordinator, self.store, self.config, self.trust = coordinator, store, config, trust

    def run(self, st: EngineState) -> str | None:
        """The coordinator's run, checked against the engine's (before the claim changes anything)."""
        run = self.coordinator.run_id or self.coordinator.health().get("run_id")
        run = None if run is None else str(run)
        if st.run_id is None or run is None or run == st.run_id:
            return run
        if self.config.allow_rollback:
            logger.warning(
                "agent %s: the coordinator's run %s is not the engine's run %s: switching runs (allow_rollback)",
                self.config.agent_id,
                run,
                st.run_id,
            )
            return run
        raise RunMismatch(
            f"the coordinator at {self.coordinator.base_url} keeps run {run}, the engine serves run {st.run_id}: "
            "refusing to follow another ledger (restart the agent with --allow-rollback to switch on purpose)"
        )

    def model(self, st: EngineState) -> str | None:
        """The model this agent's run publishes (its newest anchor's fingerprint; an adapter run's base), which an
        engine serving another model refuses at the claim; ``None`` when the run has published nothing yet (then
        the engine refuses the first object of another model, and the claim goes with it).

        Raises:
            DeltaSyncError, OSError: the run has published but its newest anchor cannot be read now (as the read
                raised it), and the engine is not this agent's already: a fresh engine is not claimed by an agent
                that cannot say what it will serve (the next sync tries again).
        """
        try:
            plan = self.coordinator.plan(None)
            anchor = next((s for s in plan.steps if s.kind == "anchor"), None)
            if anchor is None:
                return None
            manifest = read_manifest(self.store, anchor.version, "anchor", trust=self.trust())
        except CoordinatorError as exc:
            if exc.status_code == 404:
                return None  # nothing published yet
            raise
        except (DeltaSyncError, OSError) as exc:
            if st.agent_id == self.config.agent_id:  # its own engine (a restarted agent): nothing to tell it
                logger.warning("agent %s: cannot read the run's newest anchor (%s)", self.config.agent_id, exc)
                return None
            logger.warning(
                "agent %s: cannot read its run's newest anchor (%s): not claiming the engine until it can tell the "
                "engine which model its run publishes",
                self.config.agent_id,
                exc,
            )
            raise
        return manifest.model_fingerprint if manifest.adapter is None else manifest.adapter.base_fingerprint

    def rollback(self, plan: SyncPlan, st: EngineState) -> None:
        """Refuse a plan below the highest version the engine has served in its run (unless ``allow_rollback``,
        logged)."""
        if st.high_water is None or plan.to_version >= st.high_water:
            return
        if self.config.allow_rollback:
            logger.warning(
                "agent %s: rolling the engine back from v%d to v%d (allow_rollback)",
                self.config.agent_id,
                st.high_water,
                plan.to_version,
            )
            return
        raise UpdateRefused(
            f"agent {self.config.agent_id}: the coordinator's latest is v{plan.to_version}, the engine has served "
            f"v{st.high_water} of this run and never goes back (is the ledger restored from an old backup?); "
            "restart the agent with --allow-rollback to roll back on purpose",
            reason=RefusalReason.ROLLBACK,
        )
