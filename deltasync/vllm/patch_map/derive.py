"""Layers that repeat: the first layer of each kind is probed tensor by tensor, and every other layer of the kind
takes its map with its own index, proven by two probe loads (reverse and checkpoint order) and the real-values
checks, or is probed in full."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ...format import tensor_checksum
from . import tensors
from .checks import GroupCheck
from .core import Runs
from .swap import REPLACED, Spec, Swap
from .tensors import arange, numel, same, zeros
from .values import Background

__all__ = ["DerivedLayer", "LayerKind", "group_of", "layer_kind", "template"]

# a block index in a parameter or checkpoint name: Llama-style ``layers.N``, GPT-2/Falcon/Bloom ``h.N``, MPT
# ``blocks.N``, BERT ``layer.N`` (probing swaps one block at a time: the rest of the model stays as it is)
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")

_SLOT = "\x00"
"""Stands for a layer's index in a name template (no checkpoint or parameter name holds a NUL)."""


def group_of(name: str) -> str:
    """The layer a checkpoint or parameter name belongs to (``layers.N``), or ``""``: outside the layers."""
    m = _LAYER.search(name)
    return f"layers.{m.group(1)}" if m else ""


def template(name: str) -> str:
    """``name`` with its block index replaced by :data:`_SLOT` (``model.layers.7.mlp`` -> ``model.layers.\\0.mlp``)."""
    m = _LAYER.search(name)
    return name if m is None else name[: m.start(1)] + _SLOT + name[m.end(1) :]


def layer_kind(
    model: torch.nn.Module, names: list[str], probed: list[str], params: Mapping[str, torch.nn.Parameter], spec: Spec
) -> tuple[Any, ...]:
    """What makes two layers map alike: their checkpoint tensors (names, dtypes, shapes) and their parameters
    (names, shapes, dtypes, contiguity, device, the class of the module holding each), all with the index taken
    out."""
    ckpt = tuple(sorted((template(n), spec[n][0], tuple(spec[n][1])) for n in names))
    live = []
    for q in probed:
        p = params[q]
        owner = type(model.get_submodule(q.rpartition(".")[0])).__qualname__ if "." in q else ""
        live.append((template(q), tuple(p.shape), str(p.dtype), p.is_contiguous(), str(p.device), owner))
    return ckpt, tuple(sorted(live))


@dataclasses.dataclass
class LayerKind:
    """The map of the first layer of a kind, as templates: what every other layer of the kind should be."""

    runs: dict[str, list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]]
    """Checkpoint template -> (parameter template, checkpoint starts, parameter starts, lengths) per run."""
    unmapped: dict[str, str]
    """Checkpoint template -> why the first layer left it out."""
    probe: torch.Tensor | None = None
    """The derived layers' probe values, all tensors of a layer in one integer range (made once per kind)."""
    second: torch.Tensor | None = None
    """The second load's probe: :attr:`probe` plus its length: other values in other memory, so that a loader
    that skips what it was given before (a cache keyed by storage or content) still loads it."""
    second_digest: str = ""
    """The digest of :attr:`second` when made (a loader must leave it as it is)."""
    offsets: dict[str, int] = dataclasses.field(default_factory=dict)
    """Checkpoint template -> where its probe starts in :attr:`probe`."""
    scratch: dict[tuple[str, bool], torch.Tensor] = dataclasses.field(default_factory=dict)
    """(parameter template, integer?) -> the stand-in the proofs swap in (reused from layer to layer: no
    fresh allocation, no page faults)."""

    @classmethod
    def learned(cls, names: list[str], runs: Mapping[str, list[Runs]], unmapped: Mapping[str, str]) -> LayerKind:
        """The kind of a layer probed in full (its tensors ``names``), from what probing found."""
        return cls(
            runs={
                template(n): [(template(r.param), r.ckpt_start, r.param_start, r.length) for r in runs[n]]
                for n in names
                if n in runs
            },
            unmapped={template(n): unmapped[n] for n in names if n in unmapped},
        )

    def stand_in(self, param: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A stand-in for parameter ``param`` shaped like ``like``: zeroed, of integer ``dtype`` (the probes'),
        or else ``like``'s dtype, as it is (the real values' check fills it with its background)."""
        key = (template(param), dtype is not None)
        buf = self.scratch.get(key)
        if buf is None:
            device = torch.device("cpu") if dtype is not None else like.device
            buf = self.scratch[key] = zeros(like.shape, dtype or like.dtype, device)
            return buf
        return buf.zero_() if dtype is not None else buf

    def derive(self, index: str) -> tuple[dict[str, list[Runs]], dict[str, str]]:
        """Layer ``index``'s map read off the templates."""
        runs = {
            t.replace(_SLOT, index): [Runs(q.replace(_SLOT, index), c, p, n) for q, c, p, n in rs]
            for t, rs in self.runs.items()
        }
        return runs, {t.replace(_SLOT, index): why for t, why in self.unmapped.items()}

    def probes(self, derived: Mapping[str, list[Runs]], spec: Spec, wide: bool) -> None:
        """Make the kind's two probes (once), one integer range for a layer's mapped tensors (``derived``; int64
        where ``wide``)."""
        if self.probe is not None:
            return
        total = 0
        for n in derived:
            self.offsets[template(n)] = total
            total += numel(spec[n][1])
        wide = wide or 2 * total >= 2**31 - 1
        self.probe = arange(total, torch.int64 if wide else torch.int32)
        self.second = self.probe + total
        self.second_digest = tensor_checksum(self.second)


class DerivedLayer:
    """One layer (``group``, its tensors ``names`` in checkpoint order, its parameters those of ``swap``, not yet
    entered) given its ``kind``'s map: :meth:`take` proves it or says why it must be probed in full."""

    def __init__(self, swap: Swap, bg: Background, kind: LayerKind, group: str, names: list[str]) -> None:
        self.swap, self.bg, self.kind, self.group, self.names = swap, bg, kind, group, names
        self.spec = swap.subject.spec
        self.runs: dict[str, list[Runs]] = {}
        """The layer's map, once :meth:`take` proved it."""
        self.unmapped: dict[str, str] = {}

    def take(self, untrusted: Callable[[str], str | None]) -> str | None:
        """Give the layer its kind's map if both proofs pass (then ``None``), else say why it must be probed. The
        probes go in both orders (:meth:`prove`): a stray write that a later tensor of one load covered up lands
        after its victim in the other, and shows (a stray into no tensor's place shows in the counts). The real
        values go in the layer's own checkpoint order (it may differ from its kind's first layer's: a converter
        that writes k before q), where a stray only real values make shows as a checkpoint loads: with the edge
        cases, then finite ones, each load new values in new memory."""
        d_runs, d_unmapped = self.kind.derive(self.group.rsplit(".", 1)[1])
        d_runs = {n: d_runs[n] for n in self.names if n in d_runs}
        why = next((w for w in (untrusted(r.param) for rs in d_runs.values() for r in rs) if w), None)
        why = why or self.prove(d_runs)
        if why is not None:
            return why
        checked = dict(d_runs)
        with self.swap as swap:
            scratch = {q: self.kind.stand_in(q, swap.originals[q]) for q in swap.names}
            check = GroupCheck(swap, self.bg, checked, d_unmapped, scratch)
            for edges in (True, False):
                check.check_real(d_runs, edges)
            check.check_with_unmapped(self.names)
        if len(checked) != len(d_runs):
            return "real values do not land where its kind's first layer says"
        self.runs, self.unmapped = d_runs, d_unmapped
        return None

    def prove(self, derived: Mapping[str, list[Runs]]) -> str | None:
        """Prove the layer's derived map with two loader calls: every mapped tensor of the layer is loaded at
        once as a probe of values unique across the layer (tensor k: ``offset_k + 1 + flat index``), in reverse
        checkpoint order, then each parameter must hold exactly the values the derived runs put there and no
        other non-zero; then loaded again in checkpoint order (:meth:`prove_in_checkpoint_order`). ``None`` if
        both hold, else what differs. The parameters hold zeroed integer stand-ins meanwhile."""
        params = self.swap.params
        self.kind.probes(derived, self.spec, any(params[q].numel() >= 2**31 - 1 for q in self.swap.names))
        probe = self.kind.probe
        assert probe is not None
        offsets = {n: self.kind.offsets[template(n)] for n in derived}
        with self.swap as swap:
            swap.hold({q: self.kind.stand_in(q, swap.originals[q], probe.dtype) for q in swap.names})
            # in reverse checkpoint order: the real values go in checkpoint order (take)
            why = self.load_probes(swap, reversed(list(derived)), offsets, probe, "together")
            why = why or self.runs_hold(derived, offsets, probe) or self.count_written(derived)
            return why or self.prove_in_checkpoint_order(swap, derived, offsets)

    def load_probes(
        self, swap: Swap, names: Iterable[str], offsets: Mapping[str, int], probe: torch.Tensor, how: str
    ) -> str | None:
        """Load the layer's tensors ``names`` (in that order) in one call, each as its stretch of ``probe``;
        ``None`` if the loader took them, else why not (``how``: the load, in the reason)."""
        weights = [(n, probe[offsets[n] : offsets[n] + numel(self.spec[n][1])].view(self.spec[n][1])) for n in names]
        try:
            replaced = swap.load(weights)
        except Exception as exc:  # noqa: BLE001 - probed one by one instead
            return f"the loader refused the layer's probes {how} ({type(exc).__name__}: {exc})"
        return REPLACED if replaced else None

    def runs_hold(
        self, derived: Mapping[str, list[Runs]], offsets: Mapping[str, int], probe: torch.Tensor
    ) -> str | None:
        """``None`` if every derived run holds its stretch of ``probe`` (tensor ``n``'s from ``offsets[n]``), else
        which tensor does not: catches a layer whose loader places a tensor otherwise than its kind's first."""
        for n, rs in derived.items():
            for r in rs:
                flat = self.swap.data(r.param).view(-1)
                for c, p, length in zip(r.ckpt_start.tolist(), r.param_start.tolist(), r.length.tolist(), strict=True):
                    first = offsets[n] + c
                    if not same(flat[p : p + length], probe[first : first + length]):
                        return f"{n} does not land in {r.param} where its kind's first layer says"
        return None

    def count_written(self, derived: Mapping[str, list[Runs]]) -> str | None:
        """``None`` if each parameter holds as many written (non-zero) elements as the derived runs put there:
        catches a stray into no tensor's place (padding), and a loader that zeroed the kind's shared probe when it
        was given it earlier (a staging pool): every compare of :meth:`runs_hold` is then zeros against zeros, and
        only the count shows it, even where the runs tile a parameter."""
        expected: dict[str, int] = {}
        for rs in derived.values():
            for r in rs:
                expected[r.param] = expected.get(r.param, 0) + r.numel
        chunk = tensors.CHUNK
        for q in self.swap.names:
            flat = self.swap.data(q).view(-1)
            written = sum(int(torch.count_nonzero(flat[lo : lo + chunk])) for lo in range(0, flat.numel(), chunk))
            if written != expected.get(q, 0):
                return f"{q} holds {written} written elements, its kind's first layer puts {expected.get(q, 0)}"
        return None

    def prove_in_checkpoint_order(
        self, swap: Swap, derived: Mapping[str, list[Runs]], offsets: Mapping[str, int]
    ) -> str | None:
        """The layer's probes loaded again, in checkpoint order, over the first load: a stray write that a tensor
        loaded later covered up in the reverse order lands after its victim here. The probe is the kind's second
        one (:attr:`LayerKind.second`: other values in other memory, so a loader that skips what it was given
        before, by storage or content, still loads it); every run must hold its values, and the probe must still
        be what it was made (a loader that changed the probe it was given would make both sides of the
        comparison agree; then the layer is probed). Deterministic where the real values' check in checkpoint
        order is not: two tensors' real values hold the same bits at a stray's place about once in 600 builds."""
        probe = self.kind.second
        assert probe is not None
        why = self.load_probes(swap, derived, offsets, probe, "in checkpoint order")
        if why is not None:
            return why
        why = self.runs_hold(derived, offsets, probe)
        if why is not None:
            return f"{why} (checkpoint order)"
        if tensor_checksum(probe) != self.kind.second_digest:  # after the comparisons: they read what it holds now
            return "the loader changed the probe values it was given"
        return None
