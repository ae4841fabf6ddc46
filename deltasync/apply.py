"""The one apply rule, used by every receiver: the store reader, the in-memory engine, the agent's host copy and
the vLLM engine.

An object goes through four steps, in order:

1. :func:`admit`: everything knowable from its (verified) manifest and what the receiver holds: the model
   fingerprint, the run, the base version, the receiver's health and the highest version it has served.
   A refusal raises :class:`~deltasync.errors.UpdateRefused` before anything is read or written.
2. :func:`check_decoded`: the decoded entries agree with the manifest (names, dtypes, shapes, spans, counts).
   Raises ``FormatError``; still nothing written.
3. :func:`write`: the entries go into the receiver's tensors. **Not transactional**: a failure here leaves
   the tensors partly updated, and the receiver must not serve them until an anchor restores it.
4. :func:`verify`: the written tensors match the manifest's checksums (``IntegrityError`` otherwise).

:func:`apply_update` is that sequence, once, with the failure rule: a failure after the first write unlabels
the receiver (:meth:`Receiver.unlabel`) until an anchor restores it. Each receiver brings its own storage as a
:class:`Receiver` (a state dict: :class:`TensorsReceiver`; the vLLM engine's shadow, patch map or loader).
"""

from __future__ import annotations

import dataclasses
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch

from .errors import FormatError, IntegrityError, RefusalReason, UpdateRefused, VersionGapError
from .format import TensorDelta, tensor_checksum
from .manifest import AdapterEntry, DeltaManifest, ModelSpec, describe_spec_difference, model_fingerprint
from .vocab import DTYPE_NAMES, DTYPES

__all__ = [
    "Holding",
    "Receiver",
    "Step",
    "TensorsReceiver",
    "admit",
    "admit_all",
    "apply_update",
    "check_decoded",
    "overlapping",
    "refuse_claim",
    "refuse_model",
    "releases_claim",
    "spec_of",
    "verify",
    "write",
]


def spec_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The model spec (name -> dtype name, shape) of a state dict."""
    return {n: (DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape)) for n, t in tensors.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Holding:
    """What a receiver holds, as far as admitting an object is concerned."""

    version: int | None = None
    """The version its tensors are at; ``None``: unknown (only an anchor is admitted)."""
    healthy: bool = True
    """False after a failure past the first write: only an anchor is admitted."""
    spec: ModelSpec | None = None
    """The model it serves (name -> dtype, shape); ``None``: not known yet, the first anchor defines it."""
    model_id: str | None = None
    """The model id it serves, if known."""
    run_id: str | None = None
    """The run whose objects it has applied; ``None``: none yet."""
    high_water: int | None = None
    """The highest version it has served in this run."""
    fingerprint: str | None = None
    """:func:`~deltasync.manifest.model_fingerprint` of ``spec`` (computed once, when not given). Given without a
    spec (an agent knows its engine's fingerprint, not its spec), objects are admitted on it alone."""
    adapter_base: str | None = None
    """A receiver that serves a LoRA adapter's objects (not a model's own weights): the fingerprint of the base
    model it serves the adapter on. ``None``: it takes a model's own weights only."""
    adapter: AdapterEntry | None = None
    """The adapter it serves (``None``: none yet, or not an adapter receiver); later objects must be versions
    of it."""
    adapter_base_content: str | None = None
    """An adapter receiver: the digest of its base model's weights (``None``: unknown). An adapter whose
    ``base_content`` is known and differs is for another base of the same shapes."""

    def __post_init__(self) -> None:
        if self.spec is not None and self.fingerprint is None:
            object.__setattr__(self, "fingerprint", model_fingerprint(self.spec))

    def after(self, manifest: DeltaManifest) -> Holding:
        """What the receiver holds once ``manifest``'s object is applied."""
        top = manifest.version if self.high_water is None else max(self.high_water, manifest.version)
        return dataclasses.replace(
            self,
            version=manifest.version,
            healthy=True,
            spec=manifest.spec,
            fingerprint=manifest.model_fingerprint,
            model_id=manifest.model_id or self.model_id,
            adapter=manifest.adapter or self.adapter,
            run_id=manifest.run_id or self.run_id,
            high_water=top if manifest.run_id in (None, self.run_id) else manifest.version,
        )


def admit(
    manifest: DeltaManifest,
    holding: Holding,
    *,
    where: str,
    target: int | None = None,
    allow_rollback: bool = False,
) -> None:
    """Refuse an object the receiver must not take; nothing has been read or written when this raises.

    Args:
        manifest: the object's verified manifest.
        holding: what the receiver holds now (after the objects before this one in the same session).
        where: the object's name for messages (``store uri/prefix``).
        target: the version the update session finishes at (default: this object's). The engine serves
            only that one, so an anchor below the highest version served is fine on the way to a higher one.
        allow_rollback: an operator's explicit permission to go below the highest version served, or to
            another run (logged by the caller).

    Raises:
        UpdateRefused: with ``reason`` MODEL, RUN, ROLLBACK or UNHEALTHY.
        VersionGapError: a delta whose base is not the version held (``reason`` BASE).
    """
    what = f"{where}: {manifest.kind} v{manifest.version}"
    _admit_adapter(manifest, holding, what)
    if holding.fingerprint is not None and holding.fingerprint != manifest.model_fingerprint:
        # an agent knows its engine's fingerprint, not always its spec: the difference is named where it is known
        differs = "" if holding.spec is None else f": {describe_spec_difference(holding.spec, manifest.spec)}"
        raise UpdateRefused(
            f"{what} is for another model (fingerprint {manifest.model_fingerprint[:19]}..., this engine serves "
            f"{holding.fingerprint[:19]}...){differs}; point the agent at the run of the model it serves",
            reason=RefusalReason.MODEL,
        )
    if manifest.model_id and holding.model_id and manifest.model_id != holding.model_id:
        raise UpdateRefused(
            f"{what} is for model {manifest.model_id!r}, this engine serves {holding.model_id!r}",
            reason=RefusalReason.MODEL,
        )
    other_run = holding.run_id is not None and manifest.run_id is not None and manifest.run_id != holding.run_id
    if other_run and not allow_rollback:
        raise UpdateRefused(
            f"{what} belongs to run {manifest.run_id}, this engine follows run {holding.run_id}; to switch runs "
            "on purpose, restart the agent with --allow-rollback",
            reason=RefusalReason.RUN,
        )
    if manifest.kind == "delta":
        if not holding.healthy:
            raise UpdateRefused(
                f"{what} refused: this engine failed an earlier update past its first write and takes only an "
                "anchor now",
                reason=RefusalReason.UNHEALTHY,
            )
        if holding.version is None or holding.version != manifest.base_version:
            held = "an unknown version" if holding.version is None else f"v{holding.version}"
            raise VersionGapError(
                f"{what} (base v{manifest.base_version}) refused: this engine holds {held}; apply an anchor or "
                "the delta from the version held"
            )
    end = manifest.version if target is None else target
    lower = holding.high_water is not None and end < holding.high_water and not other_run
    if lower and not allow_rollback:
        raise UpdateRefused(
            f"{what} refused: the update would end at v{end}, this engine has served v{holding.high_water} of "
            "this run and never goes back "
            "(is the coordinator's ledger restored from an old backup?); to roll back on purpose, restart the "
            "agent with --allow-rollback",
            reason=RefusalReason.ROLLBACK,
        )


def _admit_adapter(manifest: DeltaManifest, holding: Holding, what: str) -> None:
    """A LoRA adapter's objects go only to a receiver serving that adapter on that base model, and a model's own
    weights never to one serving an adapter."""
    a = manifest.adapter
    if holding.adapter_base is None:
        if a is not None:
            raise UpdateRefused(
                f"{what} is a LoRA adapter's (rank {a.r}, {len(a.target_modules)} target modules), this engine takes "
                "a model's own weights: run its agent with --apply-mode lora to serve the adapter",
                reason=RefusalReason.MODEL,
            )
        return
    if a is None:
        raise UpdateRefused(
            f"{what} is a model's own weights, this engine serves a LoRA adapter (apply mode lora): point its agent "
            "at the adapter's run",
            reason=RefusalReason.MODEL,
        )
    why = _not_the_adapter(manifest, a)
    if why is not None:
        raise UpdateRefused(
            f"{what}: its tensors are not the LoRA adapter its manifest names ({why}); vLLM would not load them as "
            "that adapter",
            reason=RefusalReason.MALFORMED,
        )
    if a.base_fingerprint != holding.adapter_base:
        raise UpdateRefused(
            f"{what} is an adapter for another base model (base fingerprint {a.base_fingerprint[:19]}..., this "
            f"engine serves {holding.adapter_base[:19]}...): train the adapter on the served model",
            reason=RefusalReason.MODEL,
        )
    served = holding.adapter_base_content
    if a.base_content is not None and served is not None and a.base_content != served:
        raise UpdateRefused(
            f"{what} is an adapter for another base model of the same shapes (base weights {a.base_content[:19]}..., "
            f"this engine serves base weights {served[:19]}...): publish the adapter from a trainer whose base is the "
            "checkpoint this engine serves, or serve the adapter's own base",
            reason=RefusalReason.MODEL,
        )
    if holding.adapter is not None and a != holding.adapter:
        raise UpdateRefused(
            f"{what} is not a version of the served adapter ({a.describe_difference(holding.adapter)}): another "
            "adapter is served under another name",
            reason=RefusalReason.MODEL,
        )


_LORA_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])\.weight")


def _not_the_adapter(manifest: DeltaManifest, a: AdapterEntry) -> str | None:
    """Why an adapter object's tensors are not the adapter ``a`` (``None``: they are): only each adapted module's
    ``lora_A`` ``(r, in)`` and ``lora_B`` ``(out, r)``, both, for modules ``target_modules`` names (PEFT's rule: the
    module's name or its last dotted parts)."""
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, entry in manifest.tensors.items():
        m = _LORA_NAME.fullmatch(name)
        if m is None:
            return f"{name!r} is not a LoRA A or B weight (base_model.model.<module>.lora_A.weight)"
        module = m["module"]
        if not any(module == t or module.endswith("." + t) for t in a.target_modules):
            return f"{name!r}: module {module!r} is not one of the target modules {list(a.target_modules)}"
        shape = entry.shape
        if len(shape) != 2 or (shape[0] if m["kind"] == "A" else shape[1]) != a.r:
            return f"{name!r} has shape {list(shape)}, not that of a rank-{a.r} lora_{m['kind']}"
        pairs.setdefault(module, {})[m["kind"]] = shape
    if not pairs:
        return "no tensors"
    for module, kinds in sorted(pairs.items()):
        if set(kinds) != {"A", "B"}:
            return f"module {module!r} has lora_{''.join(kinds)} without its pair"
    return None


def refuse_claim(
    *,
    owner: str | None,
    agent_id: str | None,
    holding: Holding,
    run_id: str | None,
    allow_rollback: bool,
    owner_alive_s: float | None = None,
    same_session: bool = True,
) -> str | None:
    """Why an engine must refuse an agent's claim (``None``: it may take charge). Nothing has changed when this
    says no: a second agent pointed at the same engine (another run's coordinator, another store) never
    reconfigures it.

    Args:
        owner: the agent that claimed the engine before (``None``: none).
        agent_id: the claiming agent.
        holding: what the engine holds.
        run_id: the run the claiming agent follows.
        allow_rollback: the operator lets the agent take the engine to another run.
        owner_alive_s: seconds since the owner's session was last heard from, if it is still alive (``None``:
            expired, or none).
        same_session: the claim comes from the owner's own session (the same process).
    """
    if not agent_id:
        return "deltasync: init_info.agent_id is required: an engine obeys the one agent that claimed it"
    if owner is not None and agent_id != owner:
        return (
            f"deltasync: this engine is driven by agent {owner!r}, agent {agent_id!r} may not take it (each engine "
            "has one agent: point this agent at its own engine, or stop the other and restart vLLM)"
        )
    if owner is not None and not same_session and owner_alive_s is not None:
        return (
            f"deltasync: agent {owner!r} drives this engine from another process, heard from {owner_alive_s:.0f} s "
            "ago; two agents with one id? stop the other one (a restarted agent takes over once the old one has "
            "been silent for its claim's ttl)"
        )
    if holding.run_id is not None and run_id is not None and run_id != holding.run_id and not allow_rollback:
        return (
            f"deltasync: agent {agent_id!r} follows run {run_id}, this engine serves run {holding.run_id}; nothing "
            "was changed (to switch runs on purpose, restart the agent with --allow-rollback)"
        )
    return None


def refuse_model(*, agent_id: str | None, wanted: str | None, served: str | None, adapter: bool) -> str | None:
    """Why an engine must refuse the claim of an agent whose run publishes another model (``None``: it may take
    charge, or either side does not know its model yet): an agent of another model's run never holds an engine.

    Args:
        agent_id: the claiming agent.
        wanted: the fingerprint of the model the agent's run publishes (an adapter run: its base's).
        served: the fingerprint of the model the engine serves (adapter mode: the base it serves adapters on).
        adapter: the engine serves a LoRA adapter's versions.
    """
    if wanted is None or served is None or wanted == served:
        return None
    what = "adapters for another base model" if adapter else "another model"
    return (
        f"deltasync: agent {agent_id!r} follows a run that is for {what} (fingerprint {wanted[:19]}..., this engine "
        f"serves {served[:19]}...): nothing was changed; point the agent at the engine of its model, or this engine's "
        "agent at its run"
    )


def releases_claim(reason: RefusalReason, holding: Holding) -> bool:
    """Whether refusing the claiming agent's update for ``reason`` releases its claim: the objects are for another
    model or run, and the engine serves no version yet, so the agent is not this engine's; the engine's own
    agent then takes it at once (the refused one is refused at its next claim where its run's model is known)."""
    return reason in (RefusalReason.MODEL, RefusalReason.RUN) and holding.version is None


def overlapping(spans: list[tuple[int, int]]) -> bool:
    """Whether two of the half-open ``spans`` share an element (sorts ``spans`` in place)."""
    spans.sort()
    return any(start < stop for (_, stop), (start, _) in zip(spans, spans[1:], strict=False))


def check_decoded(manifest: DeltaManifest, deltas: Sequence[TensorDelta], *, where: str) -> None:
    """The decoded entries of an object agree with its manifest: each names a tensor the manifest lists with
    the same dtype and shape, spans of one tensor do not overlap, counts add up to the manifest's ``nnz``,
    and an anchor covers every element of every tensor.

    Raises:
        FormatError: naming the tensor.
    """
    covered: dict[str, list[tuple[int, int]]] = {}
    nnz: dict[str, int] = {}
    for d in deltas:
        e = manifest.tensors.get(d.ckpt_name)
        if e is None or e.shape != d.shape or e.dtype != DTYPE_NAMES.get(d.dtype):
            raise FormatError(
                f"{where}: tensor {d.ckpt_name!r} ({DTYPE_NAMES.get(d.dtype)} {list(d.shape)}) does not match the "
                f"manifest's entry ({None if e is None else f'{e.dtype} {list(e.shape)}'})"
            )
        covered.setdefault(d.ckpt_name, []).append(d.bounds)
        nnz[d.ckpt_name] = nnz.get(d.ckpt_name, 0) + d.nnz
    for name, spans in covered.items():
        if overlapping(spans):
            raise FormatError(f"{where}: tensor {name!r} has overlapping entries ({spans[:4]})")
    for name, e in manifest.tensors.items():
        if nnz.get(name, 0) != e.nnz:
            raise FormatError(
                f"{where}: tensor {name!r} has {nnz.get(name, 0)} elements in the shards, the manifest says {e.nnz}"
            )
        if manifest.kind == "anchor" and e.numel and sum(b - a for a, b in covered.get(name, [])) != e.numel:
            raise FormatError(f"{where}: the anchor does not cover every element of {name!r}")


def write(
    tensors: MutableMapping[str, torch.Tensor] | None, manifest: DeltaManifest, deltas: Iterable[TensorDelta]
) -> MutableMapping[str, torch.Tensor]:
    """Write an object's (checked) entries: an anchor builds new tensors, a delta updates ``tensors`` in place.

    Not transactional: an error part-way leaves ``tensors`` partly updated.

    Returns:
        The tensors at ``manifest.version`` (a new dict for an anchor, ``tensors`` for a delta).

    Raises:
        ValueError: a delta without ``tensors``.
        FormatError: an entry names a tensor ``tensors`` lacks, or with another dtype or shape.
    """
    if manifest.kind == "anchor":
        out: dict[str, torch.Tensor] = {}
        for d in deltas:
            if d.span is None:
                out[d.ckpt_name] = d.values.reshape(d.shape)
            else:
                full = out.setdefault(d.ckpt_name, torch.empty(d.shape, dtype=d.dtype))
                full.view(-1)[d.span[0] : d.span[1]] = d.values
        for name, e in manifest.tensors.items():  # empty tensors have no entry
            out.setdefault(name, torch.empty(e.shape, dtype=DTYPES[e.dtype]))
        return out
    if tensors is None:
        raise ValueError(f"delta v{manifest.version} needs the tensors of v{manifest.base_version}")
    for d in deltas:
        t = tensors.get(d.ckpt_name)
        if t is None or tuple(t.shape) != d.shape or t.dtype != d.dtype:
            found = "nothing" if t is None else f"{DTYPE_NAMES.get(t.dtype, t.dtype)} {list(t.shape)}"
            raise FormatError(
                f"tensor {d.ckpt_name!r}: the delta is for {DTYPE_NAMES[d.dtype]} {list(d.shape)}, the receiver "
                f"holds {found} (a delta for another model?)"
            )
        flat = t.view(-1)
        if d.indices is not None:
            flat.index_copy_(0, d.indices, d.values.reshape(-1))  # ~1.6x the speed of flat[indices] = values
        elif d.span is not None:
            flat[d.span[0] : d.span[1]] = d.values
        else:
            t.copy_(d.values.reshape(t.shape))
    return tensors


def verify(tensors: Mapping[str, torch.Tensor], manifest: DeltaManifest, names: Iterable[str] | None = None) -> None:
    """Check tensors against the manifest's checksums (all of them, or only ``names``).

    Raises:
        IntegrityError: a tensor is missing or differs; the message lists them.
    """
    bad = []
    for name in manifest.tensors if names is None else names:
        entry, t = manifest.tensors[name], tensors.get(name)
        if t is None:
            bad.append(f"{name} (missing)")
            continue
        for start, stop, digest in entry.checksums:
            if tensor_checksum(t, (start, stop)) != digest:
                bad.append(f"{name}[{start}:{stop}]")
    if bad:
        raise IntegrityError(
            f"v{manifest.version}: {len(bad)} tensors differ from the published checksums: "
            f"{', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}"
        )


def admit_all(
    manifests: Iterable[tuple[DeltaManifest, str]],
    holding: Holding,
    *,
    target: int | None = None,
    allow_rollback: bool = False,
) -> Holding:
    """:func:`admit` each object of an update session in turn (``(manifest, where)``, in apply order), each against
    what the receiver holds once the objects before it are applied; returns what it holds after the last.

    Raises:
        UpdateRefused: as :func:`admit`, for the first object refused; nothing has been read or written.
    """
    for manifest, where in manifests:
        admit(manifest, holding, where=where, target=target, allow_rollback=allow_rollback)
        holding = holding.after(manifest)
    return holding


@dataclass(frozen=True, slots=True)
class Step:
    """One object of an update session, as :func:`apply_update` takes it."""

    manifest: DeltaManifest
    """The object's verified manifest (admitted before any object is read)."""
    where: str
    """The object's name in messages (``store uri/prefix``, a staged path)."""
    read: Callable[[], Sequence[TensorDelta]]
    """Its entries, decoded and checked against the manifest (:func:`check_decoded`): a receiver whose objects are
    decoded against what it holds reads each one after the objects before it are written."""

    @classmethod
    def of(cls, manifest: DeltaManifest, deltas: Sequence[TensorDelta], where: str) -> Step:
        """An object whose entries were read (and checked) already."""
        return cls(manifest, where, lambda: deltas)


class Receiver(ABC):
    """The storage one receiver writes objects into, under :func:`apply_update`."""

    def check(self, objects: Sequence[tuple[DeltaManifest, Sequence[TensorDelta]]]) -> None:
        """Refuse, before the first write, what this receiver cannot write exactly (``objects``: those read before
        the next write: the whole session where it is read ahead). Default: nothing more than the manifest's.

        Raises:
            UpdateRefused: nothing was written.
        """
        return None

    @abstractmethod
    def write(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        """Write one object's checked entries. Not transactional: the failure rule covers a failure here."""

    @abstractmethod
    def verify(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        """Prove what :meth:`write` wrote of this object against its manifest.

        Raises:
            IntegrityError: a written tensor differs from the manifest's checksums.
        """

    def done(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        """One object written and proven (the agent stages it for its engine here). Default: nothing."""
        return None

    def unlabel(self, exc: Exception) -> None:
        """The failure rule: ``exc`` happened after the first write, and the receiver must serve no known version
        until an anchor restores it. It may raise the error its own callers expect instead of ``exc``. Default:
        nothing (a receiver with no label: the caller discards the tensors)."""
        return None


def apply_update(
    steps: Sequence[Step],
    into: Receiver,
    holding: Holding | None = None,
    *,
    target: int | None = None,
    allow_rollback: bool = False,
    read_ahead: bool = False,
) -> Holding | None:
    """The one apply sequence: every object admitted (:func:`admit_all`, against ``holding``; ``None``: a store's
    own chain, which the reader checks instead), then each read and checked, written and verified, in order.

    Args:
        steps: the session's objects, in apply order.
        into: the receiver's storage.
        holding: what the receiver holds before the session.
        target: the version the session ends at (default: the last object's).
        allow_rollback: the operator lets the receiver go below its highest version, or to another run.
        read_ahead: read and check every object, and :meth:`Receiver.check` them all, before the first write
            (objects staged whole, an engine's session); otherwise each is read right before it is written (it is
            decoded against what the objects before it wrote).

    Returns:
        What the receiver holds after the last object (``None`` without ``holding``).

    Raises:
        UpdateRefused: before the first write (admission, or :meth:`Receiver.check`); nothing was written.
        FormatError: an object's entries are malformed (before the first write where read ahead).
        IntegrityError: a written tensor differs from its manifest's checksums.
        Any error :meth:`Receiver.unlabel` raises, after the first write.
    """
    after = None
    if holding is not None:
        after = admit_all(((s.manifest, s.where) for s in steps), holding, target=target, allow_rollback=allow_rollback)
    ahead = [(s.manifest, s.read()) for s in steps] if read_ahead else []
    if ahead:
        into.check(ahead)
    written = False
    try:
        for i, step in enumerate(steps):
            if read_ahead:
                deltas = ahead[i][1]
            else:
                deltas = step.read()
                into.check([(step.manifest, deltas)])
            written = True
            into.write(step.manifest, deltas)
            into.verify(step.manifest, deltas)
            into.done(step.manifest, deltas)
    except Exception as exc:
        if written:
            into.unlabel(exc)
        raise
    return after


class TensorsReceiver(Receiver):
    """A receiver whose storage is a state dict (the store reader, the in-memory engine, the agent's host copy).

    Args:
        tensors: the tensors held (``None``: none yet; the first object must be an anchor).
        own_anchors: copy an anchor's tensors (they are the decoded entries' buffers, which the caller may reuse).
        verify: check what each object wrote against its manifest's checksums.
    """

    def __init__(
        self, tensors: dict[str, torch.Tensor] | None = None, *, own_anchors: bool = False, verify: bool = True
    ) -> None:
        self.tensors = tensors
        self.own_anchors = own_anchors
        self.verifies = verify

    def write(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        tensors = dict(write(self.tensors, manifest, deltas))
        if manifest.kind == "anchor" and self.own_anchors:
            tensors = {n: t.clone() for n, t in tensors.items()}
        self.tensors = tensors

    def verify(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        if self.verifies:
            assert self.tensors is not None
            verify(self.tensors, manifest, names=None if manifest.kind == "anchor" else {d.ckpt_name for d in deltas})
