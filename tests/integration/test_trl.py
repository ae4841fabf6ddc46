"""A real TRL GRPOTrainer (3 steps, tiny model, CPU) publishing through DeltaSyncCallback."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest
import torch
from deltasync_coordinator.app import create_app

from deltasync import LocalStore, list_versions, read_weights
from deltasync.client import CoordinatorClient
from deltasync.integrations.trl import DeltaSyncCallback, DeltaSyncWeightTransfer
from deltasync.publisher import Publisher
from deltasync.testing.models import peft_model
from tests.conftest import PUBLISHER_TOKEN, ServerThread, assert_bit_equal, coordinator_settings

pytestmark = pytest.mark.slow


def _reward(completions, **kwargs) -> list[float]:
    return [float(len(str(c))) / 10 for c in completions]


def _grpo_trainer(
    tmp_path: Path, model_dir: Path, model: torch.nn.Module, callback: DeltaSyncCallback, lr: float
) -> Any:
    """A real TRL GRPOTrainer of 3 optimizer steps on CPU (8 prompts, 2 generations of 6 tokens) with ``callback``."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        max_steps=3,
        learning_rate=lr,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        beta=0.0,
        seed=0,
    )
    return trl.GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": f"Guess the word {i}:"} for i in range(8)]),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[callback],
    )


def test_grpo_trainer_with_the_callback(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    store = LocalStore(tmp_path / "store")
    with (
        ServerThread(create_app(coordinator_settings(tmp_path))) as server,
        CoordinatorClient(server.url, token=PUBLISHER_TOKEN) as client,
    ):
        callback = DeltaSyncCallback(Publisher(store, client))
        trainer = _grpo_trainer(tmp_path, tiny_model_dir, model, callback, lr=1e-4)
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


def _peft(model_dir: Path) -> torch.nn.Module:
    """A trainer's PEFT model: a float32 base, PEFT's own initialization (B = 0)."""
    return peft_model(
        model_dir,
        seed=0,
        rank=4,
        random=False,
        dtype=torch.float32,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "up_proj"],
        lora_dropout=0.0,
    )


def test_grpo_trainer_with_a_peft_model_publishes_the_adapter_not_merged(tmp_path: Path, tiny_model_dir: Path) -> None:
    """GRPOTrainer trains a LoRA adapter; DeltaSyncCallback with an adapter publisher publishes the adapter's own
    tensors each step (no merge), and what a reader rebuilds is the trained adapter, bit for bit in bf16."""
    pytest.importorskip("peft")
    from deltasync.lora import adapter_entry, adapter_state

    model = _peft(tiny_model_dir)
    base_before = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    store = LocalStore(tmp_path / "store")
    entry = adapter_entry(model)
    callback = DeltaSyncCallback(Publisher(store, adapter=entry))
    trainer = _grpo_trainer(tmp_path, tiny_model_dir, model, callback, lr=1e-3)
    trainer.train()
    assert callback.versions == [0, 1, 2, 3]
    published = [m for m in callback.publisher.published if m.kind == "delta"]
    assert [m.version for m in published] == [1, 2, 3] and {m.adapter for m in published} == {entry}
    trained = {k: v.to(torch.bfloat16) for k, v in adapter_state(trainer.model).items()}
    assert_bit_equal(read_weights(store, 3), trained)
    assert not torch.equal(read_weights(store, 3)[sorted(trained)[1]], read_weights(store, 0)[sorted(trained)[1]])
    base_after = trainer.model.get_base_model().state_dict()
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)  # the base is never merged into


def test_weight_transfer_protocol_publishes_the_adapter_of_a_peft_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    """AsyncGRPO's merged path streams the adapter merged into the base; with an adapter publisher the transfer
    publishes the PEFT model's adapter instead and never reads the stream."""
    pytest.importorskip("peft")
    from deltasync.lora import adapter_entry, adapter_state

    model = _peft(tiny_model_dir)
    entry = adapter_entry(model)
    with pytest.raises(ValueError, match="pass model=peft_model"):
        DeltaSyncWeightTransfer(Publisher(LocalStore(tmp_path / "refused"), adapter=entry))

    def stream():
        raise AssertionError("the merged stream was read")
        yield

    store = LocalStore(tmp_path / "store")
    transfer = DeltaSyncWeightTransfer(Publisher(store, adapter=entry), wait=True, model=model)
    for step in range(2):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.01 * (step + 1))
        transfer.send_weights(stream())
        assert_bit_equal(read_weights(store, step), {k: v.to(torch.bfloat16) for k, v in adapter_state(model).items()})
    transfer.destroy()


class _RecordingTransfer(DeltaSyncWeightTransfer):
    """The real DeltaSyncWeightTransfer (it publishes), recording the protocol calls it receives, in order."""

    def __init__(self, publisher: Publisher) -> None:
        super().__init__(publisher, wait=True)
        self.calls: list[str] = []

    def init_weight_transfer(self) -> None:
        self.calls.append("init_weight_transfer")
        super().init_weight_transfer()

    def pause(self) -> None:
        self.calls.append("pause")
        super().pause()

    def send_weights(self, iterator) -> None:
        self.calls.append("send_weights")
        super().send_weights(iterator)

    def resume(self) -> None:
        self.calls.append("resume")
        super().resume()

    def destroy(self) -> None:
        self.calls.append("destroy")
        super().destroy()


class _NoRollouts:
    """TRL's RolloutWorkerProtocol with no rollouts: TRL's own worker feeds a training loop that cannot run on CPU
    (see the test below). It records what the trainer tells it."""

    def __init__(self) -> None:
        self.rollout_buffer: queue.Queue[object] = queue.Queue()
        self.events: list[object] = []

    def start(self) -> None:
        self.events.append("start")

    def stop(self) -> None:
        self.events.append("stop")

    def update_model_version(self, model_version: int) -> None:
        self.events.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        pass


def test_async_grpo_trainer_syncs_through_deltasync(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """TRL 1.16's AsyncGRPOTrainer, built by examples/wordle/train_async_trl.py, syncs weights through its own code
    (the train-begin cold sync, then the per-step sync callback) into DeltaSyncWeightTransfer: real versions in a
    real store and coordinator, bit-exact, with the protocol calls in TRL's order, which examples/wordle/train.py
    repeats.

    What blocks the rest of AsyncGRPO on CPU, exactly: (1) its constructor calls ``get_peak_flops_per_device``, which
    asks ``torch.cuda.get_device_name`` (replaced here by a fixed figure: it only feeds the MFU log); (2) its training
    forward runs the ``tree_fa3`` attention, whose FlashAttention-3 kernel the ``kernels`` package fetches from the
    Hub (``kernels-community/flash-attn3``), CUDA only. So ``train()`` itself does not run here."""
    pytest.importorskip("trl")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.async_grpo import async_grpo_trainer as tas

    from examples.wordle import train, train_async_trl
    from examples.wordle.env_server import create_app as env_app

    monkeypatch.setattr(tas, "get_peak_flops_per_device", lambda accelerator, dtype: 1e12)
    monkeypatch.setenv("DELTASYNC_PUBLISHER_TOKEN", PUBLISHER_TOKEN)
    store = tmp_path / "store"
    with (
        ServerThread(create_app(coordinator_settings(tmp_path))) as coordinator,
        ServerThread(env_app()) as env,
    ):
        args = train_async_trl.parser().parse_args(
            ["--model", str(tiny_model_dir), "--vllm-url", "http://127.0.0.1:9", "--env-url", env.url]
            + ["--coordinator", coordinator.url, "--store", str(store), "--out", str(tmp_path / "out"), "--steps", "2"]
        )
        worker = _NoRollouts()
        trainer = train_async_trl.build_trainer(args, rollout_worker=worker)
        transfer = _RecordingTransfer(trainer.weight_transfer.publisher)
        trainer.weight_transfer = transfer
        callbacks = trainer.callback_handler.callbacks
        begin = next(c for c in callbacks if isinstance(c, tas._TrainBeginCallback))
        begin.on_train_begin(trainer.args, trainer.state, trainer.control)
        with torch.no_grad():  # one optimizer step's worth of change
            trainer.model.model.norm.weight.add_(0.25)
        trainer.state.global_step = 1
        step = next(c for c in callbacks if isinstance(c, tas.StepIntervalCallback) and c.fn == trainer._sync_weight)
        step.on_step_end(trainer.args, trainer.state, trainer.control)
        # the end of TRL's _inner_training_loop (reached only through train()): stop the worker, destroy the transfer
        trainer.rollout_worker.stop()
        trainer.weight_transfer.destroy()
        next(c for c in callbacks if type(c).__name__ == "CloseClients").on_train_end()
        expected = {n: p.detach().to(torch.bfloat16) for n, p in tas._iter_vllm_named_params(trainer.model)}
        with CoordinatorClient(coordinator.url, token=PUBLISHER_TOKEN) as client:
            registered = [(v.version, v.kind) for v in client.wait_for_versions(None, wait_s=0)]
    sync = ["pause", "send_weights", "resume"]
    assert transfer.calls == ["init_weight_transfer", *sync, *sync, "destroy"]
    assert worker.events == [1, "start", 2, "stop"]  # TRL's model_version counts syncs from 1; deltasync's from 0
    assert transfer.versions == [0, 1] and registered == [(0, "anchor"), (1, "delta")]
    assert_bit_equal(read_weights(LocalStore(store), 1), expected)

    # examples/wordle/train.py makes the same calls in the same order
    ours = _RecordingTransfer(Publisher(LocalStore(tmp_path / "ours")))
    ours.init_weight_transfer()
    for _ in range(2):
        train.sync_weights(ours, trainer.model)
    ours.destroy()
    assert ours.calls == transfer.calls
