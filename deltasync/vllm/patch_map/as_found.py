"""Leaving the model as the build found it: the parameter objects a loader replaced put back after every load,
and the closing check that the whole model (every parameter, buffer and module, and where each weight lives)
is as it was before the first load, or :class:`~deltasync.errors.MapCorruption`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ...errors import MapCorruption
from ...format import tensor_checksum
from . import tensors
from .tensors import bits

__all__ = ["Snapshot", "Tree", "device_digest", "restore_identity", "storage_aliases"]

Edges = list[tuple[torch.nn.Module, dict[str, torch.nn.Module | None]]]


def restore_identity(
    model: torch.nn.Module,
    params: Mapping[str, torch.nn.Parameter],
    swapped: Mapping[str, torch.Tensor] | None = None,
) -> list[str]:
    """Re-register every parameter the loader replaced by another object (the map, and vLLM, hold the
    originals), and put back every stand-in of ``swapped`` (by parameter) whose ``.data`` the loader replaced
    (``param.data = w.t().clone()``: what it wrote is not in the stand-in the map reads); returns the names of
    both."""
    replaced = Tree.of(model, params).replaced()
    for qn in replaced:
        owner, _, leaf = qn.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = params[qn]
    for qn, t in (swapped or {}).items():
        d = params[qn].data
        if (d.data_ptr(), d.shape, d.stride(), d.dtype) != (t.data_ptr(), t.shape, t.stride(), t.dtype):
            params[qn].data = t
            replaced.append(qn)
    return replaced


_GONE = object()


def module_edges(modules: Iterable[torch.nn.Module]) -> Edges:
    """Each of ``modules`` (once) with its children as registered now: what :class:`Tree` trusts while they hold
    (:func:`children_hold`), and what :meth:`Snapshot.check` puts back."""
    return [(m, dict(m._modules)) for m in {id(m): m for m in modules}.values()]


def children_hold(m: torch.nn.Module, children: Mapping[str, torch.nn.Module | None]) -> bool:
    """Whether ``m`` registers exactly ``children`` now: the same names, each to the same object."""
    now = m._modules
    return len(now) == len(children) and all(now.get(k, _GONE) is c for k, c in children.items())


class Tree:
    """The module tree as one walk found it: every edge (parent, child name, child) and, for each parameter name
    of ``params``, the module that registers it and its leaf name. While every edge still holds its child, the
    parameters ``named_parameters(remove_duplicate=False)`` yields under those names are the slots' contents: a
    check after a load costs a dict lookup per module and per parameter, not a walk of ``named_modules``'
    generators (~1.5 ms a load on a 0.6B engine, ~0.2 s of its map build). A loader that replaced, added or
    removed a submodule makes the next check walk the tree again (:meth:`of`). Kept from a build's first load to
    its end (the build forgets it, whatever ends it: it holds the model's modules)."""

    _cache: dict[int, Tree] = {}

    def __init__(self, model: torch.nn.Module, params: Mapping[str, torch.nn.Parameter]) -> None:
        modules = dict(model.named_modules(remove_duplicate=False))
        self.model, self.params = model, params
        self.edges = module_edges(modules.values())
        self.slots = []
        for qn in params:
            owner, _, leaf = qn.rpartition(".")
            if owner in modules:
                self.slots.append((qn, modules[owner], leaf))

    @classmethod
    def of(cls, model: torch.nn.Module, params: Mapping[str, torch.nn.Parameter]) -> Tree:
        """The cached tree of ``model`` if its edges still hold (and it was made for ``params``), else a new
        walk."""
        tree = cls._cache.get(id(model))
        if (
            tree is None
            or tree.model is not model
            or tree.params is not params
            or not all(children_hold(m, children) for m, children in tree.edges)
        ):
            tree = cls._cache[id(model)] = cls(model, params)
        return tree

    @classmethod
    def forget(cls, model: torch.nn.Module) -> None:
        cls._cache.pop(id(model), None)

    def replaced(self) -> list[str]:
        """The names of ``params`` registered now to another (non-``None``) object than theirs."""
        out = []
        for qn, owner, leaf in self.slots:
            p = owner._parameters.get(leaf)
            if p is not None and p is not self.params[qn]:
                out.append(qn)
        return out


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def fingerprints(model: torch.nn.Module) -> dict[str, tuple[Any, ...]]:
    """What building the map must leave exactly as it found it, by name:

    - every parameter and buffer: its object, where its data lives (pointer, storage, offset, strides: a loader
      that moved a weight to new memory with the same values leaves views and captured graphs reading the old
      one), dtype, shape, negative and conjugate bits, and content digest (xxh3 on CPU, :func:`device_digest` on
      an accelerator);
    - every module: its object and class, its instance attributes that hide a registered name (the forward reads
      them, not the registered parameter) or the ``forward``, how many hooks it has, and which of its
      registered names its class defines (a property named ``weight`` is what the forward reads).

    A name that goes is a change as much as one that differs."""
    out: dict[str, tuple[Any, ...]] = {}
    held: list[tuple[str, torch.Tensor]] = [
        ("param:" + n, t) for n, t in model.named_parameters(remove_duplicate=False)
    ]
    held += [("buffer:" + n, t) for n, t in model.named_buffers(remove_duplicate=False)]
    for name, t in held:
        data = t.detach()
        layout = (data.data_ptr(), data.untyped_storage().data_ptr(), data.storage_offset(), data.stride())
        flags = (data.is_neg(), data.is_conj())
        data = data.resolve_neg().resolve_conj()
        if data.device.type == "cpu":
            digest: Any = tensor_checksum(data.contiguous()) if data.numel() else ""
        else:
            digest = device_digest(
                bits(data.reshape(-1)) if data.dtype != torch.bool else data.reshape(-1).to(torch.uint8)
            )
        out[name] = (id(t), layout, flags, data.dtype, tuple(data.shape), digest)
    for name, m in model.named_modules(remove_duplicate=False):
        cls = type(m)
        registered = {*m._parameters, *m._buffers, *m._modules}
        shadowed = sorted(k for k in registered if any(k in c.__dict__ for c in cls.__mro__))
        hooks = tuple(len(getattr(m, h, ())) for h in _HOOKS)
        # instance attributes that hide a registered name, or the forward; not every new one: a loader may cache
        # an attribute on its module at its first call, as DeepseekV2Model.load_weights does
        hiding = frozenset(k for k in m.__dict__ if k in registered or k == "forward")
        out["module:" + name] = (id(m), cls, hiding, hooks, tuple(shadowed))
    return out


_MIX = tuple(k - (1 << 64) for k in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
"""Odd 64-bit multipliers (splitmix64's), as the signed int64 values torch multiplies by (wrapping)."""


def device_digest(words: torch.Tensor) -> tuple[int, int]:
    """A digest of an integer tensor on its own device (an accelerator's parameters are not copied to the host):
    two sums of every word mixed with its position (multiply, xor-shift; wrapping int64). Plain sums of words and
    of words times positions would miss a change of +1, -2, +1 to three neighbours."""
    s1 = s2 = 0
    chunk = tensors.CHUNK
    for lo in range(0, words.numel(), chunk):
        x = words[lo : lo + chunk].to(torch.int64)
        x = x * _MIX[0] + torch.arange(lo + 1, lo + 1 + x.numel(), device=x.device)
        x ^= x >> 31
        x *= _MIX[1]
        x ^= x >> 29
        s1 += int(x.sum())
        x *= _MIX[2]
        x ^= x >> 32
        s2 += int(x.sum())
    return s1, s2


def storage_aliases(params: Mapping[str, torch.nn.Parameter]) -> set[str]:
    """The names of parameters that share memory with another parameter object (``Parameter(other.data)``, or a
    view of it: tying by data rather than by object): each would get its own stand-ins, and the map would place
    two tensors in one place."""
    extents = []
    for qn, p in params.items():
        if p.numel() == 0:
            continue
        size = p.element_size()
        span = sum((n - 1) * abs(st) for n, st in zip(p.shape, p.stride(), strict=True)) + 1
        start = p.data_ptr()
        extents.append((p.untyped_storage().data_ptr(), start, start + span * size, id(p), qn))
    extents.sort()
    names: dict[int, list[str]] = {}
    for *_, i, qn in extents:
        names.setdefault(i, []).append(qn)
    out: set[str] = set()
    reach: tuple[int, int, int] | None = None  # (storage, end, object) of the furthest-reaching extent so far
    for storage, start, end, i, _ in extents:
        if reach is not None and reach[0] == storage and start < reach[1] and reach[2] != i:
            out.update(names[i], names[reach[2]])
        if reach is None or reach[0] != storage or end > reach[1]:
            reach = (storage, end, i)
    return out


class Snapshot:
    """The model before the build's first load (:func:`fingerprints`, and its module tree), for the closing check
    "left as found": what probing cannot see (a write into another layer's parameter, a buffer, an alias of a
    parameter's storage, a submodule replaced, a weight moved to other memory) must not outlive the build."""

    def __init__(self, model: torch.nn.Module, params: Mapping[str, torch.nn.Parameter]) -> None:
        self.model, self.params = model, params
        self.before = fingerprints(model)
        self.edges = module_edges(m for _, m in model.named_modules(remove_duplicate=False))

    def check(self, cause: BaseException | None = None) -> None:
        """Put back the module tree as it was (a submodule the loader replaced, added or removed), and the
        parameter objects and stand-ins it replaced (:func:`restore_identity`), then raise :class:`MapCorruption`
        if building the map (finished, or stopped by ``cause``) left the model otherwise than it found it
        (:func:`fingerprints`, compared both ways: a parameter, buffer or module that went is a change too).
        Whatever raises while restoring or checking is a :class:`MapCorruption` as well: the engine must not
        serve a model its build could not even read."""
        try:
            for m, children in self.edges:
                if not children_hold(m, children):
                    m._modules.clear()
                    m._modules.update(children)
            Tree.forget(self.model)
            restore_identity(self.model, self.params)
            after = fingerprints(self.model)
        except Exception as exc:
            raise MapCorruption(
                f"building the patch map left the model in a state it cannot check ({type(exc).__name__}: {exc}): "
                "the loader changed the module tree; this engine serves wrong weights until an anchor restores it"
            ) from (cause or exc)
        changed = sorted(n for n in self.before.keys() | after.keys() if self.before.get(n) != after.get(n))
        if changed:
            raise MapCorruption(
                f"building the patch map changed live weights it had not swapped ({len(changed)}: {changed[:3]}): "
                "the loader writes where probing cannot see (another layer's parameter, a buffer, an alias of a "
                "parameter's storage); this engine serves wrong weights until an anchor restores it"
            ) from cause
