"""The ranks' changes to tensors held in parts are added up before the first write, through the engine's real
proof (:func:`deltasync.vllm.proof.prove_update`, each rank's map built by hand, no vLLM) and
``_VllmTarget.prepare``; a drifted base at a changed element is the documented limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltasync import LocalStore, compute_delta, write_anchor, write_delta
from deltasync.errors import UpdateRefused
from deltasync.staging import read_staged
from deltasync.targets.base import combine_changes
from deltasync.testing.stream import UpdateStream
from deltasync.vllm.proof import prove_update
from tests.support.staging import stage_as_published
from tests.unit.test_tp_decode import TP, Rank


def _publish_first_half_change(tmp: Path):
    """v0 anchor; v1 changes w only in its first 32 rows (rank 0's rows in a rows split), sparse."""
    store = LocalStore(tmp / "store")
    s0 = UpdateStream.from_shapes({"w": (64, 32), "b": (64,)}, seed=5).bf16()
    m0 = write_anchor(store, s0, version=0)
    s1 = {k: v.clone() for k, v in s0.items()}
    s1["w"][:32:5, ::7] += torch.tensor(0.01, dtype=torch.bfloat16)
    prev = {k: v.clone() for k, v in s0.items()}
    m1 = write_delta(store, compute_delta(prev, s1, update_prev=True), state=s1, version=1, base=m0)
    return store, s0, s1, m0, m1


def _answers(tmp: Path, store, s0, m0, m1, drift_rank: int | None):
    answers = []
    for r in range(TP):
        rank = Rank("rows", r, s0)
        if r == drift_rank:  # rank serves another value at a changed element: its decode is wrong
            live = rank.params["w_p"].data.view(-1)
            live[0] = live[0] * 2  # the same sign: the ordinal code moves new and old alike
        root = tmp / f"stage{r}"
        obj = stage_as_published(store, root / "v1", 1, "delta")
        _, deltas = read_staged(obj, root=root, base=rank.source())
        changes = prove_update(rank.pm, m0, [(m1, deltas)], [rank.pm.plan(deltas)])
        answers.append({"ok": True, "changes": changes})
    return answers


def test_split_change_on_both_ranks_is_proven(tmp_path: Path) -> None:
    """A delta that changes both halves of a rows-split tensor: each rank reports its parts, added up proven."""
    store = LocalStore(tmp_path / "store")
    stream = UpdateStream.from_shapes({"w": (64, 32), "b": (64,)}, seed=5, lr=3e-5)
    s0 = stream.bf16()
    m0 = write_anchor(store, s0, version=0)
    s1 = stream.step()
    prev = {k: v.clone() for k, v in s0.items()}
    m1 = write_delta(store, compute_delta(prev, s1, update_prev=True), state=s1, version=1, base=m0)
    answers = _answers(tmp_path, store, s0, m0, m1, None)
    assert combine_changes(answers) == ([], [])


def test_first_half_change_is_added_up_before_the_write(tmp_path: Path) -> None:
    """Changes that all fall in rank 0's rows: the ranks' parts must still be added up and prove the tensor
    before any write (proven, not left to the audit after the pause)."""
    store, s0, _, m0, m1 = _publish_first_half_change(tmp_path)
    answers = _answers(tmp_path, store, s0, m0, m1, None)
    bad, unproven = combine_changes(answers)
    assert bad == []
    assert "w" not in unproven, "a split tensor whose changes lie in one rank's part is not added up"


def test_a_drifted_base_at_a_changed_element_is_the_documented_limit(tmp_path: Path) -> None:
    """Rank 0 (holding every changed element) serves a drifted value at a changed element. The rank decodes the
    new value from the drifted one and its change (new - old) is what was published, so the sum before the write
    proves the update, as on one rank (docs/RELIABILITY.md: the limit of proving from the changed elements); the
    drift itself is found by the whole-state proof, which adds up every rank's whole part."""
    store, s0, _, m0, m1 = _publish_first_half_change(tmp_path)
    # drift exactly at the first changed element (flat 0 is row 0 col 0: changed by [:32:5, ::7]), same sign
    answers = _answers(tmp_path, store, s0, m0, m1, drift_rank=0)
    assert combine_changes(answers) == ([], [])


class _FakeTarget:
    """_VllmTarget.prepare over a scripted RPC."""

    def __init__(self, answers):
        from deltasync.targets.vllm import _VllmTarget

        self.cls = _VllmTarget
        self.answers = answers

    def prepare(self, update):
        answers = self.answers

        class T(self.cls):
            def _rpc(self, method, **kwargs):
                return answers

        return T().prepare(update)


def _update():
    from deltasync.staging import StagedObject, StagedUpdate

    obj = StagedObject(kind="delta", version=1, base_version=0, manifest_path="/x/manifest.json", shard_paths=("/x/s",))
    return StagedUpdate(objects=(obj,))


def _bad_answer():
    from deltasync.sketch import ZERO, format_sketch, tensor_sketch

    a = tensor_sketch(torch.randn(64).to(torch.bfloat16))
    b = tensor_sketch(torch.randn(64).to(torch.bfloat16))
    return {
        "ok": True,
        "changes": {"w": {"parts": [["p", format_sketch(ZERO), 64]], "served": a, "published": b, "numel": 64}},
    }


def test_prepare_refuses_bad_parts() -> None:
    """Two ranks whose parts do not give the published sketch: prepare refuses before the pause."""
    with pytest.raises(UpdateRefused):
        _FakeTarget([_bad_answer(), {"ok": True, "changes": {}}]).prepare(_update())


def test_prepare_refuses_bad_parts_even_if_another_rank_failed() -> None:
    """One rank's parts are provably bad; another rank failed to prepare (no refusal): the update must not go on."""
    with pytest.raises(UpdateRefused):
        _FakeTarget([_bad_answer(), {"ok": False, "refused": None, "message": "boom"}]).prepare(_update())
