"""The Wordle demo, on one machine: coordinator, vLLM server + deltasync sidecar, environment server and trainer
as separate processes on 127.0.0.1 (free ports), live progress, a report and a plot. What `make demo` runs.

    python -m examples.wordle.run_demo [--out demo-out] [--steps 200] [--lora-rank 8 | --moe]
    python -m examples.wordle.run_demo --steps 4 --warmup-steps 20 --out demo-out/short
                         # the smallest real run (about a minute here)

With ``--lora-rank R`` the trainer trains a LoRA adapter of rank R on the frozen base and publishes the adapter
itself; vLLM serves it as ``policy`` (``--enable-lora --lora-modules policy=DIR``) and the agent keeps DIR at the
latest version (``--apply-mode lora --adapter-dir DIR``).

With ``--moe`` the policy is a tiny Qwen3-MoE (4 experts of 96, 2 routed per token): vLLM keeps plain weights
(``DELTASYNC_VLLM_PLAIN_WEIGHTS=1``) and the agent writes every expert in place where its kernel reads it. vLLM
repacks experts in a layout only it knows, so the final check compares the served engine with a fresh one loaded
from the final version (``examples.wordle.fresh_check``).

Every process it starts is stopped at the end, on Ctrl-C and on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from deltasync.testing.launchers import VllmServerProcess, free_port, stop_process_group, wait_until_serving
from deltasync.testing.models import build_tiny_model
from deltasync.testing.output_dir import fresh_output_dir
from deltasync.tokens import make_agent_token

from .check_served import served
from .fresh_check import compare, fresh_checksums
from .game import SYSTEM, allowed_words

MODEL_CONFIG = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}


MOE_CONFIG = {
    **MODEL_CONFIG,
    "moe_intermediate_size": 96,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
}
"""``--moe``: the demo's Qwen3 with each MLP replaced by 4 routed experts of 96 (vLLM's CPU kernel pads them to 96,
a multiple of 32 already)."""


def build_model(path: Path, *, moe: bool = False) -> Path:
    """The tiny Qwen3 (or Qwen3-MoE) of the demo, with a tokenizer trained on Wordle text (short prompts, whole
    words)."""
    words = sorted(allowed_words())
    corpus = [SYSTEM, "Previous guesses:\n(no guesses yet)\nGuesses left: 6", "GGGGG XXXXX YYYYY GYXXG XYGYY"]
    corpus += [" ".join(f"<guess>{w}</guess>" for w in words[i : i + 50]) for i in range(0, len(words), 50)]
    if moe:
        return build_tiny_model(path, seed=0, config=MOE_CONFIG, corpus=corpus, arch="qwen3_moe")
    return build_tiny_model(path, seed=0, config=MODEL_CONFIG, corpus=corpus)


def warm_start(model_dir: Path, steps: int, seed: int) -> None:
    """The supervised warm-up on the scripted solver's games, written over the model: the checkpoint vLLM starts
    from and the trainer trains from. It runs before any other process, so nothing competes with it (with vLLM up,
    its CPU worker holds about one of the two cores)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .train import warmup

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    t0 = time.perf_counter()
    losses = warmup(model, tok, steps, seed=seed)
    model.to(torch.bfloat16).save_pretrained(model_dir)
    print(
        f"[demo] warm-up: {steps} steps in {time.perf_counter() - t0:.0f} s, loss {losses[0]:.2f} -> {losses[-1]:.2f}"
    )


class Processes:
    """Child processes, each in its own process group, all stopped by :meth:`stop_all`."""

    def __init__(self, out: Path) -> None:
        self.out, self.children = out, {}  # type: dict[str, subprocess.Popen[bytes]]
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.out / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                cmd, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.children[name] = proc
        self._record()
        return proc

    def adopt(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        self.children[name] = proc
        self._record()

    def _record(self) -> None:
        (self.out / "pids.json").write_text(json.dumps({n: p.pid for n, p in self.children.items()}))

    def stop_all(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process group, give each ``grace_s`` to exit, then SIGKILL the group and reap."""
        for proc in self.children.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.children.values():
            stop_process_group(proc, grace_s, signalled=True)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def cpu_seconds(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system, reaped children included) of every process in each named process group."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(groups, 0.0)
    by_pgid = {pgid: name for name, pgid in groups.items()}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = by_pgid.get(int(fields[2]))
        if name is not None:
            out[name] += sum(int(f) for f in fields[11:15]) / tick
    return out


def summarize(
    rows: list[dict[str, Any]], pauses: dict[int, float], final: dict[str, Any], cpu: list[Any]
) -> dict[str, Any]:
    """The figures of one run (what --compare prints side by side)."""
    wall = final["rl_ended_at"] - final["rl_started_at"]
    quarter = max(1, len(rows) // 4)
    latency = list(final["publish_to_served_s"].values())
    start = next((c for t, c in cpu if t >= final["rl_started_at"]), cpu[0][1] if cpu else {})
    end = next((c for t, c in reversed(cpu) if t <= final["rl_ended_at"]), cpu[-1][1] if cpu else {})
    return {
        "mode": final["mode"],
        "max_staleness": final["max_staleness"],
        "steps": len(rows),
        "wall_s": wall,
        "trainer_busy_fraction": sum(r["train_s"] for r in rows) / wall,
        "trainer_rollout_wait_s": sum(r["rollout_wait_s"] for r in rows),
        "trainer_sync_wait_s": sum(r["sync_wait_s"] for r in rows),
        "publish_blocked_s": sum(r["publish_blocked_s"] for r in rows),
        "episodes_per_s": final["episodes"] / wall,
        "staleness_histogram": final["staleness_histogram"],
        "dropped_groups": final["dropped_groups"],
        "dropped_per_step": final["dropped_groups"] / max(1, len(rows)),
        "held_back_s": final.get("held_back_s", 0.0),
        "publish_to_served_ms_median": _quantile(latency, 0.5) * 1e3,
        "publish_to_served_ms_p90": _quantile(latency, 0.9) * 1e3,
        "pause_ms_median": _quantile(list(pauses.values()), 0.5) * 1e3,
        "reward_first_quarter": sum(r["reward"] for r in rows[:quarter]) / quarter,
        "reward_last_quarter": sum(r["reward"] for r in rows[-quarter:]) / quarter,
        "cpu_cores": {n: (end.get(n, 0) - start.get(n, 0)) / wall for n in end},
        "bit_exact": final["bit_exact"],
    }


SUMMARY_LINES = [
    ("RL wall time (s)", "wall_s", "{:.1f}"),
    ("trainer busy (fraction of wall)", "trainer_busy_fraction", "{:.1%}"),
    ("trainer waiting for rollouts (s)", "trainer_rollout_wait_s", "{:.1f}"),
    ("trainer waiting for a weight sync (s)", "trainer_sync_wait_s", "{:.3f}"),
    ("trainer blocked publishing (s)", "publish_blocked_s", "{:.3f}"),
    ("rollout throughput (episodes/s)", "episodes_per_s", "{:.1f}"),
    ("staleness at consumption {versions: groups}", "staleness_histogram", "{}"),
    ("dropped groups", "dropped_groups", "{}"),
    ("dropped groups per step", "dropped_per_step", "{:.2f}"),
    ("rollouts held back, would be dropped (s)", "held_back_s", "{:.1f}"),
    ("publish -> served, median (ms)", "publish_to_served_ms_median", "{:.0f}"),
    ("publish -> served, p90 (ms)", "publish_to_served_ms_p90", "{:.0f}"),
    ("vLLM pause, median (ms)", "pause_ms_median", "{:.0f}"),
    ("reward, first quarter", "reward_first_quarter", "{:.3f}"),
    ("reward, last quarter", "reward_last_quarter", "{:.3f}"),
]


def _show(fmt: str, value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}:{v}" for k, v in value.items())
    return fmt.format(value)


def print_summaries(summaries: list[dict[str, Any]]) -> None:
    print(f"\n{'':42}" + "".join(f"{s['mode'] + ' (K=' + str(s['max_staleness']) + ')':>22}" for s in summaries))
    for label, key, fmt in SUMMARY_LINES:
        print(f"{label:42}" + "".join(f"{_show(fmt, s[key]):>22}" for s in summaries))
    for name in summaries[0]["cpu_cores"]:
        print(
            f"{'CPU busy, ' + name + ' (cores)':42}"
            + "".join(f"{s['cpu_cores'].get(name, 0):>22.2f}" for s in summaries)
        )


def report(
    out: Path, rows: list[dict[str, Any]], pauses: dict[int, float], final: dict[str, Any], summary: dict[str, Any]
) -> None:
    published = {p["version"]: p for p in final["published"] if p["kind"] == "delta"}
    full = final["full_bytes"]
    print(
        f"\n{'step':>4} {'version':>7} {'delta KB':>9} {'vs full':>8} {'stale':>6} {'wait ms':>8} "
        f"{'train ms':>9} {'reward':>7}"
    )
    for r in rows:
        size = published.get(r["version"], {}).get("bytes", 0)
        print(
            f"{r['step']:4d} {r['version']:7d} {size / 1024:9.1f} {size / max(full, 1):8.2%} "
            f"{max(r['staleness']):6d} {(r['rollout_wait_s'] + r['sync_wait_s']) * 1e3:8.0f} {r['train_s'] * 1e3:9.0f} "
            f"{r['reward']:7.3f}"
        )
    print_summaries([summary])
    print(
        f"final: trainer v{final['version']} / vLLM weight_version {final['served_weight_version']}: "
        f"{'BIT-EXACT' if final['bit_exact'] else 'MISMATCH'} over {final['tensors_checked']} tensors"
    )
    try:
        plot(out / "demo.png", rows, pauses, final, summary)
        print(f"plot: {out / 'demo.png'}")
    except ImportError:
        print("plot skipped: pip install matplotlib")


def plot(
    path: Path, rows: list[dict[str, Any]], pauses: dict[int, float], final: dict[str, Any], summary: dict[str, Any]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    published = [p for p in final["published"] if p["kind"] == "delta"]
    fig, axes = plt.subplots(3, 2, figsize=(12, 10))
    ax = axes[0][0]
    ax.bar([p["version"] for p in published], [p["bytes"] / 1024 for p in published], label="delta (KB)")
    ax.axhline(final["full_bytes"] / 1024, color="red", linestyle="--", label="full model (KB)")
    ax.set_yscale("log")
    ax.set_xlabel("version")
    ax.set_title("bytes per version")
    ax.legend()
    ax = axes[0][1]
    lat = sorted((int(v), s * 1e3) for v, s in final["publish_to_served_s"].items())
    ax.plot([v for v, _ in lat], [ms for _, ms in lat], marker=".", label="publish -> served")
    ax.plot(sorted(pauses), [pauses[v] * 1e3 for v in sorted(pauses)], marker=".", label="vLLM pause")
    ax.set_xlabel("version")
    ax.set_ylabel("ms")
    ax.set_title("weight sync")
    ax.legend()
    ax = axes[1][0]
    rewards = [r["reward"] for r in rows]
    window = max(1, min(10, len(rewards) // 4))
    trend = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(rewards))
    ]
    ax.plot(steps, rewards, marker=".", alpha=0.35, label="per step")
    ax.plot(steps, trend, linewidth=2, label=f"{window}-step moving average")
    ax.set_xlabel("step")
    ax.set_title("mean reward")
    ax.legend()
    ax = axes[1][1]
    train = [r["train_s"] * 1e3 for r in rows]
    wait = [r["rollout_wait_s"] * 1e3 for r in rows]
    ax.bar(steps, train, label="training")
    ax.bar(steps, wait, bottom=train, label="waiting for rollouts")
    ax.bar(
        steps,
        [r["sync_wait_s"] * 1e3 for r in rows],
        bottom=[a + b for a, b in zip(train, wait, strict=True)],
        label="waiting for a sync",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("trainer time per step")
    ax.legend()
    ax = axes[2][0]
    hist = {int(k): v for k, v in summary["staleness_histogram"].items()}
    ax.bar(list(hist), list(hist.values()))
    ax.set_xlabel(
        f"versions behind at consumption (bound {summary['max_staleness']}; {summary['dropped_groups']} dropped)"
    )
    ax.set_title("staleness of consumed groups")
    ax = axes[2][1]
    names = list(summary["cpu_cores"])
    ax.barh(names, [summary["cpu_cores"][n] for n in names])
    ax.set_xlabel("cores busy during the RL phase")
    ax.set_title("CPU per process")
    fig.suptitle(f"Wordle GRPO with deltasync ({summary['mode']}): trainer -> store -> vLLM")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def initial_adapter(model: Path, rank: int, directory: Path) -> Path:
    """The adapter vLLM starts serving (PEFT's initialization, B = 0: the base's outputs), with the configuration
    the trainer's adapter has: the agent's first anchor then replaces it."""
    import torch
    from transformers import AutoModelForCausalLM

    from .train import with_adapter

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    with_adapter(base, rank).save_pretrained(directory)
    return directory


def max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM takes that holds ``rank``."""
    return next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)


def run_once(out: Path, model: Path, args: argparse.Namespace, *, sync: bool) -> dict[str, Any]:
    """One run: every process started, the trainer followed, every process stopped. Returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    procs = Processes(out)
    secret = secrets.token_hex(16)
    publisher_env = {"DELTASYNC_PUBLISHER_TOKEN": secrets.token_hex(16)}
    tokens = {**publisher_env, "DELTASYNC_AGENT_SECRET": secret}  # the coordinator's credentials
    agent_env = {"DELTASYNC_AGENT_TOKEN": make_agent_token(secret, "vllm-0")}  # bound to the agent's id
    env_token = {"WORDLE_ENV_TOKEN": secrets.token_urlsafe(24)}  # the environment's, and its client's: the trainer
    py, store = sys.executable, out / "store"
    try:
        coord_port, env_port = free_port(), free_port()
        coord = procs.start(
            "coordinator",
            [py, "-m", "deltasync.cli", "coordinator", "--db", str(out / "ledger.db"), "--store", str(store)]
            + ["--port", str(coord_port)],
            tokens,
        )
        env = procs.start("env", [py, "-m", "examples.wordle.env_server", "--port", str(env_port)], env_token)
        coord_url, env_url = f"http://127.0.0.1:{coord_port}", f"http://127.0.0.1:{env_port}"
        wait_until_serving(coord_url + "/healthz", coord, "the coordinator", timeout_s=120, interval_s=0.2)
        wait_until_serving(env_url + "/healthz", env, "the environment", timeout_s=120, interval_s=0.2)
        print(
            f"[demo] coordinator {coord_url}, environment {env_url}; starting vLLM (about 30 s on 2 cores)", flush=True
        )
        # --enable-scale-out: the token-in/token-out route, whose answers carry each token's weight version
        vllm_args, vllm_env, agent_extra, trainer_extra = ["--enable-scale-out"], {}, [], []
        moe = getattr(args, "moe", False)
        if moe:  # experts are written in place where the kernel reads them: linear weights plain as well
            vllm_env["DELTASYNC_VLLM_PLAIN_WEIGHTS"] = "1"
            trainer_extra = ["--skip-final-check"]  # the fresh engine below checks what vLLM computes with
        if args.lora_rank:
            adapter = initial_adapter(model, args.lora_rank, out / "adapter")
            vllm_args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", str(max_lora_rank(args.lora_rank))]
            vllm_args += ["--lora-modules", f"policy={adapter}"]
            vllm_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the final check loads the trainer's adapter
            agent_extra = ["--apply-mode", "lora", "--adapter-dir", str(adapter)]
            trainer_extra = ["--lora-rank", str(args.lora_rank), "--adapter-name", "policy"]
        vllm = VllmServerProcess(model, log=out / "logs" / "vllm.log", args=vllm_args, env=vllm_env)
        vllm.start_async()
        procs.adopt("vllm", vllm.proc)  # type: ignore[arg-type]
        vllm.wait_healthy()
        mode = "lock-step (--sync)" if sync else f"asynchronous, max staleness {args.max_staleness}"
        print(f"[demo] vLLM {vllm.url} up; starting the sidecar agent and the trainer, {mode}", flush=True)
        agent_args = ["--vllm-url", vllm.url, "--coordinator", coord_url, "--store", str(store), "--agent-id", "vllm-0"]
        agent_args += ["--poll-wait-s", "5", "--staging-dir", str(out / "staging"), "--backoff-s", "0.2", *agent_extra]
        # the engine credential: the agent changes the engine with it, the trainer's final check reads with it;
        # the rollout workers and the environment never get it and reach only inference routes
        engine = {"DELTASYNC_ENGINE_TOKEN_FILE": str(vllm.engine_token_file)}
        procs.start("agent", [py, "-m", "deltasync.cli", "agent", *agent_args], {**agent_env, **engine})
        train_args = ["--model", str(model), "--vllm-url", vllm.url, "--env-url", env_url, "--coordinator", coord_url]
        train_args += ["--store", str(store), "--out", str(out / "run"), "--steps", str(args.steps)]
        train_args += ["--warmup-steps", "0", "--learning-rate", str(args.learning_rate)]  # warm-started already
        train_args += ["--max-staleness", str(args.max_staleness), "--seed", str(args.seed), *trainer_extra] + (
            ["--sync"] if sync else []
        )
        trainer = procs.start(
            "trainer", [py, "-m", "examples.wordle.train", *train_args], {**publisher_env, **engine, **env_token}
        )
        rows, pauses, seen, cpu = follow(trainer, out, coord_url, procs, publisher_env["DELTASYNC_PUBLISHER_TOKEN"])
        if trainer.returncode != 0:
            print((out / "logs" / "trainer.log").read_text()[-3000:], file=sys.stderr)
            raise RuntimeError(f"the trainer exited with {trainer.returncode}; logs in {out / 'logs'}")
        if moe:  # what vLLM computes with now, read with the engine credential on its host
            served_now = served(vllm.url, vllm.engine_token_file.read_text().strip())
    finally:
        procs.stop_all()
        print(f"[demo] all processes stopped; logs in {out / 'logs'}", flush=True)
    final = json.loads((out / "run" / "final.json").read_text())
    if moe:
        print("[demo] final check: a fresh vLLM engine loaded from the final version (about 20 s)", flush=True)
        fresh = fresh_checksums(model, store, int(final["version"]), out / "fresh")
        final.update(compare(served_now, fresh, int(final["version"])))
    final["applied_versions_in_order"] = seen
    summary = summarize(rows, pauses, final, cpu)
    result = {"summary": summary, "steps": rows, "pauses": pauses, "final": final}
    (out / "report.json").write_text(json.dumps(result, indent=1))
    report(out, rows, pauses, final, summary)
    return result


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of one demo run, the same on one machine and across hosts (``run_hosts``)."""
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=3e-4,
        help="3e-4: the tiny model's reward rises within 80 steps (at 1e-5 it stays flat); it also changes most of "
        "its bf16 elements every step, where a real model at 1e-6 changes 1-3%%",
    )
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--moe",
        action="store_true",
        help="a tiny Qwen3-MoE policy (4 experts, 2 routed per token): experts synced in place, bit-exact",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train and sync a LoRA adapter of this rank (served as 'policy'), not the full weights (0)",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    add_run_arguments(parser)
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--sync", action="store_true", help="lock-step: vLLM serves each version before rollouts")
    modes.add_argument("--compare", action="store_true", help="sync, then async, same seed and steps; side by side")
    args = parser.parse_args()
    if args.moe and args.lora_rank:
        parser.error(
            "--moe and --lora-rank: a LoRA adapter on a MoE base is not synced (PEFT's adapters of fused experts)"
        )
    try:
        out = fresh_output_dir(args.out)
    except ValueError as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        name = "Qwen3-MoE" if args.moe else "Qwen3"
        print(f"[demo] building the tiny {name} and its Wordle tokenizer in {out / 'model'}", flush=True)
        model = build_model(out / "model", moe=args.moe)
        if args.warmup_steps > 0:
            warm_start(model, args.warmup_steps, args.seed)
        if not args.compare:
            result = run_once(out, model, args, sync=args.sync)
            return 0 if result["final"]["bit_exact"] else 1
        results = [run_once(out / mode, model, args, sync=mode == "sync") for mode in ("sync", "async")]
        summaries = [r["summary"] for r in results]
        (out / "compare.json").write_text(json.dumps(summaries, indent=1))
        print(f"\n[demo] the same {args.steps} steps, seed {args.seed}, lock-step then asynchronous:")
        print_summaries(summaries)
        return 0 if all(s["bit_exact"] for s in summaries) else 1
    except KeyboardInterrupt:
        print("\n[demo] interrupted: every process was stopped", file=sys.stderr)
        return 130


def follow(
    trainer: subprocess.Popen[bytes], out: Path, coord_url: str, procs: Processes, token: str
) -> tuple[list[dict[str, Any]], dict[int, float], list[int], list[tuple[float, dict[str, float]]]]:
    """Print progress while the trainer runs; collect metrics, the agent's pause per version, the applied order,
    and the CPU time of every process (sampled)."""
    metrics = out / "run" / "metrics.jsonl"
    rows: list[dict[str, Any]] = []
    pauses: dict[int, float] = {}
    seen: list[int] = []
    cpu: list[tuple[float, dict[str, float]]] = []
    offset = 0
    with httpx.Client(base_url=coord_url, timeout=10, headers={"Authorization": f"Bearer {token}"}) as http:
        while True:
            done = trainer.poll() is not None
            for name, proc in procs.children.items():
                if name != "trainer" and proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {out / 'logs' / (name + '.log')}")
            if not done:
                cpu.append((time.time(), cpu_seconds({n: p.pid for n, p in procs.children.items()})))
            try:
                for agent in http.get("/v1/agents").json()["agents"]:
                    v = agent["applied_version"]
                    if v is not None and (not seen or seen[-1] != v):
                        seen.append(v)
                        if "pause" in agent["timings"]:
                            pauses[v] = agent["timings"]["pause"]
            except httpx.HTTPError:
                pass
            if metrics.exists():
                with open(metrics) as f:
                    f.seek(offset)
                    for line in f:
                        r = json.loads(line)
                        rows.append(r)
                        print(
                            f"[demo] step {r['step']:3d}: reward {r['reward']:.3f}, rollouts from "
                            f"v{min(g[0] for g in r['groups'])} (trainer at v{r['policy_version']}), waited "
                            f"{(r['rollout_wait_s'] + r['sync_wait_s']) * 1e3:.0f} ms, trained "
                            f"{r['train_s'] * 1e3:.0f} ms, published v{r['version']}",
                            flush=True,
                        )
                    offset = f.tell()
            if done:
                return rows, pauses, seen, cpu
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
