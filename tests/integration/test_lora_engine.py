"""A served LoRA adapter replaced in place, in its slot (the engine side).

vLLM on CPU with ``enable_lora``: an adapter is loaded under one id, then a newer version of it (a PEFT directory)
replaces its weights in its slot through the worker extension (``deltasync_lora_replace``). What vLLM computes
with it must equal a fresh load of that version under another id, token ids and logprobs, and every buffer slot
must read back bit-exact. Another rank or other target modules are refused with nothing written."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltasync.testing.models import LORA_TARGETS, peft_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TARGETS = LORA_TARGETS


def make_adapter(model_dir: Path, out: Path, seed: int, *, rank: int = 8, targets: list[str] = TARGETS) -> str:
    """A PEFT LoRA adapter of the tiny model with random non-zero A and B, saved as vLLM loads it."""
    peft_model(model_dir, seed=seed, rank=rank, target_modules=targets).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir: Path) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from deltasync.testing.launchers import offline_llm

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = offline_llm(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _outputs(llm: Any, request: Any) -> list[tuple[list[int], list[dict[int, float]]]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, seed=0)
    outs = llm.generate(["hello world", "the quick brown", "wordle"], params, lora_request=request, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs])
        for o in outs
    ]


def _buffers(llm: Any, lora_id: int) -> dict[str, str]:
    """Every rank's buffer slots for the adapter (``rank/module.a0`` ...)."""
    ranks = llm.collective_rpc("deltasync_lora_buffers", args=(lora_id,))
    return {f"{r}/{k}": v for r, slots in enumerate(ranks) for k, v in slots.items()}


def test_a_new_version_replaces_the_adapter_in_its_slot_bit_exact(
    lora_llm: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from vllm.lora.request import LoRARequest

    v0 = make_adapter(tiny_model_dir, tmp_path / "v0", seed=1)
    v1 = make_adapter(tiny_model_dir, tmp_path / "v1", seed=2)
    served = LoRARequest("policy", 1, v0)
    before = _outputs(lora_llm, served)
    slot_before = _buffers(lora_llm, 1)
    result = lora_llm.collective_rpc("deltasync_lora_replace", args=(1, v1))[0]
    assert result["ok"] and result["slot"] is not None and result["written"] == result["modules"] > 0, result
    after = _outputs(lora_llm, served)  # the same request (id 1): its path is not read again
    fresh = _outputs(lora_llm, LoRARequest("fresh-v1", 2, v1))  # vLLM's own load of v1, in another slot
    assert after == fresh, "the adapter replaced in place computes otherwise than a fresh load of that version"
    assert after != before
    buffers, reference = _buffers(lora_llm, 1), _buffers(lora_llm, 2)
    assert buffers and buffers == reference, sorted(k for k in buffers if buffers[k] != reference.get(k))[:5]
    assert buffers != slot_before


@pytest.mark.parametrize(
    "other",
    [
        {"rank": 4},  # another rank
        {"targets": ["q_proj", "v_proj"]},  # other target modules, same rank
    ],
    ids=["rank", "targets"],
)
def test_another_adapter_shape_is_refused_before_any_write(
    lora_llm: Any, tiny_model_dir: Path, tmp_path: Path, other: dict[str, Any]
) -> None:
    from vllm.lora.request import LoRARequest

    served = LoRARequest("policy-r", 3, make_adapter(tiny_model_dir, tmp_path / "v0", seed=3))
    before = _outputs(lora_llm, served)
    slot = _buffers(lora_llm, 3)
    result = lora_llm.collective_rpc(
        "deltasync_lora_replace", args=(3, make_adapter(tiny_model_dir, tmp_path / "other", seed=4, **other))
    )[0]
    assert not result["ok"] and "AdapterRefused" in result["refused"], result
    assert ("rank 4" in result["refused"]) if "rank" in other else ("not a version" in result["refused"])
    assert _buffers(lora_llm, 3) == slot and _outputs(lora_llm, served) == before


def test_an_adapter_with_a_nan_is_refused_before_any_write(lora_llm: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.lora.request import LoRARequest

    served = LoRARequest("policy-n", 5, make_adapter(tiny_model_dir, tmp_path / "v0", seed=6))
    before = _outputs(lora_llm, served)
    slot = _buffers(lora_llm, 5)
    poisoned = Path(make_adapter(tiny_model_dir, tmp_path / "v1", seed=7))
    tensors = load_file(poisoned / "adapter_model.safetensors")
    name = sorted(k for k in tensors if "lora_B" in k)[-1]
    tensors[name][0, 0] = torch.nan
    save_file(tensors, poisoned / "adapter_model.safetensors")
    result = lora_llm.collective_rpc("deltasync_lora_replace", args=(5, str(poisoned)))[0]
    assert not result["ok"] and "NaN or infinite" in result["refused"], result
    assert _buffers(lora_llm, 5) == slot and _outputs(lora_llm, served) == before


def test_an_adapter_not_loaded_or_a_broken_directory_is_refused(
    lora_llm: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    good = make_adapter(tiny_model_dir, tmp_path / "v0", seed=5)
    result = lora_llm.collective_rpc("deltasync_lora_replace", args=(77, good))[0]
    assert not result["ok"] and "not loaded" in result["refused"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((Path(good) / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    from vllm.lora.request import LoRARequest

    served = LoRARequest("policy-b", 4, good)
    before = _outputs(lora_llm, served)
    result = lora_llm.collective_rpc("deltasync_lora_replace", args=(4, str(broken)))[0]
    assert not result["ok"], result
    assert _outputs(lora_llm, served) == before
    missing = lora_llm.collective_rpc("deltasync_lora_replace", args=(4, str(tmp_path / "nowhere")))[0]
    assert not missing["ok"], missing
    # a relative name is refused before vLLM's loader, which would take it for a Hub repository and download it
    relative = lora_llm.collective_rpc("deltasync_lora_replace", args=(4, "some-org/some-adapter"))[0]
    assert not relative["ok"] and "absolute path" in relative["refused"], relative
    assert _outputs(lora_llm, served) == before


def test_tp2_llama_each_rank_replaces_its_slice_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adapter_run: tuple[Any, Any, Any]
) -> None:
    """A tiny Llama (untied lm_head, GQA with one KV head replicated over the ranks, an intermediate size that is not
    a multiple of 64) at TP=2: each rank holds its slice of every adapter (B rows of column-parallel layers, A
    columns of row-parallel ones), and the layer's own set_lora slices the replacement as it slices a fresh load.
    Then an adapter's run is kept served by an agent in lora mode (every rank decodes against its own copy of the
    adapter and writes the same served version), bit-exact against fresh loads on both ranks."""
    pytest.importorskip("vllm")
    from vllm.lora.request import LoRARequest

    from deltasync.testing.launchers import offline_llm
    from deltasync.testing.models import build_tiny_model

    tiny_model_dir = build_tiny_model(tmp_path / "llama", seed=0, arch="llama")

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    v0 = make_adapter(tiny_model_dir, tmp_path / "v0", seed=11)
    v1 = make_adapter(tiny_model_dir, tmp_path / "v1", seed=12)
    llm = offline_llm(tiny_model_dir, tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        served = LoRARequest("policy", 1, v0)
        before = _outputs(llm, served)
        results = llm.collective_rpc("deltasync_lora_replace", args=(1, v1))
        assert len(results) == 2 and all(r["ok"] and r["written"] > 0 for r in results), results
        after, fresh = _outputs(llm, served), _outputs(llm, LoRARequest("fresh-v1", 2, v1))
        assert after == fresh and after != before
        buffers, reference = _buffers(llm, 1), _buffers(llm, 2)
        assert {k.split("/")[0] for k in buffers} == {"0", "1"} and buffers == reference
        _serve_adapter_run(llm, tiny_model_dir, adapter_run, steps=2, first_id=41, tp_size=2)
        statuses = llm.collective_rpc("deltasync_status")
        assert [(st["mode"], st["version"], st["healthy"]) for st in statuses] == [("lora", 1, True)] * 2
    finally:
        llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------------------------------- an adapter's run, synced


def _trainer(model_dir: Path, seed: int, *, rank: int = 8) -> Any:
    """A PEFT model as a LoRA trainer holds it: float32 adapters (PEFT's default) with random non-zero A and B."""
    return peft_model(model_dir, seed=seed, rank=rank)


def _train_step(model: Any, seed: int, lr: float = 1e-3) -> None:
    """An optimizer-like step: every adapter element moves a little (nearly all bf16 elements change)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * lr)


@pytest.fixture
def adapter_run(tmp_path: Path) -> Iterator[tuple[Any, Any, Any]]:
    """A coordinator with a publisher's and an agent's client."""
    from deltasync_coordinator.app import create_app

    from deltasync.client import CoordinatorClient
    from tests.conftest import PUBLISHER_TOKEN, ServerThread, agent_token, coordinator_settings

    with ServerThread(create_app(coordinator_settings(tmp_path))) as server:
        with (
            CoordinatorClient(server.url, token=PUBLISHER_TOKEN) as pub,
            CoordinatorClient(server.url, token=agent_token("lora-0")) as agt,
        ):
            yield pub, agt, tmp_path


def _serve_adapter_run(
    llm: Any, model_dir: Path, adapter_run: tuple[Any, Any, Any], *, steps: int, first_id: int, tp_size: int = 1
) -> tuple[Any, Any, Any, Any, Path, list[Any]]:
    """A trainer publishes its adapter (not merged) each step, and an agent in lora mode keeps ``llm`` serving it
    from one directory: at every version, what vLLM computes with it equals a fresh load of the trainer's own
    adapter at that version (float32, saved by PEFT; vLLM casts it), token ids and logprobs, and every rank's LoRA
    buffer slot reads back bit-exact. Returns the agent, the trainer, its entry, the store, the directory and the
    last outputs."""
    from vllm.lora.request import LoRARequest

    from deltasync import Publisher
    from deltasync.agent import Agent
    from deltasync.config import AgentConfig
    from deltasync.lora import adapter_entry
    from deltasync.store import LocalStore

    pub_client, agent_client, tmp = adapter_run
    model = _trainer(model_dir, seed=11)
    entry = adapter_entry(model)
    store = LocalStore(tmp / "store")
    served = tmp / "served-adapter"
    config = AgentConfig(
        agent_id="lora-0",
        staging_dir=str(tmp / "staging"),
        apply_mode="lora",
        adapter_dir=str(served),
        tp_size=tp_size,
        retries=1,
        backoff_s=0.01,
    )
    agent = Agent.for_llm(llm, store=store, coordinator=agent_client, config=config)
    policy = LoRARequest("policy", first_id, str(served))
    with Publisher(store, pub_client, adapter=entry) as pub:
        for step in range(steps):
            if step:
                _train_step(model, seed=step)
            version = pub.publish(model, step)
            pub.flush()
            result = agent.sync()
            assert result.to_version == version, result
            assert agent.host is None  # the engine decodes against its own copy of the adapter
            reference = tmp / f"trainer-v{version}"
            model.save_pretrained(reference)  # the trainer's adapter as PEFT saves it (float32)
            fresh_id = first_id + 1 + step
            served_out = _outputs(llm, policy)
            fresh_out = _outputs(llm, LoRARequest(f"fresh-v{version}", fresh_id, str(reference)))
            # first what vLLM holds (exact, per rank), then what it computes: a failure says which differs
            slots, fresh_slots = _buffers(llm, first_id), _buffers(llm, fresh_id)
            assert {k.split("/")[0] for k in slots} == {str(r) for r in range(tp_size)}
            assert slots == fresh_slots, f"v{version}: {sorted(k for k in slots if slots[k] != fresh_slots.get(k))[:4]}"
            proofs = llm.collective_rpc("deltasync_prove")  # every rank: the directory, the loaded copy, the slot
            assert [(p["ok"], p.get("slots")) for p in proofs] == [(True, 1)] * tp_size, proofs
            differ = [i for i, (a, b) in enumerate(zip(served_out, fresh_out, strict=True)) if a != b]
            assert not differ, (
                f"v{version}: the served adapter computes otherwise than a fresh load (prompts {differ}) although "
                f"every rank's slot holds the same values: {[(served_out[i], fresh_out[i]) for i in differ]}"
            )
        deltas = [m.version for m in pub.published if m.kind == "delta"]
        assert deltas == list(range(1, steps)), [(m.kind, m.version) for m in pub.published]
    return agent, model, entry, store, served, served_out


def test_an_adapter_run_is_served_bit_exact_at_every_version(
    lora_llm: Any, tiny_model_dir: Path, adapter_run: tuple[Any, Any, Any]
) -> None:
    """An adapter's run kept served, bit-exact at every version (:func:`_serve_adapter_run`); the whole-state proof
    reads the served directory and finds drift there; an anchor restores it; objects that are not versions of the
    served adapter are refused before any write."""
    from vllm.lora.request import LoRARequest

    from deltasync import Publisher
    from deltasync.lora import adapter_entry
    from deltasync.store import LocalStore

    agent, model, entry, store, served, fresh_out = _serve_adapter_run(
        lora_llm, tiny_model_dir, adapter_run, steps=4, first_id=21
    )
    tmp, version = adapter_run[2], 3
    policy = LoRARequest("policy", 21, str(served))
    status = lora_llm.collective_rpc("deltasync_status")[0]
    assert status["mode"] == "lora" and status["version"] == version and status["healthy"], status
    assert status["adapter"]["served"] == entry.to_dict()
    proof = lora_llm.collective_rpc("deltasync_prove")[0]
    assert proof["ok"] and proof["proven"] and not proof["bad"], proof
    assert lora_llm.get_weight_version() == str(version)
    # drift in the served directory (what vLLM loads the adapter from next) is found by the whole-state proof
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(served / "adapter_model.safetensors")
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += torch.tensor(1.0, dtype=tensors[name].dtype)
    save_file(tensors, served / "adapter_model.safetensors", metadata={"format": "pt"})
    proof = lora_llm.collective_rpc("deltasync_prove")[0]
    assert not proof["ok"] and any(name in b for b in proof["bad"]), proof
    status = lora_llm.collective_rpc("deltasync_status")[0]
    assert not status["healthy"] and status["drift"], status
    assert agent.sync().to_version == version  # restored from the anchor and the deltas after it
    assert lora_llm.collective_rpc("deltasync_prove")[0]["ok"]
    assert _outputs(lora_llm, policy) == fresh_out

    # objects that are not versions of the served adapter are refused by the engine before any write
    import dataclasses

    from deltasync import UpdateRefused
    from deltasync.errors import RefusalReason
    from deltasync.staging import StagedUpdate
    from deltasync.targets import OfflineLLMTarget
    from tests.support.staging import stage_as_published

    def anchor_of(state: Any, name: str, **publisher: Any) -> Any:
        other = LocalStore(tmp / name)
        with Publisher(other, **publisher) as p:
            p.publish(state)
        return stage_as_published(other, tmp / "staging" / name, 0, "anchor")

    foreign = [
        (
            anchor_of(model, "base", adapter=dataclasses.replace(entry, base_fingerprint="sha256:" + "0" * 64)),
            "an adapter for another base model",
        ),
        (
            anchor_of(
                _trainer(tiny_model_dir, seed=12, rank=4),
                "rank",
                adapter=adapter_entry(_trainer(tiny_model_dir, seed=12, rank=4)),
            ),
            "not a version of the served adapter (r 8 here, 4",
        ),
        (anchor_of(model.get_base_model(), "full"), "is a model's own weights"),
    ]
    before = (served / "adapter_model.safetensors").read_bytes()
    for obj, message in foreign:
        with pytest.raises(UpdateRefused, match=message.replace("(", r"\(")) as exc:
            OfflineLLMTarget(lora_llm).apply(StagedUpdate(objects=(obj,)))
        assert exc.value.reason is RefusalReason.MODEL
    assert (served / "adapter_model.safetensors").read_bytes() == before
    assert _outputs(lora_llm, policy) == fresh_out
    assert lora_llm.collective_rpc("deltasync_status")[0]["version"] == version
