"""The closing check of a map build ("left as found") covers the module tree, not only the weights' values: a
loader that unregisters a parameter or buffer, replaces a submodule, plants an attribute the forward reads before
the registered parameter, turns a weight into a negative view, or moves a weight to other memory, has the tree put
back or makes the build raise :class:`MapCorruption` (never another error, which would leave the engine
serving). The cached module tree (``Tree``) finds what a walk of ``named_parameters`` finds, whatever a loader
did, and no build leaves it cached. The loaders here write through the registry
(``named_parameters``/``_parameters``, as vLLM's ``params_dict = dict(self.named_parameters())``) while the
model's forward reads attributes; each changes the tree at its first integer probe. Toy models, torch only."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest
import torch

from deltasync.vllm.patch_map import MapCorruption, build_map
from deltasync.vllm.patch_map.as_found import Tree, restore_identity

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
    """``layers.i.lin`` (weight, bias) and a buffer ``layers.i.scale``; the loader writes through the registry and
    calls :meth:`change` once, at its first integer probe."""

    def __init__(self, how: str = "", n: int = N) -> None:
        super().__init__()
        self.how = how  # which change a subclass makes
        self.layers = torch.nn.ModuleList([Layer() for _ in range(n)])
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
        """Called once per loaded tensor before it is written: :meth:`change` on the first integer probe."""
        if not w.is_floating_point() and self.ints == 1:
            self.change(name, w)

    def change(self, name: str, w: torch.Tensor) -> None:
        """What the loader does to the tree (nothing here)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if not w.is_floating_point():
                self.ints += 1
            self.quirk(name, w)
            p = self.registered(name)
            if p is None:
                continue
            with torch.no_grad():
                p.data.copy_(w.reshape(p.shape))


def _loaded(model: Net, seed: int = 1) -> Net:
    g = torch.Generator().manual_seed(seed)
    model.load_weights(
        [(n, torch.randn(shape, generator=g).to(torch.bfloat16)) for n, (_, shape) in model.spec().items()]
    )
    model.ints = 0
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


def test_a_plain_loader_builds_maps_every_tensor_and_leaves_the_tree_as_found() -> None:
    model = _loaded(Net())
    before, bits, x = _registry(model), _bits(model), model(_x())
    pm = build_map(model, model.spec(), model.load_weights)
    assert not pm.unmapped and sorted(pm.runs) == sorted(model.spec())
    assert _registry(model) == before
    after = _bits(model)
    assert all(torch.equal(before_bits, after[n]) for n, before_bits in bits.items())
    assert torch.equal(model(_x()), x)


class Unregister(Net):
    def change(self, name: str, w: torch.Tensor) -> None:
        layer = self._modules["layers"]._modules["1"]  # type: ignore[union-attr]
        if self.how == "bias-none":
            layer.lin.bias = None  # _parameters["bias"] = None: named_parameters skips it
        elif self.how == "bias-del":
            del layer.lin._parameters["bias"]
        else:
            layer.scale = None  # _buffers["scale"] = None: named_buffers skips it


@pytest.mark.parametrize("how", ["bias-none", "bias-del", "buffer-none"])
def test_a_parameter_or_buffer_the_loader_unregisters_is_not_missed(how: str) -> None:
    """Another layer's ``lin.bias = None``, ``del lin._parameters["bias"]`` or ``scale = None``: a name that goes
    is a change as much as one that differs (the fingerprints are compared both ways), so the build raises, or
    returns with the model as it was."""
    model = _loaded(Unregister(how))
    before, ref = _registry(model), model(_x())
    try:
        build_map(model, model.spec(), model.load_weights)
    except MapCorruption:
        return  # raising is allowed: the engine goes unhealthy
    missing = sorted(before.keys() - _registry(model).keys())
    assert missing == [], f"the build returned, and the model lost {missing}"
    assert torch.equal(model(_x()), ref)


class Doubled(torch.nn.Linear):
    """A ``Linear`` whose forward doubles its output (any module class the loader likes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class SwapModule(Net):
    def change(self, name: str, w: torch.Tensor) -> None:
        layer = self._modules["layers"]._modules["1"]  # type: ignore[union-attr]
        new = copy.copy(layer.lin)  # shares its _parameters dict: the same Parameter objects under the same names
        new.__class__ = Doubled
        layer.lin = new


def test_a_replaced_submodule_holding_the_same_parameters_is_put_back() -> None:
    """Another layer's ``lin`` replaced by a module of another class holding the *same* Parameter objects (every
    name still yields its original object and data): the module tree is put back as it was, or the build
    raises; the engine never serves the loader's module."""
    model = _loaded(SwapModule())
    lin, ref = model.layers[1].lin, model(_x())
    try:
        build_map(model, model.spec(), model.load_weights)
    except MapCorruption:
        return
    assert model.layers[1].lin is lin, f"the build returned, serving a {type(model.layers[1].lin).__name__}"
    assert torch.equal(model(_x()), ref)


class Shadow(Net):
    def change(self, name: str, w: torch.Tensor) -> None:
        lin = self._modules["layers"]._modules["1"]._modules["lin"]  # type: ignore[union-attr]
        probe = torch.nn.Parameter(torch.arange(1, H * H + 1).reshape(H, H).to(torch.bfloat16), requires_grad=False)
        if self.how == "instance-dict":
            lin.__dict__["weight"] = probe  # found before Module.__getattr__ looks in _parameters
        else:  # a class with a data descriptor for ``weight``: wins over __dict__ and _parameters alike
            lin.__class__ = type("ShadowLinear", (type(lin),), {"weight": property(lambda self: probe)})


@pytest.mark.parametrize("how", ["instance-dict", "class-property"])
def test_the_forward_never_reads_a_parameter_the_registry_does_not_show(how: str) -> None:
    """A parameter holding probe values planted where attribute access finds it before the registry (in
    ``lin.__dict__["weight"]``, or as a property of a class assigned to ``lin.__class__``): the map writes through
    the registry, the forward would read the planted one for good. The fingerprints hold each module's class and
    the instance attributes that hide a registered name: the build raises, or returns with the forward reading
    the registered parameters."""
    model = _loaded(Shadow(how))
    ref = model(_x())
    registered = dict(model.named_parameters())
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


class Unreadable(Net):
    def change(self, name: str, w: torch.Tensor) -> None:
        lin = self._modules["layers"]._modules["1"]._modules["lin"]  # type: ignore[union-attr]
        if self.how == "neg-view":
            # the same memory, shape, strides and dtype: the weight now reads negated; a digest of it raises
            p = lin._parameters["weight"]
            p.data = torch._neg_view(p.data)
        else:
            # a foreign parameter with probe-like values, and a non-module in a _modules table: every walk of the
            # tree raises from here on
            lin._parameters["weight"] = torch.nn.Parameter(torch.full((H, H), 7.0, dtype=torch.bfloat16))
            self._modules["junk"] = object()  # type: ignore[assignment]


@pytest.mark.parametrize("how", ["neg-view", "junk-module"])
def test_a_build_that_changed_the_model_raises_map_corruption_not_another_error(how: str) -> None:
    """The engine stops serving for :class:`MapCorruption` only; any other error from the build means "no map:
    reload instead", and it keeps serving. A weight turned into a negative view (same pointer, shape, strides,
    dtype; a digest of it raises) or a tree that no walk can read (a non-module in a ``_modules`` table) must
    end in the model exactly as found, or in :class:`MapCorruption`."""
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
    if raised is None:  # the tree was put back: then the model must be exactly as found
        assert not changed, "build_map returned with the model changed"
        assert {n: id(p) for n, p in model.named_parameters()} == ids
        assert all(torch.equal(before[n], t) for n, t in _bits(model).items())
        return
    assert not changed or isinstance(raised, MapCorruption), (
        f"build_map raised {type(raised).__name__}: {raised} (the engine keeps serving) while "
        "layers.1.lin.weight is not what it was"
    )


class PathShadow(Net):
    """In the last layer's first probe, re-registers its weight (a foreign parameter) and shadows the path to it
    (``model.__dict__["layers"]``, not a module): ``get_submodule("layers.2.lin")`` raises from then on, while
    every ``_modules`` edge, which ``Tree`` checks, is unchanged."""

    def quirk(self, name: str, w: torch.Tensor) -> None:
        if w.is_floating_point() or "__dict__shadow" in self.__dict__ or not name.startswith("model.layers.2."):
            return
        lin = self._modules["layers"]._modules["2"]._modules["lin"]  # type: ignore[union-attr]
        lin._parameters["weight"] = torch.nn.Parameter(torch.full((H, H), 7.0, dtype=torch.bfloat16))
        self.__dict__["layers"] = "shadow"
        self.__dict__["__dict__shadow"] = True


def test_a_build_whose_final_restore_raises_leaves_no_tree_cached() -> None:
    """The cached tree holds the model's modules: a build whose closing restore raises must not leave it in the
    class-level cache (a reference that keeps a failed engine's model alive, and a stale tree the next build of
    that object would start from)."""
    model = _loaded(PathShadow())
    try:
        with pytest.raises(Exception):  # noqa: PT011, B017 - any: the point is what it leaves behind
            build_map(model, model.spec(), model.load_weights)
        assert id(model) not in Tree._cache, "a raising build left its module tree in Tree._cache"
    finally:
        Tree.forget(model)


class Relocate(Net):
    def change(self, name: str, w: torch.Tensor) -> None:
        layer = self._modules["layers"]._modules["2"]  # type: ignore[union-attr]
        if self.how == "param-data":
            p = layer.lin._parameters["weight"]
            p.data = p.data.clone()  # same values, new memory
        else:
            b = layer._buffers["scale"]
            b.set_(b.clone())  # the same buffer object, same values, new memory


@pytest.mark.parametrize("how", ["param-data", "buffer-set"])
def test_a_weight_moved_to_equal_new_memory_is_never_left_there(how: str) -> None:
    """Another layer's weight (``p.data = p.data.clone()``) or buffer (``b.set_(b.clone())``) moved to new memory
    holding the same values: a captured CUDA graph and any view taken at load time keep reading the old memory,
    and every update the map writes would miss what is served. The fingerprints hold where each weight's data
    lives: the build raises, or returns with every weight in its own memory."""
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


# -- the cached tree ---------------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3, bias=True)
        self.norm = torch.nn.Parameter(torch.ones(3))


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.shared = self.layers[0].lin  # one module under two names
        self.head = torch.nn.Parameter(torch.zeros(2))


def _walk(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> list[str]:
    """A full walk: every name ``named_parameters`` yields now to another object than ``params``'."""
    return sorted(
        qn for qn, p in model.named_parameters(remove_duplicate=False) if qn in params and p is not params[qn]
    )


def _mutations() -> list[tuple[str, object]]:
    def reregister(m: Shared) -> None:
        m.layers[1].lin.weight = torch.nn.Parameter(m.layers[1].lin.weight.data.clone())

    def replace_submodule(m: Shared) -> None:
        m.layers[1].lin = copy.deepcopy(m.layers[1].lin)

    def replace_shared(m: Shared) -> None:
        m.shared = torch.nn.Linear(3, 3)  # layers.0.lin keeps the original: only shared.* differ

    def replace_list_item(m: Shared) -> None:
        m.layers[0] = Block()

    def drop_parameter(m: Shared) -> None:
        m.layers[0].lin.bias = None  # named_parameters skips None: nothing to re-register

    def delete_submodule(m: Shared) -> None:
        del m.layers[1].lin

    def add_submodule(m: Shared) -> None:
        m.layers[1].extra = torch.nn.Linear(1, 1)

    def swap_parameters_dict(m: Shared) -> None:
        m.layers[0]._parameters = {k: torch.nn.Parameter(v.data.clone()) for k, v in m.layers[0]._parameters.items()}

    def nothing(m: Shared) -> None:
        pass

    return [
        (f.__name__, f)
        for f in (
            reregister,
            replace_submodule,
            replace_shared,
            replace_list_item,
            drop_parameter,
            delete_submodule,
            add_submodule,
            swap_parameters_dict,
            nothing,
        )
    ]


@pytest.mark.parametrize(("name", "mutate"), _mutations())
def test_the_cached_tree_finds_what_a_walk_finds_after_any_change_to_the_tree(name: str, mutate) -> None:
    model = Shared()
    params = dict(model.named_parameters(remove_duplicate=False))
    try:
        assert restore_identity(model, params) == []  # caches the tree
        mutate(model)
        expected = _walk(model, params)
        got = restore_identity(model, params)
        assert sorted(got) == expected, name
        assert _walk(model, params) == []  # and put every original back where the walk finds it
        assert restore_identity(model, params) == []
    finally:
        Tree.forget(model)


def test_a_build_leaves_no_tree_behind() -> None:
    """The cache holds the model's modules: a build that ends (or fails) drops its entry."""

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for _, t in weights:
                self.w.data.copy_(t)

    model = Tiny()
    build_map(model, {"w": ("BF16", (64,))}, model.load_weights)
    assert id(model) not in Tree._cache

    class Stop(BaseException):
        """Out of every ``except Exception``: the build ends here, in its first load."""

    calls = []

    def broken(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        calls.append(1)
        if len(calls) > 1:  # after a load that cached the tree
            raise Stop
        model.load_weights(weights)

    with pytest.raises(Stop):
        build_map(model, {"w": ("BF16", (64,))}, broken)
    assert id(model) not in Tree._cache
