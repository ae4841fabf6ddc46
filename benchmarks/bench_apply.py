"""Apply benchmark (run by hand; asserts nothing): the serving pause per update, side by side, on vLLM's CPU build
(``load_format="dummy"``), kept current by the in-process agent from an update stream.

Shapes (``--shapes``, one after the other): Qwen3-0.6B whole (the AdamW stream of
``deltasync.testing.stream.UpdateStream``), and ``70B-1``: one layer of Llama-3-70B's shapes (hidden 8192,
intermediate 28672, 64 heads, 8 KV heads; vocabulary cut to 32000, as in bench_map) with the light stream
``UlpStream`` (``--changed`` of every tensor's elements moved by one unit in the last place: AdamW's state at these
shapes does not fit this machine).

Two engines per shape, one after the other:

* **packed** (vLLM's default: linear weights repacked for oneDNN): ``reload`` mode; tokens/s.
* **plain** (``DELTASYNC_VLLM_PLAIN_WEIGHTS=1``): ``patches`` (vLLM's ``load_checkpoint_weight_patches``, the
  NaN-masked sparse loader), ``inplace`` through the patch map at each learning rate (its cost should follow the
  changed elements, not the model), the same engine's full reload (an anchor through ``reload`` mode); tokens/s;
  the floors of the pause's write, measured in the engine's worker on the last update's changes: ``index_copy_``
  of the same changes on one thread and on all the worker's cores.

Per update: the pause (the agent's serving gap: the whole update session), the engine's own write time, and
the work done before the pause (fetch, decode, stage, prepare). Ends with the side-by-side table (per changed
element) and one JSON line.

    python benchmarks/bench_apply.py [--steps 4] [--lr 1e-6 1e-5] [--tokens 64] [--anchor-encoding raw]
        [--modes inplace]    (DELTASYNC_BENCH_PROFILE=1: where the engine worker's time goes, first sync and updates)
    python benchmarks/bench_apply.py --shapes 0.6B 70B-1 --engines plain --lr 1e-6 --anchor-encoding raw
                         # the side-by-side table at both shapes (vLLM's sparse path, deltasync, a full reload)
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
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of this script's functions (the floors)
PROFILE = os.environ.get("DELTASYNC_BENCH_PROFILE") == "1"

LLAMA3_70B_LAYER = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "num_hidden_layers": 1,
}
SHAPES: dict[str, dict[str, Any]] = {"0.6B": {}, "70B-1": LLAMA3_70B_LAYER}
"""Config overrides of Qwen3-0.6B's, by ``--shapes`` name."""


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


def _floors(worker: Any, path: str, repeats: int = 7) -> dict[str, Any]:
    """On the worker: the pause's write of ``deltas`` (the values the engine holds already: nothing changes) as
    the pause runs it (one thread) and on the worker's cores, beside its floors: ``index_copy_`` of the same
    changes, one per live parameter with its indices and values ready, on one thread and on all the worker's
    cores. Best of ``repeats``, inside a collective RPC like the pause itself (vLLM's engine process waits on
    the reply meanwhile). ``deltas``: saved at ``path`` (``torch.save``: a collective RPC's arguments cannot carry
    tensors)."""
    import torch

    from deltasync._cpus import parallel_map, work_cpus
    from deltasync.format import TensorDelta
    from deltasync.vllm.patch_map.core import Scatter

    deltas = [TensorDelta(**d) for d in torch.load(path)]
    pm = worker.weight_transfer_engine.served.patch_map()
    ops = [op for op in pm.plan(deltas) if isinstance(op, Scatter)]  # dense entries (a few norms) left out
    nnz = sum(op.index.numel() for op in ops)
    by_param: dict[str, tuple[list[Any], list[Any]]] = {}
    for op in ops:
        by_param.setdefault(op.param, ([], []))[0].append(op.index)
        by_param[op.param][1].append(op.values)
    joined = [(q, torch.cat(i), torch.cat(v)) for q, (i, v) in by_param.items()]

    def copy_one(item: tuple[str, Any, Any]) -> int:
        q, i, v = item
        with torch.no_grad():
            pm.param(q).data.view(-1).index_copy_(0, i, v)
        return int(i.numel())

    samples: dict[str, list[float]] = {}

    def best(fn: Any, key: str = "") -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if key:
            samples[key] = [round(t * 1e3, 1) for t in times]
        return min(times)

    def floor_all() -> None:
        parallel_map(copy_one, joined, nnz, cost=lambda item: item[1].numel())

    def quiet(fn: Any) -> float:
        """``fn``'s time after 1.2 s asleep: vLLM's engine process busy-waits (``sched_yield``) for a reply for
        1 s after its last one, then sleeps on a socket; the core it held is free meanwhile."""
        times = []
        for _ in range(2):
            time.sleep(1.2)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        floor_1 = best(lambda: [copy_one(item) for item in joined])
        write_1 = best(lambda: pm.write(ops, threads=False), "write_one_thread_ms")
    finally:
        torch.set_num_threads(threads)
    return {
        "changed": nnz,
        "threads": threads,
        "cpus": sorted(work_cpus()),
        "write_one_thread_s": write_1,
        "write_all_cores_s": best(lambda: pm.write(ops, threads=True), "write_all_cores_ms"),
        "floor_one_thread_s": floor_1,
        "floor_all_cores_s": best(floor_all),
        "quiet_floor_all_cores_s": quiet(floor_all),
        "quiet_write_all_cores_s": quiet(lambda: pm.write(ops, threads=True)),
        "samples": samples,
    }


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
        shape: str = "0.6B",
    ):
        from deltasync import LocalStore, write_anchor
        from deltasync.agent import Agent
        from deltasync.config import AgentConfig

        self.llm, self.label, self.client, self.lease, self.stream = llm, label, client, lease, stream
        self.shape, self.tmp = shape, tmp
        self.changes: dict[str, Any] = {}
        """The last update's changes (what the floors write again)."""
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

    def updates(self, mode: str, lr: float | None, steps: int) -> list[dict[str, Any]]:
        """``steps`` updates in ``mode``; ``lr``: the AdamW stream's learning rate (``None``: a UlpStream's)."""
        from deltasync import compute_delta, write_delta

        self.mode(mode)
        if lr is not None:
            self.stream.lr = lr
        rows = []
        for _ in range(steps):
            self.version += 1
            self.curr = self.stream.step()
            changes = compute_delta(self.snapshot, self.curr, update_prev=True)
            self.changes = changes
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
                    "shape": self.shape,
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
                f"{self.shape} {self.label:>6} {mode:>8} lr={lr or 0:<7g} v{self.version:<3d} {row['changed_fraction']:7.3%} "
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

    def floors(self) -> dict[str, Any]:
        """The last update's write, as the pause runs it and on all the worker's cores, beside ``index_copy_`` of
        the same changes on one thread and on all cores (:func:`_floors`)."""
        import torch

        deltas = [
            {"ckpt_name": d.ckpt_name, "shape": d.shape, "dtype": d.dtype, "indices": d.indices, "values": d.values}
            for d in self.changes.values()
            if d.indices is not None
        ]
        path = self.tmp / "floors.pt"
        torch.save(deltas, path)
        del deltas
        try:
            (row,) = self.llm.collective_rpc(_floors, kwargs={"path": str(path)})
        finally:
            path.unlink()
        n = row["changed"]
        print(
            f"{self.shape} {self.label}: the pause's write of the last update ({n:,} changed elements, deltasync's "
            f"threads on cores {row['cpus']}, torch's {row['threads']}): as the pause runs it (one thread) "
            f"{row['write_one_thread_s'] * 1e3:.1f} ms = {row['write_one_thread_s'] / row['floor_one_thread_s']:.2f}x "
            f"index_copy_ on one thread ({row['floor_one_thread_s'] * 1e3:.1f} ms), "
            f"{row['write_one_thread_s'] / row['floor_all_cores_s']:.2f}x index_copy_ on all cores "
            f"({row['floor_all_cores_s'] * 1e3:.1f} ms); on all cores {row['write_all_cores_s'] * 1e3:.1f} ms = "
            f"{row['write_all_cores_s'] / row['floor_all_cores_s']:.2f}x; with vLLM's engine process asleep (not "
            f"busy-waiting on a core for the reply): index_copy_ on all cores {row['quiet_floor_all_cores_s'] * 1e3:.1f}"
            f" ms, the write on all cores {row['quiet_write_all_cores_s'] * 1e3:.1f} ms; every try (ms): "
            f"{row['samples']}",
            flush=True,
        )
        return dict(row)

    def full_reload(self) -> float:
        """The same engine's full reload: an anchor of the current weights through ``reload`` mode. The stream's
        optimizer state is freed first (~7 GB at 0.6B; nothing steps after this), with what ``malloc`` keeps of
        the updates before: the agent's decode of a 0.6B anchor after the ``patches`` updates went past 24 GB."""
        import ctypes

        from deltasync import write_anchor

        self.stream = None
        gc.collect()
        try:
            ctypes.CDLL(None).malloc_trim(0)  # glibc: freed memory back to the system
        except (OSError, AttributeError):
            pass

        self.mode("reload")
        anchor = write_anchor(self.store, self.curr, version=self.version, encoding="packed")
        self._register(anchor)
        self.agent.needs_anchor = True
        return float(self.agent.sync().timings["pause"] * 1e3)


def run_engine(
    tmp: Path, model: Path, shape: str, label: str, args: argparse.Namespace, figures: dict[str, Any]
) -> list[Any]:
    """One engine with its own run (coordinator, store, stream); everything it holds is freed on return."""
    from deltasync.client import CoordinatorClient
    from deltasync.testing.credentials import PUBLISHER_TOKEN, TOKENS_ENV, agent_token
    from deltasync.testing.launchers import CoordinatorProcess, offline_llm
    from deltasync.testing.models import QWEN3_0_6B_CONFIG, qwen3_shapes
    from deltasync.testing.stream import UlpStream, UpdateStream
    from deltasync.vllm.config import PLAIN_ENV as ENV

    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = figures.setdefault(shape, {})
    shapes = qwen3_shapes({**QWEN3_0_6B_CONFIG, **SHAPES[shape]})
    light = shape != "0.6B"  # AdamW's state (16 B per element) does not fit at 70B layer shapes
    lrs: list[float | None] = [None] if light else list(args.lr)
    os.environ[ENV] = "1" if label == "plain" else "0"
    llm = offline_llm(model, load_format="dummy", max_model_len=256)
    try:
        with (
            CoordinatorProcess(tmp / f"ledger-{label}.db", env=TOKENS_ENV, log=tmp / f"coordinator-{label}.log") as c,
            CoordinatorClient(c.url, token=PUBLISHER_TOKEN) as client,
            CoordinatorClient(c.url, token=agent_token(f"bench-{label}")) as agent_client,
        ):
            lease = client.acquire_lease(f"bench-{label}", ttl_s=3600)
            stream: Any = (
                UlpStream.from_shapes(shapes, changed=args.changed, seed=0)
                if light
                else UpdateStream.from_shapes(shapes, lr=args.lr[0], seed=0)
            )
            bench = Bench(tmp, llm, label, client, agent_client, lease, stream, args.anchor_encoding, shape)
            del stream
            out["model_elements"] = sum(t.numel() for t in bench.curr.values())
            out["stream"] = f"UlpStream changed={args.changed}" if light else "UpdateStream (AdamW)"
            out[f"{label}_first_sync"] = {"timings": bench.first.timings, "memory": bench.first_memory}
            out[f"{label}_tokens_per_s"] = tokens_per_s(llm, args.tokens)
            print(f"{shape} {label}: {out[f'{label}_tokens_per_s']:.1f} tokens/s (4 prompts x {args.tokens} tokens)")
            if label == "packed":
                rows += bench.updates("reload", lrs[0], args.steps)
                out["packed_audit"] = bench.audit(args.audit_stall_s)
            else:
                if "patches" in args.modes:
                    rows += bench.updates("patches", lrs[0], args.steps)
                for lr in lrs:
                    rows += bench.updates("inplace", lr, args.steps)
                    out.setdefault("floors", {})[f"lr={lr:g}" if lr else "ulp"] = bench.floors()
                out["plain_audit"] = bench.audit(args.audit_stall_s)
                out["map"] = llm.collective_rpc("deltasync_status")[0].get("map")
                out["full_reload_pause_ms"] = bench.full_reload()
    finally:
        llm.llm_engine.engine_core.shutdown()
    return rows


def side_by_side(rows: list[dict[str, Any]], figures: dict[str, Any]) -> dict[str, Any]:
    """Per shape, the plain engine's paths side by side (each at its first learning rate, steady updates: the
    first of a mode pays one-time costs): vLLM's sparse loader, deltasync in place, a full reload."""
    table: dict[str, Any] = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        plain = [r for r in rows if r["shape"] == shape and r["engine"] == "plain"]
        if not plain:
            continue
        first_lr = plain[0]["lr"]
        for mode in ("patches", "inplace"):
            group = [r for r in plain if r["mode"] == mode and r["lr"] == first_lr]
            sel = group[1:] or group
            if sel:
                changed = statistics.median(r["changed"] for r in sel)
                table[f"{shape} {mode}"] = {
                    "changed": changed,
                    "pause_ms": statistics.median(r["pause_ms"] for r in sel),
                    "before_ms": statistics.median(r["before_pause_ms"] for r in sel),
                    "engine_ms": statistics.median(r["engine_apply_ms"] for r in sel),
                }
        reload_ms = figures.get(shape, {}).get("full_reload_pause_ms")
        if reload_ms is not None and f"{shape} inplace" in table:
            table[f"{shape} full reload"] = {
                "changed": table[f"{shape} inplace"]["changed"],  # what a reload writes to apply the same update
                "pause_ms": reload_ms,
                "before_ms": None,
                "engine_ms": None,
            }
    print("\nside by side, per update (steady; per changed element of the update applied):")
    print(
        f"{'shape / path':<24} {'changed':>12} {'pause ms':>10} {'ns/changed':>11} {'before ms':>10} {'ns/changed':>11}"
    )
    for key, t in table.items():
        per = 1e6 / max(t["changed"], 1)
        before = "-" if t["before_ms"] is None else f"{t['before_ms']:10.1f}"
        before_per = "-" if t["before_ms"] is None else f"{t['before_ms'] * per:11.1f}"
        print(
            f"{key:<24} {t['changed']:12,.0f} {t['pause_ms']:10.1f} {t['pause_ms'] * per:11.1f} "
            f"{before:>10} {before_per:>11}"
        )
    for shape, out in figures.items():
        for which, f in (out.get("floors") or {}).items():
            print(
                f"{shape} ({which}): the pause's write {f['write_one_thread_s'] * 1e3:.1f} ms on one thread = "
                f"{f['write_one_thread_s'] / f['floor_all_cores_s']:.2f}x index_copy_ of the same changes on all "
                f"{len(f['cpus'])} cores ({f['floor_all_cores_s'] * 1e3:.1f} ms; one thread "
                f"{f['floor_one_thread_s'] * 1e3:.1f} ms); the write on all cores "
                f"{f['write_all_cores_s'] / f['floor_all_cores_s']:.2f}x; with vLLM's engine process asleep: the "
                f"floor {f['quiet_floor_all_cores_s'] * 1e3:.1f} ms, the write on all cores "
                f"{f['quiet_write_all_cores_s'] * 1e3:.1f} ms"
            )
    return table


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
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["0.6B"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5], help="the 0.6B AdamW stream's")
    parser.add_argument("--changed", type=float, default=0.025, help="UlpStream's changed fraction (70B-1)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--engines", nargs="+", choices=("packed", "plain"), default=["packed", "plain"])
    parser.add_argument("--anchor-encoding", choices=("packed", "raw"), default="packed", help="the first sync's")
    parser.add_argument("--modes", nargs="+", choices=("patches", "inplace"), default=["patches", "inplace"])
    parser.add_argument("--audit-stall-s", type=float, default=0.05, help="the sliced audit's bound per call")
    args = parser.parse_args()

    from deltasync.testing.models import QWEN3_0_6B_CONFIG, write_config_only_model

    tmp = Path(tempfile.mkdtemp(prefix="deltasync-bench-apply-"))
    rows: list[dict[str, Any]] = []
    figures: dict[str, Any] = {}
    try:  # the stores and staging hold a few GB: never left behind
        for shape in args.shapes:
            model = write_config_only_model(tmp / shape, {**QWEN3_0_6B_CONFIG, **SHAPES[shape]})
            for label in args.engines:  # one engine at a time (2 cores, and ~10 GB of optimizer state at 0.6B)
                rows += run_engine(tmp / f"{shape}-{label}", model, shape, label, args, figures)
                gc.collect()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary: dict[str, Any] = {}
    for shape, label, mode, lr in dict.fromkeys((r["shape"], r["engine"], r["mode"], r["lr"]) for r in rows):
        group = [r for r in rows if (r["shape"], r["engine"], r["mode"], r["lr"]) == (shape, label, mode, lr)]
        sel = group[1:] or group  # the first update of a mode pays one-time costs (the map): report it in rows
        summary[f"{shape}/{label}/{mode}/lr={lr or 0:g}"] = {
            "pause_median_ms": statistics.median(r["pause_ms"] for r in sel),
            "engine_median_ms": statistics.median(r["engine_apply_ms"] for r in sel),
            "changed_fraction_median": statistics.median(r["changed_fraction"] for r in sel),
        }
    print()
    for key, s in summary.items():
        print(
            f"{key:<34} pause median {s['pause_median_ms']:8.1f} ms  engine {s['engine_median_ms']:8.1f} ms  "
            f"changed {s['changed_fraction_median']:.3%}"
        )
    for shape, out in figures.items():
        print(
            f"{shape} full reload (plain engine, every module): {out.get('full_reload_pause_ms', float('nan')):.0f} ms"
        )
        if "packed_tokens_per_s" in out and "plain_tokens_per_s" in out:
            print(f"{shape} tokens/s plain / packed: {out['plain_tokens_per_s'] / out['packed_tokens_per_s']:.2f}")
    table = side_by_side(rows, figures)
    print(json.dumps({"shapes": figures, "summary": summary, "side_by_side": table, "rows": rows, "lr": args.lr}))


if __name__ == "__main__":
    main()
