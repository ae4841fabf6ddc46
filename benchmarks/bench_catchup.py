"""Catch-up benchmark: bytes and time for an agent 1, 4, 16 and 64 versions behind, through the route the
coordinator plans (a squash when one is the cheapest) against replaying the chain and against an anchor (run by
hand; asserts nothing).

The update stream of ``deltasync.testing`` at Qwen3-0.6B shapes (``--layers`` and ``--vocab`` shrink it), a real
coordinator process, the real Publisher (squashes on, an anchor at the last version) and one agent per lag on an
in-memory engine: each agent syncs once at ``latest - lag``, then waits while the publisher goes on; the publisher
squashes from the versions the agents hold. At the end each agent catches up once. Printed per lag: the planned
route, its objects and bytes; the chain's (the lag's deltas) and the anchor's bytes; the agent's sync time
(fetch, verify, decode, apply) and, for the chain and the anchor, the time to fetch, verify and decode them.

    python benchmarks/bench_catchup.py --layers 1 --vocab 8192     # minutes on 2 cores
    python benchmarks/bench_catchup.py                             # Qwen3-0.6B shapes (slow: 65+ versions)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from deltasync import LocalStore
from deltasync.agent import Agent
from deltasync.client import CoordinatorClient
from deltasync.config import AgentConfig, PublisherConfig
from deltasync.publisher import Publisher
from deltasync.reader import load_object, read_manifest, read_weights
from deltasync.targets import InMemoryTarget
from deltasync.testing.credentials import PUBLISHER_TOKEN, TOKENS_ENV, agent_token
from deltasync.testing.launchers import CoordinatorProcess
from deltasync.testing.models import QWEN3_0_6B_CONFIG, qwen3_shapes
from deltasync.testing.stream import UpdateStream


def _load_time(store: LocalStore, objects: list[tuple[int, str]], base: dict[str, torch.Tensor] | None) -> float:
    """Seconds to read, verify and decode ``objects`` in order, each delta decoded against ``base`` (kept current
    as the deltas are applied to it)."""
    t0 = time.perf_counter()
    for version, kind in objects:
        m = read_manifest(store, version, kind)  # type: ignore[arg-type]
        for d in load_object(store, m, base=base):
            if base is not None and d.indices is not None:
                base[d.ckpt_name].view(-1)[d.indices] = d.values
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B_CONFIG["num_hidden_layers"])
    parser.add_argument("--vocab", type=int, default=QWEN3_0_6B_CONFIG["vocab_size"])
    parser.add_argument("--lags", default="1,4,16,64")
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()
    lags = sorted({int(x) for x in args.lags.split(",")})
    config = dict(QWEN3_0_6B_CONFIG, num_hidden_layers=args.layers, vocab_size=args.vocab)
    shapes = qwen3_shapes(config)
    stream = UpdateStream.from_shapes(shapes, seed=0, lr=args.lr)
    stream.step()  # Adam's warm-up step is not part of the workload
    latest = max(lags) + 1
    print(
        f"{sum(map(lambda s: torch.Size(s).numel(), shapes.values())):,} elements, {len(shapes)} tensors; "
        f"lags {lags}, {latest + 1} versions",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        store = LocalStore(tmp / "store")
        with (
            CoordinatorProcess(tmp / "ledger.db", env=TOKENS_ENV, log=tmp / "coordinator.log") as proc,
            CoordinatorClient(proc.url, token=PUBLISHER_TOKEN) as client,
        ):
            agents: dict[int, Agent] = {}
            for lag in lags:
                c = CoordinatorClient(proc.url, token=agent_token(f"lag-{lag}"))
                cfg = AgentConfig(agent_id=f"lag-{lag}", staging_dir=str(tmp / f"agent-{lag}"), poll_wait_s=0)
                agents[lag] = Agent(store=store, coordinator=c, target=InMemoryTarget(), config=cfg)
            pconfig = PublisherConfig(
                anchor_every=latest,  # an anchor at v0 and at the last version: the anchor route is one object
                anchor_bytes_fraction=None,
                squash_window=max(lags) + 1,
                squash_bases=len(lags),
                squash_max_fraction=1.0,
            )
            with Publisher(store, client, pconfig) as pub:
                t0 = time.perf_counter()
                for v in range(latest + 1):
                    if v:
                        stream.step()
                    assert pub.publish(stream.master) == v
                    pub.flush()
                    for lag, agent in agents.items():
                        if v == latest - lag:
                            agent.sync()
                        elif v > latest - lag:  # a live agent that waits (generating): it still heartbeats
                            agent.coordinator.heartbeat(
                                agent.config.agent_id, applied_version=latest - lag, state="idle"
                            )
                print(
                    f"published v0..v{latest} with squashes in {time.perf_counter() - t0:.0f} s; "
                    f"{len(pub.squashes)} squashes written",
                    flush=True,
                )
            anchor = client.get_version(latest, "anchor").bytes
            rows = []
            print(
                f"{'lag':>4} {'route':>7} {'objects':>7} {'bytes':>12} {'chain bytes':>12} {'anchor bytes':>12} "
                f"{'vs min':>6} {'sync ms':>8} {'chain ms':>8} {'anchor ms':>9}"
            )
            for lag, agent in agents.items():
                held = latest - lag
                plan = agent.coordinator.plan(held)
                chain = sum(client.get_version(v, "delta").bytes for v in range(held + 1, latest + 1))
                t0 = time.perf_counter()
                result = agent.sync()
                sync_s = time.perf_counter() - t0
                assert result.to_version == latest
                state = read_weights(store, held)  # what the agent held (not timed)
                chain_s = _load_time(store, [(v, "delta") for v in range(held + 1, latest + 1)], state)
                anchor_s = _load_time(store, [(latest, "anchor")], None)
                row = {
                    "lag": lag,
                    "route": plan.route,
                    "objects": len(plan.steps),
                    "bytes": plan.bytes,
                    "chain_bytes": chain,
                    "chain_objects": lag,
                    "anchor_bytes": anchor,
                    "sync_ms": sync_s * 1e3,
                    "chain_fetch_decode_ms": chain_s * 1e3,
                    "anchor_fetch_decode_ms": anchor_s * 1e3,
                }
                rows.append(row)
                print(
                    f"{lag:>4} {plan.route:>7} {len(plan.steps):>7} {plan.bytes:>12,} {chain:>12,} {anchor:>12,} "
                    f"{plan.bytes / min(chain, anchor):>6.2f} {sync_s * 1e3:>8.0f} {chain_s * 1e3:>8.0f} "
                    f"{anchor_s * 1e3:>9.0f}",
                    flush=True,
                )
                agent.coordinator.close()
            print(json.dumps({"config": {"layers": args.layers, "vocab": args.vocab, "lr": args.lr}, "rows": rows}))


if __name__ == "__main__":
    main()
