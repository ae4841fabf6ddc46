"""Learning a model's patch map by watching its loader: :class:`MapBuild` probes each layer's checkpoint tensors
(integer probes whose values are their own flat indices, into parameters swapped for zeroed integer stand-ins),
checks the map with real values, derives repeating layers from the first of their kind, and ends with the
closing check that the model is left as found."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable
from typing import Any

import torch

from ...vocab import DTYPES
from . import scan
from .as_found import Snapshot, Tree, storage_aliases
from .checks import GroupCheck
from .core import PatchMap, Runs
from .derive import DerivedLayer, LayerKind, group_of, layer_kind
from .experts import ExpertsBuild, FusedExperts
from .scan import high_pass, low_pass, probe_dtype, runs_of, split_probe
from .swap import REPLACED, Load, Spec, Subject, Swap
from .tensors import arange, numel, reuse, zeros
from .values import Background, draw_real_values

__all__ = ["MapBuild", "build_map"]

logger = logging.getLogger("vllm.deltasync.patch_map")

_SHARED = "it shares memory with another parameter (tied, or across layers): a reload writes the last one loaded"


class _Refused(Exception):
    """Why a checkpoint tensor cannot be probed: it is left out of the map (its modules are reloaded instead)."""


def _minor_faults() -> int:
    """This process's minor page faults so far (Linux: pages of fresh memory mapped in as first touched)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def build_map(
    model: torch.nn.Module,
    spec: Spec,
    load: Load,
    untrusted: Callable[[str], str | None] = lambda param: None,
    *,
    split_at: int | None = None,
    experts: list[FusedExperts] | None = None,
) -> PatchMap:
    """Learn the map of ``model`` for the checkpoint ``spec`` by watching ``load`` (the model's
    ``load_weights``) write probe tensors. The live parameters are swapped for zeroed integer tensors one
    layer at a time and restored afterwards, bit for bit; peak extra memory: one layer's parameters in int32
    (int64 for tensors of 2^31 elements or more; int16 where its largest tensor has ``split_at`` elements or more,
    default :data:`~.scan.SPLIT_AT`, then probed in two passes) plus one probe.

    Layers repeat: only the first layer of each kind (:func:`~.derive.layer_kind`: the same checkpoint tensors
    and the same parameters, index aside) is probed tensor by tensor. Every other layer of the kind gets the
    first one's map with its own index, proven by two loader calls of unique probe values for the whole layer
    (each element where the map says, nothing anywhere else) and the real-values checks; a layer whose proof
    fails is probed in full. The build costs about one layer's probing per kind plus a few copies of the model.

    The loader shows where values land, not what the model does with them afterwards: a parameter that
    post-load processing repacks (quantization, a CPU kernel's layout) holds another layout than the one
    written. ``untrusted(param)`` names why a parameter cannot be patched (``None``: it can); tensors landing
    in one are left out of the map.

    Fused MoE experts (``experts``: the layers the engine found, and how their kernel lays them out) are placed by
    :class:`~.experts.ExpertsBuild` (one expert learned per kind, the others derived), never probed tensor by
    tensor: their checkpoint tensors and parameters are left out of the dense build.

    Raises:
        MapCorruption: the build left the model otherwise than it found it (the engine must not serve it).
    """
    return MapBuild(model, spec, load, untrusted, split_at=split_at, experts=experts).run()


class MapBuild:
    """One build of a patch map: the model watched (:class:`~.swap.Subject`), its checkpoint tensors grouped by
    layer, the map so far (``runs``, and ``unmapped`` with why), the kinds of layer learned, and the background the
    real-values checks fill stand-ins with. Each step is a method; :meth:`run` takes them in order."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: Spec,
        load: Load,
        untrusted: Callable[[str], str | None],
        *,
        split_at: int | None = None,
        experts: list[FusedExperts] | None = None,
    ) -> None:
        self.started = time.perf_counter()
        self.split_at = scan.SPLIT_AT if split_at is None else split_at  # read at call time: tests shrink it
        """A group whose largest tensor has this many elements or more is probed in two int16 passes."""
        self.subject = Subject(model, dict(model.named_parameters(remove_duplicate=False)), spec, load)
        self.experts = ExpertsBuild(lambda names: Swap(self.subject, names), spec, self.subject.params, experts or [])
        """The fused experts layers: placed by their own build, left out of the dense one."""
        expert_names = self.experts.names()
        self.groups: dict[str, list[str]] = {}
        """Group (``layers.N``; ``""``: outside the layers) -> its checkpoint tensors, in checkpoint order."""
        for name in spec:
            if name not in expert_names:
                self.groups.setdefault(group_of(name), []).append(name)
        self._expert_params = {q for fe in experts or [] for q in fe.params}
        self.param_groups, self.shared = self._param_groups()
        self._untrusted = untrusted
        self.runs: dict[str, list[Runs]] = {}
        self.unmapped: dict[str, str] = {}
        self.kinds: dict[tuple[Any, ...], LayerKind] = {}
        self.counts = {"probed": 0, "derived": 0}
        self.split: list[str] = []
        self.bg = Background()
        self.timings: dict[str, float] = {}
        """Seconds of each step (``experts_s``, ``outside_s``, ``probed_s``, ``derived_s``, ``check_s``), and the
        pages the build faulted in (``minor_faults``: fresh memory the kernel zeroed for it)."""
        self._faults = _minor_faults()

    def _param_groups(self) -> tuple[dict[str, list[str]], set[str]]:
        """The float parameters each group swaps for stand-ins (a tied parameter under its first name in a
        group), and those that two groups share, or that share memory with another parameter object: two layers'
        tensors in one place, where a reload writes the last one loaded and the map both; neither is mapped."""
        params = self.subject.params
        groups: dict[str, list[str]] = {}
        seen: dict[int, set[str]] = {}  # parameter -> the groups that name it
        shared: set[str] = set()
        for qn, p in params.items():
            if not p.is_floating_point() or p.numel() == 0 or qn in self._expert_params:
                continue
            named_in = seen.setdefault(id(p), set())
            if named_in and group_of(qn) in named_in:
                continue  # a tied parameter is probed once per group, under its first name there
            if named_in:  # shared by layers: each group that names it swaps it for stand-ins
                shared.update(q for q, o in params.items() if o is p)
            named_in.add(group_of(qn))
            groups.setdefault(group_of(qn), []).append(qn)
        return groups, shared | storage_aliases(params)

    def untrusted(self, param: str) -> str | None:
        """Why ``param`` cannot be patched (shared, or the caller's reason), or ``None``."""
        return _SHARED if param in self.shared else self._untrusted(param)

    def run(self) -> PatchMap:
        """Every group, then the closing check (also when a step raised: its error is the cause)."""
        model = self.subject.model
        snapshot = Snapshot(model, self.subject.params)
        try:
            try:
                t0 = time.perf_counter()
                self.experts.run()
                if self.experts.experts:
                    self.timings["experts_s"] = time.perf_counter() - t0
                self.each_group()
            except Exception as exc:
                snapshot.check(exc)
                raise
            t0 = time.perf_counter()
            snapshot.check()
            self.timings["check_s"] = time.perf_counter() - t0
        finally:
            Tree.forget(model)  # it holds the model's modules: also when the check raises
        runs: dict[str, list[Any]] = {**self.runs, **self.experts.runs}
        unmapped = {**self.unmapped, **self.experts.unmapped}
        pm = PatchMap(runs, unmapped, self.subject.params, time.perf_counter() - self.started, model=model)
        pm.layers, pm.split = dict(self.counts), self.split
        if self.experts.experts:
            pm.layers.update({f"experts_{k}": v for k, v in self.experts.counts.items()})
        pm.timings.update({k: round(v, 4) for k, v in self.timings.items()})
        pm.timings["minor_faults"] = _minor_faults() - self._faults
        logger.info("deltasync: patch map built: %s", pm.summary())
        return pm

    def each_group(self) -> None:
        """Each group probed, or derived from the first layer of its kind (then probed if its proof fails); the
        seconds of each (``outside_s``, ``probed_s``, ``derived_s``) added to :attr:`timings`."""
        for group, names in sorted(self.groups.items()):
            t0 = time.perf_counter()
            phase = "outside" if group == "" else "probed"
            try:
                done = self.map_group(group, names)
                phase = done if group else phase
            finally:
                self.timings[f"{phase}_s"] = self.timings.get(f"{phase}_s", 0.0) + time.perf_counter() - t0

    def map_group(self, group: str, names: list[str]) -> str:
        """One group of :meth:`each_group`; whether it was ``derived`` or ``probed``."""
        subject = self.subject
        probed = self.param_groups.get(group, [])
        if group == "" or not probed:  # outside the layers, names can go anywhere outside them
            probed = [q for g, qs in self.param_groups.items() if g == "" or g not in self.groups for q in qs]
        kind = None
        if group and group in self.param_groups:
            kind = layer_kind(subject.model, names, probed, subject.params, subject.spec)
        if kind is not None and kind in self.kinds:
            layer = DerivedLayer(Swap(subject, probed), self.bg, self.kinds[kind], group, names)
            why = layer.take(self.untrusted)
            if why is None:
                self.runs.update(layer.runs)
                self.unmapped.update(layer.unmapped)
                self.counts["derived"] += 1
                return "derived"
            logger.info("deltasync: patch map: %s probed in full (%s)", group, why)
        self.counts["probed"] += 1
        if self.probe_group(names, probed):
            self.split.append(group)
        if kind is not None and kind not in self.kinds:
            self.kinds[kind] = LayerKind.learned(names, self.runs, self.unmapped)
        return "probed"

    def probe_group(self, names: list[str], probed: list[str]) -> bool:
        """Probe a group's checkpoint tensors one at a time, then check the group with real values (a draw with
        the edge cases, then finite ones: :class:`~.checks.GroupCheck`); returns whether the probes went in two
        int16 passes."""
        spec, params = self.subject.spec, self.subject.params
        sizes = [numel(spec[n][1]) for n in names]
        itype, split = probe_dtype(max([params[q].numel() for q in probed] + sizes, default=0), sizes, self.split_at)
        with Swap(self.subject, probed) as swap:
            swap.hold({q: zeros(swap.originals[q].shape, itype, torch.device("cpu")) for q in probed})
            for name in names:
                try:
                    found = self.probe_split(swap, name) if split else self.probe_whole(swap, name, itype)
                except _Refused as exc:
                    self.unmapped[name] = str(exc)
                    for q in probed:
                        swap.data(q).zero_()
                    continue
                why = self.unpatchable(swap, name, found)
                if not found:
                    self.unmapped[name] = "the loader wrote none of its elements into a probed parameter"
                elif why:
                    self.unmapped[name] = why
                else:
                    self.runs[name] = found
            # drawn now, in new tensors, once the last probe is let go: they may reuse the probes' freed memory,
            # never a probe the loader kept (a zero-copy loader takes an integer tensor as the parameter's data)
            values, digests = draw_real_values(names, spec)
            mapped = {n: self.runs[n] for n in names if n in self.runs}
            scratch = {q: reuse(swap.data(q), swap.originals[q]) for q in probed}  # the probes' memory: no page faults
            check = GroupCheck(swap, self.bg, self.runs, self.unmapped, scratch)
            check.verify(mapped, values, digests, (), True)
            del values
            check.check_real(mapped, False)  # finite values, as a checkpoint's
            check.check_with_unmapped(names)
        return split

    def unpatchable(self, swap: Swap, name: str, found: list[Runs]) -> str | None:
        """Why tensor ``name`` cannot be patched where the probe found it, or ``None``: a parameter the caller
        does not trust (repacked after loading) or shared (:meth:`untrusted`), one that is not contiguous (its
        flat indices are not its memory's), or one of another dtype than the checkpoint's (the engine decodes
        against its parameters' bits: they must be the checkpoint's)."""
        why = next((w for w in (self.untrusted(r.param) for r in found) if w), None)
        why = why or next(
            (f"{r.param} is not contiguous in memory" for r in found if not swap.originals[r.param].is_contiguous()),
            None,
        )
        dtype = DTYPES[self.subject.spec[name][0]]
        return why or next(
            (
                f"{r.param} holds {swap.originals[r.param].dtype}, not {dtype}"
                for r in found
                if swap.originals[r.param].dtype != dtype
            ),
            None,
        )

    def load_probe(self, swap: Swap, name: str, probe: torch.Tensor) -> None:
        """Load one probe into the stand-ins.

        Raises:
            _Refused: the loader raised, or replaced a parameter object or a stand-in.
        """
        try:
            if swap.load([(name, probe)]):
                raise ValueError(REPLACED)
        except Exception as exc:  # noqa: BLE001 - this tensor cannot be probed: it is reloaded instead
            raise _Refused(f"{type(exc).__name__}: {exc}"[:200]) from None

    def probe_whole(self, swap: Swap, name: str, itype: torch.dtype) -> list[Runs]:
        """Where one checkpoint tensor lands, from one probe of its 1-based element indices (``itype``, or int64
        for a tensor of 2^31 elements or more). Leaves the stand-ins zeroed.

        Raises:
            _Refused: the loader refuses the probe, or transforms its values.
        """
        shape = self.subject.spec[name][1]
        n = numel(shape)
        probe = arange(n, torch.int64 if n >= 2**31 - 1 else itype)
        self.load_probe(swap, name, probe.view(shape))

        def read(q: str, flat: torch.Tensor) -> Runs | None:
            if not int(torch.count_nonzero(flat)):  # ~4x faster than any() on CPU
                return None
            r = runs_of(q, flat, n, probe)
            flat.zero_()
            return r

        return self.read_stand_ins(swap, read)

    def read_stand_ins(self, swap: Swap, read: Callable[[str, torch.Tensor], Runs | None]) -> list[Runs]:
        """The runs ``read(param, flat stand-in)`` finds in each stand-in (it zeroes what it read).

        Raises:
            _Refused: ``read`` found values that no probe holds, or an element written twice.
        """
        found = []
        try:
            for q in swap.names:
                r = read(q, swap.data(q).view(-1))
                if r is not None:
                    found.append(r)
        except ValueError as exc:
            raise _Refused(str(exc)) from None
        return found

    def probe_split(self, swap: Swap, name: str) -> list[Runs]:
        """:meth:`probe_whole` in two passes of int16 halves (:func:`~.scan.split_probe`) into int16 stand-ins:
        half the memory of int32 probes and stand-ins, which is what a large tensor's map build costs where fresh
        memory is slow to first touch (a VM backs each page then: ~1-3 ns per byte). The low pass is kept per
        chunk as the stretch of the period it matches (or a copy of the chunk where it matches none); the high
        pass must then put every element at the one place both halves name, or the chunk's values are joined
        element by element: a loader whose placement depends on the values it is given (the halves differ)
        leaves no wrong map.

        Raises:
            _Refused: the loader refuses a probe, transforms its values, or writes a place in one pass only.
        """
        shape = self.subject.spec[name][1]
        n = numel(shape)
        low = split_probe(n, high=False)
        self.load_probe(swap, name, low.view(shape))
        lows: dict[str, list[int | torch.Tensor | None]] = {}
        for q in swap.names:
            flat = swap.data(q).view(-1)
            if int(torch.count_nonzero(flat)):
                lows[q] = low_pass(flat, n, low)
                flat.zero_()
        # a new tensor for the second pass: a loader that kept the first never sees it change. (It often gets the
        # freed first one's memory: a loader that caches by storage address replays the low pass, and the scan
        # refuses.)
        del low
        high = split_probe(n, high=True)
        self.load_probe(swap, name, high.view(shape))

        def read(q: str, flat: torch.Tensor) -> Runs | None:
            if q not in lows:
                if int(torch.count_nonzero(flat)):
                    raise ValueError(f"{q}: written by the second half of a probe only (the loader transforms it)")
                return None
            r = high_pass(q, flat, n, high, lows.pop(q))
            flat.zero_()
            return r

        return self.read_stand_ins(swap, read)
