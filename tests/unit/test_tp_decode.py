"""Tensor parallel ranks decode published objects against what each serves: a rank decodes the elements it holds,
and the ranks' changes, added up, prove the update before the first write (:func:`combine_changes`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from deltasync import LocalStore, compute_delta, read_manifest, write_anchor, write_delta
from deltasync.manifest import DeltaManifest
from deltasync.staging import read_staged
from deltasync.targets.base import combine_changes
from deltasync.testing.stream import UpdateStream
from deltasync.vllm.patch_map import PatchMap, Runs
from deltasync.vllm.proof import ProvingEngine
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
                    "parts": ProvingEngine._change_parts(self.pm, name, ds, torch.bfloat16),
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
