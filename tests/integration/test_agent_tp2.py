"""TP=2 on CPU: every rank's effective weights equal a fresh TP=2 load, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from deltasync import RefusalReason, UpdateRefused
from deltasync.agent import Agent
from deltasync.config import AgentConfig
from deltasync.layout import manifest_key
from deltasync.reader import load_object, read_manifest
from deltasync.staging import StagedUpdate, stage_object
from deltasync.targets import OfflineLLMTarget
from deltasync.testing.launchers import offline_llm
from tests.conftest import agent_token
from tests.integration.fresh_engine import fresh_run, generate
from tests.support.world import world

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPTS = ["Guess the five letter word:", "crane slate audio raise"]
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one NUMA node: bind one core per rank


def test_tp2_bit_exact_against_a_fresh_tp2_load(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm")
    for k, v in TP_ENV.items():
        monkeypatch.setenv(k, v)
    llm = offline_llm(tiny_model_dir, tensor_parallel_size=2)
    try:
        with world(tmp_path, load_file(tiny_model_dir / "model.safetensors"), lr=1e-5) as w:
            store, publisher = w.store, w.publisher
            config = AgentConfig(agent_id="tp2", staging_dir=str(tmp_path / "staging"), tp_size=2)
            agent = Agent.for_llm(llm, store=store, coordinator=w.client(agent_token("tp2")), config=config)
            assert agent.sync().route == "anchor"
            for _ in range(3):
                publisher.step()
                assert agent.sync().route == "deltas"
            # with TP > 1 a refusal is recorded, never raised by the workers (a raising worker desyncs vLLM's
            # executor, vLLM #49972): the target reads each rank's structured outcome, and the engine stays usable
            m = read_manifest(store, 1)
            stale = stage_object(
                tmp_path / "staging" / "stale",  # the engine reads files only from the agent's staging root
                m,
                store.get(manifest_key(1, "delta")),
                load_object(store, m, base=publisher.truth[0]),
            )
            with pytest.raises(UpdateRefused) as exc:
                OfflineLLMTarget(llm).apply(StagedUpdate(objects=(stale,)))
            assert exc.value.reason is RefusalReason.BASE
            assert [r["healthy"] for r in llm.collective_rpc("deltasync_status")] == [True, True]
            publisher.step()
            assert agent.sync().to_version == 4  # the executor is still in step
            ranks = llm.collective_rpc("deltasync_effective")
            assert len(ranks) == 2 and ranks[0] != ranks[1]  # each rank holds its own slice
            assert [r["version"] for r in llm.collective_rpc("deltasync_status")] == [4, 4]
            ours = generate(llm, PROMPTS)
    finally:
        llm.llm_engine.engine_core.shutdown()
    fresh = fresh_run(tiny_model_dir, publisher.truth[4], tmp_path / "v4", PROMPTS, tp=2)
    assert fresh["effective"] == ranks, "a rank's effective weights differ from a fresh TP=2 load"
    assert [o["ids"] for o in ours] == [o["ids"] for o in fresh["outputs"]]
    assert [o["logprobs"] for o in ours] == [o["logprobs"] for o in fresh["outputs"]]
