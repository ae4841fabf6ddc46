"""Attacks on the patch map (issue 15), found by an adversarial review that saw only its promises: building the
map never changes the model silently, a loader the map cannot represent exactly is left out of it, and the
engine's proof before writing covers every tensor a rank holds whole. Toy loaders, torch only."""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from deltasync.format import TensorDelta, tensor_checksum
from deltasync.sketch import tensor_sketch
from deltasync.vllm.patch_map import MapCorruption, PatchMap, build_map
from deltasync.vocab import DTYPES

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves

Spec = dict[str, tuple[str, tuple[int, ...]]]


def _p(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.uint8).clone()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).clone()


def _state(model: torch.nn.Module) -> dict[str, tuple[Any, ...]]:
    out = {f"P:{n}": (id(p), p.dtype, _bits(p)) for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({f"B:{n}": (id(b), b.dtype, _bits(b)) for n, b in model.named_buffers(remove_duplicate=False)})
    return out


def _same(a: dict[str, tuple[Any, ...]], b: dict[str, tuple[Any, ...]], identity: bool = True) -> list[str]:
    bad = [k for k in a.keys() ^ b.keys()]
    for k in a.keys() & b.keys():
        (ia, da, xa), (ib, db, xb) = a[k], b[k]
        if (identity and ia != ib) or da != db or not torch.equal(xa, xb):
            bad.append(k)
    return sorted(bad)


def _weights(spec: Spec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(DTYPES[dt]) for n, (dt, shape) in spec.items()}


def _dense(name: str, t: torch.Tensor) -> TensorDelta:
    return TensorDelta(ckpt_name=name, shape=tuple(t.shape), dtype=t.dtype, indices=None, values=t)


def _map_and_rewrite(model: Any, spec: Spec, new: dict[str, torch.Tensor] | None = None) -> tuple[PatchMap, list[str]]:
    """Map ``model`` at one version, write another through the map (reloading what it leaves out, as the engine
    does), and compare with a model that loaded the new version whole: the map, and what differs."""
    base = _weights(spec, 1)
    new = new if new is not None else _weights(spec, 2)
    model.load_weights(list(base.items()))
    ref = copy.deepcopy(model)
    ref.load_weights(list(new.items()))
    pm = build_map(model, spec, model.load_weights)
    pm.write(pm.plan([_dense(n, new[n]) for n in spec if n in pm]))
    if pm.unmapped:
        model.load_weights([(n, new[n]) for n in spec if n in pm.unmapped])
    return pm, _same(_state(ref), _state(model), identity=False)


def _through_the_map(make: Callable[[], Any], spec: Spec, new: dict[str, torch.Tensor] | None = None) -> list[str]:
    """What differs after :func:`_map_and_rewrite` of a fresh ``make()``."""
    return _map_and_rewrite(make(), spec, new)[1]


def test_a_loader_writing_outside_the_probed_layer_is_caught_not_left_silent() -> None:
    """Checkpoint layer i lands in parameter layer i+1 (a draft model's numbering): the probes land in weights
    that were never swapped. The map cannot undo that, so it says so: the engine goes unhealthy (anchor)."""

    class Offset(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
            for layer in self.layers:
                layer.w = _p(4, 4)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, w in weights:
                self.layers[int(name.split(".")[2]) + 1].w.data.copy_(w)

    spec: Spec = {"model.layers.0.w": ("BF16", (4, 4)), "model.layers.1.w": ("BF16", (4, 4))}
    m = Offset()
    m.load_weights(list(_weights(spec, 1).items()))
    with pytest.raises(MapCorruption, match=r"changed live weights it had not swapped .*layers\.1\.w"):
        build_map(m, spec, m.load_weights)


def test_buffers_non_float_parameters_and_aliases_written_by_the_loader_are_caught() -> None:
    class Buffers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = _p(4, 4)
            self.register_buffer("scale", torch.zeros(4))
            self.g_idx = _p(4, dtype=torch.int32)

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
    m2.load_weights(list(_weights(alias, 1).items()))
    with pytest.raises(MapCorruption, match="param:a"):
        build_map(m2, alias, m2.load_weights)


def test_a_loader_that_re_registers_a_parameter_leaves_the_original_in_place() -> None:
    class Recreate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.v = _p(2, 3), _p(3)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, t in weights:
                if name == "w":
                    self.w = torch.nn.Parameter(t.clone(), requires_grad=False)
                else:
                    self.v.data.copy_(t)

    spec: Spec = {"w": ("BF16", (2, 3)), "v": ("BF16", (3,))}
    m = Recreate()
    m.load_weights(list(_weights(spec, 1).items()))
    before = _state(m)
    pm = build_map(m, spec, m.load_weights)
    assert not _same(before, _state(m))  # the same objects, dtypes and bits
    assert "replaced a parameter object" in pm.unmapped["w"] and "v" in pm


def test_derived_and_value_transforming_loaders_never_map_wrongly() -> None:
    """A negated copy (``w_neg = -w``, ``[u; -u]``) is a write the probes must see; clamping, NaN cleaning and
    ``+0.0`` are the identity on probes and on plain random values, not on edge values."""

    class Derived(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.w_neg, self.fused = _p(4, 4), _p(4, 4), _p(8)
            self.norm, self.bias, self.gate = _p(64), _p(64), _p(64)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, t in weights:
                if name == "w":
                    self.w.data.copy_(t)
                    self.w_neg.data.copy_(-t)
                elif name == "u":
                    self.fused.data[:4].copy_(t)
                    self.fused.data[4:].copy_(-t)
                elif name == "norm":
                    self.norm.data.copy_(t.clamp(-65504, 65504))
                elif name == "bias":
                    self.bias.data.copy_(torch.nan_to_num(t))
                else:
                    self.gate.data.copy_(t + 0.0)  # -0.0 becomes +0.0

    spec: Spec = {
        "w": ("BF16", (4, 4)),
        "u": ("BF16", (4,)),
        "norm": ("BF16", (64,)),
        "bias": ("BF16", (64,)),
        "gate": ("BF16", (64,)),
    }
    new = _weights(spec, 2)
    new["norm"][3], new["bias"][5], new["gate"][7] = 1e6, float("nan"), -0.0
    assert not _through_the_map(Derived, spec, new)


def test_gpt2_style_blocks_are_probed_one_at_a_time_and_non_contiguous_parameters_left_out() -> None:
    blocks, peak = 6, [0]

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = torch.nn.ModuleList([torch.nn.Module() for _ in range(blocks)])
            for b in self.h:
                b.w = _p(8, 8)
            self.t = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16).t(), requires_grad=False)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            peak[0] = max(peak[0], sum(p.numel() for p in self.parameters() if not p.is_floating_point()))
            for n, t in weights:
                if n == "t":
                    self.t.data.copy_(t)
                else:
                    self.h[int(n.split(".")[2])].w.data.copy_(t)

    spec: Spec = {f"transformer.h.{i}.w": ("BF16", (8, 8)) for i in range(blocks)}
    spec["t"] = ("BF16", (4, 3))
    m = GPT()
    m.load_weights(list(_weights(spec, 1).items()))
    peak[0] = 0
    pm = build_map(m, spec, m.load_weights)
    assert peak[0] <= 64 + 12  # one block (and the layer-less rest) swapped at a time, not the whole model
    assert "not contiguous" in pm.unmapped["t"] and all(f"transformer.h.{i}.w" in pm for i in range(blocks))
    assert not _through_the_map(GPT, spec)


def test_the_proof_covers_a_tensor_held_whole_across_two_parameters() -> None:
    """A fused checkpoint ``gate_up`` split into two parameters: an update diffed against another base than
    the one served is refused before writing, as for a tensor in one parameter."""
    pytest.importorskip("vllm")
    from deltasync.errors import RefusalReason, UpdateRefused
    from deltasync.vllm.engine import DeltaSyncWeightTransferEngine

    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.up, self.one = _p(2, 4), _p(2, 4), _p(4, 4)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for n, t in weights:
                if n == "gate_up":
                    self.gate.data.copy_(t[:2])
                    self.up.data.copy_(t[2:])
                else:
                    self.one.data.copy_(t)

    spec: Spec = {"gate_up": ("BF16", (4, 4)), "single": ("BF16", (4, 4))}
    for name in spec:
        served, claimed = _weights(spec, 1), _weights(spec, 7)  # the publisher diffed against another base
        target = {k: v.clone() for k, v in claimed.items()}
        target[name].view(-1)[0] += 1
        m = Split()
        m.load_weights(list(served.items()))
        pm: PatchMap = build_map(m, spec, m.load_weights)
        idx = torch.nonzero(_bits(claimed[name]) != _bits(target[name])).squeeze(1)
        d = TensorDelta(
            ckpt_name=name, shape=(4, 4), dtype=torch.bfloat16, indices=idx, values=target[name].view(-1)[idx]
        )
        entry = types.SimpleNamespace(
            numel=16,
            shape=(4, 4),
            dtype="BF16",
            checksums=[(0, 16, tensor_checksum(target[name]))],
            sketch=tensor_sketch(target[name]),
        )
        # the served version's manifest: none (proven whole, on copies), or with sketches (proven from the
        # changed elements alone)
        for served_manifest in (
            None,
            types.SimpleNamespace(
                tensors={n: types.SimpleNamespace(sketch=tensor_sketch(t)) for n, t in served.items()}
            ),
        ):
            engine = types.SimpleNamespace(
                patch_map=lambda pm=pm: pm,
                _manifest=served_manifest,
                _prove_change=DeltaSyncWeightTransferEngine._prove_change,
                _changes=DeltaSyncWeightTransferEngine._changes,
                _prove_whole=DeltaSyncWeightTransferEngine._prove_whole,
                _served_reads={},
            )
            with pytest.raises(UpdateRefused, match="nothing was written") as exc:
                DeltaSyncWeightTransferEngine._prove(
                    engine,  # type: ignore[arg-type]
                    [(types.SimpleNamespace(tensors={name: entry}), [d])],  # type: ignore[list-item]
                    [pm.plan([d])],
                )
            assert exc.value.reason is RefusalReason.INTEGRITY, name
            # the same delta on the base it was made for passes both ways
            m.load_weights([(name, claimed[name])])
            DeltaSyncWeightTransferEngine._prove(
                types.SimpleNamespace(
                    **{
                        **vars(engine),
                        "_manifest": served_manifest
                        and types.SimpleNamespace(
                            tensors={name: types.SimpleNamespace(sketch=tensor_sketch(claimed[name]))}
                        ),
                    }
                ),  # type: ignore[arg-type]
                [(types.SimpleNamespace(tensors={name: entry}), [d])],  # type: ignore[list-item]
                [pm.plan([d])],
            )
            m.load_weights([(name, served[name])])


@pytest.mark.parametrize("wrong_at", [None, 0, 4, 8])
def test_the_proof_from_changed_elements_block_by_block_catches_a_wrong_value_in_any_block(
    monkeypatch: pytest.MonkeyPatch, wrong_at: int | None
) -> None:
    """The proof from the changed elements goes a block at a time (the sketch adds up over any partition): with
    blocks of 3, nine changes in three blocks give the published sketch, and one changed element whose staged
    value differs from the published one, in the first, middle or last block, is refused before any write."""
    pytest.importorskip("vllm")
    from deltasync.errors import UpdateRefused
    from deltasync.vllm import proof
    from deltasync.vllm.engine import DeltaSyncWeightTransferEngine

    monkeypatch.setattr(proof, "_BLOCK", 3)

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = _p(6, 8)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for _, t in weights:
                self.w.data.copy_(t)

    served = torch.randn(6, 8, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    m = One()
    m.load_weights([("w", served)])
    pm: PatchMap = build_map(m, {"w": ("BF16", (6, 8))}, m.load_weights)
    idx = torch.tensor([1, 5, 9, 13, 20, 27, 33, 40, 47])
    target = served.clone()
    target.view(-1)[idx] += 1
    values = target.view(-1)[idx].clone()
    if wrong_at is not None:
        values[wrong_at] += 2  # the staged value differs from what was published at one changed element
    d = TensorDelta(ckpt_name="w", shape=(6, 8), dtype=torch.bfloat16, indices=idx, values=values)
    entry = types.SimpleNamespace(
        numel=48, shape=(6, 8), dtype="BF16", checksums=[(0, 48, tensor_checksum(target))], sketch=tensor_sketch(target)
    )
    engine = types.SimpleNamespace(
        patch_map=lambda: pm,
        _manifest=types.SimpleNamespace(tensors={"w": types.SimpleNamespace(sketch=tensor_sketch(served))}),
        _prove_change=DeltaSyncWeightTransferEngine._prove_change,
        _changes=DeltaSyncWeightTransferEngine._changes,
        _prove_whole=DeltaSyncWeightTransferEngine._prove_whole,
        _served_reads={},
    )
    prove = lambda: DeltaSyncWeightTransferEngine._prove(  # noqa: E731
        engine,  # type: ignore[arg-type]
        [(types.SimpleNamespace(tensors={"w": entry}), [d])],  # type: ignore[list-item]
        [pm.plan([d])],
    )
    if wrong_at is None:
        prove()
    else:
        with pytest.raises(UpdateRefused, match="differ from the published checksums"):
            prove()
    assert torch.equal(m.w.data, served)  # proving writes nothing


@pytest.mark.parametrize("wrong", [None, "a", "c", "swap"])
def test_the_proof_of_many_tensors_in_one_sum_names_each_wrong_tensor(wrong: str | None) -> None:
    """The engine proves all sparse changes in one sum (``ChangeProof``): three tensors whose changes are right
    pass; one wrong value in one tensor is refused and named; the same changes staged under swapped names (each
    right for the other tensor, same indices) are refused too, though the plain sum of the sketches would not
    move. Nothing is written either way."""
    pytest.importorskip("vllm")
    from deltasync.errors import UpdateRefused
    from deltasync.vllm.engine import DeltaSyncWeightTransferEngine

    class Three(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = _p(8, 16), _p(8, 16), _p(8, 16)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for n, t in weights:
                getattr(self, n).data.copy_(t)

    g = torch.Generator().manual_seed(11)
    served = {n: torch.randn(8, 16, generator=g).to(torch.bfloat16) for n in "abc"}
    m = Three()
    m.load_weights(list(served.items()))
    pm: PatchMap = build_map(m, {n: ("BF16", (8, 16)) for n in "abc"}, m.load_weights)
    idx = torch.arange(0, 128, 5)
    target = {n: t.clone() for n, t in served.items()}
    for k, n in enumerate("abc"):
        target[n].view(-1)[idx] += k + 1
    staged = {n: target[n].view(-1)[idx].clone() for n in "abc"}
    if wrong in ("a", "c"):
        staged[wrong][3] += 4
    if wrong == "swap":
        staged["a"], staged["b"] = staged["b"], staged["a"]
    deltas = [
        TensorDelta(ckpt_name=n, shape=(8, 16), dtype=torch.bfloat16, indices=idx, values=staged[n]) for n in "abc"
    ]
    entries = {
        n: types.SimpleNamespace(
            numel=128,
            shape=(8, 16),
            dtype="BF16",
            checksums=[(0, 128, tensor_checksum(target[n]))],
            sketch=tensor_sketch(target[n]),
        )
        for n in "abc"
    }
    engine = types.SimpleNamespace(
        patch_map=lambda: pm,
        _manifest=types.SimpleNamespace(
            tensors={n: types.SimpleNamespace(sketch=tensor_sketch(t)) for n, t in served.items()}
        ),
        _prove_change=DeltaSyncWeightTransferEngine._prove_change,
        _changes=DeltaSyncWeightTransferEngine._changes,
        _prove_whole=DeltaSyncWeightTransferEngine._prove_whole,
        _served_reads={},
    )

    def prove() -> None:
        DeltaSyncWeightTransferEngine._prove(
            engine,  # type: ignore[arg-type]
            [(types.SimpleNamespace(tensors=entries), deltas)],  # type: ignore[list-item]
            [pm.plan(deltas)],
        )

    if wrong is None:
        prove()
    else:
        named = {"a": "1 tensors", "c": "1 tensors", "swap": "2 tensors"}[wrong]
        first = "a" if wrong == "swap" else wrong
        with pytest.raises(UpdateRefused, match=f"would give {named} .*e.g. {first}\\)"):
            prove()
    for n in "abc":
        assert torch.equal(getattr(m, n).data, served[n])  # proving writes nothing
