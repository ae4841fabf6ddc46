"""Fused MoE experts in the patch map: where each expert's checkpoint elements sit in a layer's fused expert
parameters (``w13``: gate and up rows of every expert, ``w2``: down), as the kernel holds them.

A layer of E experts has 3·E checkpoint tensors (``experts.<e>.{gate,up,down}_proj.weight``, Mixtral's
``w1``/``w3``/``w2``) landing in two 3-D parameters. Probing each of them against the layer's parameters, as the
dense build does, costs E probes of the whole layer: quadratic in the experts. Every expert is placed alike in its
own slot, so the build learns one expert's placement per expert kind and derives the others:

1. **The loader** (:meth:`ExpertsBuild.learn`): the first and the last expert of each kind are loaded through the
   model's own ``load_weights`` into integer stand-ins of the shapes the loader writes (two probes each: the row
   and the column of every element), which say the slot and the place in it of every element (TP slices
   included). Both experts must fill their own slot alike, and nothing else.
2. **The kernel's layout** (:attr:`FusedExperts.repack`): vLLM's CPU build pads the intermediate size and repacks
   each expert's weights into its kernel's tiles after loading (``cpu_prepack_moe_weight``: a pure permutation per
   expert). Its own ``process_weights_after_loading`` is run on one expert holding digit probes (small integers,
   exact in bf16, one base-256 digit of each element's place per pass), which says where each loaded element ends
   up, and that padding holds zeros.
3. **Composed**, one table per expert kind: checkpoint element -> flat place in the packed slot
   (:class:`~.core.Placed`), shared by every expert of the kind (each has its own slot's base) and by every layer
   of the same kind (the same shapes and names, its own index): the map costs one table per kind, whatever the
   experts and layers.

Every layer runs its own kernel's processing of one expert (a few milliseconds), which must give its kind's layout;
the loader's placement of experts 1..E-2, and of the layers after the first of their kind (the same module class,
shapes and names), is derived, not probed. A derivation gone wrong would be wrong alike in the writes and in the
whole-state proof, which reads experts back through the same tables: what proves it is the comparison against a
fresh engine loaded from the same checkpoint (tests/integration/test_moe_engine.py), at every layer and expert.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...vocab import DTYPES
from .core import Placed
from .derive import group_of, template
from .swap import REPLACED, Swap
from .tensors import numel, zeros

__all__ = ["ExpertsBuild", "FusedExperts", "expert_names"]

logger = logging.getLogger("vllm.deltasync.patch_map")

_EXPERT = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<e>\d+)\.(?P<kind>.+)$")

Repack = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""One expert's fused parameters as the loader writes them (``(1, ...)`` each, by leaf name) -> as the kernel
holds them: the layer's own post-load processing run on them."""


@dataclasses.dataclass(frozen=True)
class FusedExperts:
    """A layer's routed experts fused into 3-D parameters, as the engine found them."""

    module: str
    """The module's qualified name (``model.layers.3.mlp.experts.routed_experts``)."""
    params: dict[str, tuple[int, ...]]
    """Each fused parameter's qualified name -> the shape the loader writes it in (before the kernel's repack:
    the live one may be padded)."""
    repack: Repack | None
    """The kernel's post-load layout of one expert (``None``: kept as loaded)."""

    @property
    def group(self) -> str:
        return group_of(self.module)


def expert_names(spec: Mapping[str, Any], group: str) -> dict[str, dict[int, str]]:
    """The routed experts' checkpoint tensors of layer ``group``: ``{kind: {expert: name}}``, where ``kind`` is
    the name's rest after the expert's index (``gate_proj.weight``)."""
    out: dict[str, dict[int, str]] = {}
    for name in spec:
        m = _EXPERT.match(name)
        if m and group_of(name) == group:
            out.setdefault(m["kind"], {})[int(m["e"])] = name
    return out


class _Unmappable(Exception):
    """Why a layer's experts cannot be placed: they are left out of the map."""


@dataclasses.dataclass(frozen=True)
class _Learned:
    """One layer kind's tables: expert kind -> (parameter leaf, place table, held), and each parameter leaf's
    slot size in the live (packed) parameter."""

    kinds: dict[str, tuple[str, torch.Tensor, int]]
    slots: dict[str, int]
    pad: dict[str, tuple[str, torch.Tensor]]
    """Each parameter leaf -> (the expert kind whose runs own its slot's padding, the padding's places)."""
    kernel: dict[str, torch.Tensor]
    """Each parameter leaf's kernel layout of one loaded slot (checked again on every layer of the kind)."""


class ExpertsBuild:
    """The placed runs of every fused experts layer the engine names (:class:`FusedExperts`), learned on the first
    layer of each kind and derived for the rest.

    Args:
        swap: makes a :class:`~.swap.Swap` of some parameters (the build's subject: the loader and the model).
        spec: the checkpoint's tensors.
        params: the model's parameters by name.
        experts: the fused experts layers.
    """

    def __init__(
        self,
        swap: Callable[[list[str]], Swap],
        spec: Mapping[str, tuple[str, tuple[int, ...]]],
        params: Mapping[str, torch.nn.Parameter],
        experts: list[FusedExperts],
    ) -> None:
        self.swap, self.spec, self.params, self.experts = swap, spec, params, experts
        self.runs: dict[str, list[Placed]] = {}
        self.unmapped: dict[str, str] = {}
        self.counts = {"probed": 0, "derived": 0}
        self._kinds: dict[tuple[Any, ...], _Learned] = {}

    def names(self) -> set[str]:
        """Every checkpoint tensor of the experts layers (left out of the dense build)."""
        return {
            n for fe in self.experts for names in expert_names(self.spec, fe.group).values() for n in names.values()
        }

    def run(self) -> None:
        for fe in self.experts:
            names = expert_names(self.spec, fe.group)
            key = self._kind(fe, names)
            try:
                learned = self._kinds.get(key)
                if learned is not None and not self._same_kernel(fe, learned):
                    logger.info("deltasync: patch map: %s's kernel lays its experts out otherwise: learned", fe.module)
                    learned = None
                if learned is None:
                    learned = self.learn(fe, names)
                    self._kinds.setdefault(key, learned)
                    self.counts["probed"] += 1
                else:
                    self.counts["derived"] += 1
                self._place(fe, names, learned)
            except _Unmappable as exc:
                for by_e in names.values():
                    for n in by_e.values():
                        self.unmapped[n] = f"{fe.module}: {exc}"
                logger.info("deltasync: patch map: %s's experts are reloaded (%s)", fe.module, exc)

    def _kind(self, fe: FusedExperts, names: dict[str, dict[int, str]]) -> tuple[Any, ...]:
        ckpt = tuple(
            sorted(
                (kind, tuple(sorted(by_e)), self.spec[by_e[min(by_e)]][0], tuple(self.spec[by_e[min(by_e)]][1]))
                for kind, by_e in names.items()
            )
        )
        live = tuple(
            sorted(
                (template(q), shape, tuple(self.params[q].shape), str(self.params[q].dtype))
                for q, shape in fe.params.items()
            )
        )
        return template(fe.module), ckpt, live, fe.repack is None

    # ------------------------------------------------------------------ learning one layer

    def learn(self, fe: FusedExperts, names: dict[str, dict[int, str]]) -> _Learned:
        """One layer's tables: the loader's placement of its first and last expert of each kind (which must agree,
        each in its own slot), composed with the kernel's layout of one expert."""
        if not names:
            raise _Unmappable("no checkpoint tensor names its experts (experts.<e>.<kind>)")
        slots_loaded = {q: shape[0] for q, shape in fe.params.items()}
        n_slots = set(slots_loaded.values())
        if len(n_slots) != 1:
            raise _Unmappable(f"its fused parameters hold different numbers of experts ({slots_loaded})")
        (slots,) = n_slots
        for kind, by_e in names.items():
            if sorted(by_e) != list(range(slots)):
                raise _Unmappable(
                    f"its checkpoint names experts {sorted(by_e)[:4]}... of {kind}, not 0..{slots - 1} (one per slot: "
                    "expert parallelism is not mapped)"
                )
        loaded = self._loader_places(fe, names, slots)
        packed = self._kernel_places(fe)
        kinds: dict[str, tuple[str, torch.Tensor, int]] = {}
        footprint: dict[str, torch.Tensor] = {}
        for kind, (q, within) in loaded.items():
            perm, slot_numel = packed[q]
            place = torch.full_like(within, -1)
            held = within >= 0
            place[held] = perm[within[held]]
            if bool((place[held] < 0).any()):
                raise _Unmappable(f"{q}: the kernel's layout drops elements the loader wrote ({kind})")
            used = footprint.setdefault(q, torch.zeros(slot_numel, dtype=torch.int8))
            used.index_add_(0, place[held], torch.ones(int(held.sum()), dtype=torch.int8))
            kinds[kind] = (q.rpartition(".")[2], place, int(held.sum()))
        pad: dict[str, tuple[str, torch.Tensor]] = {}
        for q, used in footprint.items():
            if int(used.max()) > 1:
                raise _Unmappable(f"{q}: two checkpoint elements land on one element of an expert's slot")
            owner = min(kind for kind, (leaf, _, _) in kinds.items() if leaf == q.rpartition(".")[2])
            pad[q.rpartition(".")[2]] = (owner, torch.nonzero(used == 0).view(-1))
        return _Learned(
            kinds,
            {q.rpartition(".")[2]: packed[q][1] for q in packed},
            pad,
            {q.rpartition(".")[2]: packed[q][0] for q in packed},
        )

    def _same_kernel(self, fe: FusedExperts, learned: _Learned) -> bool:
        """Whether this layer's kernel lays one expert out as the kind's first layer's did (its own processing run
        on one expert of digit probes)."""
        packed = self._kernel_places(fe)
        return all(torch.equal(packed[q][0], learned.kernel[q.rpartition(".")[2]]) for q in packed)

    def _loader_places(
        self, fe: FusedExperts, names: dict[str, dict[int, str]], slots: int
    ) -> dict[str, tuple[str, torch.Tensor]]:
        """Expert kind -> (the parameter it lands in, for each checkpoint element its flat place within the
        loader's slot, -1 where this rank holds none), from the first and the last expert of each kind, which must
        agree."""
        probes = [(kind, e, by_e[e]) for kind, by_e in names.items() for e in sorted({0, slots - 1})]
        found = self._probe(fe, [name for _, _, name in probes])
        out: dict[str, tuple[str, torch.Tensor]] = {}
        for (kind, e, _), (q, slot, within) in zip(probes, found, strict=True):
            if slot != e:
                raise _Unmappable(f"expert {e}'s {kind} landed in slot {slot} of {q}")
            seen = out.setdefault(kind, (q, within))
            if seen[0] != q or not torch.equal(seen[1], within):
                raise _Unmappable(f"experts 0 and {e} of {kind} are placed differently in their slots")
        return out

    def _probe(self, fe: FusedExperts, names: list[str]) -> list[tuple[str, int, torch.Tensor]]:
        """Load the expert tensors ``names`` together, twice (each element's row, then its column, 1-based and
        offset per tensor so that the values say which tensor wrote them), into zeroed integer stand-ins of the
        loader's shapes: one scan of each stand-in per pass, whatever the experts. Returns per tensor the parameter
        and slot it landed in and, per checkpoint element, its flat place within the slot (-1: not on this rank).
        """
        shapes = []
        for name in names:
            shape = tuple(self.spec[name][1])
            if len(shape) != 2:
                raise _Unmappable(f"{name} is {len(shape)}-D, not a 2-D expert weight")
            shapes.append(shape)
        params = list(fe.params)
        # pass 0 writes rows, pass 1 columns: tensor i's values are (its row or column) + 1 + base[axis][i]
        bases = [[sum(s[axis] for s in shapes[:i]) for i in range(len(shapes))] for axis in (0, 1)]
        top = max(sum(s[axis] for s in shapes) for axis in (0, 1))
        itype = torch.int16 if top < 2**15 - 1 else torch.int32
        reads: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        with self.swap(params) as swap:
            swap.hold({q: zeros(s, itype, torch.device("cpu")) for q, s in fe.params.items()})
            for axis in (0, 1):
                batch = []
                for name, shape, base in zip(names, shapes, bases[axis], strict=True):
                    line = torch.arange(1 + base, shape[axis] + 1 + base, dtype=itype)
                    probe = line.view(-1, 1) if axis == 0 else line.view(1, -1)
                    batch.append((name, probe.expand(shape).contiguous()))
                try:
                    if swap.load(batch):
                        raise ValueError(REPLACED)
                except Exception as exc:  # noqa: BLE001 - the loader refuses the probes: reloaded instead
                    raise _Unmappable(f"{names[0]}...: {type(exc).__name__}: {exc}"[:300]) from None
                got: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
                for q in params:
                    flat = swap.data(q).view(-1)
                    nz = torch.nonzero(flat).view(-1)
                    if nz.numel():
                        value = flat[nz].to(torch.int64) - 1
                        if int(value.min()) < 0 or int(value.max()) >= sum(s[axis] for s in shapes):
                            raise _Unmappable(f"{q}: the loader wrote values no probe holds (it transforms them)")
                        got[q] = (nz, value)
                        flat.zero_()
                reads.append(got)
            del batch
        return [self._placed(fe, reads, i, name, shapes[i], bases) for i, name in enumerate(names)]

    @staticmethod
    def _placed(
        fe: FusedExperts,
        reads: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
        i: int,
        name: str,
        shape: tuple[int, ...],
        bases: list[list[int]],
    ) -> tuple[str, int, torch.Tensor]:
        """Tensor ``i``'s parameter, slot and places from the two passes' reads."""
        rows, cols = shape
        mine: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for axis, got in enumerate(reads):
            lo, hi = bases[axis][i], bases[axis][i] + shape[axis]
            part = {}
            for q, (at, value) in got.items():
                keep = (value >= lo) & (value < hi)
                if bool(keep.any()):
                    part[q] = (at[keep], value[keep] - lo)
            mine.append(part)
        if len(mine[0]) != 1 or set(mine[0]) != set(mine[1]):
            raise _Unmappable(f"{name} landed in {sorted(mine[0])} (one fused parameter expected)")
        (q,) = mine[0]
        (at_r, row), (at_c, col) = mine[0][q], mine[1][q]
        if not torch.equal(at_r, at_c):
            # every probe value is >= 1: both passes write the same places, or the loader does something with them
            raise _Unmappable(f"{name}: the loader wrote other places for its rows than for its columns")
        slot_numel = numel(fe.params[q][1:])
        slot = at_r // slot_numel
        if int(slot.min()) != int(slot.max()):
            raise _Unmappable(f"{name} landed in several experts' slots of {q}")
        ckpt = row * cols + col
        counts = torch.bincount(ckpt, minlength=rows * cols)
        if int(counts.max()) > 1:
            raise _Unmappable(f"{name}: the loader wrote one element in several places")
        within = torch.full((rows * cols,), -1, dtype=torch.int64)
        within[ckpt] = at_r - slot * slot_numel
        return q, int(slot[0]), within

    def _kernel_places(self, fe: FusedExperts) -> dict[str, tuple[torch.Tensor, int]]:
        """Each fused parameter -> (for each flat place in a loaded slot, its flat place in the kernel's slot; the
        kernel's slot size), from the layer's own post-load processing run on one expert of digit probes."""
        out: dict[str, tuple[torch.Tensor, int]] = {}
        if fe.repack is None:
            for q, shape in fe.params.items():
                if tuple(self.params[q].shape) != tuple(shape):
                    raise _Unmappable(f"{q} is {tuple(self.params[q].shape)}, loaded as {tuple(shape)}")
                out[q] = (torch.arange(numel(shape[1:])), numel(shape[1:]))
            return out
        leaves = {q.rpartition(".")[2]: q for q in fe.params}
        sizes = {q: numel(shape[1:]) for q, shape in fe.params.items()}
        passes = 1
        while 256**passes < max(sizes.values()):
            passes += 1
        digits: dict[str, list[torch.Tensor]] = {q: [] for q in fe.params}
        for k in range(passes):
            held = {}
            for leaf, q in leaves.items():
                place = torch.arange(sizes[q], dtype=torch.int64)
                digit = (place // 256**k) % 256 + 1  # 1..256: exact in bf16 and fp16, never 0 (padding is)
                held[leaf] = digit.to(self.params[q].dtype).view(1, *fe.params[q][1:])
            try:
                packed = fe.repack(held)
            except Exception as exc:  # noqa: BLE001 - the kernel's processing refuses one expert: reloaded instead
                raise _Unmappable(
                    f"its post-load processing of one expert raised {type(exc).__name__}: {exc}"
                ) from None
            for leaf, q in leaves.items():
                t = packed[leaf]
                live = self.params[q]
                if t.dtype != live.dtype or tuple(t.shape[1:]) != tuple(live.shape[1:]) or t.shape[0] != 1:
                    raise _Unmappable(
                        f"{q}: one expert processed is {tuple(t.shape)} {t.dtype}, the live slots "
                        f"{tuple(live.shape[1:])} {live.dtype}"
                    )
                digits[q].append(t.reshape(-1).float())
        for q, ds in digits.items():
            stacked = torch.stack(ds)  # (passes, packed slot)
            pad = stacked == 0
            if bool((pad.any(0) & ~pad.all(0)).any()):
                raise _Unmappable(f"{q}: its processing changes values (a place is padding in some passes only)")
            real = ~pad[0]
            if bool(((stacked[:, real] != stacked[:, real].round()) | (stacked[:, real] > 256)).any()):
                raise _Unmappable(f"{q}: its processing changes values (not a permutation of the loaded ones)")
            where = torch.nonzero(real).view(-1)
            source = torch.zeros(where.numel(), dtype=torch.int64)
            for k in range(passes):
                source += (stacked[k, where].to(torch.int64) - 1) * 256**k
            perm = torch.full((sizes[q],), -1, dtype=torch.int64)
            if where.numel() != sizes[q] or int(source.max()) >= sizes[q]:
                raise _Unmappable(f"{q}: its processing keeps {where.numel()} of an expert's {sizes[q]} elements")
            perm[source] = where
            if bool((perm < 0).any()):
                raise _Unmappable(f"{q}: its processing writes one loaded element twice")
            out[q] = (perm, numel(self.params[q].shape[1:]))
        return out

    # ------------------------------------------------------------------ placing every expert

    def _place(self, fe: FusedExperts, names: dict[str, dict[int, str]], learned: _Learned) -> None:
        leaves = {q.rpartition(".")[2]: q for q in fe.params}
        for kind, by_e in names.items():
            if kind not in learned.kinds:
                raise _Unmappable(f"its experts' {kind} is not in the layer kind it was derived from")
            leaf, place, held = learned.kinds[kind]
            q = leaves[leaf]
            live = self.params[q]
            if not live.is_contiguous():
                raise _Unmappable(f"{q} is not contiguous in memory")
            for e, name in by_e.items():
                dtype, shape = self.spec[name]
                if DTYPES[dtype] != live.dtype:
                    raise _Unmappable(f"{q} holds {live.dtype}, not {dtype}")
                if numel(shape) != place.numel():
                    raise _Unmappable(f"{name} is {tuple(shape)}, not the shape its layer kind was learned with")
                owner, padding = learned.pad[leaf]
                pads = padding if kind == owner and padding.numel() else None
                self.runs[name] = [Placed(q, place, e * learned.slots[leaf], held, pads)]
