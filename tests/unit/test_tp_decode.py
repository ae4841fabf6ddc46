"""Tensor parallel ranks decode published objects against what each serves: a rank decodes exactly the elements
it holds (rows split, columns split, or a replicated 1-D tensor) and never writes a placeholder, over catch-ups
with dense objects and anchors in the middle; the ranks' changes, added up, prove the update before the first
write (:func:`combine_changes`), and no malformed, disagreeing or lying answer from a rank counts as proof.

Each rank is simulated by hand: a :class:`PatchMap` over its own slice of a tensor, a ``live`` reader over its
parameter and a ``holds`` mask derived from the map."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from deltasync import LocalStore, compute_delta, read_manifest, write_anchor, write_delta
from deltasync.errors import FormatError
from deltasync.format import PartialBaseValues
from deltasync.manifest import DeltaManifest
from deltasync.sketch import format_sketch, parse_sketch, sub_sketches
from deltasync.staging import read_staged
from deltasync.targets.base import combine_changes
from deltasync.testing.stream import UpdateStream
from deltasync.vllm.model import held_in_part
from deltasync.vllm.patch_map import PatchMap, Runs
from deltasync.vllm.proof import change_parts
from deltasync.vllm.served import ServedValues
from tests.support.staging import stage_as_published


def _runs(name: str, shape: tuple[int, ...], rank: int, ranks: int, by: str) -> list[Runs]:
    """Rank ``rank``'s part of a 2-D tensor, split over ``ranks`` by rows (one run, as a column parallel layer) or
    by columns (one run per row, as a row parallel layer); a 1-D tensor is replicated."""
    numel = math.prod(shape)
    if len(shape) == 1 or by == "replicated":
        return [Runs(f"p.{name}", torch.tensor([0]), torch.tensor([0]), torch.tensor([numel]))]
    rows, cols = shape
    if by == "rows":
        n = rows // ranks
        return [Runs(f"p.{name}", torch.tensor([rank * n * cols]), torch.tensor([0]), torch.tensor([n * cols]))]
    n = cols // ranks
    starts = torch.arange(rows, dtype=torch.int64) * cols + rank * n
    return [Runs(f"p.{name}", starts, torch.arange(rows, dtype=torch.int64) * n, torch.full((rows,), n))]


def _elements(r: Runs) -> torch.Tensor:
    """The checkpoint flat indices a run set holds, in parameter order."""
    pieces = zip(r.ckpt_start.tolist(), r.length.tolist(), strict=True)
    return torch.cat([torch.arange(c, c + n) for c, n in pieces])


class _Rank:
    """One rank in place: its live parameters (its parts of the tensors) and its map."""

    def __init__(self, served: dict[str, torch.Tensor], rank: int, ranks: int, by: str) -> None:
        runs = {n: _runs(n, tuple(t.shape), rank, ranks, by) for n, t in served.items()}
        params = {}
        for name, rs in runs.items():
            (r,) = rs
            flat = served[name].reshape(-1)
            params[r.param] = torch.nn.Parameter(flat[_elements(r)].clone(), requires_grad=False)
        self.pm = PatchMap(runs, {}, params, 0.0)
        self.reads = 0

    def live(self, name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        self.reads += indices.numel()
        return self.pm.gather(name, indices)

    def holds(self, name: str, indices: torch.Tensor) -> torch.Tensor | None:
        mask = None
        for r in self.pm.runs[name]:
            held, _ = r.locate(indices)
            mask = held if mask is None else mask | held
        return None if mask is None or bool(mask.all()) else mask

    def decode(self, objects: list, root: Path) -> list[tuple[DeltaManifest, list]]:
        source = ServedValues(self.live, self.holds)
        out = []
        for obj in objects:
            m, deltas = read_staged(obj, root=root, base=source)
            source.advance(deltas)
            out.append((m, deltas))
        return out

    def changes(self, decoded: list[tuple[DeltaManifest, list]], served: DeltaManifest) -> dict:
        """What the engine's prepare returns for the tensors it holds in part."""
        out = {}
        last = decoded[-1][0]
        for name in last.tensors:
            ds = [d for _, deltas in decoded for d in deltas if d.ckpt_name == name]
            if ds and any(d.held is not None for d in ds):
                entry = last.tensors[name]
                out[name] = {
                    "parts": change_parts(self.pm, name, ds, torch.bfloat16),
                    "served": served.tensors[name].sketch,
                    "published": entry.sketch,
                    "numel": entry.numel,
                }
        return out


@pytest.fixture
def run(tmp_path: Path, update_stream: UpdateStream) -> tuple[LocalStore, dict[int, dict[str, torch.Tensor]]]:
    store = LocalStore(tmp_path / "store")
    curr = update_stream.bf16()
    truth = {0: {k: v.clone() for k, v in curr.items()}}
    prev = {k: v.clone() for k, v in curr.items()}
    base = write_anchor(store, curr, version=0)
    for v in (1, 2, 3):
        update_stream.lr = 1e-4 if v == 3 else 1e-6  # v3 changes most elements: some entries are dense
        curr = update_stream.step()
        base = write_delta(store, compute_delta(prev, curr, update_prev=True), state=curr, version=v, base=base)
        truth[v] = {k: t.clone() for k, t in curr.items()}
    return store, truth


@pytest.mark.parametrize("by", ["rows", "columns"])
def test_each_rank_decodes_the_elements_it_holds_and_the_changes_add_up(run, tmp_path: Path, by: str) -> None:
    store, truth = run
    objects = [stage_as_published(store, tmp_path / f"v{v}", v) for v in (2, 3)]  # a catch-up from v1
    ranks = [_Rank(truth[1], r, 2, by) for r in range(2)]
    answers = []
    for rank in ranks:
        decoded = rank.decode(objects, tmp_path)
        for name, t in truth[3].items():
            (r,) = rank.pm.runs[name]
            want = t.reshape(-1)
            got = rank.pm.param(r.param).data.clone()
            for _, deltas in decoded:
                rank.pm.write(rank.pm.plan(deltas), into={r.param: got})
            assert torch.equal(got.view(torch.int16), want[_elements(r)].view(torch.int16)), name
        # only elements this rank holds were read, and placeholders were never decoded against a base
        partial = [d for _, ds in decoded for d in ds if d.held is not None]
        assert partial and all(not bool(d.values.reshape(-1)[~d.held].view(torch.int16).any()) for d in partial)
        answers.append({"ok": True, "changes": rank.changes(decoded, read_manifest(store, 1, "delta"))})
    bad, unproven = combine_changes(answers)
    assert (bad, unproven) == ([], [])
    assert sum(len(a["changes"]) for a in answers) == 2 * sum(1 for t in truth[3].values() if t.dim() == 2)
    # a rank reads what it serves at the changed elements it holds, and nowhere else
    rank = _Rank(truth[1], 1, 2, by)
    ((_, deltas),) = rank.decode(objects[:1], tmp_path)
    assert rank.reads == sum(d.nnz if d.held is None else int(d.held.sum()) for d in deltas)
    assert rank.reads < sum(d.nnz for d in deltas)


def test_a_rank_that_leaves_out_a_change_it_holds_is_caught_before_the_write(run, tmp_path: Path) -> None:
    """A rank whose decode skips an element it holds (its mask and its map disagree) would write a placeholder
    there: its changes no longer add up to the published sketch, and the update is refused before the pause."""
    store, truth = run
    served = read_manifest(store, 1, "delta")
    objects = [stage_as_published(store, tmp_path / "v2", 2)]
    ranks = [_Rank(truth[1], r, 2, "rows") for r in range(2)]
    victim = next(n for n, t in truth[1].items() if t.dim() == 2)
    holds = ranks[1].holds

    def skips_one(name: str, indices: torch.Tensor) -> torch.Tensor | None:
        mask = holds(name, indices)
        if name == victim and mask is not None:
            mask = mask.clone()
            mask[int(torch.nonzero(mask)[0])] = False
        return mask

    ranks[1].holds = skips_one  # type: ignore[method-assign]
    answers = [{"ok": True, "changes": rank.changes(rank.decode(objects, tmp_path), served)} for rank in ranks]
    assert combine_changes(answers) == ([victim], [])
    # a rank that claims another served version is never added up with the others
    ranks[1].holds = holds  # type: ignore[method-assign]
    answers = [{"ok": True, "changes": rank.changes(rank.decode(objects, tmp_path), served)} for rank in ranks]
    assert combine_changes(answers) == ([], [])
    change = answers[0]["changes"][victim]
    answers[0]["changes"][victim] = {**change, "served": change["published"]}
    assert combine_changes(answers)[0] == [victim]


def test_parts_that_overlap_are_left_to_the_proof_after_the_write(run, tmp_path: Path) -> None:
    store, truth = run
    served = read_manifest(store, 1, "delta")
    objects = [stage_as_published(store, tmp_path / "v2", 2)]
    # rank 0 holds the first half of each tensor's rows, rank 1 all of it (a replicated slice): no partition
    ranks = [_Rank(truth[1], 0, 2, "rows"), _Rank(truth[1], 0, 1, "rows")]
    answers = [{"ok": True, "changes": rank.changes(rank.decode(objects, tmp_path), served)} for rank in ranks]
    bad, unproven = combine_changes(answers)
    assert bad == [] and set(unproven) == set(answers[0]["changes"])


def test_a_decode_against_whole_tensors_marks_every_element_decoded(run, tmp_path: Path) -> None:
    """An agent's decode against its host copy (whole tensors) decodes every element: no entry says it was decoded
    in part, so a plan writes all of it (a mask taken from anything else would drop or misplace changes)."""
    store, truth = run
    _, deltas = read_staged(stage_as_published(store, tmp_path / "v2", 2), root=tmp_path, base=truth[1])
    assert deltas and all(d.held is None for d in deltas)
    ranks = _Rank(truth[1], 0, 1, "rows")  # one rank holding every tensor whole
    planned = sum(op.index.numel() for op in ranks.pm.plan(deltas) if hasattr(op, "index"))
    assert planned == sum(d.nnz for d in deltas if d.indices is not None)


SHAPES = {"w": (64, 32), "b": (64,)}
TP = 2


def _layout_runs(layout: str, rank: int) -> dict[str, list[Runs]]:
    t = torch.tensor
    if layout == "rows":  # rank r holds rows [32 r, 32 r + 32) of w
        w = Runs("w_p", t([rank * 1024]), t([0]), t([1024]))
    elif layout == "cols":  # rank r holds columns [16 r, 16 r + 16) of every row
        w = Runs("w_p", torch.arange(64) * 32 + 16 * rank, torch.arange(64) * 16, torch.full((64,), 16))
    else:
        raise AssertionError(layout)
    return {"w": [w], "b": [Runs("b_p", t([0]), t([0]), t([64]))]}  # b replicated on every rank


def _param_values(runs: dict[str, list[Runs]], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, rs in runs.items():
        full = state[name].reshape(-1)
        for r in rs:
            n = int(r.length.sum())
            flat = out.setdefault(r.param, torch.zeros(n, dtype=full.dtype))
            for c, p, k in zip(r.ckpt_start.tolist(), r.param_start.tolist(), r.length.tolist(), strict=True):
                flat[p : p + k] = full[c : c + k]
    return out


def engine_holds(pm: PatchMap, name: str, indices: torch.Tensor) -> torch.Tensor | None:
    """What the engine answers (:meth:`ServedModel.holds`) for a rank with map ``pm``."""
    spec = {n: ("BF16", SHAPES[n]) for n in pm.runs}
    return held_in_part(pm, spec, name, indices)


class Rank:
    """One TP rank: its map, its live parameters, and how it reads and holds."""

    def __init__(self, layout: str, rank: int, state: dict[str, torch.Tensor]) -> None:
        self.runs = _layout_runs(layout, rank)
        vals = _param_values(self.runs, state)
        self.params = {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in vals.items()}
        self.pm = PatchMap(self.runs, {}, self.params, 0.0)

    def live(self, name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(indices.numel(), dtype=dtype)
        covered = torch.zeros(indices.numel(), dtype=torch.bool)
        for r in self.pm.runs[name]:
            held, where = r.locate(indices)
            out[held] = self.params[r.param].data.view(-1)[where].to(dtype)
            covered |= held
        if not bool(covered.all()):
            raise FormatError(f"rank reads {name} where it holds nothing")
        return out

    def holds(self, name: str, indices: torch.Tensor) -> torch.Tensor | None:
        return engine_holds(self.pm, name, indices)

    def source(self, holds=None) -> ServedValues:
        return ServedValues(self.live, self.holds if holds is None else holds)

    def flat_copy(self) -> dict[str, torch.Tensor]:
        return {k: p.data.view(-1).clone() for k, p in self.params.items()}

    def expected(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _param_values(self.runs, state)


def _publish(tmp: Path, steps: int, *, dense_at: set[int] = frozenset(), anchor_at: set[int] = frozenset(), lr=3e-5):
    """Anchor v0 then ``steps`` versions (a delta each, dense entries at ``dense_at``, also an anchor at
    ``anchor_at``). Returns the store, the states and the manifests (by (version, kind))."""
    store = LocalStore(tmp / "store")
    stream = UpdateStream.from_shapes(SHAPES, seed=3, lr=lr)
    states = [stream.bf16()]
    manifests = {(0, "anchor"): write_anchor(store, states[0], version=0)}
    prev = {k: v.clone() for k, v in states[0].items()}
    base = manifests[(0, "anchor")]
    for v in range(1, steps + 1):
        curr = stream.step()
        frac = 1e-9 if v in dense_at else 0.5
        changes = compute_delta(prev, curr, update_prev=True, dense_fraction=frac)
        assert changes, "the stream must change something"
        m = write_delta(store, changes, state=curr, version=v, base=base)
        manifests[(v, "delta")] = m
        base = m
        if v in anchor_at:
            manifests[(v, "anchor")] = base = write_anchor(store, curr, version=v)
        states.append(curr)
    return store, states, manifests


def _decode(store, tmp: Path, version: int, kind: str, source) -> list:
    root = tmp / "stage"
    obj = stage_as_published(store, root / f"v{version}-{kind}", version, kind)
    _, deltas = read_staged(obj, root=root, base=source)
    return deltas


def _assert_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k in want:
        g, w = got[k].view(torch.int16), want[k].view(torch.int16)
        diff = (g != w).nonzero().reshape(-1)
        assert diff.numel() == 0, f"{k}: {diff.numel()} elements differ, first at {diff[:5].tolist()}"


def _answer(rank: Rank, deltas: list, served_m, published_m) -> dict:
    """A rank's deltasync_prepare answer for the tensors it holds in part (as :func:`prove_update` builds it)."""
    changes = {}
    by_name: dict[str, list] = {}
    for d in deltas:
        by_name.setdefault(d.ckpt_name, []).append(d)
    for name, ds in by_name.items():
        if not any(d.held is not None for d in ds):
            continue
        entry = published_m.tensors[name]
        changes[name] = {
            "parts": change_parts(rank.pm, name, ds, torch.bfloat16),
            "served": served_m.tensors[name].sketch,
            "published": entry.sketch,
            "numel": entry.numel,
        }
    return {"ok": True, "changes": changes}


def test_served_values_is_partial_base() -> None:
    """ServedValues is the PartialBaseValues a decoder checks for (else nothing is decoded in part)."""
    assert isinstance(ServedValues(lambda n, i, d: torch.zeros(0)), PartialBaseValues)


@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_each_rank_writes_exactly_its_elements(tmp_path: Path, layout: str) -> None:
    """(a) every delta, one at a time, decoded on each rank against its own live values: the planned writes give
    exactly the published values at the rank's elements (rows split, columns split, replicated bias)."""
    store, states, _ = _publish(tmp_path, 3, dense_at={2})
    ranks = [Rank(layout, r, states[0]) for r in range(TP)]
    for v in range(1, 4):
        for r, rank in enumerate(ranks):
            deltas = _decode(store, tmp_path / f"r{r}", v, "delta", rank.source())
            ops = rank.pm.plan(deltas)
            rank.pm.write(ops)  # the live parameters (the rank's own)
            _assert_params(rank.flat_copy(), rank.expected(states[v]))


@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_placeholders_are_never_written(tmp_path: Path, layout: str) -> None:
    """(a)/(b) a decoded entry's held mask is exactly the rank's map mask at its elements (so the sparse and dense
    plans, which write only the map's elements, never reach a placeholder when mask and map agree)."""
    store, states, _ = _publish(tmp_path, 2, dense_at={2})
    for r in range(TP):
        rank = Rank(layout, r, states[0])
        for v in (1, 2):
            deltas = _decode(store, tmp_path / f"r{r}", v, "delta", rank.source())
            for d in deltas:
                if d.held is None:
                    continue
                at = d.indices if d.indices is not None else torch.arange(*d.bounds)
                mask = rank.holds(d.ckpt_name, at)
                assert mask is not None and torch.equal(mask, d.held)
            rank.pm.write(rank.pm.plan(deltas))


def _assert_catch_up(tmp_path: Path, store, states, layout: str, plan: list[tuple[int, str]]) -> None:
    """Every rank decodes the session's objects in order (each against the earlier ones' results) and plans each;
    all the plans written in order into a copy of its v0 parameters give the last version's."""
    for r in range(TP):
        rank = Rank(layout, r, states[0])
        sv = rank.source()
        all_ops = []
        for v, kind in plan:
            deltas = _decode(store, tmp_path / f"r{r}", v, kind, sv)
            sv.advance(deltas)
            all_ops.append(rank.pm.plan(deltas))
        flat = rank.flat_copy()
        for ops in all_ops:
            rank.pm.write(ops, into=flat)
        _assert_params(flat, rank.expected(states[plan[-1][0]]))


@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_catch_up_with_dense_and_anchor_in_the_middle(tmp_path: Path, layout: str) -> None:
    """(d) a catch-up delta v1, anchor v2, delta v3 (dense), delta v4 in one session: each later object decodes
    against the earlier ones' results, at held elements only; all plans written in order give v4."""
    store, states, _ = _publish(tmp_path, 4, dense_at={3}, anchor_at={2})
    _assert_catch_up(tmp_path, store, states, layout, [(1, "delta"), (2, "anchor"), (3, "delta"), (4, "delta")])


@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_catch_up_of_deltas_only(tmp_path: Path, layout: str) -> None:
    """(d) a catch-up of four deltas (one dense in the middle) with no anchor: every later object decodes against
    the session's overlay, never the stale live values."""
    store, states, _ = _publish(tmp_path, 4, dense_at={2})
    _assert_catch_up(tmp_path, store, states, layout, [(v, "delta") for v in range(1, 5)])


@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_combine_changes_proves_split_and_leaves_replicated_unproven(tmp_path: Path, layout: str) -> None:
    """(c) the ranks' parts of a split tensor add up to the published sketch (proven, not bad); the replicated
    bias (each rank holds all of it) must be unproven, never proven."""
    store, states, ms = _publish(tmp_path, 2, dense_at={2})
    for v in (1, 2):
        ranks = [Rank(layout, r, states[v - 1]) for r in range(TP)]
        answers = []
        for r, rank in enumerate(ranks):
            deltas = _decode(store, tmp_path / f"r{r}v{v}", v, "delta", rank.source())
            answers.append(_answer(rank, deltas, ms[(v - 1, "delta" if v > 1 else "anchor")], ms[(v, "delta")]))
        bad, unproven = combine_changes(answers)
        assert bad == []
        assert "w" not in unproven
        assert "w" in answers[0]["changes"]
        assert "b" not in answers[0]["changes"] or "b" in unproven  # held whole: proven by the rank itself


@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_combine_changes_catches_a_rank_with_a_wrong_base(tmp_path: Path, layout: str) -> None:
    """(c) one rank serves another value at an element the delta changes (drift): its decode is wrong, and the
    added-up parts must be bad before any write."""
    store, states, ms = _publish(tmp_path, 1)
    ranks = [Rank(layout, r, states[0]) for r in range(TP)]
    # find a changed element of w held by rank 1
    changed = states[1]["w"].reshape(-1).view(torch.int16) != states[0]["w"].reshape(-1).view(torch.int16)
    idx = changed.nonzero().reshape(-1)
    held = ranks[1].holds("w", idx)
    target = idx[held][0:1] if held is not None else idx[0:1]
    _, where = ranks[1].pm.runs["w"][0].locate(target)
    ranks[1].params["w_p"].data.view(-1)[where] += torch.tensor(0.5, dtype=torch.bfloat16)
    answers = []
    for r, rank in enumerate(ranks):
        deltas = _decode(store, tmp_path / f"r{r}", 1, "delta", rank.source())
        answers.append(_answer(rank, deltas, ms[(0, "anchor")], ms[(1, "delta")]))
    bad, _ = combine_changes(answers)
    assert bad == ["w"]


def _part_answer(served: str, published: str, numel: int, parts: list) -> dict:
    return {"ok": True, "changes": {"w": {"parts": parts, "served": served, "published": published, "numel": numel}}}


def test_combine_changes_replicated_parts_are_unproven() -> None:
    """(c) two ranks each holding the whole tensor in a parameter of one name (replicated) with a correct change:
    never proven (the sum counts twice), reported unproven, never bad-free proven."""
    from deltasync.sketch import sketch_range, tensor_sketch

    old = torch.randn(64).to(torch.bfloat16)
    new = old.clone()
    new[3] += 1
    served, published = tensor_sketch(old), tensor_sketch(new)
    change = format_sketch(sub_sketches(parse_sketch(published), parse_sketch(served)))
    ranks = [_part_answer(served, published, 64, [["b_p", change, 64]]) for _ in range(2)]
    bad, unproven = combine_changes(ranks)
    assert unproven == ["w"] and bad == []
    # parts that overlap and leave a hole, but count up to numel: rank 0 and rank 1 both hold [0, 32)
    half = format_sketch(sub_sketches(sketch_range(new[:32], 0), sketch_range(old[:32], 0)))
    ranks = [_part_answer(served, published, 64, [["b_p", half, 32]]) for _ in range(2)]
    bad, unproven = combine_changes(ranks)
    assert bad == ["w"] or unproven == ["w"]  # never accepted as proven


def test_combine_changes_overlap_that_counts_to_numel_with_zero_change_is_not_proven() -> None:
    """(c) rank 0 and rank 1 both claim the same half [0, 32) (overlap) and nobody holds [32, 64); the update changes
    nothing in [0, 32) and the published sketch equals served plus a change in [32, 64) that nobody decoded. The
    counts add up to numel: combine_changes must not report it fine unless the sketches prove it."""
    from deltasync.sketch import ZERO, tensor_sketch

    old = torch.randn(64).to(torch.bfloat16)
    new = old.clone()
    new[40] += 1
    served, published = tensor_sketch(old), tensor_sketch(new)
    ranks = [_part_answer(served, published, 64, [["p", format_sketch(ZERO), 32]]) for _ in range(2)]
    bad, unproven = combine_changes(ranks)
    assert bad == ["w"] or unproven == ["w"]


def test_combine_changes_ranks_disagreeing_on_sketches_are_bad() -> None:
    """(c) ranks claiming different served or published sketches (serving different versions) are bad."""
    from deltasync.sketch import ZERO, tensor_sketch

    a = tensor_sketch(torch.randn(64).to(torch.bfloat16))
    b = tensor_sketch(torch.randn(64).to(torch.bfloat16))
    z = format_sketch(ZERO)
    r0 = _part_answer(a, a, 64, [["p", z, 32]])
    r1 = _part_answer(b, b, 64, [["p", z, 32]])
    assert combine_changes([r0, r1])[0] == ["w"]
    r1 = _part_answer(a, b, 64, [["p", z, 32]])
    assert combine_changes([r0, r1])[0] == ["w"]
    r1 = _part_answer(a, a, 65, [["p", z, 32]])
    assert combine_changes([r0, r1])[0] == ["w"]


@pytest.mark.parametrize(
    "answer",
    [
        None,
        "ok",
        {"ok": True, "changes": ["w"]},
        {"ok": True, "changes": {"w": {"parts": [["p", "garbage", 64]], "served": "x", "published": "x", "numel": 64}}},
        {"ok": True, "changes": {"w": {"served": "x", "published": "x", "numel": 64}}},
        {"ok": True, "changes": {"w": {"parts": [["p", "x"]], "served": "x", "published": "x", "numel": 64}}},
    ],
)
def test_combine_changes_malformed_answer_never_accepted(answer) -> None:
    """(c) a malformed rank answer next to a good one: either an exception or the tensor is bad/unproven, never
    a clean ([], []) result."""
    from deltasync.sketch import ZERO, tensor_sketch

    s = tensor_sketch(torch.randn(64).to(torch.bfloat16))
    good = _part_answer(s, s, 64, [["p", format_sketch(ZERO), 32]])
    try:
        bad, unproven = combine_changes([good, answer])
    except Exception:  # noqa: BLE001 - a crash is a refusal here, not an acceptance
        return
    assert bad or unproven


def test_combine_changes_negative_count_cannot_fake_coverage() -> None:
    """(c) a rank claiming a negative element count must not make overlapping parts look like an exact cover."""
    from deltasync.sketch import ZERO, tensor_sketch

    old = torch.randn(64).to(torch.bfloat16)
    s = tensor_sketch(old)
    z = format_sketch(ZERO)
    ranks = [
        _part_answer(s, s, 64, [["p", z, 64]]),
        _part_answer(s, s, 64, [["p", z, 64]]),
        _part_answer(s, s, 64, [["p", z, -64]]),
    ]
    bad, unproven = combine_changes(ranks)
    assert bad or unproven


@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_held_mask_narrower_than_map_never_writes_placeholders(tmp_path: Path, layout: str) -> None:
    """(b) a rank whose held mask leaves out elements its map holds (mask and map disagree): the placeholders of
    those elements must never be written; either decoding refuses, or combine_changes says bad, or the writes hold
    only published values."""
    store, states, ms = _publish(tmp_path, 1, dense_at={1})  # a dense delta entry: unchanged elements inside it
    ranks = [Rank(layout, r, states[0]) for r in range(TP)]
    unchanged = states[1]["w"].reshape(-1).view(torch.int16) == states[0]["w"].reshape(-1).view(torch.int16)

    def narrower(rank: Rank):
        def holds(name: str, indices: torch.Tensor):
            mask = rank.holds(name, indices)
            if name != "w" or mask is None:
                return mask
            mask = mask.clone()
            first = (mask & unchanged[indices]).nonzero().reshape(-1)[:3]  # drop three unchanged held elements
            mask[first] = False
            return mask

        return holds

    answers, writes = [], []
    for r, rank in enumerate(ranks):
        try:
            deltas = _decode(store, tmp_path / f"r{r}", 1, "delta", rank.source(narrower(rank)))
        except FormatError:
            return  # refused before any write
        answers.append(_answer(rank, deltas, ms[(0, "anchor")], ms[(1, "delta")]))
        flat = rank.flat_copy()
        rank.pm.write(rank.pm.plan(deltas), into=flat)
        writes.append((rank, flat))
    bad, _ = combine_changes(answers)
    if bad:
        return  # refused before any write
    for rank, flat in writes:
        _assert_params(flat, rank.expected(states[1]))
