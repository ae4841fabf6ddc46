"""The map build's two fast paths (issue 22, fifteenth round) agree with the slow checks they replace:
``_same`` (libc ``memcmp``) with ``torch.equal``, and ``_Tree`` (a cached module tree) with a walk of
``named_parameters(remove_duplicate=False)``, whatever a loader did to the tree in between."""

from __future__ import annotations

import copy

import pytest
import torch

from deltasync.vllm import patch_map as pm_mod
from deltasync.vllm.patch_map import _bits, _restore_identity, _same, _Tree


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool])
def test_same_agrees_with_torch_equal_on_every_slice(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, 2 if dtype == torch.bool else 100, (4099,), generator=g).to(dtype)
    b = a.clone()
    # one differing element at each edge and in the middle of the compared slices (a wrong length or a wrong
    # storage offset in the memcmp misses one of them)
    for at in (0, 1, 2048, 4097, 4098):
        c = b.clone()
        c[at] = ~c[at] if dtype == torch.bool else c[at] + 1
        for lo, hi in ((0, 4099), (at, at + 1), (max(at - 5, 0), at), (at, 4099), (1, 4098)):
            assert _same(a[lo:hi], c[lo:hi]) == torch.equal(a[lo:hi], c[lo:hi]), (at, lo, hi)
    assert _same(a, b) and _same(a[3:3], b[5:5])
    assert not _same(a[:10], b[:11])  # shapes differ: never equal, even where the shorter is a prefix
    assert not _same(a.view(-1, 1)[:10], a[:10])  # one shape each, same bytes


def test_same_compares_bits_and_falls_back_where_bytes_and_values_differ() -> None:
    x = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    y = torch.tensor([-0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    assert not _same(x, y)  # floats: torch.equal's values (nan != nan, 0 == -0)
    assert not _same(_bits(x), _bits(y))  # their bits: -0 is not 0
    assert _same(_bits(x), _bits(x.clone()))  # the same NaN bits
    # two dtypes: torch.equal's values, not bytes (an int16 -1 and an int32 -1 are one value)
    assert _same(torch.tensor([-1], dtype=torch.int16), torch.tensor([-1], dtype=torch.int32))
    strided = torch.arange(20, dtype=torch.int32)[::2]
    assert _same(strided, torch.arange(0, 20, 2, dtype=torch.int32))  # not contiguous: torch.equal


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3, bias=True)
        self.norm = torch.nn.Parameter(torch.ones(3))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.shared = self.layers[0].lin  # one module under two names
        self.head = torch.nn.Parameter(torch.zeros(2))


def _walk(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> list[str]:
    """The old check: every name ``named_parameters`` yields now to another object than ``params``'."""
    return sorted(
        qn for qn, p in model.named_parameters(remove_duplicate=False) if qn in params and p is not params[qn]
    )


def _mutations() -> list[tuple[str, object]]:
    def reregister(m: Net) -> None:
        m.layers[1].lin.weight = torch.nn.Parameter(m.layers[1].lin.weight.data.clone())

    def replace_submodule(m: Net) -> None:
        m.layers[1].lin = copy.deepcopy(m.layers[1].lin)

    def replace_shared(m: Net) -> None:
        m.shared = torch.nn.Linear(3, 3)  # layers.0.lin keeps the original: only shared.* differ

    def replace_list_item(m: Net) -> None:
        m.layers[0] = Block()

    def drop_parameter(m: Net) -> None:
        m.layers[0].lin.bias = None  # named_parameters skips None: nothing to re-register

    def delete_submodule(m: Net) -> None:
        del m.layers[1].lin

    def add_submodule(m: Net) -> None:
        m.layers[1].extra = torch.nn.Linear(1, 1)

    def swap_parameters_dict(m: Net) -> None:
        m.layers[0]._parameters = {k: torch.nn.Parameter(v.data.clone()) for k, v in m.layers[0]._parameters.items()}

    def nothing(m: Net) -> None:
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
def test_tree_finds_what_a_walk_finds_after_any_change_to_the_tree(name: str, mutate) -> None:
    model = Net()
    params = dict(model.named_parameters(remove_duplicate=False))
    try:
        assert _restore_identity(model, params) == []  # caches the tree
        mutate(model)
        expected = _walk(model, params)
        got = _restore_identity(model, params)
        assert sorted(got) == expected, name
        assert _walk(model, params) == []  # and put every original back where the walk finds it
        assert _restore_identity(model, params) == []
    finally:
        _Tree.forget(model)


def test_a_build_leaves_no_tree_behind() -> None:
    """The cache holds the model's modules: a build that ends (or fails) drops its entry."""

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data.copy_(t)

    model = Tiny()
    pm_mod.build_map(model, {"w": ("BF16", (64,))}, model.load_weights)
    assert id(model) not in _Tree._cache

    class Stop(BaseException):
        """Out of every ``except Exception``: the build ends here, in its first load."""

    calls = []

    def broken(weights):
        calls.append(1)
        if len(calls) > 1:  # after a load that cached the tree
            raise Stop
        model.load_weights(weights)

    with pytest.raises(Stop):
        pm_mod.build_map(model, {"w": ("BF16", (64,))}, broken)
    assert id(model) not in _Tree._cache
