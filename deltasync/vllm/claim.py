"""Which agent drives the ``deltasync`` engine (:class:`Claim`): the claim, its session, and the policy it fixed.

An engine obeys the one agent that claimed it. Another agent id is refused, and so is a second process with the
same id while the first one's session is alive (every status read renews it); a restarted agent takes over once the
old session has been silent for the claim's ``ttl_s``. The operator's policy (rollback, where staged files may come
from, whether failures are raised) comes with the claim and with nothing else: no update message carries it.
"""

from __future__ import annotations

import logging
import time

from .. import apply
from ..errors import RefusalReason
from .messages import DeltaSyncInitInfo

__all__ = ["Claim"]

logger = logging.getLogger("vllm.deltasync.engine")


class Claim:
    """The claim on one engine. The rules themselves are :func:`deltasync.apply.refuse_claim`'s (shared with every
    engine deltasync drives); here is what one engine remembers of its claim."""

    def __init__(self) -> None:
        self.owner: str | None = None
        """The agent that claimed this engine."""
        self.session: str | None = None
        """The owning agent process's session."""
        self.ttl_s = 90.0
        """How long a silent session stays alive."""
        self.allow_rollback = False
        """The operator lets the engine go below the highest version it served, or to another run."""
        self.raise_errors = True
        """Raise refusals and failures from the RPCs, or only record them (TP > 1: a raising worker desyncs vLLM's
        executor, vLLM #49972)."""
        self.staging_root: str | None = None
        """The only directory staged files are read from."""
        self._seen = 0.0

    def alive_s(self) -> float | None:
        """Seconds since the owner's session was last heard from, while it is alive (``None``: expired, or none)."""
        silent = time.monotonic() - self._seen
        return silent if self.session is not None and silent < self.ttl_s else None

    def refusal(self, info: DeltaSyncInitInfo, holding: apply.Holding) -> str | None:
        """Why this claim must be refused for its agent or run (``None``: the claiming agent may take charge)."""
        return apply.refuse_claim(
            owner=self.owner,
            agent_id=info.agent_id,
            holding=holding,
            run_id=info.run_id,
            allow_rollback=bool(info.allow_rollback),
            owner_alive_s=self.alive_s(),
            same_session=info.session == self.session,
        )

    def take(self, info: DeltaSyncInitInfo) -> None:
        """The claiming agent takes charge (after :meth:`refusal` said nothing), with the policy its claim gives."""
        self.owner, self.session = info.agent_id, info.session
        self._seen = time.monotonic()
        if info.ttl_s is not None:
            self.ttl_s = info.ttl_s
        if info.allow_rollback is not None:
            self.allow_rollback = info.allow_rollback
        if info.raise_errors is not None:
            self.raise_errors = info.raise_errors
        if info.staging_root is not None:
            self.staging_root = info.staging_root

    def release(self, agent_id: str | None, session: str | None) -> bool:
        """The owner gives its claim up (its run is not this engine's): honoured from its own session only.
        Returns whether the claim was released."""
        if self.owner is None or self.owner != agent_id or self.session != session:
            return False
        logger.warning("deltasync: agent %s gave up its claim (its run is not this engine's)", self.owner)
        self.owner, self.session = None, None
        return True

    def release_unadmitted(self, reason: RefusalReason, holding: apply.Holding) -> None:
        """The owner's update was refused for ``reason`` (:func:`~deltasync.apply.releases_claim`): a claim whose
        objects are another model's or run's, on an engine that serves no version yet, is released at once, so
        that the engine's own agent takes it."""
        if self.owner is not None and apply.releases_claim(reason, holding):
            logger.warning(
                "deltasync: agent %s's objects are for another model or run than this engine serves: its claim is "
                "released",
                self.owner,
            )
            self.owner, self.session = None, None

    def touch(self, session: str | None) -> None:
        """The owner's session is alive (its agent read the status)."""
        if session is not None and session == self.session:
            self._seen = time.monotonic()
