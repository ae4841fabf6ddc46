"""Apply benchmark (run by hand; asserts nothing): the serving pause per update, side by side, on vLLM's CPU build
at Qwen3-0.6B shapes (``load_format="dummy"``), kept current by the in-process agent from the update stream of
``deltasync.testing.stream``.

Two engines, one after the other:

* **packed** (vLLM's default: linear weights repacked for oneDNN): ``reload`` mode; tokens/s.
* **plain** (``DELTASYNC_VLLM_PLAIN_WEIGHTS=1``): ``patches`` (vLLM's ``load_checkpoint_weight_patches``),
  ``inplace`` through the patch map at two learning rates (its cost should follow the changed elements, not
  the model), the same engine's full reload (an anchor through ``reload`` mode); tokens/s.

Per update: the pause (the agent's serving gap: the whole update session), the engine's own write time, and
the work done before the pause (fetch, decode, stage, prepare). Ends with one JSON line.

    python benchmarks/bench_apply.py [--steps 4] [--lr 1e-6 1e-5] [--tokens 64] [--anchor-encoding raw]
        [--modes inplace]    (DELTASYNC_BENCH_PROFILE=1: where the engine worker's time goes, first sync and updates)
    python benchmarks/bench_apply.py --steps 1 --engines plain --modes inplace --lr 1e-6 --tokens 8
                         # the smallest real run: one engine, one update (about a minute here)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
PROFILE = os.environ.get("DELTASYNC_BENCH_PROFILE") == "1"
if PROFILE:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of this script's functions


def _profile(worker: Any, on: bool) -> None:
    """On the worker: start a profile, or stop it and print where the time went."""
    import cProfile
    import pstats

    if on:
        worker.deltasync_bench_profile = cProfile.Profile()
        worker.deltasync_bench_profile.enable()
    else:
        worker.deltasync_bench_profile.disable()
        stats = pstats.Stats(worker.deltasync_bench_profile)
        stats.sort_stats("tottime").print_stats(22)
        stats.sort_stats("cumulative").print_stats("deltasync", 40)


def profiled(llm: Any, fn: Any) -> Any:
    """``fn()``, with the engine worker profiled when ``DELTASYNC_BENCH_PROFILE=1``."""
    if not PROFILE:
        return fn()
    llm.collective_rpc(_profile, args=(True,))
    try:
        return fn()
    finally:
        llm.collective_rpc(_profile, args=(False,))


PROMPTS = ["The quick brown fox", "Guess the five letter word:", "crane slate audio raise", "In a hole in the ground"]


def tokens_per_s(llm: Any, tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


class Bench:
    """One engine, its agent, and the stream publishing into one store and coordinator."""

    def __init__(
        self,
        tmp: Path,
        llm: Any,
        label: str,
        client: Any,
        agent_client: Any,
        lease: Any,
        stream: Any,
        anchor_encoding: str = "packed",
    ):
        from deltasync import LocalStore, write_anchor
        from deltasync.agent import Agent
        from deltasync.config import AgentConfig

        self.llm, self.label, self.client, self.lease, self.stream = llm, label, client, lease, stream
        self.store = LocalStore(tmp / f"store-{label}")
        self.curr = stream.bf16()
        self.snapshot = {k: v.clone() for k, v in self.curr.items()}
        self.version = 0
        self.base = write_anchor(self.store, self.curr, version=0, encoding=anchor_encoding)
        self._register(self.base)
        self.worker = self.memory()  # the engine worker's memory with the model loaded, before any sync
        self.agent = Agent.for_llm(
            llm,
            store=self.store,
            coordinator=agent_client,
            config=AgentConfig(agent_id=f"bench-{label}", staging_dir=str(tmp / f"staging-{label}")),
        )
        self.first = profiled(llm, self.agent.sync)
        first = {k: round(v, 2) for k, v in self.first.timings.items()}
        print(f"{label}: first sync of the fresh engine ({anchor_encoding} anchor v0): {first}", flush=True)
        engine = llm.collective_rpc("deltasync_status")[0]
        print(f"{label}: engine worker decodes with {engine.get('kernels')} on cores {engine.get('cpus')}", flush=True)
        model_mib = sum(t.numel() * t.element_size() for t in self.curr.values()) / 2**20
        largest = max(t.numel() * t.element_size() for t in self.curr.values()) / 2**20
        self.first_memory = {
            "engine_extra_peak_mib": round(self.memory()["peak_mib"] - self.worker["rss_mib"]),
            "agent_host_copy_mib": self.agent_host_mib(),
            "model_mib": round(model_mib),
            "largest_tensor_mib": round(largest),
        }
        print(f"{label}: memory at the first sync: {self.first_memory}", flush=True)

    def agent_host_mib(self) -> int:
        """The agent's host copy of the model (none when the engine decodes the published objects itself)."""
        host = self.agent.host or {}
        return round(sum(t.numel() * t.element_size() for t in host.values()) / 2**20)

    def memory(self) -> dict[str, Any]:
        return dict(self.llm.collective_rpc("deltasync_status")[0]["memory"] or {"rss_mib": 0, "peak_mib": 0})

    def reset_peak(self) -> None:
        """Linux: reset the worker's peak resident memory (``/proc/PID/clear_refs``), to read one update's peak."""
        pid = self.memory().get("pid")
        if pid is not None:
            Path(f"/proc/{pid}/clear_refs").write_text("5")

    def _register(self, manifest: Any) -> None:
        from deltasync.schemas import VersionCreate

        self.client.register_version(VersionCreate.for_manifest(manifest), lease=self.lease)

    def mode(self, mode: str) -> None:
        """The apply mode, set as the engine's own agent (an engine obeys only the agent that claimed it)."""
        claim = {"agent_id": self.agent.config.agent_id, "session": self.agent.session, "mode": mode}
        self.llm.init_weight_transfer_engine({"init_info": claim})
        outcome = self.llm.collective_rpc("deltasync_status")[0]["outcome"]
        if not outcome["ok"]:
            raise RuntimeError(f"the engine refused mode {mode}: {outcome['message']}")

    def updates(self, mode: str, lr: float, steps: int) -> list[dict[str, Any]]:
        from deltasync import compute_delta, write_delta

        self.mode(mode)
        self.stream.lr = lr
        rows = []
        for _ in range(steps):
            self.version += 1
            self.curr = self.stream.step()
            changes = compute_delta(self.snapshot, self.curr, update_prev=True)
            self.base = write_delta(self.store, changes, state=self.curr, version=self.version, base=self.base)
            self._register(self.base)
            self.reset_peak()
            before = self.memory()["rss_mib"]
            with _Collections() as collections:
                r = profiled(self.llm, self.agent.sync) if len(rows) == 1 else self.agent.sync()  # the second update
            extra = self.memory()["peak_mib"] - before
            last = self.llm.collective_rpc("deltasync_status")[0]["history"][-1]
            t = r.timings
            rows.append(
                {
                    "engine": self.label,
                    "mode": mode,
                    "lr": lr,
                    "version": self.version,
                    "changed_fraction": self.base.nnz / self.base.numel,
                    "pause_ms": t["pause"] * 1e3,
                    "engine_apply_ms": last.get("apply_s", 0) * 1e3 + last.get("finish_s", 0) * 1e3,
                    "before_pause_ms": (t["fetch"] + t["decode"] + t["stage"] + t.get("prepare", 0)) * 1e3,
                    "before": {k: round(t.get(k, 0) * 1e3, 1) for k in ("fetch", "decode", "stage", "prepare")},
                    "engine_prepare_ms": {k: round(v * 1e3, 1) for k, v in last.get("prepare", {}).items()},
                    "changed": self.base.nnz,
                    "audit_ms": t.get("audit", 0) * 1e3,
                    "prepared": bool(last.get("prepared")),
                    "engine_extra_peak_mib": round(extra),
                    "decoded_delta_mib": round(self.base.nnz * 10 / 2**20),  # bf16 value + int64 index
                    "agent_host_copy_mib": self.agent_host_mib(),
                    "decodes": bool(self.llm.collective_rpc("deltasync_status")[0].get("decodes")),
                    "gc_in_sync_ms": collections.ms,
                }
            )
            row = rows[-1]
            print(
                f"{self.label:>6} {mode:>8} lr={lr:<7g} v{self.version:<3d} {row['changed_fraction']:7.3%} "
                f"pause {row['pause_ms']:8.1f} ms  engine {row['engine_apply_ms']:8.1f} ms  "
                f"before {row['before_pause_ms']:7.0f} ms {row['before']} {row['engine_prepare_ms']} "
                f"({row['before_pause_ms'] * 1e6 / max(row['changed'], 1):.0f} ns per changed element)  "
                f"audit {row['audit_ms']:6.0f} ms  engine peak +{row['engine_extra_peak_mib']} MiB "
                f"(decoded delta {row['decoded_delta_mib']} MiB)  agent host copy {row['agent_host_copy_mib']} MiB "
                f"({'the engine decodes' if row['decodes'] else 'the agent decodes'})  "
                f"gc in the sync {row['gc_in_sync_ms']} ms",
                flush=True,
            )
        return rows

    def audit(self, stall_s: float) -> dict[str, Any]:
        """The whole-state proof, once in one call per rank and once sliced into calls of about ``stall_s``: how
        long each holds the engine's worker (the slowest rank), against a warm memcpy of the model here."""
        target = self.agent.target
        t0 = time.perf_counter()
        whole = self.llm.collective_rpc("deltasync_prove")
        whole_wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        unproven = target.prove(stall_s=stall_s)
        sliced_wall = time.perf_counter() - t0
        stalls = list(target.audit_stalls)
        # the floor: a warm memcpy of the model into the snapshot (equal to it after each update: no new 1.2 GB,
        # which a suite running this beside other engines does not have to spare)
        t0 = time.perf_counter()
        for k, v in self.curr.items():
            self.snapshot[k].copy_(v)
        memcpy = time.perf_counter() - t0
        row = {
            "engine": self.label,
            "whole_call_s": max(float(r.get("prove_s") or 0) for r in whole),
            "whole_call_wall_s": whole_wall,
            "sliced_calls": len(stalls),
            "sliced_max_stall_s": max(stalls),
            "sliced_last_call_s": stalls[-1],  # beside the tensors: the repacked kernels read back, padding
            "sliced_total_s": sum(stalls),
            "sliced_wall_s": sliced_wall,
            "stall_bound_s": stall_s,
            "memcpy_s": memcpy,
            "unproven": unproven[:3],
        }
        print(
            f"{self.label}: audit of the whole state: one call {row['whole_call_s'] * 1e3:.0f} ms "
            f"({row['whole_call_s'] / memcpy:.1f}x a memcpy of the model, {memcpy * 1e3:.0f} ms); sliced at "
            f"{stall_s * 1e3:.0f} ms: {len(stalls)} calls, the longest {row['sliced_max_stall_s'] * 1e3:.0f} ms "
            f"(the last, beside the tensors: {stalls[-1] * 1e3:.0f} ms), {row['sliced_total_s'] * 1e3:.0f} ms in "
            f"all, {sliced_wall * 1e3:.0f} ms wall; unproven {unproven[:3]}; each call (ms): "
            f"{[round(x * 1e3) for x in stalls]}",
            flush=True,
        )
        return row

    def full_reload(self) -> float:
        from deltasync import write_anchor

        self.mode("reload")
        anchor = write_anchor(self.store, self.curr, version=self.version, encoding="packed")
        self._register(anchor)
        self.agent.needs_anchor = True
        return float(self.agent.sync().timings["pause"] * 1e3)


def run_engine(tmp: Path, model: Path, label: str, args: argparse.Namespace, figures: dict[str, Any]) -> list[Any]:
    """One engine with its own run (coordinator, store, stream); everything it holds is freed on return."""
    from deltasync.client import CoordinatorClient
    from deltasync.testing.credentials import PUBLISHER_TOKEN, TOKENS_ENV, agent_token
    from deltasync.testing.launchers import CoordinatorProcess, offline_llm
    from deltasync.testing.models import QWEN3_0_6B_CONFIG, qwen3_shapes
    from deltasync.testing.stream import UpdateStream
    from deltasync.vllm.config import PLAIN_ENV as ENV

    rows: list[dict[str, Any]] = []
    os.environ[ENV] = "1" if label == "plain" else "0"
    llm = offline_llm(model, load_format="dummy")
    try:
        with (
            CoordinatorProcess(tmp / f"ledger-{label}.db", env=TOKENS_ENV, log=tmp / f"coordinator-{label}.log") as c,
            CoordinatorClient(c.url, token=PUBLISHER_TOKEN) as client,
            CoordinatorClient(c.url, token=agent_token(f"bench-{label}")) as agent_client,
        ):
            lease = client.acquire_lease(f"bench-{label}", ttl_s=3600)
            stream = UpdateStream.from_shapes(qwen3_shapes(QWEN3_0_6B_CONFIG), lr=args.lr[0], seed=0)
            bench = Bench(tmp, llm, label, client, agent_client, lease, stream, args.anchor_encoding)
            figures["model_elements"] = sum(t.numel() for t in bench.curr.values())
            figures[f"{label}_first_sync"] = {"timings": bench.first.timings, "memory": bench.first_memory}
            figures[f"{label}_tokens_per_s"] = tokens_per_s(llm, args.tokens)
            print(f"{label}: {figures[f'{label}_tokens_per_s']:.1f} tokens/s (4 prompts x {args.tokens} tokens)")
            if label == "packed":
                rows += bench.updates("reload", args.lr[0], args.steps)
                figures["packed_audit"] = bench.audit(args.audit_stall_s)
            else:
                if "patches" in args.modes:
                    rows += bench.updates("patches", args.lr[0], args.steps)
                for lr in args.lr:
                    rows += bench.updates("inplace", lr, args.steps)
                figures["plain_audit"] = bench.audit(args.audit_stall_s)
                figures["map"] = llm.collective_rpc("deltasync_status")[0].get("map")
                figures["full_reload_pause_ms"] = bench.full_reload()
    finally:
        llm.llm_engine.engine_core.shutdown()
    return rows


class _Collections:
    """Python's garbage collections in this process while open: their milliseconds, each (the agent keeps them
    out of an update, deltasync._gc; a full one here took 25-340 ms and landed in every few syncs before)."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms.append(round((time.perf_counter() - self._t0) * 1e3, 1))

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--engines", nargs="+", choices=("packed", "plain"), default=["packed", "plain"])
    parser.add_argument("--anchor-encoding", choices=("packed", "raw"), default="packed", help="the first sync's")
    parser.add_argument("--modes", nargs="+", choices=("patches", "inplace"), default=["patches", "inplace"])
    parser.add_argument("--audit-stall-s", type=float, default=0.05, help="the sliced audit's bound per call")
    args = parser.parse_args()

    from deltasync.testing.models import write_config_only_model

    tmp = Path(tempfile.mkdtemp(prefix="deltasync-bench-apply-"))
    rows: list[dict[str, Any]] = []
    figures: dict[str, Any] = {"model_elements": None}
    try:  # the stores and staging hold a few GB: never left behind
        model = write_config_only_model(tmp / "qwen3-0.6b")
        for label in args.engines:  # one engine at a time (2 cores, and ~10 GB of optimizer state per stream)
            rows += run_engine(tmp, model, label, args, figures)
            gc.collect()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary: dict[str, Any] = {}
    for label, mode, lr in sorted({(r["engine"], r["mode"], r["lr"]) for r in rows}):
        group = [r for r in rows if (r["engine"], r["mode"], r["lr"]) == (label, mode, lr)]
        sel = group[1:] or group  # the first update of a mode pays one-time costs (the map): report it in rows
        summary[f"{label}/{mode}/lr={lr:g}"] = {
            "pause_median_ms": statistics.median(r["pause_ms"] for r in sel),
            "engine_median_ms": statistics.median(r["engine_apply_ms"] for r in sel),
            "changed_fraction_median": statistics.median(r["changed_fraction"] for r in sel),
        }
    figures.update(summary=summary, rows=rows, lr=args.lr)
    print()
    for key, s in summary.items():
        print(
            f"{key:<28} pause median {s['pause_median_ms']:8.1f} ms  engine {s['engine_median_ms']:8.1f} ms  "
            f"changed {s['changed_fraction_median']:.3%}"
        )
    print(f"full reload (plain engine, every module): {figures.get('full_reload_pause_ms', float('nan')):.0f} ms")
    if "packed_tokens_per_s" in figures and "plain_tokens_per_s" in figures:
        print(f"tokens/s plain / packed: {figures['plain_tokens_per_s'] / figures['packed_tokens_per_s']:.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
