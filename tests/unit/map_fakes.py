"""Fake models and loaders for the patch map's tests, and the harness they share: torch modules whose
``load_weights`` fuses, pads, slices and transforms as vLLM's loaders do (torch only, no vLLM), and
:func:`map_and_rewrite`, which maps a model, writes an update through the map (reloading what the map leaves out,
as the engine does) and compares with a copy that loaded the update itself."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from deltasync.format import TensorDelta
from deltasync.vllm.patch_map import PatchMap, build_map
from deltasync.vocab import DTYPES

Spec = dict[str, tuple[str, tuple[int, ...]]]
Weights = Iterable[tuple[str, torch.Tensor]]

H = 8
"""Rows (and columns) of a :class:`QKVStack` tensor: 64 elements."""


def param(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A flat copy of ``t``'s bit patterns (a bool tensor as uint8)."""
    t = t.detach().reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.uint8).clone()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).clone()


def state(model: torch.nn.Module) -> dict[str, tuple[Any, ...]]:
    """Every parameter and buffer by name: its object, dtype and bits."""
    out = {f"P:{n}": (id(p), p.dtype, bits(p)) for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({f"B:{n}": (id(b), b.dtype, bits(b)) for n, b in model.named_buffers(remove_duplicate=False)})
    return out


def differing(a: dict[str, tuple[Any, ...]], b: dict[str, tuple[Any, ...]], identity: bool = True) -> list[str]:
    """The names where two :func:`state` s differ (in object too, with ``identity``), or that one lacks."""
    bad = list(a.keys() ^ b.keys())
    for k in a.keys() & b.keys():
        (ia, da, xa), (ib, db, xb) = a[k], b[k]
        if (identity and ia != ib) or da != db or not torch.equal(xa, xb):
            bad.append(k)
    return sorted(bad)


def weights(spec: Spec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(DTYPES[dt]) for n, (dt, shape) in spec.items()}


def dense(name: str, t: torch.Tensor) -> TensorDelta:
    return TensorDelta(ckpt_name=name, shape=tuple(t.shape), dtype=t.dtype, indices=None, values=t)


def sparse(name: str, shape: tuple[int, ...], idx: list[int], values: torch.Tensor) -> TensorDelta:
    return TensorDelta(
        ckpt_name=name, shape=shape, dtype=values.dtype, indices=torch.tensor(idx, dtype=torch.int64), values=values
    )


def leaf(name: str) -> tuple[int, str]:
    """``model.layers.3.k.weight`` -> ``(3, "k")``."""
    parts = name.split(".")
    return int(parts[2]), parts[3]


def map_and_rewrite(
    model: Any, spec: Spec, new: dict[str, torch.Tensor] | None = None, base: dict[str, torch.Tensor] | None = None
) -> tuple[PatchMap, list[str]]:
    """Map ``model`` at one version (``base``), write another (``new``) through the map (reloading what it leaves
    out, as the engine does), and compare with a copy of the model that loaded the new version whole: the map,
    and what differs. The build itself must leave every weight as it found it."""
    base = base if base is not None else weights(spec, 1)
    new = new if new is not None else weights(spec, 2)
    model.load_weights([(n, t.clone()) for n, t in base.items()])  # a loader may write into what it is given
    ref = copy.deepcopy(model)
    ref.load_weights([(n, t.clone()) for n, t in new.items()])
    before = state(model)
    pm = build_map(model, spec, model.load_weights)
    assert differing(before, state(model)) == [], "the build changed weights"
    pm.write(pm.plan([dense(n, new[n].clone()) for n in spec if n in pm]))
    if pm.unmapped:
        model.load_weights([(n, new[n].clone()) for n in spec if n in pm.unmapped])
    return pm, differing(state(ref), state(model), identity=False)


def assert_exact(model: Any, spec: Spec | None = None, new: dict[str, torch.Tensor] | None = None) -> PatchMap:
    """:func:`map_and_rewrite` (of ``model.spec()`` by default): what is served equals a whole reload."""
    pm, differ = map_and_rewrite(model, spec if spec is not None else model.spec(), new)
    assert differ == [], f"layers {pm.layers}, unmapped {sorted(pm.unmapped)}: the map differs in {differ}"
    return pm


Hook = Callable[["QKVStack", int, str, torch.Tensor, list[tuple[str, torch.Tensor]]], None]


class QKVStack(torch.nn.Module):
    """``layers.i.qkv`` holds q, k, v rows (``pad`` more rows no tensor owns), loaded as vLLM loads a fused qkv.
    Surprises come as hooks: ``put(rows, w)`` writes a tensor into its rows (a copy by default); ``after(stack, i,
    leaf, w, items)`` runs after each tensor of a call (``items``: the whole call) is written. ``quirk``: in that
    layer, loading ``k`` also writes ``k[at]`` into q's element ``at`` (a stray into a place another tensor owns,
    which q, loaded before k in checkpoint order, does not cover); ``float_only``: for float tensors only (a
    loader branching on ``is_floating_point``). ``recycle_ints``: each call first zeroes the integer tensors of
    its previous call (a staging pool for index tables)."""

    def __init__(
        self,
        n: int = 3,
        quirk: int | None = None,
        float_only: bool = False,
        recycle_ints: bool = False,
        pad: int = 0,
        at: tuple[int, int] = (H - 1, H - 1),
    ) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.qkv = param(3 * H + pad, H)
        self.quirk, self.float_only, self.recycle_ints, self.at = quirk, float_only, recycle_ints, at
        self.spent: list[torch.Tensor] = []
        self.hooks: dict[str, Any] = {}

    def spec(self) -> Spec:
        return {f"model.layers.{i}.{w}.weight": ("BF16", (H, H)) for i in range(len(self.layers)) for w in "qkv"}

    def with_hooks(self, **hooks: Any) -> QKVStack:
        self.hooks.update(hooks)
        return self

    def qkv(self, i: int) -> torch.Tensor:
        return self.layers[i].qkv.data

    def load_weights(self, weights: Weights) -> None:
        items = list(weights)
        if self.recycle_ints:
            for t in self.spent:
                t.zero_()
            self.spent = [t for _, t in items if not t.is_floating_point()]
        for name, w in items:
            i, part = leaf(name)
            row = {"q": 0, "k": H, "v": 2 * H}[part]
            self.hooks.get("put", _copy)(self.qkv(i)[row : row + H], w)
            if i == self.quirk and part == "k" and (w.is_floating_point() or not self.float_only):
                self.qkv(i)[self.at] = w[self.at]
            if "after" in self.hooks:
                self.hooks["after"](self, i, part, w, items)


def _copy(rows: torch.Tensor, w: torch.Tensor) -> None:
    rows.copy_(w)


class TwoModules(torch.nn.Module):
    """Per layer an ``attn`` module holding ``a`` and an ``mlp`` module holding ``b`` (the engine reloads an unmapped
    tensor's module alone), checkpoint tensors ``model.layers.i.a.weight`` then ``...b.weight``. ``load(layer, i,
    part, w, a_done)`` (a hook; ``a_done``: ``a`` was loaded earlier in the same call) loads one tensor; the
    default copies ``a`` and ``b`` into their parameters."""

    def __init__(self, n: int = 3, a_dtype: torch.dtype = torch.bfloat16, b_rows: int = H, load: Any = None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            layer.attn.a, layer.mlp.b = param(H, H, dtype=a_dtype), param(b_rows, H)
        self.load = load

    def spec(self) -> Spec:
        return {f"model.layers.{i}.{x}.weight": ("BF16", (H, H)) for i in range(len(self.layers)) for x in "ab"}

    def load_weights(self, weights: Weights) -> None:
        done: set[tuple[int, str]] = set()
        for name, w in weights:
            i, part = leaf(name)
            layer = self.layers[i]
            if self.load is not None:
                self.load(layer, i, part, w, (i, "a") in done)
            elif part == "a":
                layer.attn.a.data.copy_(w)
            else:
                layer.mlp.b.data.copy_(w)
            done.add((i, part))


class Plain(torch.nn.Module):
    """Parameters named and shaped as given (bf16), each checkpoint tensor copied into the one of its name."""

    def __init__(self, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            setattr(self, name, param(*shape))

    def load_weights(self, weights: Weights) -> None:
        for name, t in weights:
            getattr(self, name).data.copy_(t)


def b_fixes_up_a(layer: torch.nn.Module, i: int, part: str, w: torch.Tensor, a_done: bool) -> None:
    """A :class:`TwoModules` loader: loading ``b`` after ``a`` in the same call writes ``b[0, 0]`` into a's place (a
    fix-up applied when both halves are at hand)."""
    if part == "a":
        layer.attn.a.data.copy_(w)
        return
    layer.mlp.b.data.copy_(w)
    if a_done:
        layer.attn.a.data[0, 0] = w[0, 0]


class FusedPaddedTied(torch.nn.Module):
    """Loaded as vLLM loads: q, k, v rows fused into one parameter; a vocabulary padded to 8 rows (zero-filled by
    the loader); a tied head; a TP-like slice (this 'rank' holds the second half of the columns of ``down``); a
    norm the loader scales (arithmetic on the values: left out); a tensor the loader refuses."""

    SPEC: Spec = {
        "q": ("BF16", (2, 4)),
        "k": ("BF16", (2, 4)),
        "v": ("BF16", (2, 4)),
        "embed": ("BF16", (5, 4)),
        "down": ("BF16", (4, 6)),
        "norm": ("BF16", (4,)),
        "quantized": ("BF16", (3,)),
    }

    def __init__(self) -> None:
        super().__init__()
        self.qkv = param(6, 4)
        self.embed = param(8, 4)
        self.head = self.embed  # tied
        self.down = param(4, 3)
        self.norm = param(4)

    def load_weights(self, weights: Weights) -> None:
        for name, w in weights:
            if name in ("q", "k", "v"):
                row = {"q": 0, "k": 2, "v": 4}[name]
                self.qkv.data[row : row + 2].copy_(w)
            elif name == "embed":
                self.embed.data[: w.shape[0]].copy_(w)
                self.embed.data[w.shape[0] :].fill_(0)  # vocabulary padding, as VocabParallelEmbedding does
            elif name == "down":
                self.down.data.copy_(w[:, 3:])  # this rank's half of the input dimension
            elif name == "norm":
                self.norm.data.copy_(w * 2)  # arithmetic on the values: the real-value check catches it
            elif name == "quantized":
                raise TypeError("expected a float tensor")

    @classmethod
    def truth(cls, seed: int = 1) -> dict[str, torch.Tensor]:
        """Checkpoint values for every tensor of :attr:`SPEC`."""
        return weights(cls.SPEC, seed)


# -- a vLLM-like Llama (fused q/k/v and gate/up, a padded vocabulary) and where a loader puts real values --------

BF16 = torch.bfloat16
LH, V, VPAD, Q, K, INTER = 6, 37, 40, 8, 4, 10

LLAMA_PARAMS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed_tokens.weight": ((VPAD, LH), BF16),
    "model.layers.0.self_attn.qkv_proj.weight": ((Q + 2 * K, LH), BF16),
    "model.layers.0.mlp.gate_up_proj.weight": ((2 * INTER, LH), BF16),
    "model.layers.0.mlp.down_proj.weight": ((LH, INTER), BF16),
    "model.layers.1.self_attn.qkv_proj.weight": ((Q + 2 * K, LH), BF16),
    "model.layers.1.mlp.gate_up_proj.weight": ((2 * INTER, LH), BF16),
    "model.layers.1.mlp.down_proj.weight": ((LH, INTER), BF16),
    "model.norm.weight": ((LH,), BF16),
    "lm_head.weight": ((VPAD, LH), BF16),
}


def llama_spec() -> Spec:
    spec: Spec = {"model.embed_tokens.weight": ("BF16", (V, LH))}
    for i in range(2):
        spec[f"model.layers.{i}.self_attn.q_proj.weight"] = ("BF16", (Q, LH))
        spec[f"model.layers.{i}.self_attn.k_proj.weight"] = ("BF16", (K, LH))
        spec[f"model.layers.{i}.self_attn.v_proj.weight"] = ("BF16", (K, LH))
        spec[f"model.layers.{i}.mlp.gate_proj.weight"] = ("BF16", (INTER, LH))
        spec[f"model.layers.{i}.mlp.up_proj.weight"] = ("BF16", (INTER, LH))
        spec[f"model.layers.{i}.mlp.down_proj.weight"] = ("BF16", (LH, INTER))
    spec["model.norm.weight"] = ("BF16", (LH,))
    spec["lm_head.weight"] = ("BF16", (V, LH))
    return spec


def make_model(params: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int = 0) -> torch.nn.Module:
    """A module tree holding ``params`` (qualified name -> shape, dtype), filled with random values."""
    gen = torch.Generator().manual_seed(seed)
    root = torch.nn.Module()
    for qn, (shape, dt) in params.items():
        mod = root
        *path, name = qn.split(".")
        for a in path:
            if a not in mod._modules:
                mod.add_module(a, torch.nn.Module())
            mod = mod._modules[a]  # type: ignore[assignment]
        mod.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=gen).to(dt), requires_grad=False))
    return root


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", Q), "v_proj": ("qkv_proj", Q + K)}
_FUSED |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", INTER)}


class Llama:
    """vLLM-like loader of a :func:`make_model` of :data:`LLAMA_PARAMS`: stacked parameters (q/k/v, gate/up) by
    row offset, vocabulary padding, plain copies. ``put`` writes one tensor (``call``: how many times this name was
    loaded, this one included); a subclass changes it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.m = model
        self.calls: dict[str, int] = {}

    def route(self, name: str) -> tuple[str, int]:
        for short, (fused, off) in _FUSED.items():
            if f".{short}." in name:
                return name.replace(short, fused), off
        return name, 0

    def __call__(self, weights: Weights) -> None:
        for name, w in weights:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.put(name, w, self.calls[name])

    def put(self, name: str, w: torch.Tensor, call: int) -> None:
        q, off = self.route(name)
        p = self.m.get_parameter(q)
        p.data[off : off + w.shape[0]].copy_(w)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: bits(p.data) for n, p in model.named_parameters(remove_duplicate=False)}


def assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for n in before:
        assert before[n].dtype == after[n].dtype and torch.equal(before[n], after[n]), f"live {n} changed"


def float_truth(
    model_factory: Callable[[], torch.nn.Module], loader_factory: Callable[[torch.nn.Module], Any], spec: Spec
) -> dict[str, dict[str, torch.Tensor]]:
    """Where the loader puts each element of real (float) values: loaded as float64 index values into a float64
    twin (exact to 2^53), one tensor at a time."""
    twin = model_factory()
    for p in twin.parameters():
        p.data = torch.zeros(p.shape, dtype=torch.float64)
    load = loader_factory(twin)
    out = {}
    for name, (_, shape) in spec.items():
        for p in twin.parameters():
            p.data.zero_()
        load([(name, torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).view(shape))])
        out[name] = {
            q: p.data.reshape(-1).to(torch.int64).clone()
            for q, p in twin.named_parameters()
            if int(torch.count_nonzero(p.data))
        }
    return out


def expand(pm: PatchMap, name: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The map of ``name`` as {param: int64 tensor of the param's size, 1-based checkpoint index or 0}."""
    out: dict[str, torch.Tensor] = {}
    for r in pm.runs[name]:
        t = out.setdefault(r.param, torch.zeros(model.get_parameter(r.param).numel(), dtype=torch.int64))
        for c, p, n in zip(r.ckpt_start.tolist(), r.param_start.tolist(), r.length.tolist(), strict=True):
            assert not bool(t[p : p + n].any()), f"{name}: the map writes {r.param}[{p}] twice"
            t[p : p + n] = torch.arange(c + 1, c + n + 1)
    return out


def assert_promise(
    pm: PatchMap, model: torch.nn.Module, truth: dict[str, dict[str, torch.Tensor]], names: Iterable[str]
) -> None:
    """Every tensor of ``names`` is left out of the map, or mapped exactly where the loader puts its real
    values (``truth``: :func:`float_truth`)."""
    for name in names:
        if name in pm.unmapped:
            assert name not in pm.runs
            continue
        assert name in pm.runs, f"{name}: neither mapped nor unmapped"
        got = expand(pm, name, model)
        want = truth[name]
        assert got.keys() == want.keys(), f"{name}: mapped into {sorted(got)}, the loader writes {sorted(want)}"
        for q in want:
            bad = torch.nonzero(got[q] != want[q]).squeeze(1)
            assert bad.numel() == 0, (
                f"{name}: WRONG MAP accepted in {q}: at positions {bad[:4].tolist()} the map says element "
                f"{(got[q][bad[:4]] - 1).tolist()}, the loader puts {(want[q][bad[:4]] - 1).tolist()}"
            )


def llama(
    loader: type[Llama] = Llama, need_split: bool = True
) -> tuple[torch.nn.Module, Spec, PatchMap, dict[str, dict[str, torch.Tensor]]]:
    """Map a :func:`make_model` of :data:`LLAMA_PARAMS` through ``loader``, check the live weights are as they
    were, and work out where the loader puts real values."""
    model = make_model(LLAMA_PARAMS)
    spec = llama_spec()
    before = snapshot(model)
    pm = build_map(model, spec, loader(model))
    assert_unchanged(model, before)
    if need_split:  # the loader must have met the split probes
        assert "" in pm.split and "layers.0" in pm.split, pm.split
    truth = float_truth(lambda: make_model(LLAMA_PARAMS), loader, spec)
    return model, spec, pm, truth


def split_mode(monkeypatch: Any, period: int = 61, chunk: int = 7) -> None:
    """Probe every group in two int16 passes, with the halves' ``period`` and the scan's ``chunk`` cut short (small
    tensors then use both halves of the index, and runs cross chunk edges)."""
    from deltasync.vllm.patch_map import scan, tensors

    monkeypatch.setattr(scan, "SPLIT_AT", 0)
    monkeypatch.setattr(scan, "PERIOD", period)
    monkeypatch.setattr(tensors, "CHUNK", chunk)
