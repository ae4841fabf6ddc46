"""What an agent needs from an engine: its state, and one update session at a time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..apply import Holding
from ..errors import ApplyError, RefusalReason, UpdateRefused, VersionGapError
from ..manifest import AdapterEntry
from ..staging import StagedUpdate

__all__ = [
    "UNHEALTHY_LABEL",
    "EngineClaim",
    "EngineState",
    "EngineTarget",
    "check_claim",
    "combine_changes",
    "combine_proofs",
    "combine_ranks",
    "parse_weight_version",
    "raise_outcome",
]

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
class EngineClaim:
    """What an agent tells its engine when it takes charge of it (vLLM's ``init_weight_transfer_engine``).

    The policy fields are the operator's, fixed when the agent starts: no update message can change them. An
    engine obeys one agent: a claim by another ``agent_id`` is refused before anything changes, and so is a claim
    for another run than the one the engine serves (unless ``allow_rollback``).
    """

    agent_id: str
    """The claiming agent; the engine's owner from then on."""
    session: str = ""
    """This agent process's claim (random per :class:`~deltasync.agent.Agent`). Another process with the same
    ``agent_id`` (a copy-pasted command line) is refused while this session is alive; a restarted agent takes
    over once the old session has been silent for ``ttl_s``."""
    ttl_s: float = 90.0
    """How long the engine keeps the claim alive without hearing from this session (every status read renews
    it)."""
    run_id: str | None = None
    """The run the agent follows (its coordinator's)."""
    staging_root: str | None = None
    """The only directory the engine reads staged files from (no symlink on the way)."""
    allow_rollback: bool = False
    """The operator lets the engine go below the highest version it served, or to another run (logged)."""
    raise_errors: bool | None = None
    """Raise refusals and failures from the engine's RPCs (``None``: the engine's default), or only record them
    (TP > 1, vLLM #49972)."""
    mode: str | None = None
    """A vLLM engine's apply mode (``None``: its ``auto``)."""
    base_version: int | None = None
    """The version the served weights are (``assume_version``); ignored once the engine knows one."""
    adapter_dir: str | None = None
    """Mode ``lora``: the directory the adapter is served from."""
    model_fingerprint: str | None = None
    """The model the agent's run publishes (its newest anchor's fingerprint; an adapter run's base), when it has
    published one: an engine serving another model refuses the claim."""
    release: bool = False
    """Give the claim up (only its holder, from its own session, can): the agent found that its run's objects
    are for another model or run than the engine serves, so the engine's own agent may take it at once."""

    def to_init_info(self) -> dict[str, Any]:
        """The JSON ``init_info`` (fields left ``None`` are omitted)."""
        fields = {
            "agent_id": self.agent_id,
            "session": self.session or None,
            "ttl_s": self.ttl_s,
            "run_id": self.run_id,
            "staging_root": self.staging_root,
            "allow_rollback": self.allow_rollback,
            "raise_errors": self.raise_errors,
            "mode": self.mode,
            "base_version": self.base_version,
            "adapter_dir": self.adapter_dir,
            "model_fingerprint": self.model_fingerprint,
            "release": self.release or None,
        }
        return {k: v for k, v in fields.items() if v is not None}


_HELD = (
    "healthy",
    "run_id",
    "high_water",
    "fingerprint",
    "model_id",
    "adapter_base",
    "adapter",
    "adapter_base_content",
)
"""What an engine's state says of what it holds (:class:`~deltasync.apply.Holding`'s fields of the same names)."""


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
    agent_id: str | None = None
    """The agent that claimed the engine (``None``: none yet)."""
    drift: Mapping[str, Any] | None = None
    """The last drift a proof found (tensors, version, when), until an anchor restores the engine."""
    detail: str = ""
    """Why it is unhealthy, or what its last outcome was."""
    decodes: bool = False
    """Every rank decodes published objects against what it serves: its agent stages them as fetched and keeps no
    copy of the model (:func:`~deltasync.staging.stage_published`)."""
    adapter_base: str | None = None
    """It serves a LoRA adapter's objects (mode ``lora``) on the base model of this fingerprint (``"unknown"``:
    it cannot tell, and refuses every adapter); ``None``: it takes a model's own weights."""
    adapter: AdapterEntry | None = None
    """The adapter it serves (mode ``lora``; ``None``: none yet)."""
    adapter_base_content: str | None = None
    """Mode ``lora``: the digest of its base's weights, once it read them (``None``: not known)."""
    ranks: tuple[Mapping[str, Any], ...] = field(default=(), repr=False)
    """Each rank's raw status."""

    def holding(self) -> Holding:
        """What the engine holds, as its agent admits objects for it (on its fingerprint: the agent does not know
        its spec)."""
        return Holding(version=self.version if self.healthy else None, **{f: getattr(self, f) for f in _HELD})

    @classmethod
    def of(cls, holding: Holding, *, label: str | None, agent_id: str | None, detail: str) -> EngineState:
        """The state of an engine that holds ``holding`` (an engine in this process)."""
        version = holding.version if holding.healthy else None
        return cls(
            version=version, label=label, agent_id=agent_id, detail=detail, **{f: getattr(holding, f) for f in _HELD}
        )


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

    def init(self, claim: EngineClaim) -> None:
        """Take charge of the engine (:class:`EngineClaim`).

        Raises:
            UpdateRefused: (reason ``run``) the engine is claimed by another agent, or serves another run; nothing
                changed.
        """
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
        agent_id=first.get("agent"),
        drift=next((r["drift"] for r in ranks if r.get("drift")), None),
        detail="; ".join(details),
        decodes=all(r.get("decodes") is True for r in ranks),
        adapter_base=_adapter_base(first),
        adapter=_served_adapter(first),
        adapter_base_content=_adapter_base_content(first),
        ranks=tuple(ranks),
    )


def _adapter_base(status: Mapping[str, Any]) -> str | None:
    adapter = status.get("adapter")
    if not isinstance(adapter, Mapping):
        return None
    return str(adapter.get("base_fingerprint") or "unknown")


def _adapter_base_content(status: Mapping[str, Any]) -> str | None:
    adapter = status.get("adapter")
    content = adapter.get("base_content") if isinstance(adapter, Mapping) else None
    return content if isinstance(content, str) else None


def _served_adapter(status: Mapping[str, Any]) -> AdapterEntry | None:
    adapter = status.get("adapter")
    served = adapter.get("served") if isinstance(adapter, Mapping) else None
    if not isinstance(served, Mapping):
        return None
    try:
        return AdapterEntry(
            r=int(served["r"]),
            lora_alpha=served["lora_alpha"],
            target_modules=tuple(served["target_modules"]),
            use_rslora=bool(served["use_rslora"]),
            base_fingerprint=str(served["base_fingerprint"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


def check_claim(ranks: Sequence[Mapping[str, Any]], claim: EngineClaim) -> None:
    """After ``init``: every rank must name ``claim.agent_id`` as its agent (an engine records a refused claim
    instead of raising it: a raising worker desyncs vLLM's executor at TP > 1).

    Raises:
        UpdateRefused: (reason ``run``; ``model`` for an engine of another model; ``unsupported`` for one that
            cannot serve the claimed mode) with the engine's own explanation; nothing changed there.
    """
    for rank in ranks:
        outcome = rank.get("outcome") or {}
        refused = outcome.get("refused")
        if rank.get("agent") != claim.agent_id or refused is not None:
            why = outcome.get("message") or f"the engine is claimed by agent {rank.get('agent')!r}"
            reason = RefusalReason(refused) if refused in {r.value for r in RefusalReason} else RefusalReason.RUN
            raise UpdateRefused(str(why), reason=reason)


def combine_proofs(ranks: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """Each rank's ``deltasync_prove`` answer, added up: ``(drifted, unproven)`` tensor names.

    A rank proves the tensors it holds whole itself (``bad``). For a tensor held in parts, the sketches of the
    parts held by one live parameter (same name on every rank) are added over the ranks: the sum must be the
    published sketch, and the parts must cover the tensor exactly once (sketches add up over any partition of
    the elements, :mod:`deltasync.sketch`). Parts that cover more (a replicated slice) or less than the tensor
    cannot be added up and are reported unproven, never as proven.
    """
    from ..sketch import add_sketches, format_sketch, parse_sketch

    drifted = sorted({n for r in ranks for n in r.get("bad") or []})
    unproven = sorted({n for r in ranks for n in r.get("unproven") or []})
    sums: dict[tuple[str, str], tuple[list[str], int]] = {}
    published: dict[str, str] = {}
    numel: dict[str, int] = {}
    for r in ranks:
        published.update(r.get("published") or {})
        numel.update(r.get("numel") or {})
        for name, held in (r.get("parts") or {}).items():
            for param, sketch, count in held:
                sketches, total = sums.get((name, param), ([], 0))
                sums[(name, param)] = ([*sketches, sketch], total + int(count))
    for (name, _), (sketches, total) in sorted(sums.items()):
        if total != numel.get(name):
            unproven.append(name)
        elif format_sketch(add_sketches(*(parse_sketch(s) for s in sketches))) != published.get(name):
            drifted.append(name)
    return sorted(set(drifted)), sorted(set(unproven) - set(drifted))


def combine_changes(ranks: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """Each rank's ``deltasync_prepare`` answer, added up: ``(bad, unproven)`` tensor names.

    With tensor parallelism a rank decodes only the elements it holds, and proves only the tensors it holds whole.
    For a tensor held in parts, each rank gives, per live parameter, how the update moves the sketch of its part
    (``changes``). Where the parts of one parameter (same name on every rank) cover the tensor exactly once, the
    served sketch plus their sum must be the published sketch, or the update is bad; parts that cover more (a
    replicated slice) or less cannot be added up and are reported unproven (the audit after the pause proves
    the result, as every rank's whole state).
    """
    from ..sketch import add_sketches, format_sketch, parse_sketch

    sums: dict[tuple[str, str], tuple[list[str], int]] = {}
    facts: dict[str, tuple[str, str, int]] = {}
    bad: set[str] = set()
    for r in ranks:
        for name, change in (r.get("changes") or {}).items():
            fact = (str(change["served"]), str(change["published"]), int(change["numel"]))
            if facts.setdefault(name, fact) != fact:  # ranks that serve different versions: never add them up
                bad.add(name)
            for param, sketch, count in change["parts"]:
                if int(count) <= 0:  # a part holds elements: anything else is a malformed answer
                    bad.add(name)
                sketches, total = sums.get((name, param), ([], 0))
                sums[(name, param)] = ([*sketches, sketch], total + int(count))
    unproven: set[str] = set()
    for (name, _), (sketches, total) in sorted(sums.items()):
        served, published, numel = facts[name]
        if total != numel:
            unproven.add(name)
        elif format_sketch(add_sketches(parse_sketch(served), *(parse_sketch(s) for s in sketches))) != published:
            bad.add(name)
    return sorted(bad), sorted(unproven - bad)


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
