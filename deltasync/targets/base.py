"""What an agent needs from an engine: its state, and one update session at a time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..errors import ApplyError, RefusalReason, UpdateRefused, VersionGapError
from ..staging import StagedUpdate

__all__ = ["UNHEALTHY_LABEL", "EngineState", "EngineTarget", "combine_ranks", "parse_weight_version", "raise_outcome"]

UNHEALTHY_LABEL = "unhealthy"
"""The ``weight_version`` an engine is given after a failure past the first write, so that nothing is ever
served under the label of a version it no longer holds."""


def parse_weight_version(raw: object) -> int | None:
    """vLLM's ``weight_version`` string as a deltasync version (``None`` for 'default', 'unhealthy' or unknown)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 18:
        return int(raw)
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineState:
    """An engine as its agent sees it (every rank agreeing, or the first disagreement)."""

    version: int | None
    """The version every rank holds; ``None``: unknown, unhealthy, or ranks disagree."""
    label: str | None
    """What it serves its clients as ``weight_version`` (vLLM's label)."""
    healthy: bool = True
    """False after a failure past the first write: it needs an anchor."""
    run_id: str | None = None
    """The run whose objects it applied."""
    high_water: int | None = None
    """The highest version it has served in this run."""
    fingerprint: str | None = None
    """The model fingerprint of what it serves (``None``: not known yet)."""
    model_id: str | None = None
    """The model id it serves, if known."""
    session_open: bool = False
    """An update session was started and not finished (an agent died inside it)."""
    detail: str = ""
    """Why it is unhealthy, or what its last outcome was."""
    ranks: tuple[Mapping[str, Any], ...] = field(default=(), repr=False)
    """Each rank's raw status."""


@runtime_checkable
class EngineTarget(Protocol):
    """An engine an :class:`~deltasync.agent.Agent` keeps current.

    Failure semantics of :meth:`apply`: :class:`~deltasync.errors.UpdateRefused` means nothing was written, the
    engine is healthy and keeps its label; :class:`~deltasync.errors.ApplyError` means a failure past the first
    write: the engine is unhealthy, its label is :data:`UNHEALTHY_LABEL`, and it must not serve until an anchor
    restores it (the agent keeps it paused).
    """

    def state(self) -> EngineState:
        """The engine's state, read from the engine itself."""
        ...

    def recover(self) -> None:
        """After an agent (re)start: serve again if healthy, close a dangling update session, and make the
        label say what the engine really holds (:data:`UNHEALTHY_LABEL` when unhealthy)."""
        ...

    def init(
        self,
        *,
        base_version: int | None = None,
        raise_errors: bool | None = None,
        staging_root: str | None = None,
        mode: str | None = None,
    ) -> None:
        """Tell the engine which version its weights are (``assume_version``, ignored once it knows one), how to
        report failures, the only directory it may read staged files from, and (vLLM) its apply ``mode``."""
        ...

    def pause(self) -> None:
        """Stop serving (in-flight requests are kept, waited for or aborted, per the target)."""
        ...

    def resume(self) -> None:
        """Serve again."""
        ...

    def apply(self, update: StagedUpdate) -> None:
        """One update session: validate every object, write them, finish, label ``update.target_version``,
        reset the prefix cache.

        Raises:
            UpdateRefused: nothing was written (``VersionGapError`` for a wrong base).
            ApplyError: a failure past the first write.
        """
        ...


def combine_ranks(ranks: Sequence[Mapping[str, Any]], label: str | None) -> EngineState:
    """One :class:`EngineState` from each rank's ``deltasync_status``."""
    if not ranks:
        return EngineState(version=None, label=label, detail="no rank answered")
    first = ranks[0]
    healthy = all(bool(r.get("healthy", False)) for r in ranks)
    versions = {r.get("version") for r in ranks}
    version = versions.pop() if len(versions) == 1 and healthy else None
    details = [str(r.get("detail") or "") for r in ranks if r.get("detail")]
    if len(versions) > 1:
        details.append(f"ranks disagree on the version: {sorted(map(str, versions))}")
    return EngineState(
        version=version if isinstance(version, int) else None,
        label=label,
        healthy=healthy,
        run_id=first.get("run_id"),
        high_water=max((r["high_water"] for r in ranks if isinstance(r.get("high_water"), int)), default=None),
        fingerprint=first.get("fingerprint"),
        model_id=first.get("model_id"),
        session_open=any(bool(r.get("session_active")) for r in ranks),
        detail="; ".join(details),
        ranks=tuple(ranks),
    )


def raise_outcome(ranks: Sequence[Mapping[str, Any]], what: str, cause: BaseException | None = None) -> None:
    """Raise what each rank's last outcome says, if it failed: UpdateRefused when every rank refused before a
    write (the structured ``reason``, never the message text), ApplyError otherwise."""
    outcomes = [r.get("outcome") or {} for r in ranks]
    if outcomes and all(o.get("ok") for o in outcomes) and cause is None:
        return
    refused = [o for o in outcomes if o.get("refused")]
    if refused and len(refused) == len(outcomes):  # every rank refused before writing (healthy or not)
        reason = RefusalReason(refused[0]["refused"])
        message = f"{what}: {refused[0].get('message', '')}"
        if reason is RefusalReason.BASE:
            raise VersionGapError(message) from cause
        raise UpdateRefused(message, reason=reason) from cause
    failed = next((o for o in outcomes if not o.get("ok")), {})
    text = failed.get("message") or (str(cause) if cause is not None else "an unknown failure")
    raise ApplyError(f"{what}: {str(text)[:800]}") from cause
