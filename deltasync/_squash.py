"""The publisher's squashes: one delta from a lagging agent's version to the latest, kept current in the background.

A squash ``S -> V`` is a delta in every byte (kind ``delta``, ``base_version`` S): applied on exactly S it gives V,
proven by the same checksums and sketches as V's own delta, and written at its own keys
(``v{V}/squash-{S}/``) so that it never stands for V's delta. An agent S versions behind fetches it in one round
trip instead of the chain S -> V, when the coordinator's plan finds it the cheapest route.

What the publisher keeps, per rank and per tracked base S: the union of the elements its own shard changed since S
(flat local indices, int64) and their values at S (their bit patterns). A squash's values at V are read from the
publisher's snapshot of V when it is written, so nothing else is kept. Bases are the versions live agents hold
(the coordinator's fleet view), plus the two newest versions (agents that applied them may not have said so yet);
at most ``squash_bases`` of them, each at most ``squash_window`` versions old and holding at most
``squash_max_fraction`` of this rank's elements. Memory is therefore bounded by
``(squash_bases + 2) x squash_max_fraction x elements x (8 + dtype bytes)``, and the work per version by the
tracked unions' sizes (one sorted merge each).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from .diff import bits_of
from .format import TensorDelta

__all__ = ["SquashTracker"]

logger = logging.getLogger(__name__)

_GRACE_VERSIONS = 2
"""The newest versions tracked as bases whoever holds them: an agent applies a version, then says so."""


@dataclass
class _Base:
    """The union of changed elements since one base version, and their values there (bit patterns)."""

    version: int
    tensors: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    elements: int = 0

    def add(self, name: str, idx: np.ndarray, old: np.ndarray) -> None:
        """Merge one delta's changed elements (sorted local indices, their values before it): an element seen
        before keeps its value at the base; a new one takes the value before this delta, which is the base's."""
        held = self.tensors.get(name)
        if held is None:  # by reference: a delta's arrays are never written after the diff made them
            self.tensors[name] = (idx, old)
            self.elements += idx.size
            return
        have, base = held
        pos = np.searchsorted(have, idx)
        inside = pos < have.size
        fresh = np.ones(idx.size, dtype=bool)
        fresh[inside] = have[pos[inside]] != idx[inside]
        self.tensors[name] = (np.insert(have, pos[fresh], idx[fresh]), np.insert(base, pos[fresh], old[fresh]))
        self.elements += int(fresh.sum())


class SquashTracker:
    """The bases a publisher rank tracks, and the squashes it can write from them.

    Args:
        window: the oldest base kept is this many versions below the newest.
        max_bases: bases held by agents tracked at once (the two newest versions come on top).
        max_fraction: a base whose union passes this fraction of the rank's elements is dropped (its squash
            would cost about an anchor's bytes: the anchor route serves it).
        elements: the rank's elements (all local tensors).

    Not thread safe: the publisher's worker drives it.
    """

    def __init__(self, *, window: int, max_bases: int, max_fraction: float, elements: int) -> None:
        self.window, self.max_bases, self.max_fraction = window, max_bases, max_fraction
        self.elements = max(elements, 1)
        self.bases: dict[int, _Base] = {}

    @property
    def kept_elements(self) -> int:
        """Elements kept over every tracked base (each costs its index and its base value)."""
        return sum(b.elements for b in self.bases.values())

    def observe(self, base_version: int, changes: Mapping[str, TensorDelta]) -> None:
        """The delta ``base_version -> next`` (local indices, with ``base_values``, as ``compute_delta`` gives
        it): start tracking ``base_version`` (an empty union: it is the state before this delta) and merge the
        delta into every tracked base."""
        self.bases.setdefault(base_version, _Base(base_version))
        for name, d in changes.items():
            assert d.base_values is not None, f"{name}: compute_delta gives base values"
            new, old = bits_of(d.values), bits_of(d.base_values)
            if d.indices is None:  # dense: every element in the entry, changed or not
                idx = np.flatnonzero(new != old)
                old = old[idx]
            else:
                idx = d.indices.numpy()
            for base in self.bases.values():
                base.add(name, idx, old)

    def keep(self, newest: int, held: Mapping[int, int]) -> list[int]:
        """Drop the bases no agent needs (keeping the two newest), those older than the window or too large, and
        the least held past ``max_bases``. Returns the bases to write a squash to ``newest`` from: those agents
        hold, at least two versions below it (one below, the squash is the version's own delta)."""
        for v, base in list(self.bases.items()):
            grace = v > newest - _GRACE_VERSIONS
            if (
                (not grace and v not in held)
                or newest - v > self.window
                or base.elements > self.max_fraction * self.elements
            ):
                del self.bases[v]
        wanted = sorted((v for v in self.bases if v in held), key=lambda v: (-held[v], -v))
        for v in wanted[self.max_bases :]:
            if v <= newest - _GRACE_VERSIONS:
                del self.bases[v]
        return sorted(v for v in wanted[: self.max_bases] if v <= newest - 2)

    def deltas(self, base_version: int, current: Mapping[str, torch.Tensor]) -> list[TensorDelta]:
        """The squash ``base_version -> current`` in local coordinates: every element of the union whose value
        differs from the base's (one changed and changed back is left out: it holds the base's value)."""
        out = []
        for name, (idx, base_bits) in sorted(self.bases[base_version].tensors.items()):
            t = current[name]
            now = bits_of(t)[idx]
            changed = now != base_bits
            if not changed.any():
                continue
            out.append(
                TensorDelta(
                    ckpt_name=name,
                    shape=tuple(t.shape),
                    dtype=t.dtype,
                    indices=torch.from_numpy(idx[changed]),
                    values=torch.from_numpy(now[changed]).view(t.dtype),
                    base_values=torch.from_numpy(base_bits[changed]).view(t.dtype),
                )
            )
        return out


def fleet_bases(versions: list[int | None]) -> Counter[int]:
    """How many live agents hold each version (``None``: an agent that holds nothing known)."""
    return Counter(v for v in versions if v is not None)
