"""The engine's proof before writing, through the patch map: an update staged against another base than the one
served, or with one wrong value, is refused before any write, whether the tensor sits in one parameter or is
held whole across two, proven whole or from the changed elements alone (block by block, many tensors in one
sum, each wrong tensor named). Toy loaders and the engine's proof methods, no vLLM started."""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from deltasync.format import TensorDelta, tensor_checksum
from deltasync.sketch import tensor_sketch
from deltasync.vllm.patch_map import PatchMap, build_map
from tests.unit.map_fakes import Plain, Spec, bits, param, weights

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves


def _engine_class() -> Any:
    """The engine's proof before the first write (:func:`deltasync.vllm.proof.prove_update`)."""
    pytest.importorskip("vllm")
    from deltasync.vllm.proof import prove_update

    return prove_update


def _entry(target: torch.Tensor) -> types.SimpleNamespace:
    """A published manifest entry of ``target``."""
    n = target.numel()
    return types.SimpleNamespace(
        numel=n,
        shape=tuple(target.shape),
        dtype="BF16",
        checksums=[(0, n, tensor_checksum(target))],
        sketch=tensor_sketch(target),
    )


def _served(tensors: dict[str, torch.Tensor] | None) -> types.SimpleNamespace | None:
    """The served version's manifest (sketches only), or ``None``: the proof then goes whole, on copies."""
    if tensors is None:
        return None
    return types.SimpleNamespace(
        tensors={n: types.SimpleNamespace(sketch=tensor_sketch(t)) for n, t in tensors.items()}
    )


def _prove(
    pm: PatchMap, served: dict[str, torch.Tensor] | None, entries: dict[str, Any], deltas: list[TensorDelta]
) -> None:
    """The engine's proof of one update (``entries``: its manifest's; ``deltas``: staged) over the map."""
    prove_update = _engine_class()
    prove_update(pm, _served(served), [(types.SimpleNamespace(tensors=entries), deltas)], [pm.plan(deltas)])


class Split(torch.nn.Module):
    """A fused checkpoint ``gate_up`` split into two parameters, and a tensor in one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.one = param(2, 4), param(2, 4), param(4, 4)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for n, t in weights:
            if n == "gate_up":
                self.gate.data.copy_(t[:2])
                self.up.data.copy_(t[2:])
            else:
                self.one.data.copy_(t)


@pytest.mark.parametrize("name", ["gate_up", "single"])
@pytest.mark.parametrize("with_sketches", [False, True], ids=["proven-whole", "from-changed-elements"])
def test_an_update_against_another_base_is_refused_before_writing_wherever_the_tensor_lies(
    name: str, with_sketches: bool
) -> None:
    """The publisher diffed against another base than the one served: refused (INTEGRITY, nothing written),
    whether the tensor is held whole across two parameters or in one; the same delta on the base it was made for
    passes."""
    from deltasync.errors import RefusalReason, UpdateRefused

    _engine_class()
    spec: Spec = {"gate_up": ("BF16", (4, 4)), "single": ("BF16", (4, 4))}
    served, claimed = weights(spec, 1), weights(spec, 7)
    target = {k: v.clone() for k, v in claimed.items()}
    target[name].view(-1)[0] += 1
    m = Split()
    m.load_weights(list(served.items()))
    pm = build_map(m, spec, m.load_weights)
    idx = torch.nonzero(bits(claimed[name]) != bits(target[name])).squeeze(1)
    d = TensorDelta(ckpt_name=name, shape=(4, 4), dtype=torch.bfloat16, indices=idx, values=target[name].view(-1)[idx])
    with pytest.raises(UpdateRefused, match="nothing was written") as exc:
        _prove(pm, served if with_sketches else None, {name: _entry(target[name])}, [d])
    assert exc.value.reason is RefusalReason.INTEGRITY, name
    m.load_weights([(name, claimed[name])])
    _prove(pm, {name: claimed[name]} if with_sketches else None, {name: _entry(target[name])}, [d])


@pytest.mark.parametrize("wrong_at", [None, 0, 4, 8])
def test_the_proof_from_changed_elements_block_by_block_catches_a_wrong_value_in_any_block(
    monkeypatch: pytest.MonkeyPatch, wrong_at: int | None
) -> None:
    """The proof from the changed elements goes a block at a time (the sketch adds up over any partition): with
    blocks of 3, nine changes in three blocks give the published sketch, and one changed element whose staged
    value differs from the published one, in the first, middle or last block, is refused before any write."""
    _engine_class()
    from deltasync.errors import UpdateRefused
    from deltasync.vllm import proof

    monkeypatch.setattr(proof, "_BLOCK", 3)

    served = torch.randn(6, 8, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    m = Plain(w=(6, 8))
    m.load_weights([("w", served)])
    pm = build_map(m, {"w": ("BF16", (6, 8))}, m.load_weights)
    idx = torch.tensor([1, 5, 9, 13, 20, 27, 33, 40, 47])
    target = served.clone()
    target.view(-1)[idx] += 1
    staged = target.view(-1)[idx].clone()
    if wrong_at is not None:
        staged[wrong_at] += 2  # the staged value differs from what was published at one changed element
    d = TensorDelta(ckpt_name="w", shape=(6, 8), dtype=torch.bfloat16, indices=idx, values=staged)
    if wrong_at is None:
        _prove(pm, {"w": served}, {"w": _entry(target)}, [d])
    else:
        with pytest.raises(UpdateRefused, match="differ from the published checksums"):
            _prove(pm, {"w": served}, {"w": _entry(target)}, [d])
    assert torch.equal(m.w.data, served)  # proving writes nothing


@pytest.mark.parametrize("wrong", [None, "a", "c", "swap"])
def test_the_proof_of_many_tensors_in_one_sum_names_each_wrong_tensor(wrong: str | None) -> None:
    """The engine proves all sparse changes in one sum (``ChangeProof``): three tensors whose changes are right
    pass; one wrong value in one tensor is refused and named; the same changes staged under swapped names (each
    right for the other tensor, same indices) are refused too, though the plain sum of the sketches would not
    move. Nothing is written either way."""
    _engine_class()
    from deltasync.errors import UpdateRefused

    g = torch.Generator().manual_seed(11)
    served = {n: torch.randn(8, 16, generator=g).to(torch.bfloat16) for n in "abc"}
    m = Plain(a=(8, 16), b=(8, 16), c=(8, 16))
    m.load_weights(list(served.items()))
    pm = build_map(m, {n: ("BF16", (8, 16)) for n in "abc"}, m.load_weights)
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
    entries = {n: _entry(target[n]) for n in "abc"}
    if wrong is None:
        _prove(pm, served, entries, deltas)
    else:
        named = {"a": "1 tensors", "c": "1 tensors", "swap": "2 tensors"}[wrong]
        first = "a" if wrong == "swap" else wrong
        with pytest.raises(UpdateRefused, match=f"would give {named} .*e.g. {first}\\)"):
            _prove(pm, served, entries, deltas)
    for n in "abc":
        assert torch.equal(getattr(m, n).data, served[n])  # proving writes nothing
