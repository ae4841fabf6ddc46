"""LoRA mode on a real vLLM (CPU, ``enable_lora``, ``max_lora_rank=8``): the served adapter is exactly the version.

A catch-up across an anchor after a restart and an rsLoRA adapter with a fractional alpha serve as a fresh load
does; any change to the served configuration, or a stray write into what vLLM computes with, is drift; a failure
past the first write unlabels the engine until an anchor; what the engine cannot serve (an adapter above
``max_lora_rank``, an engine without ``enable_lora``, an adapter object for a full-weights engine or the reverse,
another base, a first anchor whose tensors are not its adapter) is refused before any write, and an agent for
another base never keeps a fresh engine's claim.

One engine for the module. Each test starts from a fresh deltasync engine in it (what a vLLM restart gives the
deltasync backend: nothing known, the served directory as the last engine left it), claims it in ``lora`` mode on
its own served directory, and drives it with objects staged as an agent stages them. No test generates with an
adapter the engine should have refused: vLLM's engine core dies on an adapter its loader refuses."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

from deltasync import Publisher, UpdateRefused, read_weights
from deltasync.errors import ApplyError, RefusalReason
from deltasync.lora import adapter_config_json, adapter_entry, adapter_state
from deltasync.staging import StagedUpdate
from deltasync.store import LocalStore
from deltasync.targets import UNHEALTHY_LABEL, EngineClaim, OfflineLLMTarget
from deltasync.testing.models import LORA_TARGETS, peft_model
from deltasync.vllm.lora_slots import ADAPTER_FILE, CONFIG_FILE
from tests.support.staging import stage_as_published

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import this module

TARGETS = LORA_TARGETS
PROMPTS = ["hello world", "the quick brown"]


@dataclasses.dataclass
class Rig:
    llm: Any
    model_dir: Path
    root: Path
    staging: Path
    count: int = 0

    def fresh(self, name: str, *, lora_enabled: bool = True, mode: str = "lora") -> tuple[OfflineLLMTarget, Path]:
        """A restarted deltasync engine, claimed by one agent in ``mode`` on a served directory of its own."""
        self.count += 1
        assert self.llm.collective_rpc(_restart, args=(lora_enabled,)) == [True]
        served = self.root / f"{name}-served"
        target = OfflineLLMTarget(self.llm)
        claim = EngineClaim(
            agent_id="adversary",
            session=f"s{self.count}",
            staging_root=str(self.staging),
            mode=mode,
            adapter_dir=str(served) if mode == "lora" else None,
        )
        target.init(claim)
        return target, served

    def stage(self, store: LocalStore, name: str, version: int, kind: str) -> Any:
        return stage_as_published(store, self.staging / name, version, kind)  # type: ignore[arg-type]

    def status(self) -> dict[str, Any]:
        return self.llm.collective_rpc("deltasync_status")[0]


def _restart(worker: Any, lora_enabled: bool) -> bool:
    """Runs in the vLLM worker: a new deltasync engine, as a restarted vLLM builds it (``lora_enabled=False``: as
    one started without ``--enable-lora`` sees its configuration)."""
    import copy

    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    worker = getattr(worker, "worker", worker)  # collective_rpc hands callables vLLM's wrapper of the worker
    config = worker.vllm_config
    if not lora_enabled:
        config = copy.copy(config)
        object.__setattr__(config, "lora_config", None)
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        config.weight_transfer_config, config, worker.device, worker.model_runner.get_model()
    )
    return True


def _vllm_loads(worker: Any, adapter_dir: str) -> str:
    """Runs in the vLLM worker: what vLLM's own LoRA loader says of a directory (``ok`` or its error), without
    activating it (a refused load inside a step kills vLLM's engine core)."""
    from vllm.lora.request import LoRARequest

    try:
        worker.model_runner.lora_manager._load_adapter(LoRARequest("adversary-probe", 999, adapter_dir))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"[:300]
    return "ok"


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    pytest.importorskip("vllm")
    from deltasync.testing.launchers import offline_llm

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    root = tmp_path_factory.mktemp("adv-lora-engine")
    (root / "staging").mkdir()
    llm = offline_llm(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        yield Rig(llm=llm, model_dir=tiny_model_dir, root=root, staging=root / "staging")
    finally:
        llm.llm_engine.engine_core.shutdown()


def _trainer(model_dir: Path, seed: int, *, rank: int = 8, **config: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft_model(model_dir, seed=seed, rank=rank, **config)


def _step(model: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def _outputs(llm: Any, request: Any) -> list[tuple[list[int], list[dict[int, float]]]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, seed=0)
    outs = llm.generate(PROMPTS, params, lora_request=request, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs])
        for o in outs
    ]


def _publish(store: LocalStore, model: Any, steps: int, **publisher: Any) -> Any:
    with Publisher(store, **{"adapter": adapter_entry(model), **publisher}) as pub:
        for step in range(steps):
            if step:
                _step(model, step)
            pub.publish(model, step)
        pub.flush()
    return pub


def _nothing_written(served: Path) -> bool:
    return not (served / ADAPTER_FILE).exists() and not (served / CONFIG_FILE).exists()


_ids = iter(range(100, 10_000))


def _lora(path: Path) -> Any:
    """A request naming the adapter at ``path`` under an id vLLM has not loaded yet (a fresh load from disk)."""
    from vllm.lora.request import LoRARequest

    i = next(_ids)
    return LoRARequest(f"adv-{i}", i, str(path))


# ------------------------------------------------------------------------------------------- promises 1 and 3


def test_a_catch_up_across_an_anchor_after_a_restart_serves_the_version_exactly(rig: Rig) -> None:
    """A restarted engine whose served directory holds an older version (v0): a delta on it is refused (the engine
    knows no version), a catch-up across an anchor (anchor v2, delta v3) serves v3 bit for bit; vLLM's outputs
    equal a fresh load of the trainer's own adapter (float32, as PEFT saves it); the whole-state proof holds."""
    model = _trainer(rig.model_dir, seed=1)
    store = LocalStore(rig.root / "catchup-store")
    pub = _publish(store, model, 4, config=_anchor_every(2))
    assert [(m.kind, m.version) for m in pub.published][:1] == [("anchor", 0)]
    reference = rig.root / "catchup-trainer-v3"
    model.save_pretrained(reference)

    target, served = rig.fresh("catchup")
    target.apply(StagedUpdate(objects=(rig.stage(store, "c-a0", 0, "anchor"),)))
    older = (served / ADAPTER_FILE).read_bytes()
    target, served = rig.fresh("catchup")  # restarted: the directory holds v0, the engine knows no version
    with pytest.raises(UpdateRefused) as exc:
        target.apply(StagedUpdate(objects=(rig.stage(store, "c-d1", 1, "delta"),)))
    assert exc.value.reason is RefusalReason.BASE
    assert (served / ADAPTER_FILE).read_bytes() == older
    objects = (rig.stage(store, "c-a2", 2, "anchor"), rig.stage(store, "c-d3", 3, "delta"))
    target.apply(StagedUpdate(objects=objects))
    status = rig.status()
    assert status["version"] == 3 and status["healthy"] and rig.llm.get_weight_version() == "3"
    from safetensors.torch import load_file

    want = read_weights(store, 3)
    got = load_file(served / ADAPTER_FILE)
    assert set(got) == set(want) and all(torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want)
    assert json.loads((served / CONFIG_FILE).read_text()) == adapter_config_json(adapter_entry(model))
    trainer_bf16 = {k: v.to(torch.bfloat16) for k, v in adapter_state(model).items()}
    assert all(torch.equal(got[n].view(torch.int16), trainer_bf16[n].view(torch.int16)) for n in trainer_bf16)
    assert _outputs(rig.llm, _lora(served)) == _outputs(rig.llm, _lora(reference))
    proof = rig.llm.collective_rpc("deltasync_prove")[0]
    assert proof["ok"] and proof["proven"], proof


def test_an_rslora_adapter_with_a_fractional_alpha_is_served_as_a_fresh_load(rig: Rig) -> None:
    """The scaling vLLM applies comes from the served adapter_config.json: rsLoRA and alpha 12.5 (alpha/sqrt(r)),
    on a subset of the modules, must compute as the trainer's own adapter loaded fresh."""
    model = _trainer(rig.model_dir, seed=11, use_rslora=True, lora_alpha=12.5, target_modules=["q_proj", "down_proj"])
    store = LocalStore(rig.root / "rslora-store")
    _publish(store, model, 2)
    reference = rig.root / "rslora-trainer"
    model.save_pretrained(reference)
    target, served = rig.fresh("rslora")
    target.apply(StagedUpdate(objects=(rig.stage(store, "rs-a0", 0, "anchor"), rig.stage(store, "rs-d1", 1, "delta"))))
    config = json.loads((served / CONFIG_FILE).read_text())
    assert config["use_rslora"] is True and config["lora_alpha"] == 12.5
    assert _outputs(rig.llm, _lora(served)) == _outputs(rig.llm, _lora(reference))
    assert rig.llm.collective_rpc("deltasync_prove")[0]["ok"]


def _anchor_every(n: int) -> Any:
    from deltasync.config import PublisherConfig

    return PublisherConfig(anchor_every=n)


def test_a_served_config_that_differs_from_the_version_is_drift(rig: Rig) -> None:
    model = _trainer(rig.model_dir, seed=2)
    store = LocalStore(rig.root / "config-store")
    _publish(store, model, 1)
    target, served = rig.fresh("config")
    target.apply(StagedUpdate(objects=(rig.stage(store, "cfg-a0", 0, "anchor"),)))
    assert rig.llm.collective_rpc("deltasync_prove")[0]["ok"]
    before = _outputs(rig.llm, _lora(served))
    config = json.loads((served / CONFIG_FILE).read_text())
    config["lora_alpha"] = 2 * config["lora_alpha"]  # planted (or a stray write): the next load scales by 4, not 2
    (served / CONFIG_FILE).write_text(json.dumps(config))
    changed = _outputs(rig.llm, _lora(served))  # what vLLM serves from the directory now, labelled v0
    proof = rig.llm.collective_rpc("deltasync_prove")[0]
    status = rig.status()
    assert not proof["ok"] and not status["healthy"], (
        f"the served directory computes otherwise than v0 ({changed != before}) and the proof says {proof}"
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("alpha_pattern", {"q_proj": 64}),  # vLLM scales q_proj by 64/8 where the version scales by 16/8
        ("rank_pattern", {"v_proj": 4}),
        ("init_lora_weights", "pissa"),  # vLLM refuses it when a request names the adapter: its engine core dies
        ("layers_to_transform", [0]),
        ("some_later_peft_field", True),  # a key nobody classified yet
        ("lora_alpha", 16.0),  # the same number, another JSON type
    ],
    ids=["alpha-pattern", "rank-pattern", "init-pissa", "layers-to-transform", "unknown-key", "alpha-as-float"],
)
def test_any_change_to_the_served_config_is_drift(rig: Rig, key: str, value: Any) -> None:
    """Whoever can write the served directory edits or adds one key of adapter_config.json: the whole-state proof
    says drift, naming the file and the key, and the engine is unhealthy until an anchor restores it."""
    model = _trainer(rig.model_dir, seed=12)
    store = LocalStore(rig.root / f"cfg-{key}-store")
    _publish(store, model, 1)
    target, served = rig.fresh(f"cfg-{key}")
    target.apply(StagedUpdate(objects=(rig.stage(store, f"cfg-{key}-a0", 0, "anchor"),)))
    assert rig.llm.collective_rpc("deltasync_prove")[0]["ok"]
    config = json.loads((served / CONFIG_FILE).read_text())
    assert config["lora_alpha"] == 16 and isinstance(config["lora_alpha"], int)
    config[key] = value
    (served / CONFIG_FILE).write_text(json.dumps(config))
    proof = rig.llm.collective_rpc("deltasync_prove")[0]
    assert not proof["ok"] and proof["bad"] == [f"{served / CONFIG_FILE} ({key})"], proof
    status = rig.status()
    assert not status["healthy"] and status["drift"]["tensors"] == proof["bad"], status
    target.apply(StagedUpdate(objects=(rig.stage(store, f"cfg-{key}-a0b", 0, "anchor"),)))
    assert json.loads((served / CONFIG_FILE).read_text()) == adapter_config_json(adapter_entry(model))
    assert rig.status()["healthy"] and rig.llm.collective_rpc("deltasync_prove")[0]["ok"]


def _serve_one_version(rig: Rig, seed: int, name: str, tag: str) -> tuple[LocalStore, OfflineLLMTarget, Path, Path]:
    """A trainer's adapter (``seed``) published once to a store of its own (``NAME-store``), saved as the trainer
    has it (``NAME-trainer``: what a fresh load reads), and its anchor (staged as ``TAG-a0``) applied on a fresh
    engine serving ``NAME-served``: the store, the target, the served directory and the trainer's copy."""
    model = _trainer(rig.model_dir, seed=seed)
    store = LocalStore(rig.root / f"{name}-store")
    _publish(store, model, 1)
    reference = rig.root / f"{name}-trainer"
    model.save_pretrained(reference)
    target, served = rig.fresh(name)
    target.apply(StagedUpdate(objects=(rig.stage(store, f"{tag}-a0", 0, "anchor"),)))
    return store, target, served, reference


@pytest.mark.parametrize("edit", ["alpha-times-16", "nested-json"])
def test_an_edited_served_directory_is_never_what_vllm_computes_with(rig: Rig, edit: str) -> None:
    """Whoever can write the served directory edits it, then has vLLM load the adapter again (a request under a new
    id, as after an eviction), then puts the file back: every load of the served adapter reads the engine's own
    copy of the version, so the requests compute as the published version throughout (and leave no KV computed
    with anything else); the whole-state proof reports the edit as drift, an unparsable file included."""
    store, target, served, reference = _serve_one_version(rig, 15, f"edit-{edit}", f"e-{edit}")
    fresh = _outputs(rig.llm, _lora(reference))
    original = (served / CONFIG_FILE).read_text()
    if edit == "alpha-times-16":
        config = json.loads(original)
        config["lora_alpha"] *= 16
        (served / CONFIG_FILE).write_text(json.dumps(config))
    else:
        (served / CONFIG_FILE).write_text("[" * 200_000 + "]" * 200_000)
    assert _outputs(rig.llm, _lora(served)) == fresh  # loaded now, after the edit
    proof = rig.llm.collective_rpc("deltasync_prove")[0]
    assert not proof["ok"] and proof["bad"] and str(served / CONFIG_FILE) in proof["bad"][0], proof
    assert not rig.status()["healthy"]
    (served / CONFIG_FILE).write_text(original)
    assert _outputs(rig.llm, _lora(served)) == fresh
    target.apply(StagedUpdate(objects=(rig.stage(store, f"e-{edit}-a0b", 0, "anchor"),)))
    assert rig.llm.collective_rpc("deltasync_prove")[0]["ok"]


def _tamper(worker: Any, lora_id: int, where: str) -> str:
    """Runs in the vLLM worker: one element of the loaded adapter ``lora_id`` moved, in its slot of the first
    layer's buffers (``slot``) or in vLLM's loaded copy (``copy``), as a stray write in the engine would."""
    worker = getattr(worker, "worker", worker)
    mm = worker.model_runner.lora_manager._adapter_manager
    name, module = next((n, m) for n, m in mm.modules.items() if mm._get_lora_layer_weights(mm.get_adapter(lora_id), n))
    if where == "slot":
        stacked = module.lora_b_stacked[0] if isinstance(module.lora_b_stacked, tuple) else module.lora_b_stacked
        target = stacked[mm.lora_index_to_id.index(lora_id)]
    else:
        b = mm._get_lora_layer_weights(mm.get_adapter(lora_id), name).lora_b
        target = next(t for t in (b if isinstance(b, list) else [b]) if t is not None)
    with torch.inference_mode():  # vLLM loads adapters as inference tensors
        target.view(-1)[0] += 1.0
    return name


@pytest.mark.parametrize("where", ["slot", "copy"])
def test_a_stray_write_into_what_vllm_computes_with_is_drift(rig: Rig, where: str) -> None:
    """The served directory holds the version, but vLLM computes with another value: one element of the adapter's
    slot in a layer's LoRA buffers, or of vLLM's loaded copy (which fills the slot when the adapter comes back after
    an eviction). The whole-state proof reads both back as each layer's own set_lora would write them, and says
    drift; an anchor restores what vLLM computes with (its session end drops every loaded adapter)."""
    store, target, served, reference = _serve_one_version(rig, 13, f"stray-{where}", f"s-{where}")
    request = _lora(served)
    fresh = _outputs(rig.llm, _lora(reference))
    assert _outputs(rig.llm, request) == fresh  # loaded into a slot from the served directory
    proof = rig.llm.collective_rpc("deltasync_prove")[0]
    assert proof["ok"] and proof["slots"] == 1, proof
    module = rig.llm.collective_rpc(_tamper, args=(request.lora_int_id, where))[0]
    proof = rig.llm.collective_rpc("deltasync_prove")[0]
    what = "(slot" if where == "slot" else "(vLLM's loaded copy)"
    assert not proof["ok"] and any(module in b and what in b for b in proof["bad"]), proof
    assert not rig.status()["healthy"]
    target.apply(StagedUpdate(objects=(rig.stage(store, f"s-{where}-a0b", 0, "anchor"),)))
    assert _outputs(rig.llm, request) == fresh
    proof = rig.llm.collective_rpc("deltasync_prove")[0]
    assert proof["ok"] and proof["slots"] == 1, proof


def test_a_failure_past_the_first_write_unlabels_the_engine_until_an_anchor(rig: Rig) -> None:
    """The served directory cannot be written at the session's end (a file is in its way): the engine is
    unhealthy and labelled ``unhealthy``; a delta is refused; an anchor restores it."""
    model = _trainer(rig.model_dir, seed=3)
    store = LocalStore(rig.root / "fail-store")
    _publish(store, model, 2)
    target, served = rig.fresh("fail")
    served.write_bytes(b"not a directory")
    with pytest.raises(ApplyError):
        target.apply(StagedUpdate(objects=(rig.stage(store, "f-a0", 0, "anchor"),)))
    status = rig.status()
    assert not status["healthy"] and status["version"] is None, status
    assert rig.llm.get_weight_version() == UNHEALTHY_LABEL
    served.unlink()
    with pytest.raises(UpdateRefused):
        target.apply(StagedUpdate(objects=(rig.stage(store, "f-d1", 1, "delta"),)))
    assert rig.llm.get_weight_version() == UNHEALTHY_LABEL and not served.exists()
    target.apply(StagedUpdate(objects=(rig.stage(store, "f-a0b", 0, "anchor"), rig.stage(store, "f-d1b", 1, "delta"))))
    status = rig.status()
    assert status["healthy"] and status["version"] == 1 and rig.llm.get_weight_version() == "1"
    assert rig.llm.collective_rpc("deltasync_prove")[0]["ok"]


# ------------------------------------------------------------------------- promise 2: refused, nothing written


def _refused(rig: Rig, target: OfflineLLMTarget, served: Path, obj: Any) -> UpdateRefused:
    with pytest.raises(UpdateRefused) as exc:
        target.apply(StagedUpdate(objects=(obj,)))
    assert _nothing_written(served), sorted(os.listdir(served))
    status = rig.status()
    assert status["version"] is None and status["healthy"], status
    return exc.value


def test_an_adapter_above_max_lora_rank_is_refused_before_any_write(rig: Rig) -> None:
    model = _trainer(rig.model_dir, seed=4, rank=16)
    store = LocalStore(rig.root / "rank-store")
    _publish(store, model, 1)
    target, served = rig.fresh("rank")
    refusal = _refused(rig, target, served, rig.stage(store, "r-a0", 0, "anchor"))
    assert refusal.reason is RefusalReason.UNSUPPORTED and "max-lora-rank" in str(refusal)


def test_an_engine_without_enable_lora_refuses_a_lora_claim(rig: Rig) -> None:
    """An adapter run's agent (same base) pointed at an engine started without LoRA is refused at the claim:
    it never holds the engine, whose own agent then claims it at once."""
    try:
        with pytest.raises(UpdateRefused) as exc:
            rig.fresh("nolora", lora_enabled=False)
        assert exc.value.reason is RefusalReason.UNSUPPORTED and "--enable-lora" in str(exc.value)
        assert rig.status()["agent"] is None
        OfflineLLMTarget(rig.llm).init(EngineClaim(agent_id="own", session="o2", staging_root=str(rig.staging)))
        assert rig.status()["agent"] == "own"
    finally:
        rig.llm.collective_rpc(_restart, args=(True,))


def test_an_adapter_object_sent_to_a_full_weights_engine_is_refused(rig: Rig) -> None:
    model = _trainer(rig.model_dir, seed=6)
    store = LocalStore(rig.root / "full-store")
    _publish(store, model, 1)
    target, _ = rig.fresh("full", mode="reload")
    with pytest.raises(UpdateRefused, match="LoRA adapter's") as exc:
        target.apply(StagedUpdate(objects=(rig.stage(store, "fw-a0", 0, "anchor"),)))
    assert exc.value.reason is RefusalReason.MODEL
    assert rig.status()["healthy"]


def test_full_weights_and_another_base_are_refused_by_a_fresh_lora_engine(rig: Rig) -> None:
    """Before the first anchor too (nothing served yet: the first object defines the adapter): a model's own
    weights, and the adapter's entry on another base."""
    model = _trainer(rig.model_dir, seed=7)
    entry = adapter_entry(model)
    full, other = LocalStore(rig.root / "own-store"), LocalStore(rig.root / "base-store")
    with Publisher(full) as pub:
        pub.publish(model.get_base_model())
    _publish(other, model, 1, adapter=dataclasses.replace(entry, base_fingerprint="sha256:" + "0" * 64))
    target, served = rig.fresh("fresh-refusals")
    for store, name, message in ((full, "own", "model's own weights"), (other, "base", "another base model")):
        refusal = _refused(rig, target, served, rig.stage(store, f"fr-{name}", 0, "anchor"))
        assert refusal.reason is RefusalReason.MODEL and message in str(refusal), refusal


def test_an_agent_for_another_base_never_keeps_a_fresh_engines_claim(rig: Rig) -> None:
    """An agent of another base model's adapter run, pointed by mistake at a fresh engine, is refused at the claim
    where its run's base is known; where it is not (its run had published nothing), its first object is refused and
    its claim released with it. Either way the engine's own agent then takes the engine at once."""
    model = _trainer(rig.model_dir, seed=14)
    other = LocalStore(rig.root / "claim-other-store")
    entry = dataclasses.replace(adapter_entry(model), base_fingerprint="sha256:" + "1" * 64)
    _publish(other, model, 1, adapter=entry)
    target, served = rig.fresh("claim-fresh")  # claimed by "adversary" with no model: as an empty run's agent
    rig.llm.collective_rpc(_restart, args=(True,))
    wrong = EngineClaim(
        agent_id="wrong", session="w1", staging_root=str(rig.staging), mode="lora", adapter_dir=str(served)
    )
    with pytest.raises(UpdateRefused) as exc:
        target.init(dataclasses.replace(wrong, model_fingerprint=entry.base_fingerprint))
    assert exc.value.reason is RefusalReason.MODEL and "adapters for another base model" in str(exc.value)
    assert rig.status()["agent"] is None
    target.init(wrong)  # its run was empty when it started: the engine cannot tell yet
    assert rig.status()["agent"] == "wrong"
    refusal = _refused(rig, target, served, rig.stage(other, "claim-a0", 0, "anchor"))
    assert refusal.reason is RefusalReason.MODEL and "another base model" in str(refusal)
    assert rig.status()["agent"] is None  # released with the refusal
    own = EngineClaim(agent_id="own", session="o1", staging_root=str(rig.staging), mode="lora", adapter_dir=str(served))
    target.init(own)
    assert rig.status()["agent"] == "own"


# The first anchor of a lora engine (and the first after a restart) defines the served tensors, so it is checked
# against the manifest's adapter (apply._not_the_adapter, on both sides): tensors vLLM's loader refuses must never
# be written to adapter_dir and labelled (the next request naming the adapter would kill vLLM's engine core).


def _hostile_rank(model_dir: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """An adapter whose manifest says rank 8 (<= max_lora_rank) while its tensors are rank 16."""
    entry = adapter_entry(_trainer(model_dir, seed=8))
    return entry, adapter_state(_trainer(model_dir, seed=8, rank=16))


def _hostile_extra(model_dir: Path, name: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The served adapter's own tensors, plus one that is not a LoRA A or B (a base weight, a bias)."""
    model = _trainer(model_dir, seed=9)
    state = dict(adapter_state(model))
    base = model.get_base_model().state_dict()
    norm = base["model.norm.weight"]  # the hidden size: o_proj's output, as its lora_B.bias would be
    state[name] = (norm if name.endswith("norm.weight") else torch.zeros_like(norm)).clone()
    return adapter_entry(model), state


@pytest.mark.parametrize(
    "how",
    ["rank-16-tensors-declared-r-8", "base-norm-weight-smuggled", "lora-b-bias"],
)
def test_a_first_anchor_whose_tensors_are_not_its_adapter_is_refused_before_any_write(rig: Rig, how: str) -> None:
    if how.startswith("rank"):
        entry, state = _hostile_rank(rig.model_dir)
    elif how.startswith("base"):
        entry, state = _hostile_extra(rig.model_dir, "base_model.model.model.norm.weight")
    else:
        entry, state = _hostile_extra(rig.model_dir, "base_model.model.model.layers.0.self_attn.o_proj.lora_B.bias")
    store = LocalStore(rig.root / f"{how}-store")
    with Publisher(store, adapter=entry) as pub:  # a store writer's object: the publisher is no gate here
        pub.publish(state)
    target, served = rig.fresh(how)
    try:
        target.apply(StagedUpdate(objects=(rig.stage(store, how, 0, "anchor"),)))
    except UpdateRefused as exc:
        assert exc.reason in (RefusalReason.MALFORMED, RefusalReason.UNSUPPORTED, RefusalReason.MODEL)
        assert _nothing_written(served)
        return
    verdict = rig.llm.collective_rpc(_vllm_loads, args=(str(served),))[0]
    pytest.fail(
        f"served as v{rig.status()['version']} (label {rig.llm.get_weight_version()}); vLLM's loader on adapter_dir: "
        f"{verdict}"
    )


def test_an_adapter_trained_on_another_base_of_the_same_shapes_is_refused_and_the_version_kept(rig: Rig) -> None:
    """The run's trainer restarts on another base of the same names and shapes (other random weights) and publishes
    on: its anchor's adapter entry equals the served one but for the digest of its base's weights. The engine, which
    reads its own checkpoint's, refuses it before any write, naming both digests, and keeps serving v0 exactly (names
    and shapes alone would have admitted it)."""
    from deltasync.testing.models import build_tiny_model

    model = _trainer(rig.model_dir, seed=16)
    store = LocalStore(rig.root / "other-base-store")
    run = _publish(store, model, 1).published[0].run_id
    target, served = rig.fresh("other-base")
    target.apply(StagedUpdate(objects=(rig.stage(store, "ob-a0", 0, "anchor"),)))
    files = {f: (served / f).read_bytes() for f in (ADAPTER_FILE, CONFIG_FILE)}
    outputs = _outputs(rig.llm, _lora(served))
    wrong = _trainer(build_tiny_model(rig.root / "other-base", seed=1), seed=16)
    assert adapter_entry(wrong) == adapter_entry(model)  # one manifest entry, but for the base's weights
    pub = _publish(store, wrong, 1)  # the same run, on from v1 (a new publisher starts with an anchor)
    assert [(m.kind, m.version, m.run_id) for m in pub.published] == [("anchor", 1, run)]
    with pytest.raises(UpdateRefused) as exc:
        target.apply(StagedUpdate(objects=(rig.stage(store, "ob-a1", 1, "anchor"),)))
    assert exc.value.reason is RefusalReason.MODEL
    theirs, ours = adapter_entry(wrong).base_content, adapter_entry(model).base_content
    assert theirs is not None and ours is not None and theirs != ours
    assert (
        f"anchor v1 is an adapter for another base model of the same shapes (base weights {theirs[:19]}..., this "
        f"engine serves base weights {ours[:19]}...): publish the adapter from a trainer whose base is the checkpoint "
        "this engine serves, or serve the adapter's own base"
    ) in str(exc.value), exc.value
    status = rig.status()
    assert status["version"] == 0 and status["healthy"] and rig.llm.get_weight_version() == "0", status
    assert status["adapter"]["base_content"] == ours
    assert {f: (served / f).read_bytes() for f in files} == files
    assert _outputs(rig.llm, _lora(served)) == outputs
    assert rig.llm.collective_rpc("deltasync_prove")[0]["ok"]
