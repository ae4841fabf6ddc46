"""Prints docs/SCALING.md's tables from unit costs (arithmetic only; every input is a flag). Measured inputs
come from benchmarks/bench_layouts.py, bench_apply.py and bench_coordinator.py on a 2-core CPU; the rest are
assumptions, named as such in docs/SCALING.md.

    python benchmarks/scaling_table.py [--changed-fraction 0.02] [--step-s 10,30,60,120] ...
"""

from __future__ import annotations

import argparse
import math

MODELS = {"0.6B": 596e6, "8B": 8.2e9, "70B": 70.6e9, "1T": 1.0e12}  # elements (0.6B: Qwen3-0.6B, 310 tensors)
REPLICAS = (10, 100, 1000)
MIB_64 = 64 << 20  # an agent reports fetching/applying heartbeats for plans this large (agent.py)


def _split(text: str, cast: type = float) -> list:
    return [cast(x) for x in text.split(",")]


def _f(x: float) -> str:
    """Three significant digits, thousands separated, never an exponent."""
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if x >= 0.001 else f"{x:.1g}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--changed-fraction", type=float, default=0.02, help="assumption (1-3%% in real RL runs)")
    p.add_argument("--delta-B-per-elem", type=float, default=1.20, help="measured, packed sparse, 2.0%% changed")
    p.add_argument("--anchor-B-per-elem", type=float, default=1.34, help="measured, packed anchor")
    p.add_argument("--anchor-every", type=int, default=20, help="PublisherConfig default")
    p.add_argument("--decode-ns", type=float, default=130.0, help="measured, per changed element, 2 cores")
    p.add_argument("--host-cores", type=int, default=32, help="assumption: decode scales linearly from 2 cores")
    p.add_argument("--checksum-GBps", type=float, default=35.0, help="measured xxh3 (docs/FORMAT.md)")
    p.add_argument("--step-s", default="10,30,60,120", help="assumption: seconds per optimizer step, per model")
    p.add_argument("--gpus", default="1,1,4,16", help="assumption: H200s per replica, per model")
    p.add_argument("--hbm-TBps", type=float, default=4.8, help="assumption: H200 HBM bandwidth")
    p.add_argument("--scatter-B-per-elem", type=float, default=100.0, help="assumption: HBM traffic per write")
    p.add_argument("--conn-MBps", type=float, default=100.0, help="assumption: per S3 connection")
    p.add_argument("--fetch-workers", type=int, default=4, help="AgentConfig default")
    p.add_argument("--nic-Gbps", type=float, default=25.0, help="assumption: per host / per store server")
    p.add_argument("--poll-wait-s", type=float, default=30.0, help="AgentConfig default")
    p.add_argument("--coord-writes-per-s", type=float, default=1000.0, help="measured, SQLite heartbeats")
    p.add_argument("--plan-ms", type=float, default=2.75, help="measured, SQLite, 100k-version ledger")
    p.add_argument("--max-long-polls", type=int, default=512, help="coordinator default")
    a = p.parse_args()
    step_s, gpus = _split(a.step_s), _split(a.gpus, int)
    conn_Bps, nic_Bps = a.fetch_workers * a.conn_MBps * 1e6, a.nic_Gbps / 8 * 1e9

    print(
        "| model | step s* | delta GB | anchor GB | ingress GB/step | delta fetch s (4 conn* / NIC*) "
        "| decode s (2 cores / 32 cores*) | checksums s | GPU pause ms* | anchor fetch s (4 conn* / NIC*) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for (name, n), t, g in zip(MODELS.items(), step_s, gpus, strict=True):
        nnz = n * a.changed_fraction
        delta, anchor = nnz * a.delta_B_per_elem, n * a.anchor_B_per_elem
        decode = nnz * a.decode_ns * 1e-9
        pause_ms = nnz / g * a.scatter_B_per_elem / (a.hbm_TBps * 1e12) * 1e3
        rows.append((name, n, t, delta, anchor))
        print(
            f"| {name} | {t:g} | {_f(delta / 1e9)} | {_f(anchor / 1e9)} | {_f((delta + anchor / a.anchor_every) / 1e9)} "
            f"| {_f(delta / conn_Bps)} / {_f(delta / nic_Bps)} | {_f(decode)} / {_f(decode * 2 / a.host_cores)} "
            f"| {_f(n * 2 / (a.checksum_GBps * 1e9))} | {_f(pause_ms)} | {_f(anchor / conn_Bps)} / {_f(anchor / nic_Bps)} |"
        )

    print(
        "\n| model | replicas | egress GB/step | egress GB/s | req/s avg | burst / version | SQLite drain s "
        "| long-polls / cap |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, _, t, delta, _anchor in rows:
        per_version = 3 + (2 if delta >= MIB_64 else 0)  # long-poll + plan + heartbeat(s)
        idle = max(0, math.ceil(t / a.poll_wait_s) - 1) * 3  # timed-out long-poll + plan + heartbeat
        for r in REPLICAS:
            egress = r * delta
            drain = r * (a.plan_ms / 1e3 + (per_version - 2) / a.coord_writes_per_s)
            print(
                f"| {name} | {r:,} | {_f(egress / 1e9)} | {_f(egress / t / 1e9)} | {_f(r * (per_version + idle) / t)} "
                f"| {r * per_version:,} | {_f(drain)} | {r:,} / {a.max_long_polls} |"
            )


if __name__ == "__main__":
    main()
