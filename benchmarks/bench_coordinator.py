"""Coordinator benchmark on 127.0.0.1 (run by hand; asserts nothing): registrations/s, heartbeats/s, and
the wake-up latency of 100 long-pollers (median and max), against a real `deltasync coordinator` process
with a SQLite file. Ends with one JSON line of the figures.

    python benchmarks/bench_coordinator.py [--registrations 1000] [--heartbeats 3000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from deltasync.testing import CoordinatorProcess

TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def body(version: int, kind: str = "delta") -> dict:
    prefix = f"v{version:08d}/" + ("anchor/" if kind == "anchor" else "")
    return {
        "version": version,
        "kind": kind,
        "base_version": version - 1 if kind == "delta" else None,
        "manifest_key": prefix + "manifest.json",
        "bytes": 1000,
        "nnz": 10,
        "tensors": 310,
        "checksum": "sha256:" + hashlib.sha256(str(version).encode()).hexdigest(),
    }


async def run(url: str, n_reg: int, n_hb: int, rounds: int) -> dict:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60, headers=AUTH) as http:
        (await http.post("/v1/versions", json=body(0, "anchor"))).raise_for_status()
        t0 = time.perf_counter()
        for v in range(1, n_reg + 1):  # versions are sequential by nature: one publisher, one at a time
            (await http.post("/v1/versions", json=body(v))).raise_for_status()
        reg_s = n_reg / (time.perf_counter() - t0)
        latest = n_reg

        sem = asyncio.Semaphore(50)

        async def beat(i: int) -> None:
            async with sem:
                r = await http.post(
                    f"/v1/agents/agent-{i % 100}/heartbeat",
                    json={"applied_version": latest - i % 7, "state": "idle", "timings": {"apply": 0.01}},
                )
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(beat(i) for i in range(n_hb)))
        hb_s = n_hb / (time.perf_counter() - t0)

        wake_ms: list[float] = []
        for _ in range(rounds):
            done: list[float] = []

            async def poll(after: int, done: list[float] = done) -> None:
                r = await http.get("/v1/versions", params={"after": after, "wait_s": 30})
                assert r.json()["versions"], "timed out instead of being woken"
                done.append(time.perf_counter())

            tasks = [asyncio.create_task(poll(latest)) for _ in range(100)]
            await asyncio.sleep(1.0)
            latest += 1
            t0 = time.perf_counter()
            (await http.post("/v1/versions", json=body(latest))).raise_for_status()
            await asyncio.gather(*tasks)
            wake_ms.extend((t - t0) * 1e3 for t in done)
        plan_t0 = time.perf_counter()
        for _ in range(200):
            (await http.get("/v1/plan", params={"from": latest - 5})).raise_for_status()
        plan_ms = (time.perf_counter() - plan_t0) / 200 * 1e3
    return {
        "registrations_per_s": reg_s,
        "heartbeats_per_s": hb_s,
        "wake_median_ms": statistics.median(wake_ms),
        "wake_max_ms": max(wake_ms),
        "long_pollers": 100,
        "rounds": rounds,
        "plan_ms": plan_ms,
        "versions_in_ledger": latest + 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registrations", type=int, default=1000)
    parser.add_argument("--heartbeats", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {"DELTASYNC_PUBLISHER_TOKEN": TOKEN, "DELTASYNC_AGENT_TOKEN": TOKEN}
        with CoordinatorProcess(Path(tmp) / "ledger.db", env=env, log=Path(tmp) / "log") as proc:
            figures = asyncio.run(run(proc.url, args.registrations, args.heartbeats, args.rounds))
    print(f"registrations: {figures['registrations_per_s']:.0f}/s (sequential, durable SQLite commits)")
    print(f"heartbeats:    {figures['heartbeats_per_s']:.0f}/s (100 agents, 50 in flight)")
    print(
        f"wake-up of 100 long-pollers over {args.rounds} publishes: median {figures['wake_median_ms']:.1f} ms, "
        f"max {figures['wake_max_ms']:.1f} ms"
    )
    print(f"plan over {figures['versions_in_ledger']} versions: {figures['plan_ms']:.1f} ms")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
