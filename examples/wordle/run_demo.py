"""The Wordle demo, on one machine: coordinator, vLLM server + deltasync sidecar, environment server and trainer
as separate processes on 127.0.0.1 (free ports), live progress, a report and a plot. What `make demo` runs.

    python -m examples.wordle.run_demo [--out demo-out] [--steps 200]

Every process it starts is stopped at the end, on Ctrl-C and on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from deltasync.tokens import make_agent_token
from tests.support.launchers import VllmServerProcess, free_port, stop_process_group, wait_until_serving
from tests.support.models import build_tiny_model

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


def build_model(path: Path) -> Path:
    """The tiny Qwen3 of the demo, with a tokenizer trained on Wordle text (short prompts, whole words)."""
    words = sorted(allowed_words())
    corpus = [SYSTEM, "Previous guesses:\n(no guesses yet)\nGuesses left: 6", "GGGGG XXXXX YYYYY GYXXG XYGYY"]
    corpus += [" ".join(f"<guess>{w}</guess>" for w in words[i : i + 50]) for i in range(0, len(words), 50)]
    return build_tiny_model(path, seed=0, config=MODEL_CONFIG, corpus=corpus)


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


def report(out: Path, rows: list[dict[str, Any]], pauses: dict[int, float], final: dict[str, Any]) -> None:
    full = rows[0]["full_bytes"] if rows else 0
    print(
        f"\n{'step':>4} {'version':>7} {'delta KB':>9} {'vs full':>8} {'changed':>8} {'sync ms':>8} {'pause ms':>9} "
        f"{'reward':>7}"
    )
    for r in rows:
        pause = pauses.get(r.get("version", -1))
        print(
            f"{r['step']:4d} {r.get('version', 0):7d} {r.get('delta_bytes', 0) / 1024:9.1f} "
            f"{r.get('delta_bytes', 0) / max(full, 1):8.2%} {r.get('changed_fraction', 0):8.2%} "
            f"{(r.get('applied_wait_s') or 0) * 1e3:8.0f} {pause * 1e3 if pause else float('nan'):9.0f} "
            f"{r['reward']:7.3f}"
        )
    if rows:
        deltas = [r for r in rows if r.get("kind") == "delta"]
        avg = sum(r["delta_bytes"] for r in deltas) / max(len(deltas), 1)
        first, last = rows[: max(1, len(rows) // 4)], rows[-max(1, len(rows) // 4) :]
        print(
            f"\nfull model {full / 1024:.0f} KB in bf16; mean delta {avg / 1024:.1f} KB ({avg / max(full, 1):.1%}); "
            f"reward {sum(r['reward'] for r in first) / len(first):.3f} (first quarter) -> "
            f"{sum(r['reward'] for r in last) / len(last):.3f} (last quarter)"
        )
    print(
        f"final: trainer v{final.get('version')} / vLLM weight_version {final.get('served_weight_version')}: "
        f"{'BIT-EXACT' if final.get('bit_exact') else 'MISMATCH'} over {final.get('tensors_checked')} tensors"
    )
    try:
        plot(out / "demo.png", rows, pauses, full)
        print(f"plot: {out / 'demo.png'}")
    except ImportError:
        print("plot skipped: pip install matplotlib")


def plot(path: Path, rows: list[dict[str, Any]], pauses: dict[int, float], full: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].bar(steps, [r.get("delta_bytes", 0) / 1024 for r in rows], label="published (KB)")
    axes[0].axhline(full / 1024, color="red", linestyle="--", label="full model (KB)")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("bytes per step (KB)")
    axes[0].legend()
    axes[1].plot(steps, [(r.get("applied_wait_s") or 0) * 1e3 for r in rows], marker=".", label="publish-to-applied")
    axes[1].plot(steps, [pauses.get(r.get("version", -1), 0) * 1e3 for r in rows], marker=".", label="vLLM pause")
    axes[1].set_ylabel("ms")
    axes[1].legend()
    axes[2].plot(steps, [r["reward"] for r in rows], marker=".", label="mean reward")
    axes[2].set_ylabel("reward")
    axes[2].set_xlabel("optimizer step")
    axes[2].legend()
    fig.suptitle("Wordle GRPO with deltasync: trainer -> store -> vLLM")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    args = parser.parse_args()
    out = args.out.absolute()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    procs = Processes(out)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    secret = secrets.token_hex(16)
    publisher_env = {"DELTASYNC_PUBLISHER_TOKEN": secrets.token_hex(16)}
    tokens = {**publisher_env, "DELTASYNC_AGENT_SECRET": secret}  # the coordinator's credentials
    agent_env = {"DELTASYNC_AGENT_TOKEN": make_agent_token(secret, "vllm-0")}  # bound to the agent's id
    py = sys.executable
    try:
        print(f"[demo] building the tiny Qwen3 and its Wordle tokenizer in {out / 'model'}", flush=True)
        model = build_model(out / "model")
        store = out / "store"
        coord_port, env_port = free_port(), free_port()
        coord = procs.start(
            "coordinator",
            [
                py,
                "-m",
                "deltasync.cli",
                "coordinator",
                "--db",
                str(out / "ledger.db"),
                "--store",
                str(store),
                "--port",
                str(coord_port),
            ],
            tokens,
        )
        env = procs.start("env", [py, "-m", "examples.wordle.env_server", "--port", str(env_port)])
        coord_url, env_url = f"http://127.0.0.1:{coord_port}", f"http://127.0.0.1:{env_port}"
        wait_until_serving(coord_url + "/healthz", coord, "the coordinator", timeout_s=120, interval_s=0.2)
        wait_until_serving(env_url + "/healthz", env, "the environment", timeout_s=120, interval_s=0.2)
        print(
            f"[demo] coordinator {coord_url}, environment {env_url}; starting vLLM (about 30 s on 2 cores)", flush=True
        )
        vllm = VllmServerProcess(model, log=out / "logs" / "vllm.log")
        vllm.start_async()
        procs.adopt("vllm", vllm.proc)  # type: ignore[arg-type]
        vllm.wait_healthy()
        print(
            f"[demo] vLLM {vllm.url} serving its start-up weights; starting the sidecar agent and the trainer",
            flush=True,
        )
        procs.start(
            "agent",
            [
                py,
                "-m",
                "deltasync.cli",
                "agent",
                "--vllm-url",
                vllm.url,
                "--coordinator",
                coord_url,
                "--store",
                str(store),
                "--agent-id",
                "vllm-0",
                "--poll-wait-s",
                "5",
                "--staging-dir",
                str(out / "staging"),
                "--backoff-s",
                "0.2",
            ],
            agent_env,
        )
        trainer = procs.start(
            "trainer",
            [
                py,
                "-m",
                "examples.wordle.train",
                "--model",
                str(model),
                "--vllm-url",
                vllm.url,
                "--env-url",
                env_url,
                "--coordinator",
                coord_url,
                "--store",
                str(store),
                "--out",
                str(out / "run"),
                "--steps",
                str(args.steps),
                "--warmup-steps",
                str(args.warmup_steps),
            ],
            publisher_env,
        )
        rows, pauses, seen = follow(trainer, out, coord_url, procs, publisher_env["DELTASYNC_PUBLISHER_TOKEN"])
        if trainer.returncode != 0:
            print((out / "logs" / "trainer.log").read_text()[-3000:], file=sys.stderr)
            raise RuntimeError(f"the trainer exited with {trainer.returncode}; logs in {out / 'logs'}")
        final = json.loads((out / "run" / "final.json").read_text())
        final["applied_versions_in_order"] = seen
        (out / "report.json").write_text(json.dumps({"steps": rows, "pauses": pauses, "final": final}, indent=1))
        report(out, rows, pauses, final)
        return 0 if final["bit_exact"] else 1
    except KeyboardInterrupt:
        print("\n[demo] interrupted: stopping every process", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        print(f"[demo] all processes stopped; logs in {out / 'logs'}", flush=True)


def follow(
    trainer: subprocess.Popen[bytes], out: Path, coord_url: str, procs: Processes, token: str
) -> tuple[list[dict[str, Any]], dict[int, float], list[int]]:
    """Print progress while the trainer runs; collect metrics, the agent's pause per version, applied order."""
    metrics = out / "run" / "metrics.jsonl"
    rows: list[dict[str, Any]] = []
    pauses: dict[int, float] = {}
    seen: list[int] = []
    offset = 0
    with httpx.Client(base_url=coord_url, timeout=10, headers={"Authorization": f"Bearer {token}"}) as http:
        while True:
            done = trainer.poll() is not None
            for name, proc in procs.children.items():
                if name != "trainer" and proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {out / 'logs' / (name + '.log')}")
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
                            f"[demo] step {r['step']:3d}: reward {r['reward']:.3f}, published v{r.get('version')} "
                            f"({r.get('delta_bytes', 0) / 1024:.1f} KB, {r.get('changed_fraction', 0):.2%} changed), "
                            f"vLLM caught up in {(r.get('applied_wait_s') or 0) * 1e3:.0f} ms",
                            flush=True,
                        )
                    offset = f.tell()
            if done:
                return rows, pauses, seen
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
