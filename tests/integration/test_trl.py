"""A real TRL GRPOTrainer (3 steps, tiny model, CPU) publishing through DeltaSyncCallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deltasync_coordinator.app import create_app

from deltasync import LocalStore, list_versions, read_weights
from deltasync.client import CoordinatorClient
from deltasync.integrations.trl import DeltaSyncCallback, DeltaSyncWeightTransfer
from deltasync.publisher import Publisher
from tests.conftest import PUBLISHER_TOKEN, ServerThread, assert_bit_equal, coordinator_settings

pytestmark = pytest.mark.slow


def _reward(completions, **kwargs) -> list[float]:
    return [float(len(str(c))) / 10 for c in completions]


def test_grpo_trainer_with_the_callback(tmp_path: Path, tiny_model_dir: Path) -> None:
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = Dataset.from_list([{"prompt": f"Guess the word {i}:"} for i in range(8)])
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        max_steps=3,
        learning_rate=1e-4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        beta=0.0,
        seed=0,
    )
    store = LocalStore(tmp_path / "store")
    with (
        ServerThread(create_app(coordinator_settings(tmp_path))) as server,
        CoordinatorClient(server.url, token=PUBLISHER_TOKEN) as client,
    ):
        callback = DeltaSyncCallback(Publisher(store, client))
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[callback],
        )
        trainer.train()
        registered = [v.version for v in client.wait_for_versions(None, wait_s=0) if v.kind == "delta"]
    assert callback.versions == [0, 1, 2, 3]  # the initial weights, then one version per optimizer step
    assert [x.version for x in list_versions(store)] == [0, 1, 2, 3] and registered == [1, 2, 3]
    final = {k: v.to(torch.bfloat16) for k, v in trainer.model.state_dict().items() if k != "lm_head.weight"}
    assert_bit_equal(read_weights(store, 3), final)


def test_weight_transfer_protocol_publishes_each_sync(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    transfer = DeltaSyncWeightTransfer(Publisher(store), wait=True)
    transfer.init_weight_transfer()
    weights = {"model.norm.weight": torch.ones(8), "model.embed_tokens.weight": torch.randn(16, 8)}
    for step in range(3):
        transfer.pause()
        weights["model.norm.weight"][step] += 0.5
        transfer.send_weights(iter(weights.items()))
        transfer.resume()
        assert_bit_equal(read_weights(store, step), {k: v.to(torch.bfloat16) for k, v in weights.items()})
    transfer.destroy()
    assert transfer.versions == [0, 1, 2]
