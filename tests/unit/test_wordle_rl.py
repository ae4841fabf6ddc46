"""The Wordle trainer's asynchronous parts (examples/wordle): version tags from vLLM's spans, the staleness bound at
consumption, and the GRPO loss with its truncated importance ratio, on a real tiny Qwen3."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from examples.wordle.grpo import grpo_tis_loss
from examples.wordle.rollouts import Completion, Group, RolloutQueue, Unlabelled, version_range


def _span(version: str, start: int, end: int) -> dict[str, object]:
    return {"version": version, "start": start, "end": end}


def test_versions_come_from_the_spans_and_a_request_may_span_an_update() -> None:
    assert version_range([_span("4", 0, 12)]) == (4, 4)
    assert version_range([_span("4", 0, 3), _span("5", 3, 12)]) == (4, 5)


@pytest.mark.parametrize(
    "spans",
    [None, [], [_span("default", 0, 12)], [_span("3", 0, 2), _span("unhealthy", 2, 12)], [_span("v3", 0, 1)]],
)
def test_tokens_without_a_numbered_version_are_refused(spans) -> None:
    with pytest.raises(Unlabelled):
        version_range(spans)


def _group(first: int, last: int | None = None, reward: float = 0.0) -> Group:
    c = Completion([1, 2], [-1.0, -1.0], reward, first, first if last is None else last)
    return Group([5, 6], [c, c], time.time())


def _never() -> None:
    pass


def test_stale_groups_are_dropped_and_counted_judged_by_their_oldest_token() -> None:
    stop = threading.Event()
    q = RolloutQueue(maxsize=8, max_staleness=2)
    for g in (_group(0), _group(1, 3), _group(3)):
        q.put(g, stop)
    taken, waited = q.take(trainer_version=3, check=_never)
    assert (taken.oldest_version, taken.newest_version) == (1, 3) and taken.spans_update
    assert q.dropped == 1 and dict(q.staleness) == {2: 1} and waited == 0.0
    assert q.take(trainer_version=3, check=_never)[0].oldest_version == 3
    assert dict(q.staleness) == {2: 1, 0: 1}


def test_the_trainer_waits_only_when_nothing_fresh_enough_is_queued() -> None:
    stop = threading.Event()
    q = RolloutQueue(maxsize=2, max_staleness=0)
    q.put(_group(4), stop)  # stale for a trainer at v5 with a bound of 0
    threading.Timer(0.3, lambda: q.put(_group(5), stop)).start()
    group, waited = q.take(trainer_version=5, check=_never)
    assert group.oldest_version == 5 and q.dropped == 1 and waited >= 0.25


def test_a_failed_worker_is_raised_in_the_trainer_while_it_waits() -> None:
    def check() -> None:
        raise RuntimeError("a rollout worker failed: boom")

    with pytest.raises(RuntimeError, match="boom"):
        RolloutQueue(maxsize=1, max_staleness=2).take(trainer_version=0, check=check)


def test_a_full_queue_blocks_producers_until_stopped() -> None:
    stop = threading.Event()
    q = RolloutQueue(maxsize=1, max_staleness=2)
    q.put(_group(0), stop)
    t = threading.Thread(target=q.put, args=(_group(1), stop))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()
    stop.set()
    t.join(timeout=2)
    assert not t.is_alive()


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _logprobs(model, prompt: list[int], reply: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + reply])).logits.float()
    lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(reply)]


def _groups(model, behaviour_shift: float = 0.0) -> list[Group]:
    prompt, replies, rewards = [3, 9, 27, 81], [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [1.0, 0.0, 0.5]
    completions = [
        Completion(r, [x + behaviour_shift for x in _logprobs(model, prompt, r)], rw, 2, 2)
        for r, rw in zip(replies, rewards, strict=True)
    ]
    return [Group(prompt, completions, time.time())]


def test_on_policy_rollouts_have_unit_importance_weights(model) -> None:
    _, stats = grpo_tis_loss(model, _groups(model), pad_id=0, cap=2.0)
    assert stats.is_weight_mean == pytest.approx(1.0, abs=1e-4) and stats.logprob_gap < 1e-4
    assert stats.is_capped == 0.0 and stats.reward == pytest.approx(0.5)


def test_the_importance_ratio_is_truncated_at_the_cap(model) -> None:
    # vLLM sampled these tokens with far lower probability than the trainer now gives them: ratio e^3, capped at 2
    _, stats = grpo_tis_loss(model, _groups(model, behaviour_shift=-3.0), pad_id=0, cap=2.0)
    assert stats.is_weight_mean == pytest.approx(2.0) and stats.is_capped == 1.0
    assert stats.logprob_gap == pytest.approx(3.0, abs=1e-3)
    # and a ratio below 1 is kept as it is (truncation only caps)
    _, low = grpo_tis_loss(model, _groups(model, behaviour_shift=1.0), pad_id=0, cap=2.0)
    assert low.is_weight_mean == pytest.approx(torch.exp(torch.tensor(-1.0)).item(), rel=1e-3)


def test_a_step_raises_the_rewarded_reply_and_lowers_the_unrewarded_one(model) -> None:
    import copy

    m = copy.deepcopy(model)
    groups = _groups(m)
    prompt, best, worst = groups[0].prompt_ids, groups[0].completions[0], groups[0].completions[1]
    before = (sum(_logprobs(m, prompt, best.token_ids)), sum(_logprobs(m, prompt, worst.token_ids)))
    loss, _ = grpo_tis_loss(m, groups, pad_id=0)
    loss.backward()
    with torch.no_grad():
        for p in m.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
    after = (sum(_logprobs(m, prompt, best.token_ids)), sum(_logprobs(m, prompt, worst.token_ids)))
    assert after[0] > before[0] and after[1] < before[1]


def test_a_group_with_equal_rewards_gives_no_gradient(model) -> None:
    groups = _groups(model)
    flat = [Completion(c.token_ids, c.logprobs, 0.3, 2, 2) for c in groups[0].completions]
    model.zero_grad()
    loss, _ = grpo_tis_loss(model, [Group(groups[0].prompt_ids, flat, time.time())], pad_id=0)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
