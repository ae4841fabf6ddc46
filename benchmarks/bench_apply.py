"""Apply benchmark (run by hand; asserts nothing): vLLM on CPU (reload mode) at Qwen3-0.6B shapes,
``load_format="dummy"``, kept current by the in-process agent from the DESIGN section 7 update stream.

Per version: fetch + decode + verify + stage time (outside the pause), the pause window (the serving gap),
and, as the reference, the same engine's full reload of the weights measured in the same run (an anchor
applied through the engine: every module reloaded and repacked). Ends with one JSON line.

    python benchmarks/bench_apply.py [--steps 6] [--lr 1e-6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()

    from deltasync import LocalStore, compute_delta, write_anchor, write_delta
    from deltasync.agent import Agent
    from deltasync.client import CoordinatorClient
    from deltasync.config import AgentConfig
    from deltasync.schemas import VersionCreate
    from tests.support.credentials import PUBLISHER_TOKEN, TOKENS_ENV, agent_token
    from tests.support.launchers import CoordinatorProcess, offline_llm
    from tests.support.models import QWEN3_0_6B_CONFIG, qwen3_shapes, write_config_only_model
    from tests.support.stream import UpdateStream

    tmp = Path(tempfile.mkdtemp(prefix="deltasync-bench-apply-"))
    model = write_config_only_model(tmp / "qwen3-0.6b")
    llm = offline_llm(model, load_format="dummy")
    store = LocalStore(tmp / "store")
    stream = UpdateStream.from_shapes(qwen3_shapes(QWEN3_0_6B_CONFIG), lr=args.lr, seed=0)
    curr = stream.bf16()
    snapshot = {k: v.clone() for k, v in curr.items()}
    with (
        CoordinatorProcess(tmp / "ledger.db", env=TOKENS_ENV, log=tmp / "coordinator.log") as coordinator,
        CoordinatorClient(coordinator.url, token=PUBLISHER_TOKEN) as client,
        CoordinatorClient(coordinator.url, token=agent_token("bench")) as agent_client,
    ):
        lease = client.acquire_lease("bench_apply", ttl_s=3600)
        base = write_anchor(store, curr, version=0, encoding="packed")
        client.register_version(VersionCreate.for_manifest(base), lease=lease)
        agent = Agent.for_llm(
            llm,
            store=store,
            coordinator=agent_client,
            config=AgentConfig(agent_id="bench", staging_dir=str(tmp / "staging")),
        )
        first = agent.sync()
        print(
            f"v0 anchor through the engine (full reload): pause {first.timings['pause'] * 1e3:.0f} ms, "
            f"fetch+decode {(first.timings['fetch'] + first.timings['decode']) * 1e3:.0f} ms\n"
        )
        print(
            f"{'ver':>4} {'changed':>8} {'MB':>7} {'fetch ms':>9} {'decode ms':>10} {'stage ms':>9} "
            f"{'pause ms':>9} {'apply ms':>9}"
        )
        rows = []
        for v in range(1, args.steps + 1):
            curr = stream.step()
            base = write_delta(store, compute_delta(snapshot, curr, update_prev=True), state=curr, version=v, base=base)
            client.register_version(VersionCreate.for_manifest(base), lease=lease)
            r = agent.sync()
            t = r.timings
            rows.append(
                {
                    "version": v,
                    "changed_fraction": base.nnz / base.numel,
                    "bytes": base.total_bytes,
                    **{f"{k}_ms": s * 1e3 for k, s in t.items()},
                }
            )
            print(
                f"{v:4d} {base.nnz / base.numel:8.3%} {base.total_bytes / 1e6:7.2f} {t['fetch'] * 1e3:9.0f} "
                f"{t['decode'] * 1e3:10.0f} {t['stage'] * 1e3:9.0f} {t['pause'] * 1e3:9.0f} {t['apply'] * 1e3:9.0f}",
                flush=True,
            )
        # the reference, in the same run: the same engine reloads every weight (an anchor of the latest version)
        anchor = write_anchor(store, curr, version=args.steps, encoding="packed")
        client.register_version(VersionCreate.for_manifest(anchor), lease=lease)
        agent.needs_anchor = True
        full = agent.sync()
        status = llm.collective_rpc("deltasync_status")[0]
    llm.llm_engine.engine_core.shutdown()
    report = [r for r in rows if r["version"] >= 2] or rows
    pause = statistics.median(r["pause_ms"] for r in report)
    outside = statistics.median(r["fetch_ms"] + r["decode_ms"] + r["stage_ms"] for r in report)
    figures = {
        "model_elements": sum(t.numel() for t in curr.values()),
        "lr": args.lr,
        "versions": [r["version"] for r in report],
        "pause_median_ms": pause,
        "outside_pause_median_ms": outside,
        "full_reload_pause_ms": full.timings["pause"] * 1e3,
        "pause_over_full_reload": pause / (full.timings["pause"] * 1e3),
        "engine_last_update": status["history"][-1],
        "rows": rows,
    }
    print(
        f"\nmedian pause {pause:.0f} ms vs full reload {full.timings['pause'] * 1e3:.0f} ms in the same engine: "
        f"{figures['pause_over_full_reload']:.2f}x; fetch+decode+stage outside the pause {outside:.0f} ms"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
