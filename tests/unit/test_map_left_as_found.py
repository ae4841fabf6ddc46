"""Building the map leaves the model as it found it, or raises :class:`MapCorruption` (the engine then stops
serving until an anchor): a loader that writes where probing cannot see (another layer's parameter, a buffer, a
non-float parameter, an alias of a parameter's storage), re-registers a parameter, replaces its data or its
module, or raises midway, never leaves the engine serving probe values or a parameter the map does not know.
Toy loaders, torch only."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest
import torch

from deltasync.vllm.patch_map import MapCorruption, as_found, build, build_map
from tests.unit.map_fakes import (
    LLAMA_PARAMS,
    QKVStack,
    Spec,
    assert_unchanged,
    dense,
    differing,
    llama_spec,
    make_model,
    param,
    snapshot,
    state,
    weights,
)
from tests.unit.map_fakes import Llama as LlamaLoader

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves


def test_a_loader_writing_outside_the_probed_layer_is_caught_not_left_silent() -> None:
    """Checkpoint layer i lands in parameter layer i+1 (a draft model's numbering): the probes land in weights
    that were never swapped. The map cannot undo that, so it says so: the engine goes unhealthy (anchor)."""

    class Offset(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
            for layer in self.layers:
                layer.w = param(4, 4)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, w in weights:
                self.layers[int(name.split(".")[2]) + 1].w.data.copy_(w)

    spec: Spec = {"model.layers.0.w": ("BF16", (4, 4)), "model.layers.1.w": ("BF16", (4, 4))}
    m = Offset()
    m.load_weights(list(weights(spec, 1).items()))
    with pytest.raises(MapCorruption, match=r"changed live weights it had not swapped .*layers\.1\.w"):
        build_map(m, spec, m.load_weights)


def test_a_probe_landing_in_another_layer_s_live_weight_is_map_corruption() -> None:
    """Layer 0's q_proj probe also lands in layer 1's (live, unswapped) qkv."""

    class Stray(LlamaLoader):
        def put(self, name: str, w: torch.Tensor, call: int) -> None:
            super().put(name, w, call)
            if not w.is_floating_point() and "layers.0.self_attn.q_proj" in name:
                self.m.get_parameter("model.layers.1.self_attn.qkv_proj.weight").data[0, 0] = 1.0

    model = make_model(LLAMA_PARAMS)
    with pytest.raises(MapCorruption):
        build_map(model, llama_spec(), Stray(model))


def test_buffers_non_float_parameters_and_aliases_written_by_the_loader_are_caught() -> None:
    class Buffers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = param(4, 4)
            self.register_buffer("scale", torch.zeros(4))
            self.g_idx = param(4, dtype=torch.int32)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, t in weights:
                if name == "w":
                    self.w.data.copy_(t)
                elif name == "scale":
                    self.scale.copy_(t)
                else:
                    self.g_idx.data.copy_(t.to(torch.int32))

    class Alias(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.storage = torch.zeros(8, dtype=torch.bfloat16)
            self.a = torch.nn.Parameter(self.storage[:4].view(2, 2), requires_grad=False)
            self.b = torch.nn.Parameter(self.storage[4:].view(2, 2), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, t in weights:
                off = {"a": 0, "b": 4}[name]
                self.storage[off : off + 4].copy_(t.reshape(-1))  # through the shared storage

    buffers: Spec = {"w": ("BF16", (4, 4)), "scale": ("F32", (4,)), "g_idx": ("BF16", (4,))}
    m1 = Buffers()
    m1.load_weights([("w", torch.randn(4, 4).bfloat16()), ("scale", torch.rand(4)), ("g_idx", torch.ones(4))])
    with pytest.raises(MapCorruption, match="buffer:scale"):
        build_map(m1, buffers, m1.load_weights)
    m2 = Alias()
    alias: Spec = {"a": ("BF16", (2, 2)), "b": ("BF16", (2, 2))}
    m2.load_weights(list(weights(alias, 1).items()))
    with pytest.raises(MapCorruption, match="param:a"):
        build_map(m2, alias, m2.load_weights)


def test_a_loader_that_re_registers_a_parameter_leaves_the_original_in_place() -> None:
    class Recreate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.v = param(2, 3), param(3)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, t in weights:
                if name == "w":
                    self.w = torch.nn.Parameter(t.clone(), requires_grad=False)
                else:
                    self.v.data.copy_(t)

    spec: Spec = {"w": ("BF16", (2, 3)), "v": ("BF16", (3,))}
    m = Recreate()
    m.load_weights(list(weights(spec, 1).items()))
    before = state(m)
    pm = build_map(m, spec, m.load_weights)
    assert not differing(before, state(m))  # the same objects, dtypes and bits
    assert "replaced a parameter object" in pm.unmapped["w"] and "v" in pm


def test_a_loader_that_replaces_a_parameter_s_data_has_that_tensor_refused() -> None:
    """vLLM-style ``param.data = loaded.t()`` (a loader that stores a transposed copy): the stand-in the loader
    replaced is put back, the tensor refused (reloaded), the others mapped; never a bare error out of the build
    (a scan of a non-contiguous stand-in)."""
    params = {"model.layers.0.w.weight": ((6, 4), torch.bfloat16), "model.layers.0.b.weight": ((4,), torch.bfloat16)}
    spec: Spec = {"model.layers.0.w.weight": ("BF16", (4, 6)), "model.layers.0.b.weight": ("BF16", (4,))}

    def loader(model: torch.nn.Module):  # type: ignore[no-untyped-def]
        def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for n, w in weights:
                p = model.get_parameter(n)
                if n.endswith("w.weight"):
                    p.data = w.t().clone()
                else:
                    p.data.copy_(w)

        return load

    model = make_model(params)
    loader(model)([(n, torch.randn(s[1]).to(torch.bfloat16)) for n, s in spec.items()])  # as vLLM's load left it
    before = snapshot(model)
    pm = build_map(model, spec, loader(model))
    assert_unchanged(model, before)
    assert "model.layers.0.w.weight" in pm.unmapped
    assert "model.layers.0.b.weight" in pm.runs


def test_a_loader_that_swaps_a_submodule_during_the_build_is_caught() -> None:
    """A loader that replaces the module holding a parameter (a new module, new parameter object) on the
    real-values call: the original parameter is put back under its name and the tensor left out; the model's
    parameters stay bit-exact."""

    class Swapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sub = torch.nn.Module()
            self.sub.w = param(4, 4)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for _, t in weights:
                if t.is_floating_point():
                    fresh = torch.nn.Module()
                    fresh.w = torch.nn.Parameter(t.clone(), requires_grad=False)
                    self.sub = fresh
                else:
                    self.sub.w.data.copy_(t)

    spec: Spec = {"w": ("BF16", (4, 4))}
    m = Swapper()
    m.sub.w.data.copy_(weights(spec, 1)["w"])
    original, bits = m.sub.w, m.sub.w.detach().view(torch.int16).clone()
    pm = build_map(m, spec, m.load_weights)
    assert "w" not in pm.runs and "replaced a parameter object" in pm.unmapped["w"], pm.unmapped
    # the served parameter is the original object again (its module put back), with its bits
    assert m.sub.w is original and torch.equal(m.sub.w.detach().view(torch.int16), bits)


class RaiseOnCall(QKVStack):
    """Raises on its ``fail_at``-th call, after writing the first tensor it was given."""

    def __init__(self, fail_at: int, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.calls, self.fail_at = 0, fail_at

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.calls += 1
        items = list(weights)
        if self.calls == self.fail_at:
            super().load_weights(items[:1])
            raise RuntimeError("loader failed midway")
        super().load_weights(items)


def test_a_loader_that_raises_midway_at_any_call_leaves_the_weights_as_they_were() -> None:
    spec = QKVStack().spec()
    base = weights(spec, 1)
    calls = 0
    for fail_at in range(2, 40):
        model = RaiseOnCall(fail_at)
        model.load_weights(list(base.items()))  # call 1
        before = state(model)
        new = weights(spec, 2)
        ref = copy.deepcopy(model)
        ref.fail_at = -1
        ref.load_weights(list(new.items()))
        pm = build_map(model, spec, model.load_weights)
        assert differing(before, state(model)) == [], f"failing call {fail_at}: the build changed weights"
        calls = max(calls, model.calls)
        model.fail_at = -1
        pm.write(pm.plan([dense(n, new[n]) for n in spec if n in pm]))
        if pm.unmapped:
            model.load_weights([(n, new[n]) for n in spec if n in pm.unmapped])
        assert differing(state(ref), state(model), identity=False) == [], f"failing call {fail_at}"
    assert calls < 40  # every call of the build was made to fail once


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        for i, layer in enumerate(self.layers):
            shape = (4, 4) if i == 0 else (4, 8)  # two kinds of layer: each probed in full
            layer.w = torch.nn.Parameter(torch.full(shape, float(i + 1), dtype=torch.bfloat16), requires_grad=False)


def test_a_build_that_stops_after_a_stray_write_is_map_corruption(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader that writes a stray value into another layer's live weight, then the build stops (out of memory
    for a stand-in): a build that changed live weights must raise MapCorruption (the engine then goes
    unhealthy), whatever stopped it."""
    model = _Toy()
    params = dict(model.named_parameters())

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            params[name].data.copy_(t.to(params[name].dtype) if params[name].dtype != t.dtype else t)
            if name == "layers.0.w":  # a stray write into the other layer's (live, unswapped) weight
                params["layers.1.w"].data.view(-1)[0] = 42

    calls = {"n": 0}
    real = build.reuse

    def oom_on_second(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 1:
            raise torch.OutOfMemoryError("stand-in")
        return real(buf, like)

    monkeypatch.setattr(build, "reuse", oom_on_second)
    spec: Spec = {"layers.0.w": ("BF16", (4, 4)), "layers.1.w": ("BF16", (4, 8))}
    before = {k: v.detach().clone() for k, v in params.items()}
    try:
        build_map(model, spec, load)
    except MapCorruption:
        return
    except Exception as exc:  # noqa: BLE001
        assert calls["n"] > 1, f"the build failed elsewhere: {exc!r}"
        changed = [k for k in before if not torch.equal(before[k], params[k].detach())]
        assert not changed, f"build stopped without MapCorruption after changing {changed}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the accelerator fingerprint needs a GPU")
def test_a_change_on_an_accelerator_that_keeps_plain_sums_is_seen() -> None:
    """The fingerprint of a weight on an accelerator is a digest computed there (:func:`device_digest`): adding
    +1, -2, +1 to three consecutive words of another layer's weight, which keeps the sum of words and of words
    times positions, is caught."""
    model = make_model(
        {"model.layers.0.w.weight": ((8, 8), torch.bfloat16), "model.layers.1.w.weight": ((8, 8), torch.bfloat16)}
    )
    model.cuda()
    spec: Spec = {"model.layers.0.w.weight": ("BF16", (8, 8))}

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for n, w in weights:
            model.get_parameter(n).data.copy_(w)
            other = model.get_parameter("model.layers.1.w.weight").data.view(-1).view(torch.int16)
            if not w.is_floating_point():
                other[10:13] += torch.tensor([1, -2, 1], dtype=other.dtype, device=other.device)

    before = snapshot(model)
    try:
        build_map(model, spec, load)
    except MapCorruption:
        return
    assert_unchanged(model, before)


def test_the_device_digest_sees_a_zero_moment_change_and_a_swap() -> None:
    """The accelerator fingerprint's digest, run on CPU words: it changes where plain sums would not."""
    words = torch.randn(3000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).view(torch.int16)
    plain = as_found.device_digest(words)
    assert as_found.device_digest(words.clone()) == plain
    moment = words.clone()
    moment[10:13] += torch.tensor([1, -2, 1], dtype=words.dtype)  # same sum, same position-weighted sum
    assert int(moment.sum()) == int(words.sum())
    swap = words.clone()
    swap[[5, 2900]] = swap[[2900, 5]]
    assert words[5] != words[2900]
    assert as_found.device_digest(moment) != plain and as_found.device_digest(swap) != plain
