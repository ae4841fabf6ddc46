"""Adversarial checks of the repacked-kernel audit (written by an adversary briefed with the promise only) (vLLM's CPU build, ``reload`` mode): an engine whose repacked
kernels are referenced in small blocks (``DELTASYNC_KERNEL_BLOCK_MACS``), including blocks that do not divide the
input size (a Llama's ``down_proj`` with 200 inputs: blocks of 32, the last of 8; or of 1 column), audited whole
and sliced.

* a single element changed in what a kernel computes with, in the last (partial) block's last column, is drift
  for both audits, the engine is unlabelled, and an anchor restores it;
* an honest engine is never drift, and a sliced audit reads every block of every repacked module exactly once,
  one block a call at the smallest bound;
* crafted windows sent straight to ``deltasync_prove`` never prove what was not read;
* an honest version whose weights hold ``-0.0`` (what ``w * mask`` gives a pruned negative weight) must not be
  drift either.
"""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle
import pytest
import torch
from safetensors.torch import load_file

from deltasync import ApplyError, compute_delta, write_delta
from deltasync.agent import Agent
from deltasync.config import AgentConfig
from deltasync.testing.launchers import offline_llm
from deltasync.testing.models import build_tiny_model
from deltasync.vllm.config import KERNEL_BLOCK_ENV, PLAIN_ENV
from deltasync.vllm.plain import kernel_block
from tests.conftest import agent_token
from tests.support.world import world

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import this module

DOWN = "model.layers.1.mlp.down_proj"
"""A Llama down_proj: 200 input columns (not a power of two), 256 outputs."""


def _poke(worker: Any, module: str, row: int, col: int) -> list[int]:
    """Runs in a vLLM worker: from now on ``module``'s GEMM computes with its own weight except one element, the
    lowest bit of ``[row, col]`` flipped (a packed copy changed behind deltasync's back). Returns the old and new
    bits."""
    from deltasync.vllm.plain import read_through_kernel

    m = worker.model_runner.get_model().get_submodule(module)
    w = read_through_kernel(m, torch.bfloat16).clone()
    old = int(w[row, col].view(torch.int16))
    w.view(torch.int16)[row, col] ^= 1
    m.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, w, bias)
    return [old, int(w[row, col].view(torch.int16))]


class Recording:
    """Wraps a target's ``_rpc`` to keep every ``deltasync_prove`` call's kernel windows."""

    def __init__(self, target: Any) -> None:
        self.target, self.original = target, target._rpc
        self.calls: list[list[list[Any]]] = []
        target._rpc = self

    def __call__(self, method: str, **kwargs: Any) -> Any:
        kernels = [w for w in kwargs.get("windows") or [] if str(w[0]).startswith("kernel:")]
        if method == "deltasync_prove" and kernels:
            self.calls.append(kernels)
        return self.original(method, **kwargs)

    def close(self) -> None:
        self.target._rpc = self.original


@pytest.fixture(scope="module", params=[1 << 21, 1], ids=["blocks-of-32", "blocks-of-1"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("vllm")
    mp = pytest.MonkeyPatch()
    mp.delenv(PLAIN_ENV, raising=False)  # reload mode: linear weights repacked
    mp.setenv(KERNEL_BLOCK_ENV, str(request.param))
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    tmp = tmp_path_factory.mktemp(f"adv-{request.param}")
    model_dir = build_tiny_model(tmp / "llama", arch="llama", seed=3)
    llm = offline_llm(model_dir)
    try:
        with world(tmp, load_file(model_dir / "model.safetensors"), lr=1e-5) as w:
            config = AgentConfig(agent_id="adv", staging_dir=str(tmp / "staging"), retries=0)
            agent = Agent.for_llm(llm, store=w.store, coordinator=w.client(agent_token("adv")), config=config)
            assert agent.sync().route == "anchor"  # every module reloaded by deltasync: every kernel referenced
            yield dict(llm=llm, agent=agent, publisher=w.publisher, macs=request.param)
    finally:
        mp.undo()
        llm.llm_engine.engine_core.shutdown()


def _plan(llm: Any) -> dict[str, Any]:
    [rank] = llm.collective_rpc("deltasync_prove", kwargs={"windows": [], "extras": False})
    return rank


def _healthy(llm: Any) -> bool:
    return all(st["healthy"] for st in llm.collective_rpc("deltasync_status"))


def test_honest_engine_every_block_read_once_and_no_drift(engine: dict[str, Any]) -> None:
    llm, agent = engine["llm"], engine["agent"]
    plan = _plan(llm)
    blocks = plan["kernel_blocks"]
    block = kernel_block(200, 256, engine["macs"])  # 32 columns (6 blocks of 32, the last of 8) / 1 column
    assert block == (32 if engine["macs"] == 1 << 21 else 1)
    assert blocks.get(DOWN) == -(-200 // block), plan
    assert set(plan["kernels"]) >= {DOWN, "lm_head"}, plan
    assert agent.target.prove() == []
    rec = Recording(agent.target)
    try:
        assert agent.target.prove(stall_s=1e-9) == []
    finally:
        rec.close()
    read: dict[str, list[int]] = {}
    for windows in rec.calls:
        assert len(windows) == 1, windows  # at the smallest bound: one window a call
        name, b0, b1 = windows[0]
        module = name.removeprefix("kernel:")
        if module in blocks:
            assert b1 - b0 == 1, windows  # one block a call
            read.setdefault(module, []).extend(range(b0, b1))
        else:
            assert (b0, b1) == (0, 0)
            read.setdefault(module, []).append(0)
    assert set(read) == set(plan["kernels"]), (sorted(read), sorted(plan["kernels"]))
    for module in plan["kernels"]:
        assert sorted(read[module]) == list(range(blocks.get(module, 1))), module  # every block, exactly once
    assert _healthy(llm)


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
@pytest.mark.parametrize("where", ["last", "first", "boundary"])
def test_one_element_in_any_block_is_drift(engine: dict[str, Any], sliced: bool, where: str) -> None:
    llm, agent = engine["llm"], engine["agent"]
    col = {"last": 199, "first": 0, "boundary": 192}[where]  # 192: the first column of the short last block (32)
    row = 77
    old, new = llm.collective_rpc(_poke, args=(DOWN, row, col))[0]
    assert old != new
    with pytest.raises(ApplyError, match="drift"):
        agent.target.prove(stall_s=1e-9 if sliced else None)
    assert not _healthy(llm)
    assert llm.get_weight_version() == "unhealthy"
    st = llm.collective_rpc("deltasync_status")[0]
    assert any(DOWN in t for t in st["drift"]["tensors"]), st["drift"]
    assert agent.sync().route == "anchor"  # restored (the reload re-dispatches the kernel)
    assert agent.target.prove(stall_s=1e-9) == [] and _healthy(llm)


def test_crafted_windows_never_prove_what_was_not_read(engine: dict[str, Any]) -> None:
    llm = engine["llm"]
    blocks = _plan(llm)["kernel_blocks"][DOWN]
    k = f"kernel:{DOWN}"
    llm.collective_rpc(_poke, args=(DOWN, 3, 199))  # drift in the last block only
    try:
        for windows in (
            [[k, -1, 0]],
            [[k, 3, 1]],
            [[k, blocks, blocks + 1]],
            [[k, 0, 2**62]],
            [[k, -(2**62), -1]],
            [[k, blocks - 1, blocks - 1]],
            [[k, 1, 0]],
        ):
            [rank] = llm.collective_rpc("deltasync_prove", kwargs={"windows": windows, "extras": False})
            assert rank["ok"] and not rank["bad"], (windows, rank)
            assert any(DOWN in u for u in rank["unproven"]), (windows, rank)  # said: not read
        for windows in ([[k, 0.5, "x"]], [[None, 0, 0]], [[k]], "kernel:x", [[k, float("nan"), 1]]):
            [rank] = llm.collective_rpc("deltasync_prove", kwargs={"windows": windows, "extras": False})
            assert not rank["ok"] or rank.get("unproven") or rank.get("bad"), (windows, rank)
        assert _healthy(llm)  # nothing read the drifted block yet
        # a window that reads the drifted block, duplicated: found
        [rank] = llm.collective_rpc(
            "deltasync_prove", kwargs={"windows": [[k, blocks - 1, blocks], [k, blocks - 1, blocks]], "extras": False}
        )
        assert rank["bad"] and not _healthy(llm)
    finally:
        assert engine["agent"].sync().route == "anchor"
    assert engine["agent"].target.prove(stall_s=1e-9) == [] and _healthy(llm)


def test_crafted_unknown_module_is_not_silently_proven(engine: dict[str, Any]) -> None:
    """A window naming a module the engine has no kernel for reads nothing: it says so (unproven), not ok with
    nothing unproven."""
    llm = engine["llm"]
    [rank] = llm.collective_rpc(
        "deltasync_prove", kwargs={"windows": [["kernel:model.layers.9.mlp.down_proj", 0, 0]], "extras": False}
    )
    assert rank["ok"]
    assert rank["unproven"], rank


def test_an_honest_negative_zero_is_not_drift(engine: dict[str, Any]) -> None:
    """A published version whose down_proj holds a -0.0 (a pruned negative weight: ``w * 0``) in the last, partial
    block: the engine loads exactly that; its kernel computes with it exactly as with +0.0. No drift."""
    llm, agent, publisher = engine["llm"], engine["agent"], engine["publisher"]
    name = f"{DOWN}.weight"
    curr = {n: t.clone() for n, t in publisher.truth[publisher.version].items()}
    w = curr[name]
    row = int(torch.nonzero(w[:, 199] < 0)[0, 0])
    w[row, 199] = w[row, 199] * 0  # -0.0
    assert int(w[row, 199].view(torch.int16)) == -32768
    publisher.version += 1
    changes = compute_delta(publisher.snapshot, curr, update_prev=True)
    publisher.base = write_delta(publisher.writer, changes, state=curr, version=publisher.version, base=publisher.base)
    publisher.register(publisher.base)
    publisher.truth[publisher.version] = curr
    try:
        agent.sync()  # applied: the update's own checks pass
        assert _healthy(llm) and llm.collective_rpc("deltasync_status")[0]["version"] == publisher.version
        assert agent.target.prove() == []  # the kernel reads -0.0 back as +0.0: compared as canonical()
        assert agent.target.prove(stall_s=1e-9) == []
        assert _healthy(llm)
    finally:
        # leave the engine on a version without -0.0 for the tests after this one
        curr = {n: t.clone() for n, t in curr.items()}
        curr[name][row, 199] = 0.5
        publisher.version += 1
        changes = compute_delta(publisher.snapshot, curr, update_prev=True)
        publisher.base = write_delta(
            publisher.writer, changes, state=curr, version=publisher.version, base=publisher.base
        )
        publisher.register(publisher.base)
        publisher.truth[publisher.version] = curr
        try:
            agent.sync()
        except Exception:  # noqa: BLE001
            pass
