"""The real-values checks of a group's map: the integer probes say where each element lands; real values loaded
the same way must land there bit for bit, and nowhere else, or the tensor is left out of the map (and reloaded).

Each check is a method of :class:`GroupCheck` whose docstring names the surprise it catches. Their common ground:
the group's parameters hold stand-ins filled with the build's background (:class:`~.values.Background`), so a
write anywhere shows, and what a reload of the tensors left out would write is compared with what the map
writes."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch

from ...format import tensor_checksum
from ...vocab import DTYPES
from .core import Runs, segments
from .swap import REPLACED, Swap
from .tensors import bits, nonzero_words, same
from .values import Background

__all__ = ["GroupCheck"]


class GroupCheck:
    """The real-values checks of one group while its parameters are swapped (``swap``) for stand-ins
    (``scratch``, by parameter: filled with the background ``bg`` before each load). A tensor a check fails
    leaves ``runs`` for ``unmapped``, with why (a tensor that left keeps its first reason)."""

    def __init__(
        self,
        swap: Swap,
        bg: Background,
        runs: dict[str, list[Runs]],
        unmapped: dict[str, str],
        scratch: Mapping[str, torch.Tensor],
    ) -> None:
        self.swap, self.bg, self.runs, self.unmapped, self.scratch = swap, bg, runs, unmapped, scratch
        self.spec = swap.subject.spec

    def leave_out(self, name: str, why: str) -> None:
        self.unmapped[name] = why
        self.runs.pop(name, None)

    def check_real(self, group_runs: Mapping[str, list[Runs]], edges: bool, strict: Collection[str] = ()) -> None:
        """:meth:`verify` with new values (:meth:`Background.values`; ``edges``: with the edge cases) for those
        of ``group_runs`` still mapped."""
        mapped = {n: rs for n, rs in group_runs.items() if n in self.runs}
        values = {n: self.bg.values(self.spec[n][1], DTYPES[self.spec[n][0]], edges) for n in mapped}
        digests = {n: tensor_checksum(v) for n, v in values.items()}
        self.verify(mapped, values, digests, strict, edges)

    def verify(
        self,
        group_runs: Mapping[str, list[Runs]],
        values: Mapping[str, torch.Tensor],
        digests: Mapping[str, str],
        strict: Collection[str] = (),
        edges: bool = False,
    ) -> None:
        """Load real values (``values``, by checkpoint name; ``edges``: with the edge cases) through the loader
        and check they land where the map says, bit for bit: catches a loader that transforms values (scales,
        offsets, clamps, cleans NaNs, casts) where integer probes land unchanged, or whose float path places them
        otherwise. The values must still be what was drawn (``digests``, taken then): a loader that writes into
        the tensors it is given would make both sides of the comparison agree. Nothing outside the runs may
        differ from the background afterwards (but zeros, outside ``strict`` parameters: :meth:`written_outside`).

        Where the group's load fails, each tensor is loaded alone (:meth:`load_alone`) and those that stray
        leave; the rest are checked together again. A failure that no tensor alone explains (a loader that strays
        only when given several tensors in one call, or a tensor whose values land right alone and not with the
        others: another wrote over them, only in the same call) sends all of them to the reload."""
        self.swap.hold(self.scratch)
        places = group_runs  # every tensor's place, checked or not: a stray there shows
        while group_runs:
            for q in self.swap.names:
                self.bg.fill(q, self.scratch[q])
            try:
                if self.swap.load([(n, values[n]) for n in group_runs]):
                    raise ValueError(REPLACED)
            except Exception as exc:  # noqa: BLE001 - the probes loaded one by one; together they do not: map nothing
                for n in group_runs:
                    self.leave_out(n, f"the loader refused real values together ({type(exc).__name__}: {exc})"[:200])
                return
            failed, bad = self.failed(group_runs, places, values, digests, strict)
            if not bad:
                return
            alone = {n: group_runs[n] for n in group_runs if n in self.runs or n in failed}
            strayed = self.load_alone(alone, places, values, strict, edges)
            left = {n: rs for n, rs in group_runs.items() if n in self.runs}
            # explained: some tensor strays alone, and each one misplaced together is misplaced alone too (one that
            # lands right alone was written over by another, only in the same call)
            if not strayed or any(not strayed.get(n, False) for n in failed):
                for n in left:
                    self.leave_out(
                        n, "its group's real values land wrong together and right alone (a stray in one call)"
                    )
                return
            group_runs = left

    def failed(
        self,
        group_runs: Mapping[str, list[Runs]],
        places: Mapping[str, list[Runs]],
        values: Mapping[str, torch.Tensor],
        digests: Mapping[str, str],
        strict: Collection[str],
    ) -> tuple[list[str], bool]:
        """After one load of a group's real values: leave out the tensors whose values are not in their runs
        (returned; and those whose runs overlap theirs: two tensors in one place, tied or aliased, where the last
        one loaded wins) or were changed by the loader, and say whether that load went wrong (then each is loaded
        alone)."""
        failed: list[str] = []
        for n, rs in group_runs.items():
            param = self.misplaced(rs, values[n])
            if param is not None:
                self.leave_out(
                    n, f"real values do not land where the probes did in {param} (the loader transforms them)"
                )
                failed.append(n)
            elif tensor_checksum(values[n]) != digests[n]:
                self.leave_out(
                    n, "the loader wrote into the real values it was given (a check against them proves nothing)"
                )
        for n in _overlapping(group_runs, failed):
            self.leave_out(n, f"its place is also {failed[0]}'s, which did not hold its values (tied, or an alias)")
        # nothing may land outside the runs (a write into padding, or into no tensor's place, for real values only);
        # and where one tensor's place was wrong, another may have written there: each is then loaded alone
        return failed, bool(failed) or self.written_outside(places, group_runs, strict)

    def misplaced(self, rs: list[Runs], values: torch.Tensor) -> str | None:
        """The first parameter whose runs ``rs`` do not hold ``values`` bit for bit as the map writes them (cast
        to the parameter's dtype, :meth:`PatchMap.plan`), or ``None``: catches a transform of the values, and a
        float path that lands elsewhere than the integer one."""
        src = values.reshape(-1)
        for param, c, p, length in segments(rs):  # slices: no per-element index arrays
            held = self.swap.data(param).view(-1)[p : p + length]
            # compared where the parameter lives: on a GPU, one copy of the (host) values in rather than the held
            # ones out into fresh host pages. Bits of one width on both sides: torch.equal compares tensors of two
            # dtypes by value, so an fp32 parameter's int32 bits would "equal" a bf16 value's int16 bits
            # sign-extended
            if not same(bits(held), bits(src[c : c + length].to(device=held.device, dtype=held.dtype))):
                return param
        return None

    def written_outside(
        self, places: Mapping[str, list[Runs]], own: Iterable[str] | None = None, strict: Collection[str] = ()
    ) -> bool:
        """Whether a load wrote the stand-ins outside the runs of the tensors it loaded (``own``, names in
        ``places``; default all of them; called once those hold their values, :meth:`misplaced`): catches a stray
        into another tensor's place or into padding. Another mapped tensor's place must still hold its
        background, and elsewhere (no mapped tensor's place) only zeros may differ from it: vLLM's embedding
        loader zero-fills the padded vocabulary rows, whatever the values, and a reload writes the same zeros
        again. In the ``strict`` parameters (those an unmapped tensor's load writes, :meth:`unmapped_writes`: its
        zeros there would be a reload's and not the map's) nothing may differ."""
        own = set(places if own is None else own)
        spans: dict[str, list[tuple[int, int]]] = {q: [] for q in self.swap.names}
        for n in own:
            for param, _, p, length in segments(places[n]):
                spans.setdefault(param, []).append((p, length))
        changed: dict[str, int] = {}
        zeros: dict[str, int] = {}
        mine: dict[str, torch.Tensor] = {}  # where the loaded tensors' runs lie, by parameter (when others are given)
        for param, where in spans.items():
            t = self.swap.data(param)
            where.sort()
            if sum(length for _, length in where) == t.numel() and all(
                a + la <= b for (a, la), (b, _) in zip(where, where[1:], strict=False)
            ):
                continue  # the loaded runs tile it: there is no outside (most of a model: nothing to scan)
            changed[param] = sum(self.bg.differing(param, t, p, length) for p, length in where)
            zeros[param] = sum(length - nonzero_words(t.view(-1)[p : p + length]) for p, length in where)
            if len(own) < len(places):
                mine[param] = torch.zeros(t.numel(), dtype=torch.bool, device=t.device)
                for p, length in where:
                    mine[param][p : p + length] = True
        for n in places.keys() - own:  # another tensor's place, outside the loaded ones' own (which may overlap it)
            for param, _, p, length in segments(places[n]):
                if param not in changed:
                    continue  # tiled by the loaded tensors' runs: any place of another lies inside them
                diff = self.bg.changed(param, self.swap.data(param), p, length)
                if param in mine:
                    diff &= ~mine[param][p : p + length]
                if bool(diff.any()):
                    return True
        return any(
            self.bg.differing(q, self.swap.data(q)) - changed[q]
            != (0 if q in strict else self.swap.data(q).numel() - nonzero_words(self.swap.data(q)) - zeros[q])
            for q in changed
        )

    def load_alone(
        self,
        group_runs: Mapping[str, list[Runs]],
        places: Mapping[str, list[Runs]],
        values: Mapping[str, torch.Tensor],
        strict: Collection[str],
        edges: bool,
    ) -> dict[str, bool]:
        """Load each of ``group_runs``' tensors alone on the stand-ins, refilled with their background: finds the
        culprit of a failed group load. Those that do not land exactly in their runs, and nowhere else
        (``places``: every tensor's runs, mapped or not), leave; returns those that strayed, and whether their own
        values missed their own place (else they wrote only outside it). Each loads new values in new memory
        (:meth:`Background.values`): a loader that recycles the tensors it was given (a staging pool that zeroes
        them at its next call) never turns this replay into a check of zeros."""
        strayed: dict[str, bool] = {}
        for n, rs in group_runs.items():
            for q in self.swap.names:
                self.bg.fill(q, self.swap.data(q), again=True)
            fresh = self.bg.values(tuple(values[n].shape), values[n].dtype, edges)  # the group's kind of values
            try:
                ok = not self.swap.load([(n, fresh)])
            except Exception:  # noqa: BLE001 - it loaded with the group: alone it must too
                ok = False
            misplaced = not ok or self.misplaced(rs, fresh) is not None
            if misplaced or self.written_outside(places, [n], strict):
                self.unmapped.setdefault(
                    n, "loaded alone, its real values land outside its own place (another's, padding)"
                )
                self.runs.pop(n, None)
                strayed[n] = misplaced
        return strayed

    def check_with_unmapped(self, names: list[str]) -> None:
        """Where a group holds tensors left out of the map (``names`` are all of its tensors, in checkpoint
        order): the engine writes the map, then reloads those. Leave out the mapped tensors that their loads, or
        the group's loaded with them, make wrong (:meth:`unmapped_writes`), and check the rest again where
        nothing but their own values may change the parameters those loads write (zeros a mapped tensor's load
        writes there are not padding: the reload of an unmapped tensor would undo them); until no more leave,
        since one that leaves is then reloaded too."""
        while True:
            mapped = {n: self.runs[n] for n in names if n in self.runs}
            if not mapped or not any(n in self.unmapped for n in names):
                return
            strict = self.unmapped_writes(names, mapped)
            if strict:
                self.check_real(mapped, False, strict)
            if all(n in self.runs for n in mapped):
                return

    def unmapped_writes(self, names: list[str], places: Mapping[str, list[Runs]]) -> set[str]:
        """Load a group's tensors in checkpoint order (``names``; the unmapped ones the engine reloads) on the
        stand-ins, and return the parameters where a reload's writes would not be the map's (strict).

        The unmapped tensors go alone, new finite values on the background: a mapped tensor whose place
        (``places``) they write leaves the map (a reload of them after the map's writes would overwrite it, where
        a whole reload loads the tensors in checkpoint order). They go again on zeroed stand-ins (a loader that
        writes only into zeros, initialising what no one filled, shows there; so does any write into a mapped
        place). Then every tensor goes together,
        the unmapped ones with the same values on the same background: outside the mapped places the parameters
        must hold what the unmapped load alone left, or a mapped tensor's load writes into an unmapped tensor's
        place when loaded with it (a fix-up made when both halves are at hand), and the rest leave the map. A
        loader that replaces what it is given here, or writes before it raises, makes every parameter strict; a
        tensor it refuses cleanly is left to the reload (which refuses it too)."""
        alone = [n for n in names if n in self.unmapped]
        if not alone:
            return set()
        spec, bg, swapped = self.spec, self.bg, self.swap.names
        values = {n: bg.values(spec[n][1], DTYPES[spec[n][0]]) for n in names if n in self.unmapped or n in self.runs}
        everything = set(swapped)
        for q in swapped:
            bg.fill(q, self.swap.data(q))
        # one at a time: a tensor the loader refuses (raises on: the reload will too) is left out of what follows,
        # unless it wrote something before it raised
        refused: list[str] = []
        replaced = False
        for n in alone:
            written = sum(bg.differing(q, self.swap.data(q)) for q in swapped)
            try:
                replaced |= self.swap.load([(n, values[n])])
            except Exception:  # noqa: BLE001 - see above
                refused.append(n)
                replaced |= sum(bg.differing(q, self.swap.data(q)) for q in swapped) != written
        for n, rs in places.items():
            if n in self.runs and any(
                bool(bg.changed(q, self.swap.data(q), p, length).any()) for q, _, p, length in segments(rs)
            ):
                self.leave_out(n, "an unmapped tensor's load (a reload) writes into its place")
        if replaced:  # what it wrote is not all in the stand-ins
            return everything
        alone = [n for n in alone if n not in refused]
        strict = {q for q in swapped if bg.differing(q, self.swap.data(q))}
        outside = self._outside_masks({n: rs for n, rs in places.items() if n in self.runs})
        alone_left = {q: self.swap.data(q).view(-1)[m].clone() for q, m in outside.items()}
        for q in swapped:
            self.swap.data(q).zero_()
        try:
            if alone and self.swap.load([(n, values[n]) for n in alone]):
                return everything
        except Exception:  # noqa: BLE001 - each loaded alone above
            return everything
        # on zeros, any write into a mapped place shows, where one on the background is missed when the value
        # written happens to be the background's there (two random bf16 values are equal about once in 600)
        self._leave_out_written(places, "an unmapped tensor's load (a reload) writes into its place")
        strict |= {q for q in swapped if nonzero_words(self.swap.data(q))}
        for q in swapped:
            bg.fill(q, self.swap.data(q), again=True)
        try:
            if self.swap.load([(n, values[n]) for n in names if n in self.runs or n in alone]):
                return everything
        except Exception:  # noqa: BLE001 - as above
            return everything
        if any(
            _company_differs(bits(self.swap.data(q).view(-1)[m]), bits(alone_left[q]), q in strict)
            for q, m in outside.items()
        ):
            for n in places:
                if n in self.runs:
                    self.leave_out(n, "loaded with the group's unmapped tensors, the group writes into their places")
        return strict

    def _leave_out_written(self, places: Mapping[str, list[Runs]], why: str) -> None:
        """Leave out the mapped tensors of ``places`` whose place holds anything but zeros (on zeroed stand-ins)."""
        for n, rs in places.items():
            if n in self.runs and any(
                nonzero_words(self.swap.data(q).view(-1)[p : p + length]) for q, _, p, length in segments(rs)
            ):
                self.leave_out(n, why)

    def _outside_masks(self, mapped: Mapping[str, list[Runs]]) -> dict[str, torch.Tensor]:
        """Where each swapped parameter lies outside every mapped run (a mask; none for one they tile)."""
        masks = {
            q: torch.ones(self.swap.data(q).numel(), dtype=torch.bool, device=self.swap.data(q).device)
            for q in self.swap.names
        }
        for rs in mapped.values():
            for q, _, p, length in segments(rs):
                if q in masks:
                    masks[q][p : p + length] = False
        return {q: m for q, m in masks.items() if bool(m.any())}


def _overlapping(group_runs: Mapping[str, list[Runs]], failed: list[str]) -> list[str]:
    """The tensors of ``group_runs`` (other than ``failed``) whose runs share an element with a failed one's."""
    if not failed:
        return []
    spans: dict[str, list[tuple[int, int]]] = {}
    for n in failed:
        for param, _, p, length in segments(group_runs[n]):
            spans.setdefault(param, []).append((p, p + length))
    return [
        n
        for n, rs in group_runs.items()
        if n not in failed
        and any(a < p + length and p < b for param, _, p, length in segments(rs) for a, b in spans.get(param, ()))
    ]


def _company_differs(together: torch.Tensor, alone: torch.Tensor, strict: bool) -> bool:
    """Whether a parameter's elements outside the mapped places differ between the group's load and its unmapped
    tensors' load alone, by more than zeros a mapped tensor's load writes (padding zero-fill,
    :meth:`GroupCheck.written_outside`; none in a ``strict`` parameter)."""
    diff = together != alone
    return bool(diff.any()) and (strict or bool(together[diff].any()))
