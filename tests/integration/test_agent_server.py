"""The sidecar agent keeps a real vLLM server bit-exact: real coordinator, server and sidecar processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.helpers import ServerStack, server_stack

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
LAYERS = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerStack]:
    with server_stack(tmp_path_factory.mktemp("server"), tiny_model_dir) as s:
        yield s


def test_a_late_sidecar_catches_up_from_the_anchor_then_follows(stack: ServerStack) -> None:
    pub = stack.publisher
    for _ in range(4):
        pub.step(anchor=pub.version + 1 == 3)
    stack.start_sidecar()  # late: the server serves its startup weights ('default'), v0..v4 are published
    stack.wait_applied(4)
    stack.assert_served(4)
    for _ in range(4):
        pub.step()
        time.sleep(0.3)
    stack.wait_applied(8)
    stack.assert_served(8)
    completion = httpx.post(
        stack.server.url + "/v1/completions",
        timeout=60,
        json={"model": stack.server.model, "prompt": "Guess the five letter word:", "max_tokens": 8, "temperature": 0},
    )
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] is not None


def test_a_sidecar_killed_mid_stream_resumes_at_the_engines_real_version(stack: ServerStack) -> None:
    pub = stack.publisher
    for _ in range(3):
        pub.step()
    time.sleep(0.5)  # the sidecar is fetching or applying
    stack.kill_sidecar()
    served = httpx.get(stack.server.url + "/weight_info", timeout=30).json()["weight_version"]
    for _ in range(2):
        pub.step(anchor=pub.version + 1 == 12)
    stack.start_sidecar()
    stack.wait_applied(pub.version)
    stack.assert_served(pub.version)
    assert int(served) in range(8, pub.version + 1)
    paused = httpx.get(stack.server.url + "/is_paused", timeout=30).json()
    assert paused.get("is_paused") is False
