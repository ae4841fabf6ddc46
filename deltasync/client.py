"""CoordinatorClient: the coordinator's HTTP API for publishers and agents (httpx).

The typed API and what it returns; the transport under it (replicas, retries, failover, the run identity) is
:mod:`deltasync._client_transport`, the one place where HTTP errors become deltasync errors
(:func:`~deltasync._client_transport._raise_for_status`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from ._client_transport import ClientTransport, RetryPolicy
from .errors import CoordinatorError, IntegrityError, LeaseError
from .schemas import (
    LEASE_HEADER,
    MAX_ERROR_CHARS,
    AgentHeartbeat,
    AgentPublic,
    AgentsPublic,
    GcPublic,
    HealthPublic,
    LeaseCreate,
    LeasePublic,
    PlanPublic,
    VersionCreate,
    VersionPublic,
    VersionsPublic,
)
from .vocab import Kind, ObjectKind

__all__ = ["AgentStatus", "CoordinatorClient", "GcReport", "Lease", "PublishedVersion", "RetryPolicy", "SyncPlan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishedVersion:
    """A registered object."""

    version: int
    """The version it produces."""
    kind: ObjectKind
    """``delta``, ``anchor`` or ``squash`` (a delta over several versions, at its own keys)."""
    base_version: int | None
    """What a delta or a squash applies to."""
    manifest_key: str
    """Store key of its manifest."""
    bytes: int
    """Bytes of its shards."""
    nnz: int
    """Elements it stores."""
    tensors: int
    """Tensors in the model."""
    checksum: str
    """``sha256:`` of its manifest."""
    created_at: datetime
    """When the coordinator registered it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncPlan:
    """What to fetch, in apply order, to go from ``from_version`` to ``to_version``."""

    from_version: int | None
    """The agent's version, or ``None`` if it holds nothing."""
    to_version: int
    """The target."""
    steps: tuple[PublishedVersion, ...]
    """An anchor first (route ``anchor``) or a squash first (route ``squash``), then deltas."""
    bytes: int
    """Total bytes to fetch."""
    route: Literal["none", "deltas", "anchor", "squash"]
    """``none`` when already at the target; else the cheapest route in registered bytes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentStatus:
    """One agent in the fleet view."""

    agent_id: str
    """Its id."""
    applied_version: int | None
    """The version its engine serves."""
    state: str
    """idle, fetching, applying, error or paused."""
    last_error: str | None
    """Its last error message."""
    timings: dict[str, float]
    """Seconds spent, by phase."""
    last_seen: datetime
    """Its last heartbeat."""
    lag: int | None
    """Latest minus applied."""
    stale: bool
    """Not seen for longer than the coordinator's stale timeout."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GcReport:
    """Retention candidates and what was deleted."""

    candidates: tuple[PublishedVersion, ...]
    """Objects nothing can still need."""
    deleted: tuple[PublishedVersion, ...]
    """Objects deleted by this call (empty for a dry run)."""
    keep_from: int | None
    """Deltas above this version are kept."""
    kept_anchor: int | None
    """The anchor proven intact before anything was deleted."""
    problems: tuple[str, ...]
    """Why something was not deleted."""
    leftovers: tuple[str, ...] = ()
    """Object prefixes the ledger never registered, deleted (a dry run: that would be): a fenced publisher's
    late writes and a crashed one's shards."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Lease:
    """The run's publisher lease: one writer per run."""

    lease_id: str
    """Sent with every registration (``Deltasync-Lease``); a stale one is refused (fenced)."""
    epoch: int
    """Increases with every new holder."""
    holder: str
    """Who holds it."""
    run_id: str
    """The run (ledger identity)."""
    expires_at: datetime
    """When it lapses unless renewed."""
    next_version: int
    """One above every version the ledger has registered."""


def _version(m: VersionPublic) -> PublishedVersion:
    return PublishedVersion(**m.model_dump())


def _lease_error(exc: CoordinatorError, message: str | None = None, *, orphaned: bool = False) -> LeaseError:
    """A 409 about the publisher lease as the :class:`LeaseError` callers branch on."""
    error = LeaseError(message or str(exc), status_code=409, method=exc.method, url=exc.url)
    error.orphaned = orphaned
    return error


class CoordinatorClient(ClientTransport):
    """A synchronous client of the coordinator (one or several replicas of one ledger), safe to share between
    threads.

    **Retries.** Connection errors, timeouts (a replica that sends no bytes within ``retry.timeout_s``), a cut
    connection and 500/502/503/504 answers are retried with exponential backoff and jitter (a ``Retry-After``
    wins; :class:`RetryPolicy`). Every call is idempotent on the server (re-registering an identical version
    answers 200), see below.

    **Several replicas** (``base_url`` a list, or ``"http://a:8600,http://b:8600"``): replicas of *one* ledger
    (the same run id). The client sticks to the replica that last answered. On a retryable failure it moves
    to the next replica at once (round robin); only when every replica failed in a round does it back off,
    so the schedule and the total backoff are those of one coordinator with ``retries`` retries: at most
    ``retries + 1`` rounds of one attempt per replica. After the last round the error names every URL and
    what it last answered. A long-poll whose replica dies moves to the next one with the same question.

    **What is retried on another replica, and why that is safe** (a request may have been carried out by a
    replica that went away before answering; the ledger is shared, so the next replica sees its effect):

    * every ``GET``: reads (a plan records the agent's latest plan: the same row again);
    * ``POST /v1/versions``: create-only: an identical body answers 200 even without the lease (the retry of
      a registration that did commit), a different body for the same (version, kind) 409: a version is never
      registered twice, and a lost answer is never a spurious failure;
    * ``POST /v1/lease`` with a lease id (renew): extends that lease only, fenced by its id;
      ``DELETE /v1/lease/{id}``: a lease already released answers 404, which is ignored;
    * ``POST /v1/agents/{id}/heartbeat``: the agent's state, last write wins;
    * ``POST /v1/gc``: proves an anchor and deletes what is a candidate *now*; a second pass deletes what the
      first left;
    * ``POST /v1/lease`` without a lease id (take the lease) is the one request that is not idempotent: the
      lease is exclusive, so a retry can never make two writers, but if the first attempt took the lease
      before its answer was lost, the retry is refused naming this holder; :class:`LeaseError` then says so
      (``orphaned``), and :class:`~deltasync.publisher.Publisher` waits for that lease to lapse (it is never
      renewed) instead of failing.

    **Run identity.** The run id is pinned once for all replicas (from ``run_id``, or the first answer). A
    replica that names another run (another ledger), or none, is refused with
    :class:`~deltasync.errors.RunMismatch`, never used: the client does not fail over past it, and moves
    on from it so the next call tries the others first.

    Args:
        base_url: e.g. ``http://127.0.0.1:8600``; or several replicas: a list, or one comma-separated string.
        token: bearer token (the publisher's or the agent's), the same for every replica.
        ca_bundle: a CA certificate file (PEM) to verify an ``https://`` coordinator with (default: the system's).
        insecure_http: send ``token`` over plain ``http://`` to a host other than this one's loopback
            (127.0.0.0/8, ``::1``, ``localhost``), where anyone on the path reads it; logged. By default refused.
        retry: the per-request timeout and the retry schedule (default: ``RetryPolicy()``: 30 s, 8 rounds after
            the first, backoff from 0.2 s).
        run_id: pin the coordinator's run identity now (default: pinned from its first answer). Every answer
            names its run; one that names another raises :class:`~deltasync.errors.RunMismatch`.
        http_client: an ``httpx.Client`` to use instead of a new one (tests pass an ASGI one); requests go to
            absolute URLs, so it serves every replica.

    Raises:
        ValueError: no URL, a URL without ``http://`` or ``https://``, a URL listed twice, or a token for a plain
            ``http://`` URL on another host without ``insecure_http``.

    Example:
        >>> client = CoordinatorClient("http://127.0.0.1:8600", token="...")  # doctest: +SKIP
        >>> client = CoordinatorClient("http://coord-a:8600,http://coord-b:8600", token="...")  # doctest: +SKIP
        >>> client.latest_version()  # doctest: +SKIP
    """

    def __repr__(self) -> str:  # never show the token
        return f"CoordinatorClient({','.join(self.urls)!r})"

    # ------------------------------------------------------------------ versions

    def register_version(self, version: VersionCreate, *, lease: Lease | None = None) -> tuple[PublishedVersion, bool]:
        """Register a committed object; returns it and whether it was new (201) or known (200).

        Args:
            version: the object.
            lease: the publisher lease (a new object needs the live one).

        Raises:
            LeaseError: status 409, the lease is not the live one (fenced).
            CoordinatorError: status 409 if it conflicts with the ledger.
        """
        headers = {LEASE_HEADER: lease.lease_id} if lease is not None else {}
        try:
            response = self._send("POST", "/v1/versions", json=version.model_dump(mode="json"), headers=headers)
        except CoordinatorError as exc:
            if exc.status_code == 409 and "publisher lease" in str(exc):
                raise _lease_error(exc) from None
            raise
        return _version(self._parse(response, VersionPublic)), response.status_code == 201

    # ------------------------------------------------------------------ the publisher lease

    def acquire_lease(self, holder: str, *, ttl_s: float) -> Lease:
        """Take the run's publisher lease.

        Raises:
            LeaseError: another publisher holds it (the message names it and when it expires).
        """
        return self._lease(LeaseCreate(holder=holder, ttl_s=ttl_s))

    def renew_lease(self, lease: Lease, *, ttl_s: float) -> Lease:
        """Renew the lease. Raises LeaseError if it was lost (expired, or another publisher took the run)."""
        return self._lease(LeaseCreate(holder=lease.holder, ttl_s=ttl_s, lease_id=lease.lease_id))

    def _lease(self, body: LeaseCreate) -> Lease:
        lost: list[str] | None = [] if body.lease_id is None else None  # taking it is the one non-idempotent call
        try:
            response = self._send("POST", "/v1/lease", json=body.model_dump(mode="json"), lost=lost)
        except CoordinatorError as exc:
            if exc.status_code != 409:
                raise
            if lost and repr(body.holder) in str(exc):
                raise _lease_error(
                    exc,
                    f"{exc}; this client's own earlier attempt may have taken the lease before its answer was lost "
                    f"({'; '.join(lost)}): that lease is never renewed and lapses within {body.ttl_s:g} s",
                    orphaned=True,
                ) from None
            raise _lease_error(exc) from None
        return Lease(**self._parse(response, LeasePublic).model_dump())

    def release_lease(self, lease: Lease) -> None:
        """Give the lease up; a lease that is no longer live is ignored."""
        try:
            self._send("DELETE", f"/v1/lease/{lease.lease_id}")
        except CoordinatorError as exc:
            if exc.status_code != 404:
                raise

    def latest_version(self) -> PublishedVersion | None:
        """The newest registered object, or ``None`` if nothing is registered."""
        try:
            return _version(self._request("GET", "/v1/versions/latest", VersionPublic))
        except CoordinatorError as exc:
            if exc.status_code == 404:
                return None
            raise

    def get_version(self, version: int, kind: Kind | None = None) -> PublishedVersion:
        """One registered object. Raises CoordinatorError (404) if unknown."""
        params = {"kind": kind} if kind else {}
        return _version(self._request("GET", f"/v1/versions/{version}", VersionPublic, params=params))

    def registered_digest(self, version: int, kind: Kind) -> str:
        """The ``sha256:`` digest the publisher registered for an object (a :data:`deltasync.reader.LedgerLookup`).

        Raises:
            IntegrityError: the coordinator has no such object (a store object it never registered).
        """
        try:
            return self.get_version(version, kind).checksum
        except CoordinatorError as exc:
            if exc.status_code == 404:
                raise IntegrityError(
                    f"{kind} v{version} is not registered with the coordinator at {self.base_url}: the store holds an "
                    "object the publisher never registered (forged, or left by a crash)"
                ) from None
            raise

    def wait_for_versions(self, after: int | None, wait_s: float = 30.0) -> list[PublishedVersion]:
        """Long-poll: objects above ``after`` (all if ``None``) as soon as one exists, else ``[]`` after ``wait_s``."""
        params = {"after": -1 if after is None else after, "wait_s": wait_s}
        page = self._request("GET", "/v1/versions", VersionsPublic, params=params, extra_timeout_s=wait_s)
        return [_version(v) for v in page.versions]

    def plan(self, from_version: int | None, to_version: int | None = None) -> SyncPlan:
        """What to fetch to go from ``from_version`` (``None``: nothing held) to ``to_version`` (or the latest)."""
        params = {k: v for k, v in (("from", from_version), ("to", to_version)) if v is not None}
        p = self._request("GET", "/v1/plan", PlanPublic, params=params)
        return SyncPlan(
            from_version=p.from_version,
            to_version=p.to_version,
            steps=tuple(map(_version, p.steps)),
            bytes=p.bytes,
            route=p.route,
        )

    # ------------------------------------------------------------------ agents

    def heartbeat(
        self,
        agent_id: str,
        *,
        applied_version: int | None,
        state: str,
        last_error: str | None = None,
        timings: dict[str, float] | None = None,
        drift: str | None = None,
    ) -> AgentStatus:
        """Report this agent's state (``last_error`` and ``drift`` are cut to the protocol's cap; only finite
        timings go)."""
        body = AgentHeartbeat.model_validate(
            {
                "applied_version": applied_version,
                "state": state,
                "last_error": None if last_error is None else last_error[:MAX_ERROR_CHARS],
                "timings": {k: v for k, v in (timings or {}).items() if math.isfinite(v) and v >= 0},
                "drift": None if drift is None else drift[:MAX_ERROR_CHARS],
            }
        )
        a = self._request("POST", f"/v1/agents/{agent_id}/heartbeat", AgentPublic, json=body.model_dump(mode="json"))
        return AgentStatus(**a.model_dump())

    def agents(self, *, page_size: int = 500) -> list[AgentStatus]:
        """The fleet view (every page)."""
        out: list[AgentStatus] = []
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": page_size} | ({"after": after} if after else {})
            page = self._request("GET", "/v1/agents", AgentsPublic, params=params)
            out.extend(AgentStatus(**a.model_dump()) for a in page.agents)
            if page.next_after is None:
                return out
            after = page.next_after

    # ------------------------------------------------------------------ retention and health

    def gc_candidates(self) -> GcReport:
        """Objects the coordinator would delete now (a dry run)."""
        return self._gc(self._request("GET", "/v1/gc/candidates", GcPublic))

    def collect_garbage(self, *, dry_run: bool = False) -> GcReport:
        """Prove the kept anchor, then delete every candidate from the store (needs the publisher token).
        ``dry_run``: prove and list, delete nothing."""
        return self._gc(self._request("POST", "/v1/gc", GcPublic, params={"dry_run": dry_run}))

    @staticmethod
    def _gc(g: GcPublic) -> GcReport:
        return GcReport(
            candidates=tuple(map(_version, g.candidates)),
            deleted=tuple(map(_version, g.deleted)),
            keep_from=g.keep_from,
            kept_anchor=g.kept_anchor,
            problems=tuple(g.problems),
            leftovers=tuple(g.leftovers),
        )

    def health(self) -> dict[str, Any]:
        """``/healthz`` as a dict."""
        return self._request("GET", "/healthz", HealthPublic).model_dump()
