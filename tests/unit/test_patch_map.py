"""The patch map's algorithm (issue 15) on a small torch model whose loader fuses, pads and shards the way
vLLM's do; the real vLLM models are in tests/integration/test_inplace.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltasync.format import TensorDelta
from deltasync.vllm.patch_map import build_map

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves


class Fused(torch.nn.Module):
    """q, k, v rows fused into one parameter; a vocabulary padded to 8 rows; a tied head; a TP-like slice
    (this 'rank' holds the second half of the columns of ``down``); a loader that refuses one tensor."""

    def __init__(self, rank_half: bool = True) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)
        self.head = self.embed  # tied
        self.down = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
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


SPEC = {
    "q": ("BF16", (2, 4)),
    "k": ("BF16", (2, 4)),
    "v": ("BF16", (2, 4)),
    "embed": ("BF16", (5, 4)),
    "down": ("BF16", (4, 6)),
    "norm": ("BF16", (4,)),
    "quantized": ("BF16", (3,)),
}


def _delta(name: str, like: torch.Tensor, indices: torch.Tensor | None, values: torch.Tensor) -> TensorDelta:
    return TensorDelta(ckpt_name=name, shape=tuple(like.shape), dtype=like.dtype, indices=indices, values=values)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n, (_, shape) in SPEC.items()}


def test_the_map_learned_from_the_loader_scatters_exactly_where_the_loader_writes() -> None:
    model = Fused()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pm = build_map(model, SPEC, model.load_weights)
    assert {n: p.detach() for n, p in model.named_parameters()}.keys() == before.keys()
    for n, p in model.named_parameters():  # the probes left the live parameters exactly as they were
        assert p.dtype == torch.bfloat16 and torch.equal(p.view(torch.int16), before[n].view(torch.int16))
    assert set(pm.unmapped) == {"quantized", "norm"} and "TypeError" in pm.unmapped["quantized"]
    assert "the loader transforms them" in pm.unmapped["norm"]
    assert [r.param for r in pm.runs["q"]] == ["qkv"] and int(pm.runs["v"][0].param_start[0]) == 16
    assert pm.runs["down"][0].length.tolist() == [3, 3, 3, 3]  # four rows of this rank's half

    truth = _weights(1)
    model.load_weights([(n, t) for n, t in truth.items() if n != "quantized"])
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_weights([(n, torch.zeros_like(t)) for n, t in truth.items() if n != "quantized"])
    dense = [_delta(n, t, None, t) for n, t in truth.items() if n in pm]
    ops = pm.plan(dense)
    assert pm.write(ops) > 0 and not pm.check_written(ops)
    for n, p in model.named_parameters():
        if n != "norm":  # unmapped: the engine reloads its module instead
            assert torch.equal(p.view(torch.int16), expected[n].view(torch.int16)), n

    new = {n: t.clone() for n, t in truth.items()}
    for t in new.values():
        t.view(-1)[::3] += 1
    sparse = []
    for n in pm.runs:
        idx = torch.nonzero(new[n].view(-1).view(torch.int16) != truth[n].view(-1).view(torch.int16)).squeeze(1)
        sparse.append(_delta(n, new[n], idx, new[n].view(-1)[idx]))
    ops = pm.plan(sparse)
    pm.write(ops)
    assert not pm.check_written(ops)
    model.load_weights([(n, t) for n, t in new.items() if n != "quantized"])  # what a full reload would give
    reloaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    values = pm.read_whole("q")
    assert values is not None and torch.equal(values.view(torch.int16), new["q"].view(-1).view(torch.int16))
    assert pm.read_whole("down") is None  # a rank holds part: the audit counts it as partial
    assert reloaded  # (kept for the reader: the scatter above equals this reload)


def test_a_parameter_that_changed_since_the_map_is_never_written() -> None:
    model = Fused()
    pm = build_map(model, SPEC, model.load_weights)
    model.qkv.data = torch.zeros(7, 4, dtype=torch.bfloat16)  # re-allocated behind the map's back
    d = _delta("q", torch.zeros(2, 4, dtype=torch.bfloat16), torch.tensor([0]), torch.ones(1, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="changed shape or dtype since the patch map was built"):
        pm.plan([d])


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 22])
@pytest.mark.parametrize("fast", [False, True], ids=["scan", "probe-compare"])
def test_runs_are_the_same_whatever_the_scan_chunk(monkeypatch: pytest.MonkeyPatch, chunk: int, fast: bool) -> None:
    """The probe scan reads a parameter in bounded chunks (an embedding has 10^8 elements); runs crossing a
    chunk edge are joined, runs are ordered by checkpoint index, and an element landing twice is caught. With
    the probe given, a chunk that is one stretch of it is taken in one compare: the same runs."""
    from deltasync.vllm import patch_map

    monkeypatch.setattr(patch_map, "_CHUNK", chunk)
    probe = torch.arange(1, 31, dtype=torch.int32) if fast else None
    flat = torch.zeros(40, dtype=torch.int32)
    flat[2:12] = torch.arange(21, 31)  # checkpoint 20..29 at 2..11
    flat[12:20] = torch.arange(1, 9)  # checkpoint 0..7 at 12..19 (adjacent in the parameter, not in the ckpt)
    flat[25:35] = torch.arange(9, 19)  # checkpoint 8..17 at 25..34
    r = patch_map._runs("p", flat, 30, probe)
    assert r is not None
    assert r.ckpt_start.tolist() == [0, 8, 20] and r.param_start.tolist() == [12, 25, 2]
    assert r.length.tolist() == [8, 10, 10]
    whole = torch.arange(1, 31, dtype=torch.int32)  # one tensor written whole: one run, however chunked
    r = patch_map._runs("p", whole, 30, probe)
    assert r is not None and (r.ckpt_start.tolist(), r.param_start.tolist(), r.length.tolist()) == ([0], [0], [30])
    flat[36] = 5  # checkpoint element 4 lands a second time
    with pytest.raises(ValueError, match="written twice"):
        patch_map._runs("p", flat, 30, probe)
    flat[36] = 31  # no element of a 30-element tensor
    with pytest.raises(ValueError, match="no element index"):
        patch_map._runs("p", flat, 30, probe)
    assert patch_map._runs("p", torch.zeros(9, dtype=torch.int32), 30, probe) is None
    twice = torch.cat([whole, whole])  # the whole tensor twice (chunks that each match the probe)
    with pytest.raises(ValueError, match="written twice"):
        patch_map._runs("p", twice, 30, probe)


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16)


def test_gather_and_plan_read_and_write_where_the_loader_does_at_every_offset() -> None:
    model = Fused()
    pm = build_map(model, SPEC, model.load_weights)
    truth = _weights(1)
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
    sparse = []
    for name in ("q", "k", "v", "down"):
        idx = torch.tensor([1, 4, 7]) if name != "down" else held
        _bits16(new[name])[idx] += 1
        sparse.append(_delta(name, new[name], idx, new[name].reshape(-1)[idx]))
    ops = pm.plan(sparse)
    # one scatter per checkpoint tensor, in order: the fused qkv gets three, with no joined copy of the indices
    assert [op.param for op in ops] == ["qkv", "qkv", "qkv", "down"]
    assert ops[0].index is sparse[0].indices and torch.equal(ops[1].index, sparse[1].indices + 8)
    assert pm.write(ops) == 13 and not pm.check_written(ops)
    written = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_weights([(n, t) for n, t in new.items() if n != "quantized"])  # what a full reload gives
    for n, p in model.named_parameters():
        assert torch.equal(_bits16(written[n]), _bits16(p.detach())), n


def test_parameters_are_resolved_by_name_as_get_parameter_does_even_after_a_reregistration() -> None:
    outer = torch.nn.Module()
    outer.inner = Fused()  # nested, as vLLM's models are: "inner.qkv"
    pm = build_map(outer, SPEC, outer.inner.load_weights)
    assert [r.param for r in pm.runs["q"]] == ["inner.qkv"]
    assert pm.param("inner.qkv") is outer.get_parameter("inner.qkv")
    fresh = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)
    outer.inner.register_parameter("qkv", fresh)  # a module reloaded in place re-registers its parameters
    assert pm.param("inner.qkv") is fresh
    d = _delta("q", torch.zeros(2, 4, dtype=torch.bfloat16), torch.tensor([1]), torch.ones(1, dtype=torch.bfloat16))
    pm.write(pm.plan([d]))
    assert float(fresh.view(-1)[1]) == 1.0
    del outer.inner  # gone: the lookup fails as get_parameter does, naming what is missing
    with pytest.raises(AttributeError, match="inner"):
        pm.param("inner.qkv")


class Wide(torch.nn.Module):
    """q, k, v fused into one parameter, large enough that a plan's writes and read-back run on threads."""

    ROWS, COLS = 256, 512

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * self.ROWS, self.COLS, dtype=torch.bfloat16), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(self.COLS, self.ROWS, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
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
    from deltasync.vllm import patch_map

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
    sparse = []
    for n in spec:
        idx = torch.nonzero(new[n].view(-1).view(torch.int16) != truth[n].view(-1).view(torch.int16)).squeeze(1)
        sparse.append(_delta(n, new[n], idx, new[n].view(-1)[idx]))
    jobs: list[int] = []
    real = patch_map.parallel_map

    def spy(fn, items, elements=0, cost=None):  # type: ignore[no-untyped-def]
        jobs.append(elements)
        return real(fn, items, elements, cost)

    monkeypatch.setattr(patch_map, "parallel_map", spy)
    ops = pm.plan(sparse)
    assert len(ops) == 4 and pm.write(ops) == sum(d.nnz for d in sparse)
    for name, p in model.named_parameters():
        assert torch.equal(p.view(torch.int16), dict(reference.named_parameters())[name].view(torch.int16)), name
    assert pm.check_written(ops) == []
    assert jobs and min(jobs) >= PARALLEL_MIN_ELEMENTS  # both went to the threads
    at = int(sparse[1].indices[len(sparse[1].indices) // 2]) + Wide.ROWS * Wide.COLS  # an element k wrote
    model.qkv.data.view(-1)[at] += 1
    assert pm.check_written(ops) == ["qkv"]


# Round-11 review: the pause's writes run on threads, so two writes over one element would race (found by an
# adversary: an aliasing map and an update with overlapping entries for one tensor were both written, racing).


def _one_run(param: str, param_start: int, n: int) -> list[Any]:
    from deltasync.vllm.patch_map import Runs

    return [Runs(param, torch.tensor([0]), torch.tensor([param_start]), torch.tensor([n]))]


def test_a_map_that_lands_two_tensors_on_one_element_is_refused() -> None:
    from deltasync.vllm.patch_map import PatchMap

    w = torch.nn.Parameter(torch.zeros(100, dtype=torch.bfloat16), requires_grad=False)
    PatchMap({"a": _one_run("w", 0, 50), "b": _one_run("w", 50, 50)}, {}, {"w": w}, 0.0)  # side by side: fine
    for b_start in (0, 49, 10):
        with pytest.raises(ValueError, match=r"'a' and 'b' both land on elements from \d+ of parameter 'w'"):
            PatchMap({"a": _one_run("w", 0, 50), "b": _one_run("w", b_start, 20)}, {}, {"w": w}, 0.0)
    with pytest.raises(ValueError, match="'b' and 'c' both land"):  # the overlap past a long run is found
        PatchMap({"a": _one_run("w", 0, 10), "b": _one_run("w", 20, 60), "c": _one_run("w", 70, 5)}, {}, {"w": w}, 0.0)


def test_an_update_with_overlapping_entries_for_one_tensor_is_refused_before_any_write() -> None:
    from deltasync.vllm.patch_map import PatchMap

    n = 1 << 19
    w = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
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
