"""The patch map at update time: ``plan`` + ``write`` change exactly the named elements (fused parameters, TP-like
slices with either shift, padding untouched), the read-back names what differs, ``gather`` reads exactly the live
values and refuses what this rank does not hold, ``param`` follows the registered parameter, and a map or an
update that would write one element twice is refused before any write."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from deltasync.format import TensorDelta
from deltasync.vllm.patch_map import PatchMap, Runs, Scatter, build_map, core
from tests.unit.map_fakes import FusedPaddedTied, Spec, param, sparse, weights

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16)


def _delta(name: str, like: torch.Tensor, indices: torch.Tensor | None, values: torch.Tensor) -> TensorDelta:
    return TensorDelta(ckpt_name=name, shape=tuple(like.shape), dtype=like.dtype, indices=indices, values=values)


class Reordered(torch.nn.Module):
    """q, k, v rows in one parameter (k and v in reverse order, v with a padding row before it), and a TP-like
    ``down`` holding the second half of the checkpoint's rows (negative shift: parameter index = checkpoint
    index - 8)."""

    SPEC: Spec = {"q": ("BF16", (2, 2)), "k": ("BF16", (2, 2)), "v": ("BF16", (2, 2)), "down": ("BF16", (8, 2))}

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.qkv = param(7, 2)
        self.down = param(4, 2)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            if name == "q":
                self.attn.qkv.data[0:2].copy_(t)
            elif name == "k":
                self.attn.qkv.data[5:7].copy_(t)
            elif name == "v":
                self.attn.qkv.data[2:4].copy_(t)  # row 4: padding
            else:
                self.down.data.copy_(t[4:])


def _reordered() -> tuple[Reordered, PatchMap, dict[str, torch.Tensor]]:
    m = Reordered()
    base = weights(Reordered.SPEC, 1)
    m.load_weights(list(base.items()))
    return m, build_map(m, Reordered.SPEC, m.load_weights), base


def test_plan_and_write_change_exactly_the_named_elements_of_a_fused_parameter_at_run_boundaries() -> None:
    """Deltas at the first and last element of each piece, in delta order (k before q), an empty delta, and a
    TP-like tensor with a negative shift: exactly those elements change, one scatter per (tensor, parameter),
    nothing in the padding or the other pieces."""
    m, pm, base = _reordered()
    before = {"qkv": m.attn.qkv.detach().clone(), "down": m.down.detach().clone()}
    vals = torch.tensor([11.0, 12.0], dtype=torch.bfloat16)
    deltas = [
        sparse("k", (2, 2), [0, 3], vals),
        sparse("q", (2, 2), [0, 3], vals + 2),
        sparse("v", (2, 2), [], torch.tensor([], dtype=torch.bfloat16)),
        sparse("down", (8, 2), [8, 15], vals + 4),
    ]
    ops = pm.plan(deltas)
    assert all(isinstance(o, Scatter) for o in ops)
    assert [o.param for o in ops if o.index.numel()] == ["attn.qkv", "attn.qkv", "down"]
    pm.write(ops)
    assert pm.check_written(ops) == []
    exp_qkv = before["qkv"].clone().view(-1)
    exp_qkv[[10, 13]] = vals  # k: rows 5-6
    exp_qkv[[0, 3]] = vals + 2
    exp_down = before["down"].clone().view(-1)
    exp_down[[0, 7]] = vals + 4
    assert torch.equal(_bits16(m.attn.qkv), _bits16(exp_qkv)) and torch.equal(_bits16(m.down), _bits16(exp_down))
    # gather reads them back at the checkpoint's indices, through either shift
    assert torch.equal(pm.gather("k", torch.tensor([0, 3])), vals)
    assert torch.equal(pm.gather("down", torch.tensor([8, 15])), vals + 4)
    assert torch.equal(pm.gather("v", torch.tensor([0, 1, 2, 3])), base["v"].reshape(-1))


def test_gather_of_one_run_refuses_indices_just_outside_what_the_rank_holds() -> None:
    """A TP-like tensor held from element 8: index 7 (just before) and 16 (past the end) raise KeyError; so does an
    index past a fused piece's end (it would read the next piece or padding)."""
    _, pm, _ = _reordered()
    for name, idx in (("down", [7, 8]), ("down", [15, 16]), ("q", [3, 4]), ("v", [0, 4])):
        with pytest.raises(KeyError):
            pm.gather(name, torch.tensor(idx))


class SplitPartly(torch.nn.Module):
    """A rank holding part of a fused checkpoint tensor ``gate_up`` (4x4) in two parameters: row 0 in ``gate``,
    row 2 in ``up`` (rows 1 and 3 live on another rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = param(1, 4), param(1, 4)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, t in weights:
            self.gate.data.copy_(t[0:1])
            self.up.data.copy_(t[2:3])


def test_gather_across_two_parameters_refuses_an_index_the_rank_does_not_hold() -> None:
    """An index no parameter holds (element 5: row 1, another rank's) is a KeyError, never the uninitialised
    memory of the gather's output."""
    spec: Spec = {"gate_up": ("BF16", (4, 4))}
    m = SplitPartly()
    w = weights(spec, 1)["gate_up"]
    m.load_weights([("gate_up", w)])
    pm = build_map(m, spec, m.load_weights)
    assert sorted(r.param for r in pm.runs["gate_up"]) == ["gate", "up"]
    assert torch.equal(pm.gather("gate_up", torch.tensor([0, 9])), w.reshape(-1)[[0, 9]])  # held: right
    with pytest.raises(KeyError):
        pm.gather("gate_up", torch.tensor([0, 5]))


def test_gather_and_plan_read_and_write_where_the_loader_does_at_every_offset() -> None:
    model = FusedPaddedTied()
    pm = build_map(model, FusedPaddedTied.SPEC, model.load_weights)
    truth = FusedPaddedTied.truth()
    model.load_weights([(n, t) for n, t in truth.items() if n != "quantized"])
    for name in ("q", "k", "v", "embed"):  # one run each, at parameter offsets 0, 8, 16 and 0
        idx = torch.tensor([0, 3, 5, truth[name].numel() - 1])
        assert pm.runs[name][0].offset_of(idx) == int(pm.runs[name][0].param_start[0])
        assert torch.equal(_bits16(pm.gather(name, idx)), _bits16(truth[name])[idx]), name
    held = torch.tensor([3, 5, 9, 23])  # `down`: this rank's half of each row, one run per row (located)
    assert pm.runs["down"][0].offset_of(held) is None
    assert torch.equal(_bits16(pm.gather("down", held)), _bits16(truth["down"])[held])
    for name, idx in (("k", torch.tensor([7, 8])), ("down", torch.tensor([2, 3]))):  # past k's end; a column
        with pytest.raises(KeyError, match="does not hold every element"):  # of `down` another rank holds
            pm.gather(name, idx)

    new = {n: t.clone() for n, t in truth.items()}
    deltas = []
    for name in ("q", "k", "v", "down"):
        idx = torch.tensor([1, 4, 7]) if name != "down" else held
        _bits16(new[name])[idx] += 1
        deltas.append(_delta(name, new[name], idx, new[name].reshape(-1)[idx]))
    ops = pm.plan(deltas)
    # one scatter per checkpoint tensor, in order: the fused qkv gets three, with no joined copy of the indices
    assert [op.param for op in ops] == ["qkv", "qkv", "qkv", "down"]
    assert isinstance(ops[0], Scatter) and isinstance(ops[1], Scatter)
    assert ops[0].index is deltas[0].indices and torch.equal(ops[1].index, deltas[1].indices + 8)
    assert pm.write(ops) == 13 and not pm.check_written(ops)
    written = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_weights([(n, t) for n, t in new.items() if n != "quantized"])  # what a full reload gives
    for n, p in model.named_parameters():
        assert torch.equal(_bits16(written[n]), _bits16(p.detach())), n


def test_a_parameter_that_changed_since_the_map_is_never_written() -> None:
    model = FusedPaddedTied()
    pm = build_map(model, FusedPaddedTied.SPEC, model.load_weights)
    model.qkv.data = torch.zeros(7, 4, dtype=torch.bfloat16)  # re-allocated behind the map's back
    d = _delta("q", torch.zeros(2, 4, dtype=torch.bfloat16), torch.tensor([0]), torch.ones(1, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="changed shape or dtype since the patch map was built"):
        pm.plan([d])


def test_parameters_are_resolved_by_name_as_get_parameter_does_even_after_a_reregistration() -> None:
    outer = torch.nn.Module()
    outer.inner = FusedPaddedTied()  # nested, as vLLM's models are: "inner.qkv"
    pm = build_map(outer, FusedPaddedTied.SPEC, outer.inner.load_weights)
    assert [r.param for r in pm.runs["q"]] == ["inner.qkv"]
    assert pm.param("inner.qkv") is outer.get_parameter("inner.qkv")
    fresh = param(6, 4)
    outer.inner.register_parameter("qkv", fresh)  # a module reloaded in place re-registers its parameters
    assert pm.param("inner.qkv") is fresh
    d = _delta("q", torch.zeros(2, 4, dtype=torch.bfloat16), torch.tensor([1]), torch.ones(1, dtype=torch.bfloat16))
    pm.write(pm.plan([d]))
    assert float(fresh.view(-1)[1]) == 1.0
    del outer.inner  # gone: the lookup fails as get_parameter does, naming what is missing
    with pytest.raises(AttributeError, match="inner"):
        pm.param("inner.qkv")


def test_param_follows_a_replaced_submodule_and_fails_when_it_is_gone() -> None:
    """After the submodule holding ``qkv`` is replaced by a new module, ``param`` and ``write`` use the new
    parameter (the old one is untouched); a parameter of another shape raises; a removed one raises."""
    m, pm, _ = _reordered()
    old = m.attn.qkv
    new_attn = torch.nn.Module()
    new_attn.qkv = param(7, 2)
    m.attn = new_attn
    assert pm.param("attn.qkv") is new_attn.qkv
    old_bits = _bits16(old).clone()
    pm.write(pm.plan([sparse("q", (2, 2), [1], torch.tensor([5.0], dtype=torch.bfloat16))]))
    assert float(new_attn.qkv.view(-1)[1]) == 5.0 and torch.equal(_bits16(old), old_bits)
    new_attn.qkv = param(8, 2)
    with pytest.raises(RuntimeError, match="changed shape"):
        pm.param("attn.qkv")
    del new_attn.qkv
    with pytest.raises(AttributeError):
        pm.param("attn.qkv")
    m.attn = None  # type: ignore[assignment]
    with pytest.raises(AttributeError):
        pm.param("attn.qkv")


class Wide(torch.nn.Module):
    """q, k, v fused into one parameter, large enough that a plan's writes and read-back run on threads."""

    ROWS, COLS = 256, 512

    def __init__(self) -> None:
        super().__init__()
        self.qkv = param(3 * self.ROWS, self.COLS)
        self.o = param(self.COLS, self.ROWS)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "o":
                self.o.data.copy_(w)
            else:
                row = {"q": 0, "k": 1, "v": 2}[name] * self.ROWS
                self.qkv.data[row : row + self.ROWS].copy_(w)


def test_a_large_plan_is_written_and_read_back_on_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several ops into one fused parameter and another, written at once: exactly what the loader gives; the
    read-back passes, then names the one parameter with one wrong element."""
    from deltasync._cpus import PARALLEL_MIN_ELEMENTS

    spec = {n: ("BF16", (Wide.ROWS, Wide.COLS)) for n in "qkv"} | {"o": ("BF16", (Wide.COLS, Wide.ROWS))}
    model, reference = Wide(), Wide()
    pm = build_map(model, spec, model.load_weights)
    g = torch.Generator().manual_seed(5)
    truth = {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n, (_, shape) in spec.items()}
    model.load_weights(truth.items())
    new = {n: t.clone() for n, t in truth.items()}
    for t in new.values():
        t.view(-1)[torch.randperm(t.numel(), generator=g)[: t.numel() * 3 // 4]] += 1
    reference.load_weights(new.items())
    deltas = []
    for n in spec:
        idx = torch.nonzero(_bits16(new[n]) != _bits16(truth[n])).squeeze(1)
        deltas.append(_delta(n, new[n], idx, new[n].view(-1)[idx]))
    jobs: list[int] = []
    real = core.parallel_map

    def spy(fn, items, elements=0, cost=None):  # type: ignore[no-untyped-def]
        jobs.append(elements)
        return real(fn, items, elements, cost)

    monkeypatch.setattr(core, "parallel_map", spy)
    ops = pm.plan(deltas)
    assert len(ops) == 4 and pm.write(ops) == sum(d.nnz for d in deltas)
    for name, p in model.named_parameters():
        assert torch.equal(p.view(torch.int16), dict(reference.named_parameters())[name].view(torch.int16)), name
    assert pm.check_written(ops) == []
    assert jobs and min(jobs) >= PARALLEL_MIN_ELEMENTS  # both went to the threads
    indices = deltas[1].indices
    assert indices is not None
    at = int(indices[len(indices) // 2]) + Wide.ROWS * Wide.COLS  # an element k wrote
    model.qkv.data.view(-1)[at] += 1
    assert pm.check_written(ops) == ["qkv"]


# the writes of one update run on threads: two writes over one element would race


def _one_run(param_name: str, param_start: int, n: int) -> list[Runs]:
    return [Runs(param_name, torch.tensor([0]), torch.tensor([param_start]), torch.tensor([n]))]


def test_a_map_that_lands_two_tensors_on_one_element_is_refused() -> None:
    w = param(100)
    PatchMap({"a": _one_run("w", 0, 50), "b": _one_run("w", 50, 50)}, {}, {"w": w}, 0.0)  # side by side: fine
    for b_start in (0, 49, 10):
        with pytest.raises(ValueError, match=r"'a' and 'b' both land on elements from \d+ of parameter 'w'"):
            PatchMap({"a": _one_run("w", 0, 50), "b": _one_run("w", b_start, 20)}, {}, {"w": w}, 0.0)
    with pytest.raises(ValueError, match="'b' and 'c' both land"):  # the overlap past a long run is found
        PatchMap({"a": _one_run("w", 0, 10), "b": _one_run("w", 20, 60), "c": _one_run("w", 70, 5)}, {}, {"w": w}, 0.0)


def test_an_update_with_overlapping_entries_for_one_tensor_is_refused_before_any_write() -> None:
    n = 1 << 19
    w = param(n, dtype=torch.float32)
    pm = PatchMap({"a": _one_run("w", 0, n)}, {}, {"w": w}, 0.0)
    half = TensorDelta(
        ckpt_name="a", shape=(n,), dtype=torch.float32, indices=torch.arange(0, n, 2), values=torch.full((n // 2,), 3.0)
    )
    whole = TensorDelta(ckpt_name="a", shape=(n,), dtype=torch.float32, indices=None, values=torch.full((n,), 5.0))
    with pytest.raises(ValueError, match="entries for 'a' overlap"):
        pm.plan([half, whole])
    assert not bool(w.data.any())  # nothing written
    lo = TensorDelta(ckpt_name="a", shape=(n,), dtype=torch.float32, indices=None, values=torch.ones(10), span=(0, 10))
    hi = TensorDelta(
        ckpt_name="a", shape=(n,), dtype=torch.float32, indices=None, values=torch.ones(n - 10), span=(10, n)
    )
    assert pm.write(pm.plan([hi, lo])) == n and bool((w.data == 1).all())  # an anchor's spans, side by side
