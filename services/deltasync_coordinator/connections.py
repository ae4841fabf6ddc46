"""The coordinator's open connections: caps overall and per client address, the counts of refusals and of TLS
handshake, read and write timeouts, and a refusal log that a flood cannot fill.

Every connection costs an open file. Past the process's open-files limit the server can no longer accept (nor
open its own ledger files), so ``/healthz`` and authenticated requests would fail with resets while slow clients
hold every descriptor. The caps keep the server below that limit and one client address below the overall cap;
:mod:`.http` enforces them on each connection from its TCP accept (before any TLS handshake), and times the
handshake, the request reads and the client's reading of the answers. Addresses are always the socket's peer:
no header can name another.
"""

from __future__ import annotations

import logging
import resource
import time

__all__ = [
    "FILES_KEPT",
    "KEPT_FOR_OTHERS",
    "LOG_BURST",
    "LOG_WINDOW_S",
    "ConnectionLedger",
    "fit_to_open_files",
    "open_files_limit",
]

logger = logging.getLogger("deltasync.coordinator")

FILES_KEPT = 64
"""Open files kept out of the connection cap: the ledger (database, WAL, lock), the listening socket, logs, the
thread pool, a PostgreSQL pool, and the descriptor each refusal needs for a moment."""
KEPT_FOR_OTHERS = 32
"""Connections that one client address can never take: health checks and publishers get in while one host
holds all it may (and what ``max_long_polls`` leaves of the cap)."""
LOG_BURST = 10
"""Refusals (and timeouts) of one kind logged one by one per window; the rest are counted in the next line."""
LOG_WINDOW_S = 60.0

REASONS = ("max_connections", "max_connections_per_peer")
"""Why a connection was refused (the ``reason`` label of ``deltasync_connections_refused_total``)."""
REQUEST_REASONS = ("max_pipelined_requests",)
"""Why the protocol refused a request of an admitted connection (the ``reason`` label of
``deltasync_requests_refused_total``): one queued past the cap on pipelined requests (answered 503 in its turn,
then the connection closes)."""
PHASES = ("handshake", "head", "body", "write")
"""What did not complete in time (the ``phase`` label of ``deltasync_requests_timed_out_total``): the TLS
handshake, a request head, a request body (all read from the client), or the client's reading of an answer."""


def open_files_limit() -> int:
    """This process's soft limit on open files (what ``deltasync coordinator`` raised it to)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def fit_to_open_files(max_connections: int, max_per_peer: int, nofile: int) -> tuple[int, int]:
    """The caps in force: ``max_connections`` lowered to ``nofile`` less :data:`FILES_KEPT`, and ``max_per_peer``
    to that less :data:`KEPT_FOR_OTHERS` (at least 1 each)."""
    overall = max(1, min(max_connections, nofile - FILES_KEPT))
    return overall, max(1, min(max_per_peer, overall - KEPT_FOR_OTHERS))


class _Burst:
    """At most :data:`LOG_BURST` lines a window of :data:`LOG_WINDOW_S`; the rest counted in the next line."""

    def __init__(self) -> None:
        self.window_start, self.logged, self.suppressed = float("-inf"), 0, 0

    def admit(self) -> tuple[bool, int]:
        """Whether to log this one, and how many were left out since the last line."""
        now = time.monotonic()
        if now - self.window_start > LOG_WINDOW_S:
            self.window_start, self.logged = now, 0
        if self.logged >= LOG_BURST:
            self.suppressed += 1
            return False, 0
        self.logged += 1
        more, self.suppressed = self.suppressed, 0
        return True, more


class ConnectionLedger:
    """The open connections of one coordinator, overall and by client address, and what was refused or closed.

    Lives on the server's event loop (not thread-safe); ``/metrics`` reads its counters from a thread, which sees
    whole integers.

    Args:
        max_connections: the overall cap in force (see :func:`fit_to_open_files`).
        max_per_peer: the cap in force for one client address.
        logger_name: where refusals and timeouts are logged (a service other than the coordinator names itself).
    """

    def __init__(self, max_connections: int, max_per_peer: int, *, logger_name: str = logger.name) -> None:
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self._logger = logging.getLogger(logger_name)
        self.open = 0
        """Connections open now."""
        self.refused = dict.fromkeys(REASONS, 0)
        """Connections refused so far, by reason."""
        self.refused_requests = dict.fromkeys(REQUEST_REASONS, 0)
        """Requests of admitted connections refused so far, by reason."""
        self.timed_out = dict.fromkeys(PHASES, 0)
        """Connections closed because a TLS handshake, a request head or a body did not arrive in time, or an
        answer was not read in time, by phase."""
        self._by_peer: dict[str, int] = {}
        self._bursts = {kind: _Burst() for kind in (*REASONS, *REQUEST_REASONS, *PHASES)}

    def admit(self, peer: str, status: int | None = 503) -> str | None:
        """Count a new connection from ``peer`` (its socket's address), or say why it is refused (the answer's
        detail; then it is not counted as open, and the refusal is counted and logged as answered ``status``, or
        closed without an answer when None: a TLS connection is refused before its handshake)."""
        held = self._by_peer.get(peer, 0)
        if self.open >= self.max_connections:
            reason, detail = "max_connections", f"too many connections ({self.open} open, max_connections)"
        elif held >= self.max_per_peer:
            reason = "max_connections_per_peer"
            detail = f"too many connections from {peer} ({held} open, max_connections_per_peer)"
        else:
            self.open += 1
            self._by_peer[peer] = held + 1
            return None
        detail += "; retry after 1 s"
        self.refused[reason] += 1
        self.log(reason, peer, status, detail)
        return detail

    def record_request_refusal(self, reason: str, peer: str, status: int, detail: str) -> None:
        """Count and log a request of an admitted connection refused for ``reason`` (one of
        :data:`REQUEST_REASONS`) with ``status``; the connection closes after that answer."""
        self.refused_requests[reason] += 1
        self.log(reason, peer, status, detail)

    def release(self, peer: str) -> None:
        """A connection that :meth:`admit` counted has closed."""
        self.open -= 1
        held = self._by_peer.pop(peer) - 1
        if held:
            self._by_peer[peer] = held

    def record_timeout(self, phase: str, peer: str, status: int | None, detail: str) -> None:
        """Count and log a connection closed because its ``phase`` (one of :data:`PHASES`) did not complete in
        time (answered ``status``, or closed without an answer when None)."""
        self.timed_out[phase] += 1
        self.log(phase, peer, status, detail)

    def log(self, kind: str, peer: str, status: int | None, detail: str) -> None:
        """One WARNING line, at most :data:`LOG_BURST` of each ``kind`` a window (a flood cannot fill the log; the
        metrics count every one)."""
        admitted, more = self._bursts[kind].admit()
        if admitted:
            self._logger.warning(
                "connection from %s closed%s: %s%s",
                peer,
                f" with {status}" if status is not None else "",
                detail,
                f"; {more} more like this not logged" if more else "",
            )
