"""The Wordle demo, shortened (4 asynchronous steps, its docstring's smallest run): real processes, the staleness
bound held, every rollout tagged with a version vLLM served, versions applied in order, bit-exact at the end, and no
process left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.user_tree import make_user_tree, user_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _alive(pid: int) -> bool:
    """Running (a zombie, already dead and only waiting to be reaped by init, does not count)."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state != "Z"


SMALLEST_RUN = ["-m", "examples.wordle.run_demo", "--steps", "4", "--warmup-steps", "20", "--out"]
"""The demo's smallest real run, as its docstring gives it (the output directory last)."""


def test_the_docstring_gives_the_smallest_run() -> None:
    import examples.wordle.run_demo as demo

    assert "python " + " ".join(SMALLEST_RUN) in " ".join((demo.__doc__ or "").split()), demo.__doc__


def test_shortened_async_demo(tmp_path: Path) -> None:
    """The smallest run as a user runs it: from a copy of what a user has (the ``tests`` package refuses import)
    against the installed package."""
    out = tmp_path / "demo"
    tree = make_user_tree(tmp_path / "user")
    cmd = [sys.executable, *SMALLEST_RUN, str(out)]
    proc = subprocess.run(cmd, cwd=tree, env=user_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "BIT-EXACT" in proc.stdout and (out / "demo.png").stat().st_size > 10_000
    report = json.loads((out / "report.json").read_text())
    final, summary, steps = report["final"], report["summary"], report["steps"]
    assert final["mode"] == "async" and final["max_staleness"] == 2
    assert final["bit_exact"] and final["served_weight_version"] == str(final["version"]) == "4"
    published = sorted({p["version"] for p in final["published"]})
    assert published == [0, 1, 2, 3, 4]
    # the engine's own log: versions applied in order, none repeated, ending at the last (an agent may apply several
    # deltas in one pause). The server's log level is explicit: importing TRL sets VLLM_LOGGING_LEVEL=ERROR in
    # os.environ for every child, which would silence it.
    applied = [int(v) for v in re.findall(r"deltasync: now at v(\d+)", (out / "logs" / "vllm.log").read_text())]
    assert applied == sorted(set(applied)) and applied[-1] == 4 and set(applied) <= set(published), applied
    # the bound held: every consumed group was at most 2 versions behind the trainer
    assert all(0 <= s <= 2 for r in steps for s in r["staleness"]), [r["staleness"] for r in steps]
    assert sum(final["staleness_histogram"].values()) == 2 * len(steps) == 8
    # every tag came from the server: a version vLLM applied, never one the trainer had not published yet
    for r in steps:
        for oldest, newest, _ in r["groups"]:
            assert oldest in applied and newest in applied and oldest <= newest <= r["policy_version"], r
    # asynchronous: the trainer never waited for a weight sync
    assert summary["trainer_sync_wait_s"] == 0 and all(r["sync_wait_s"] == 0 for r in steps)
    # every process the demo started is gone, and nothing else still runs from its directory
    pids = json.loads((out / "pids.json").read_text())
    assert set(pids) == {"coordinator", "env", "vllm", "agent", "trainer"}
    assert not [name for name, pid in pids.items() if _alive(pid)]
    leftovers = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out).encode() in cmdline.read_bytes():
                leftovers.append(cmdline.parent.name)
        except OSError:
            continue
    assert not leftovers, leftovers


def test_shortened_async_lora_demo(tmp_path: Path) -> None:
    """The same demo training a rank-8 LoRA adapter: the trainer publishes the adapter itself (never merged), vLLM
    serves it as ``policy`` and the rollouts name it; at the end the adapter vLLM loads equals the trainer's bit for
    bit, vLLM's base is untouched, and the served adapter gives the same tokens and logprobs as the trainer's own
    adapter loaded fresh into the same server."""
    from deltasync import LocalStore, read_manifest

    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "examples.wordle.run_demo", "--out", str(out), "--steps", "4", "--warmup-steps", "20"]
    proc = subprocess.run([*cmd, "--lora-rank", "8"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "BIT-EXACT" in proc.stdout
    final = json.loads((out / "report.json").read_text())["final"]
    assert final["lora_rank"] == 8 and final["bit_exact"] and not final["differ"]
    assert final["served_weight_version"] == str(final["version"]) == "4"
    # the base's 20 tensors as vLLM computes with them, the adapter's 28 (A and B of 7 modules x 2 layers), 4 prompts
    assert final["tensors_checked"] == 20 + 28 + 4
    store = LocalStore(out / "store")
    for p in final["published"]:
        m = read_manifest(store, p["version"], p["kind"])
        assert m.adapter is not None and m.adapter.r == 8 and all(".lora_" in n for n in m.tensors)
    applied = [int(v) for v in re.findall(r"deltasync: now at v(\d+)", (out / "logs" / "vllm.log").read_text())]
    assert applied == sorted(set(applied)) and applied[-1] == 4, applied
    pids = json.loads((out / "pids.json").read_text())
    assert not [name for name, pid in pids.items() if _alive(pid)]


def test_shortened_async_moe_demo(tmp_path: Path) -> None:
    """The same demo with a tiny Qwen3-MoE policy: every step changes every expert, the agent writes them in place
    where vLLM's CPU kernel reads them (plain weights), and at the end what vLLM computes with (every parameter,
    the packed experts included) equals a fresh engine loaded from the final version, under its label."""
    from deltasync import LocalStore, read_manifest

    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "examples.wordle.run_demo", "--out", str(out), "--steps", "4", "--warmup-steps", "20"]
    proc = subprocess.run([*cmd, "--moe"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "BIT-EXACT" in proc.stdout
    final = json.loads((out / "report.json").read_text())["final"]
    assert final["bit_exact"] and not final["differ"]
    assert final["served_weight_version"] == str(final["version"]) == "4"
    # every parameter vLLM holds: embeddings, norms, attention, the routers and the two fused experts of each layer
    assert final["tensors_checked"] >= 2 + 2 * 6
    # every expert of both layers published in the checkpoint's names, and served: the anchor of v0 wrote them in
    # place (in 4 steps of this tiny policy the groups' rewards are often all equal: no gradient, empty deltas;
    # tests/integration/test_moe_engine.py changes every expert)
    anchor = read_manifest(LocalStore(out / "store"), 0, "anchor")
    experts = [n for n, e in anchor.tensors.items() if ".experts." in n and e.nnz == e.numel]
    assert len(experts) == 2 * 4 * 3, experts
    applied = [int(v) for v in re.findall(r"deltasync: now at v(\d+)", (out / "logs" / "vllm.log").read_text())]
    assert applied == sorted(set(applied)) and applied[-1] == 4, applied
    pids = json.loads((out / "pids.json").read_text())
    assert not [name for name, pid in pids.items() if _alive(pid)]
