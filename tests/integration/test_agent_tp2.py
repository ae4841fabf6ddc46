"""TP=2 on CPU: every rank's effective weights equal a fresh TP=2 load, bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deltasync.testing import offline_llm
from deltasync_coordinator.app import create_app
from deltasync_coordinator.settings import Settings
from safetensors.torch import load_file, save_file

from deltasync import LocalStore
from deltasync.agent import Agent
from deltasync.client import CoordinatorClient
from deltasync.config import AgentConfig
from tests.conftest import AGENT_TOKEN, PUBLISHER_TOKEN, ServerThread
from tests.integration.fresh_engine import generate
from tests.integration.helpers import StreamPublisher

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPTS = ["Guess the five letter word:", "crane slate audio raise"]
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one NUMA node: bind one core per rank


def test_tp2_bit_exact_against_a_fresh_tp2_load(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm")
    settings = Settings(db=tmp_path / "c.db", publisher_token=PUBLISHER_TOKEN, agent_token=AGENT_TOKEN)
    for k, v in TP_ENV.items():
        monkeypatch.setenv(k, v)
    llm = offline_llm(tiny_model_dir, tensor_parallel_size=2)
    try:
        with (
            ServerThread(create_app(settings)) as server,
            CoordinatorClient(server.url, token=PUBLISHER_TOKEN) as pub,
            CoordinatorClient(server.url, token=AGENT_TOKEN) as agt,
        ):
            store = LocalStore(tmp_path / "store")
            publisher = StreamPublisher(store, pub, load_file(tiny_model_dir / "model.safetensors"), lr=1e-5)
            config = AgentConfig(agent_id="tp2", staging_dir=str(tmp_path / "staging"), tp_size=2)
            agent = Agent.for_llm(llm, store=store, coordinator=agt, config=config)
            assert agent.sync().route == "anchor"
            for _ in range(3):
                publisher.step()
                assert agent.sync().route == "deltas"
            ranks = llm.collective_rpc("deltasync_effective")
            assert len(ranks) == 2 and ranks[0] != ranks[1]  # each rank holds its own slice
            assert [r["version"] for r in llm.collective_rpc("deltasync_status")] == [3, 3]
            ours = generate(llm, PROMPTS)
    finally:
        llm.llm_engine.engine_core.shutdown()
    ckpt = tmp_path / "v3"
    shutil.copytree(tiny_model_dir, ckpt)
    save_file(publisher.truth[3], str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.fresh_engine", str(ckpt), json.dumps(PROMPTS), "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    fresh = json.loads(lines[-1][len("RESULT ") :])
    assert fresh["effective"] == ranks, "a rank's effective weights differ from a fresh TP=2 load"
    assert [o["ids"] for o in ours] == [o["ids"] for o in fresh["outputs"]]
    assert [o["logprobs"] for o in ours] == [o["logprobs"] for o in fresh["outputs"]]
