"""Adversarial review r15 of the patch map build (round 15's fast paths: ``_same``, libc ``memcmp`` for
contiguous host integer tensors, and ``_Tree``, a cached module tree for ``_restore_identity``), and of promise 2
(the model is left as found) around them. White-box, but every attack is only a model's ``load_weights`` as
``build_map`` calls it, and what that loader does to the model's module structure while it runs.

Each test asserts a promise and failed on the code as it was (docstrings: the hole, the promise, a fix); all six
holes are fixed (docs/RELIABILITY.md, round 15): the build's end puts the module tree back, fingerprints modules,
where each weight's data lives and its negative bit, compares names both ways, and turns any error in its final
check into ``MapCorruption``; the tree cache goes whatever raises. A loader
here is vLLM-like: it writes through the registry (``named_parameters``/``_parameters``, as vLLM's
``params_dict = dict(self.named_parameters())``), while the model's forward reads attributes. Each misbehaves only
on integer input (a probe: a reload of a checkpoint never sees one), once. Toy models, torch only."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest
import torch

from deltasync.vllm.patch_map import MapCorruption, _Tree, build_map

H = 4
N = 3
Spec = dict[str, tuple[str, tuple[int, ...]]]


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, H, bias=True, dtype=torch.bfloat16)
        self.lin.requires_grad_(False)
        self.register_buffer("scale", torch.ones(H, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        return x * self.scale if self.scale is not None else x


class Net(torch.nn.Module):
    """``layers.i.lin`` (weight, bias) and a buffer ``layers.i.scale``; the loader writes through the registry."""

    def __init__(self, how: str = "", n: int = N) -> None:
        super().__init__()
        self.how = how  # which way a subclass attacks
        self.layers = torch.nn.ModuleList([Layer() for _ in range(n)])
        self.calls = 0
        self.ints = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def spec(self) -> Spec:
        out: Spec = {}
        for i in range(len(self.layers)):
            out[f"model.layers.{i}.lin.weight"] = ("BF16", (H, H))
            out[f"model.layers.{i}.lin.bias"] = ("BF16", (H,))
        return out

    def registered(self, name: str) -> torch.nn.Parameter | None:
        """The parameter registered for checkpoint ``name`` (through ``_modules``/``_parameters``, as
        ``named_parameters`` finds it)."""
        parts = name.split(".")
        lin = self._modules["layers"]._modules[parts[2]]._modules["lin"]  # type: ignore[union-attr]
        return lin._parameters.get(parts[4])  # type: ignore[union-attr]

    def quirk(self, name: str, w: torch.Tensor) -> None:
        """Called once per loaded tensor before it is written: :meth:`attack` on the first integer probe."""
        if not w.is_floating_point() and self.ints == 1:
            self.attack(name, w)

    def attack(self, name: str, w: torch.Tensor) -> None:
        """The attack, once (nothing here)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.calls += 1
        for name, w in weights:
            if not w.is_floating_point():
                self.ints += 1
            self.quirk(name, w)
            p = self.registered(name)
            if p is None:
                continue
            with torch.no_grad():
                p.data.copy_(w.reshape(p.shape))


def _weights(spec: Spec, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(shape, generator=g).to(torch.bfloat16)) for n, (_, shape) in spec.items()]


def _loaded(model: Net, seed: int = 1) -> Net:
    model.load_weights(_weights(model.spec(), seed))
    model.calls = model.ints = 0
    return model


def _registry(model: torch.nn.Module) -> dict[str, int]:
    """Every registered parameter and buffer, and every module, by name: its object's identity."""
    out = {f"P:{n}": id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({f"B:{n}": id(b) for n, b in model.named_buffers(remove_duplicate=False)})
    out.update({f"M:{n}": id(m) for n, m in model.named_modules(remove_duplicate=False)})
    return out


def _bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        out[n] = t.detach().resolve_neg().reshape(-1).view(torch.int16).clone()
    return out


def _x() -> torch.Tensor:
    return torch.randn(2, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)


# --------------------------------------------------------------------------------------------------------------
# 1. A parameter or buffer the loader unregisters (set to None, deleted) is never missed
# --------------------------------------------------------------------------------------------------------------


class Unregister(Net):
    def attack(self, name: str, w: torch.Tensor) -> None:
        layer = self._modules["layers"]._modules["1"]  # type: ignore[union-attr]
        if self.how == "bias-none":
            layer.lin.bias = None  # _parameters["bias"] = None: named_parameters skips it
        elif self.how == "bias-del":
            del layer.lin._parameters["bias"]
        else:
            layer.scale = None  # _buffers["scale"] = None: named_buffers skips it


@pytest.mark.parametrize("how", ["bias-none", "bias-del", "buffer-none"])
def test_r15_a_parameter_or_buffer_the_loader_unregisters_is_not_missed(how: str) -> None:
    """Hole (deterministic; old and new code alike). On its first probe the loader unregisters a parameter or a
    buffer of another layer (``lin.bias = None``, ``del lin._parameters["bias"]``, ``scale = None``).
    ``_restore_identity`` puts back only parameters registered to *another non-None object* (``_Tree.replaced``
    skips ``None``; the walk it replaced never yielded one), and ``_check_untouched`` compares only the names the
    model has *after* the build (``for n, fp in _fingerprints(model).items(): before.get(n) != fp``): a name that
    disappeared is never looked at. The build returns a map (with runs into the vanished bias) and the engine
    serves layer 1 without its bias (or its scale): promise 2 (every parameter object is the one registered
    before, buffers unchanged). Fix: ``_check_untouched`` compares both key sets (``before.keys() ^ after.keys()``
    is corruption), and ``_restore_identity`` puts back a slot that holds ``None`` or lost its key (a snapshot of
    every ``(owner, leaf) -> param`` taken before the first load)."""
    model = _loaded(Unregister(how))
    before, ref = _registry(model), model(_x())
    try:
        build_map(model, model.spec(), model.load_weights)
    except MapCorruption:
        return  # raising is allowed: the engine goes unhealthy
    missing = sorted(before.keys() - _registry(model).keys())
    assert missing == [], f"the build returned, and the model lost {missing}"
    assert torch.equal(model(_x()), ref)


# --------------------------------------------------------------------------------------------------------------
# 2. A submodule the loader replaces (same parameter objects, another module) is put back, or the build raises
# --------------------------------------------------------------------------------------------------------------


class Doubled(torch.nn.Linear):
    """A ``Linear`` whose forward doubles its output (any module class the loader likes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class SwapModule(Net):
    def attack(self, name: str, w: torch.Tensor) -> None:
        layer = self._modules["layers"]._modules["1"]  # type: ignore[union-attr]
        new = copy.copy(layer.lin)  # shares its _parameters dict: the same Parameter objects under the same names
        new.__class__ = Doubled
        layer.lin = new


def test_r15_a_replaced_submodule_holding_the_same_parameters_is_left_in_place() -> None:
    """Hole (deterministic; old and new code alike). On its first probe the loader replaces another layer's
    ``lin`` by a new module object of another class (a forward that doubles) that holds the *same* Parameter
    objects. Every parameter name still yields its original object with its original data, and no buffer
    changed: ``_restore_identity`` finds nothing to put back and ``_check_untouched`` (parameters and buffers
    only) passes. The build returns; the engine serves the loader's module, whose output is twice the model's:
    promise 2 (a loader that replaces a submodule must be put back or make the build raise). ``_Tree`` makes
    this cheap to fix: take the tree's edges (every module's ``_modules`` children) *before the first load*,
    and after every load (and at the end) put back every edge that changed, or include the modules (name ->
    object identity and type) in ``_fingerprints`` so that ``_check_untouched`` raises."""
    model = _loaded(SwapModule())
    lin, ref = model.layers[1].lin, model(_x())
    try:
        build_map(model, model.spec(), model.load_weights)
    except MapCorruption:
        return
    assert model.layers[1].lin is lin, f"the build returned, serving a {type(model.layers[1].lin).__name__}"
    assert torch.equal(model(_x()), ref)


# --------------------------------------------------------------------------------------------------------------
# 3. What the forward reads (attribute access) is the registered parameter the map knows
# --------------------------------------------------------------------------------------------------------------


class Shadow(Net):
    def attack(self, name: str, w: torch.Tensor) -> None:
        lin = self._modules["layers"]._modules["1"]._modules["lin"]  # type: ignore[union-attr]
        probe = torch.nn.Parameter(torch.arange(1, H * H + 1).reshape(H, H).to(torch.bfloat16), requires_grad=False)
        if self.how == "instance-dict":
            lin.__dict__["weight"] = probe  # found before Module.__getattr__ looks in _parameters
        else:  # a class with a data descriptor for ``weight``: wins over __dict__ and _parameters alike
            lin.__class__ = type("ShadowLinear", (type(lin),), {"weight": property(lambda self: probe)})


@pytest.mark.parametrize("how", ["instance-dict", "class-property"])
def test_r15_the_forward_reads_a_parameter_the_registry_does_not_show(how: str) -> None:
    """Hole (deterministic; old and new code alike). On its first probe the loader plants a parameter holding
    probe values where attribute access finds it before the registry: in ``lin.__dict__["weight"]``, or as a
    property of a subclass it assigns to ``lin.__class__``. ``named_parameters``, ``_Tree`` (``_parameters``)
    and ``_fingerprints`` read the registry: the original object is still there with its bits, so nothing is
    put back and nothing raises. vLLM's loaders write through ``dict(named_parameters())`` and so does the map
    (``_resolve``): every update lands in the registered parameter, while the forward (``self.weight``) reads
    the loader's, with probe values, for good. Promise 2 (never leave the engine serving probe values or a
    parameter object the map does not know). Fix: after every load and at the end, for every slot check
    ``getattr(owner, leaf) is params[qn]`` (and ``type(module)`` unchanged, a ``Tree`` snapshot of the classes
    taken before the first load); put back (pop the ``__dict__`` entry, restore ``__class__``) or raise
    :class:`MapCorruption`."""
    model = _loaded(Shadow(how))
    ref = model(_x())
    registered = {n: p for n, p in model.named_parameters()}
    try:
        build_map(model, model.spec(), model.load_weights)
    except MapCorruption:
        return
    shadowed = sorted(
        n
        for n, p in registered.items()
        if getattr(model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) is not p
    )
    assert shadowed == [], f"the build returned; the forward reads parameters the map does not know: {shadowed}"
    assert torch.equal(model(_x()), ref)


# --------------------------------------------------------------------------------------------------------------
# 4. A build that leaves the model changed raises MapCorruption (the one exception that marks the engine unhealthy)
# --------------------------------------------------------------------------------------------------------------


class Unreadable(Net):
    def attack(self, name: str, w: torch.Tensor) -> None:
        lin = self._modules["layers"]._modules["1"]._modules["lin"]  # type: ignore[union-attr]
        if self.how == "neg-view":
            # the same memory, shape, strides and dtype: the weight now reads negated; a digest of it raises
            p = lin._parameters["weight"]
            p.data = torch._neg_view(p.data)
        else:
            # a foreign parameter with probe-like values, and a non-module in a _modules table: every walk of the
            # tree raises from here on, so nothing is put back and nothing is fingerprinted
            lin._parameters["weight"] = torch.nn.Parameter(torch.full((H, H), 7.0, dtype=torch.bfloat16))
            self._modules["junk"] = object()  # type: ignore[assignment]


@pytest.mark.parametrize("how", ["neg-view", "junk-module"])
def test_r15_a_build_that_changed_the_model_raises_map_corruption_not_another_error(how: str) -> None:
    """Hole (deterministic; old and new code alike). The engine (``deltasync/vllm/base.py``, ``patch_map``) marks
    itself unhealthy only for :class:`MapCorruption`; any other exception from ``build_map`` means "no map: reload
    instead", and the engine keeps serving. But ``build_map``'s own end-of-build checks can raise something else
    while the model is changed: (``neg-view``) the loader sets another layer's ``weight.data`` to
    ``torch._neg_view`` of itself (same pointer, shape, strides, dtype: ``_restore_identity`` sees no change);
    the weight now reads negated, and ``_fingerprints``' ``tensor_checksum`` raises ``RuntimeError`` (``view``
    of a negative-bit tensor) out of ``_check_untouched``; (``junk-module``) the loader re-registers a weight with
    a foreign parameter and puts a non-module into a ``_modules`` table: ``_Tree`` (and the walk before it)
    raises ``AttributeError`` inside ``_restore_identity``, every load is then "refused", and the final
    ``_restore_identity`` raises before ``_check_untouched`` runs. Either way the engine stays healthy and serves
    a negated or foreign weight: promise 2 (put back, or raise, where raising means the engine stops serving).
    Fix: in ``build_map``, run the final restore and check (both paths) under ``try``, and turn any exception
    there into ``MapCorruption(...) from exc``; ``_fingerprints`` should digest ``t.resolve_neg()`` /
    ``resolve_conj()`` and record ``t.is_neg()``, so that a negative-bit view is a change, not a crash."""
    model = _loaded(Unreadable(how))
    before = _bits(model)
    ids = {n: id(p) for n, p in model.named_parameters()}
    raised: BaseException | None = None
    try:
        build_map(model, model.spec(), model.load_weights)
    except Exception as exc:  # noqa: BLE001 - which one is the point
        raised = exc
    lin = model._modules["layers"]._modules["1"]._modules["lin"]  # type: ignore[union-attr]
    w = lin._parameters["weight"]
    changed = (
        id(w) != ids["layers.1.lin.weight"]
        or w.is_neg()
        or not torch.equal(w.detach().resolve_neg().reshape(-1).view(torch.int16), before["layers.1.lin.weight"])
        or "junk" in model._modules
    )
    if raised is None:  # the fix puts the tree back (round 15): then the model must be exactly as found
        assert not changed, "build_map returned with the model changed"
        assert {n: id(p) for n, p in model.named_parameters()} == ids
        assert all(torch.equal(before[n], t) for n, t in _bits(model).items())
        return
    assert not changed or isinstance(raised, MapCorruption), (
        f"build_map raised {type(raised).__name__}: {raised} (the engine keeps serving) while "
        "layers.1.lin.weight is not what it was"
    )


# --------------------------------------------------------------------------------------------------------------
# 5. A build that raises leaves no tree cached
# --------------------------------------------------------------------------------------------------------------


class PathShadow(Net):
    """In the last layer's first probe, re-registers its weight (a foreign parameter) and shadows the path to it
    (``model.__dict__["layers"]``, not a module): ``get_submodule("layers.2.lin")`` raises from then on, while
    every ``_modules`` edge, which ``_Tree`` checks, is unchanged."""

    def quirk(self, name: str, w: torch.Tensor) -> None:
        if w.is_floating_point() or "__dict__shadow" in self.__dict__ or not name.startswith("model.layers.2."):
            return
        lin = self._modules["layers"]._modules["2"]._modules["lin"]  # type: ignore[union-attr]
        lin._parameters["weight"] = torch.nn.Parameter(torch.full((H, H), 7.0, dtype=torch.bfloat16))
        self.__dict__["layers"] = "shadow"
        self.__dict__["__dict__shadow"] = True


def test_r15_a_build_whose_final_restore_raises_leaves_its_tree_cached() -> None:
    """Hole (deterministic; new in round 15). ``build_map`` forgets the tree in a ``finally`` around
    ``_build_groups`` and then calls ``_restore_identity(model, params)`` once more, and ``_Tree.forget`` only
    after it. That last call walks the tree anew and caches it (``cls._cache[id(model)] = cls(model, params)``)
    before it puts back what it found; when putting back raises (here ``model.get_submodule`` meets the loader's
    non-module ``__dict__`` shadow of ``layers``, planted in the last layer, after every ``_layer_kind``), the
    exception leaves ``build_map`` with the model's whole module tree in the class-level ``_Tree._cache``: a
    reference that keeps a failed engine's model alive, and a stale tree the next build of that object starts
    from. The brief's check (a failed or raising build leaves nothing cached) fails. Fix: make the forget a
    ``finally`` around the final restore and check too (one ``try: ... finally: _Tree.forget(model)`` around
    everything after ``before = ...``), or have ``_restore_identity`` take the tree as an argument (a local of
    ``build_map``) instead of a class-level cache."""
    model = _loaded(PathShadow())
    try:
        with pytest.raises(Exception):  # noqa: PT011, B017 - any: the point is what it leaves behind
            build_map(model, model.spec(), model.load_weights)
        assert id(model) not in _Tree._cache, "a raising build left its module tree in _Tree._cache"
    finally:
        _Tree.forget(model)


# --------------------------------------------------------------------------------------------------------------
# 6. Every parameter holds its original data tensor (memory), not an equal copy
# --------------------------------------------------------------------------------------------------------------


class Relocate(Net):
    def attack(self, name: str, w: torch.Tensor) -> None:
        layer = self._modules["layers"]._modules["2"]  # type: ignore[union-attr]
        if self.how == "param-data":
            p = layer.lin._parameters["weight"]
            p.data = p.data.clone()  # same values, new memory
        else:
            b = layer._buffers["scale"]
            b.set_(b.clone())  # the same buffer object, same values, new memory


@pytest.mark.parametrize("how", ["param-data", "buffer-set"])
def test_r15_a_parameter_moved_to_equal_new_memory_is_not_put_back(how: str) -> None:
    """Hole (deterministic; old and new code alike). On its first probe (layer 0's) the loader moves another
    layer's weight to new memory holding the same values (``p.data = p.data.clone()``), or a buffer
    (``b.set_(b.clone())``). ``_restore_identity`` checks ``.data`` only for the parameters swapped in the
    group being probed; when layer 2 is probed later its "original" is taken as the clone, and put back as the
    clone. ``_fingerprints`` records the Parameter/buffer object, dtype, shape and content, not where the data
    lives, so ``_check_untouched`` passes. The build returns with the weight in memory no one had before: a
    captured CUDA graph (vLLM captures its decode graphs before any sync) and any view taken at load time
    (fused kernels, a weight cache) keep reading the old memory, and from then on every update the map writes
    (``param.data``) misses what the graph serves. Promise 2 (every parameter holds its original data tensor).
    Fix: take ``{qn: params[qn].data}`` (and each buffer's ``data_ptr``/storage) before the first load and put it
    back at the end (and after each load, as for the swapped ones); or add ``data_ptr()``, ``stride()`` and the
    storage's ``data_ptr()`` to ``_fingerprints``."""
    model = _loaded(Relocate(how))
    where = {n: t.data_ptr() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    try:
        build_map(model, model.spec(), model.load_weights)
    except MapCorruption:
        return
    moved = sorted(
        n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.data_ptr() != where[n]
    )
    assert moved == [], f"the build returned; these now live in other memory: {moved}"


# a guard that the harness itself is sound: a plain loader builds, maps every tensor, and leaves all as found
def test_r15_baseline_plain_loader() -> None:
    model = _loaded(Net())
    before, bits, x = _registry(model), _bits(model), model(_x())
    pm = build_map(model, model.spec(), model.load_weights)
    assert not pm.unmapped and sorted(pm.runs) == sorted(model.spec())
    assert _registry(model) == before
    after = _bits(model)
    assert all(torch.equal(before_bits, after[n]) for n, before_bits in bits.items())
    assert torch.equal(model(_x()), x)
