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


def _queue(q: RolloutQueue, group: Group) -> None:
    """A producer's turn: reserve a place, then queue the group."""
    assert q.reserve(threading.Event())
    q.put(group)


def test_stale_groups_are_dropped_and_counted_judged_by_their_oldest_token() -> None:
    q = RolloutQueue(maxsize=8, max_staleness=2)
    for g in (_group(0), _group(1, 3), _group(3)):
        _queue(q, g)
    taken, waited = q.take(trainer_version=3, check=_never)
    assert (taken.oldest_version, taken.newest_version) == (1, 3) and taken.spans_update
    assert q.dropped == 1 and dict(q.staleness) == {2: 1} and waited == 0.0
    assert q.take(trainer_version=3, check=_never)[0].oldest_version == 3
    assert dict(q.staleness) == {2: 1, 0: 1}


def test_the_trainer_waits_only_when_nothing_fresh_enough_is_queued() -> None:
    q = RolloutQueue(maxsize=2, max_staleness=0)
    _queue(q, _group(4))  # stale for a trainer at v5 with a bound of 0
    threading.Timer(0.3, lambda: _queue(q, _group(5))).start()
    group, waited = q.take(trainer_version=5, check=_never)
    assert group.oldest_version == 5 and q.dropped == 1 and waited >= 0.25


def test_take_gives_up_after_its_timeout() -> None:
    group, waited = RolloutQueue(maxsize=2, max_staleness=1).take(trainer_version=0, check=_never, timeout_s=0.2)
    assert group is None and waited >= 0.15


def test_a_failed_worker_is_raised_in_the_trainer_while_it_waits() -> None:
    def check() -> None:
        raise RuntimeError("a rollout worker failed: boom")

    with pytest.raises(RuntimeError, match="boom"):
        RolloutQueue(maxsize=1, max_staleness=2).take(trainer_version=0, check=check)


def test_a_full_queue_blocks_producers_until_stopped() -> None:
    stop = threading.Event()
    q = RolloutQueue(maxsize=1, max_staleness=2)
    _queue(q, _group(0))
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(q.reserve(stop)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()
    stop.set()
    t.join(timeout=2)
    assert not t.is_alive() and got == [False] and q.in_flight == 0


def test_a_released_place_lets_the_next_producer_in() -> None:
    q = RolloutQueue(maxsize=1, max_staleness=2)
    assert q.reserve(threading.Event())
    q.release()  # its producer failed
    assert q.in_flight == 0 and q.reserve(threading.Event())


def test_production_waits_while_a_new_group_would_be_dropped_at_consumption() -> None:
    """Sized to consumption: vLLM seen serving v3 while the trainer is at v6 (bound 2): a group started now would be
    3+ versions behind when taken, so producers wait (one group always goes, to learn that vLLM caught up)."""
    q = RolloutQueue(maxsize=8, max_staleness=2, per_step=2)
    assert q.take(trainer_version=6, check=_never, timeout_s=0)[0] is None  # the trainer is at v6
    _queue(q, _group(3))  # vLLM was last seen serving v3 (this group will be dropped)
    stop = threading.Event()
    assert q.reserve(stop)  # nothing in flight: one may go, to learn what vLLM serves now
    waiting: list[bool] = []
    t = threading.Thread(target=lambda: waiting.append(q.reserve(stop)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "a second group was started although it would be dropped"
    q.put(_group(6))  # the probe comes back: vLLM serves v6
    t.join(timeout=2)
    assert waiting == [True] and q.held_back_s > 0.1
    assert q.take(trainer_version=6, check=_never)[0] is not None and q.dropped == 1  # v3's group dropped, v6 taken
    # the next group would be taken (1 taken + 0 queued + 1 in flight) // 2 = 1 step on, at v7: 1 behind v6;
    # with two more in flight, 2 steps on (2 behind, within the bound); with four more, 3 behind: held back
    assert not q._would_drop()
    q.in_flight += 2
    assert not q._would_drop()
    q.in_flight += 2
    assert q._would_drop()


def test_with_a_probe_no_group_is_started_to_be_dropped() -> None:
    """With a probe (a one-token request that reads vLLM's version tag), producers wait without generating while
    vLLM lags beyond the bound, and start as soon as the probe sees it caught up."""
    served = [3]
    calls: list[float] = []

    def probe() -> int:
        calls.append(time.monotonic())
        return served[0]

    q = RolloutQueue(maxsize=8, max_staleness=2, per_step=2, probe=probe, probe_interval_s=0.05)
    q.set_trainer_version(6)
    stop = threading.Event()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(q.reserve(stop)))
    t.start()
    time.sleep(0.4)
    assert t.is_alive() and q.in_flight == 0, "a group was started while vLLM was 3 versions behind"
    assert len(calls) >= 3 and q.served_version == 3
    served[0] = 5
    t.join(timeout=2)
    assert got == [True] and q.in_flight == 1 and q.held_back_s > 0.3
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert min(gaps) >= 0.04, "the probe was asked more often than its interval"


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
