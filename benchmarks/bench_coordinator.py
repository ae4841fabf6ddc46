"""Coordinator benchmark on 127.0.0.1 (run by hand; asserts nothing): registrations/s, heartbeats/s, the
wake-up latency of 100 long-pollers (median and max), and the cost of a 1-step plan over a large ledger,
against a real `deltasync coordinator` process, on SQLite and (with ``--postgres`` or ``--db``) PostgreSQL in
the same run; on PostgreSQL also the wake-up of 100 long-pollers on coordinator B by a registration through
coordinator A. Ends with one JSON line of the figures per backend.

    python benchmarks/bench_coordinator.py [--registrations 2000] [--heartbeats 3000] [--rounds 5]
                                           [--plan-versions 100000] [--postgres | --db postgresql://...]
    python benchmarks/bench_coordinator.py --registrations 50 --heartbeats 50 --rounds 1 --plan-versions 200
                                           # the smallest real run (seconds)

``--postgres`` starts a throwaway PostgreSQL server as the tests do (initdb in a temporary directory; needs its
binaries); ``--db URL`` uses an existing database, which is EMPTIED between phases. The client runs on the same
2 cores as the server(s), so these are lower bounds of what the server does.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from deltasync.testing.credentials import PUBLISHER_TOKEN, TOKENS_ENV, agent_token
from deltasync.testing.launchers import CoordinatorProcess
from deltasync.testing.postgres import PostgresServer

PUB = {"Authorization": f"Bearer {PUBLISHER_TOKEN}"}


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


class BareClient:
    """A keep-alive HTTP/1.1 connection with no client library: what the server does, not what httpx costs."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> BareClient:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, host)

    async def post(self, path: str, payload: dict, headers: dict[str, str]) -> int:
        data = json.dumps(payload).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{head}\r\n".encode()
            + data
        )
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await self.reader.readexactly(length)
        return int(status_line.split()[1])

    def close(self) -> None:
        self.writer.close()


async def bare(url: str, n_reg: int, n_hb: int, start: int, lease: str) -> dict:
    """Registrations (one connection, sequential) and heartbeats (50 connections) without a client library."""
    c = await BareClient.open(url)
    headers = {**PUB, "Deltasync-Lease": lease}
    t0 = time.perf_counter()
    for v in range(start, start + n_reg):
        assert await c.post("/v1/versions", body(v), headers) == 201
    reg_s = n_reg / (time.perf_counter() - t0)
    c.close()
    conns = [await BareClient.open(url) for _ in range(50)]
    tokens = [{"Authorization": f"Bearer {agent_token(f'agent-{i}')}"} for i in range(100)]
    beat = {"applied_version": start, "state": "idle", "timings": {"apply": 0.01}}

    async def worker(k: int) -> None:
        for i in range(k, n_hb, 50):
            assert await conns[k].post(f"/v1/agents/agent-{i % 100}/heartbeat", beat, tokens[i % 100]) == 200

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(50)))
    hb_s = n_hb / (time.perf_counter() - t0)
    for conn in conns:
        conn.close()
    return {"bare_registrations_per_s": reg_s, "bare_heartbeats_per_s": hb_s, "next_version": start + n_reg}


async def run(url: str, n_reg: int, n_hb: int, rounds: int) -> dict:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60, headers=PUB) as http:
        lease = (await http.post("/v1/lease", json={"holder": "bench", "ttl_s": 600})).json()["lease_id"]
        fenced = {"Deltasync-Lease": lease}
        (await http.post("/v1/versions", json=body(0, "anchor"), headers=fenced)).raise_for_status()
        t0 = time.perf_counter()
        for v in range(1, n_reg + 1):  # versions are sequential by nature: one publisher, one at a time
            (await http.post("/v1/versions", json=body(v), headers=fenced)).raise_for_status()
        reg_s = n_reg / (time.perf_counter() - t0)
        latest = n_reg

        sem = asyncio.Semaphore(50)
        tokens = [{"Authorization": f"Bearer {agent_token(f'agent-{i}')}"} for i in range(100)]

        async def beat(i: int) -> None:
            async with sem:
                r = await http.post(
                    f"/v1/agents/agent-{i % 100}/heartbeat",
                    json={"applied_version": latest - i % 7, "state": "idle", "timings": {"apply": 0.01}},
                    headers=tokens[i % 100],
                )
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(beat(i) for i in range(n_hb)))
        hb_s = n_hb / (time.perf_counter() - t0)

        wake_ms: list[float] = []
        host, port = url.removeprefix("http://").split(":")
        auth = tokens[0]["Authorization"]
        for _ in range(rounds):
            tasks = [asyncio.create_task(_answered_at(host, port, auth, latest)) for _ in range(100)]
            await asyncio.sleep(1.0)
            latest += 1
            t0 = time.perf_counter()
            (await http.post("/v1/versions", json=body(latest), headers=fenced)).raise_for_status()
            wake_ms.extend((t - t0) * 1e3 for t in await asyncio.gather(*tasks))
    lean = await bare(url, n_reg, n_hb, latest + 1, lease)
    return {
        **lean,
        "registrations_per_s": reg_s,
        "heartbeats_per_s": hb_s,
        "wake_median_ms": statistics.median(wake_ms),
        "wake_max_ms": max(wake_ms),
        "long_pollers": 100,
        "rounds": rounds,
    }


def big_ledger(db: Path | str, n: int) -> None:
    """A ledger of ``n`` versions, written directly (the schema of the running coordinator)."""
    rows = [
        (b["version"], b["kind"], b["base_version"], b["manifest_key"], 1000, 10, 310, b["checksum"], 0.0)
        for b in (body(0, "anchor"), *(body(v) for v in range(1, n)))
    ]
    sql = (
        "INSERT INTO versions (version, kind, base_version, manifest_key, bytes, nnz, tensors, checksum, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
    )
    if isinstance(db, str):
        import psycopg

        with psycopg.connect(db) as pg, pg.cursor() as cur:
            cur.executemany(sql.replace("?", "%s"), rows)
        return
    con = sqlite3.connect(db)
    con.executemany(sql, rows)
    con.commit()
    con.close()


def plan_cost(tmp: Path, n: int, db: Path | str | None = None) -> dict:
    """A 1-step plan's wall time (client included) over a ledger of ``n`` versions."""
    db = db if db is not None else tmp / "plan.db"
    with CoordinatorProcess(db, env=TOKENS_ENV, log=tmp / "plan.log"):
        pass  # create and migrate it
    big_ledger(db, n)
    with CoordinatorProcess(db, env=TOKENS_ENV, log=tmp / "plan.log") as proc:
        with httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {agent_token('planner')}"}) as http:
            for _ in range(20):
                http.get("/v1/plan", params={"from": n - 2}).raise_for_status()
            samples = []
            for _ in range(200):
                t0 = time.perf_counter()
                r = http.get("/v1/plan", params={"from": n - 2})
                samples.append((time.perf_counter() - t0) * 1e3)
                assert [s["version"] for s in r.json()["steps"]] == [n - 1]
    return {
        "plan_versions": n,
        "plan_1_step_median_ms": statistics.median(samples),
        "plan_1_step_p95_ms": sorted(samples)[189],
    }


async def _answered_at(host: str, port: str, auth: str, after: int) -> float:
    """One long-poll for versions after ``after`` on a bare HTTP/1.1 socket (the figure is the server's wake-up,
    not a client library's); when its whole answer had arrived."""
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"GET /v1/versions?after={after}&wait_s=30 HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: {auth}\r\nConnection: close\r\n\r\n".encode()
    )
    await writer.drain()
    raw = await reader.read()  # until the server closes: the whole answer
    at = time.perf_counter()
    writer.close()
    assert b'"versions":[{' in raw, "timed out instead of being woken"
    return at


async def cross_wake(url_a: str, url_b: str, rounds: int, pollers: int = 100) -> dict:
    """``pollers`` long-polls on coordinator B, woken by a registration through coordinator A (one database)."""
    async with httpx.AsyncClient(base_url=url_a, timeout=60, headers=PUB) as http:
        lease = (await http.post("/v1/lease", json={"holder": "bench-x", "ttl_s": 600})).json()["lease_id"]
        fenced = {"Deltasync-Lease": lease}
        (await http.post("/v1/versions", json=body(0, "anchor"), headers=fenced)).raise_for_status()
        host, port = url_b.removeprefix("http://").split(":")
        auth = f"Bearer {agent_token('poller')}"
        wake_ms: list[float] = []
        for latest in range(rounds):
            tasks = [asyncio.create_task(_answered_at(host, port, auth, latest)) for _ in range(pollers)]
            await asyncio.sleep(1.0)
            t0 = time.perf_counter()
            (await http.post("/v1/versions", json=body(latest + 1), headers=fenced)).raise_for_status()
            wake_ms.extend((t - t0) * 1e3 for t in await asyncio.gather(*tasks))
    return {"cross_wake_median_ms": statistics.median(wake_ms), "cross_wake_max_ms": max(wake_ms)}


def _empty(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")


def bench_backend(tmp: Path, backend: str, args: argparse.Namespace, fresh) -> dict:
    """Every figure on one backend; ``fresh()`` gives an empty ledger (a SQLite path or a PostgreSQL URL)."""
    with CoordinatorProcess(fresh("ledger.db"), env=TOKENS_ENV, log=tmp / f"{backend}.log") as proc:
        figures = asyncio.run(run(proc.url, args.registrations, args.heartbeats, args.rounds))
    figures |= plan_cost(tmp, args.plan_versions, fresh("plan.db"))
    if backend == "postgres":
        db = fresh("x.db")
        with (
            CoordinatorProcess(db, env=TOKENS_ENV, log=tmp / "a.log") as a,
            CoordinatorProcess(db, env=TOKENS_ENV, log=tmp / "b.log") as b,
        ):
            figures |= asyncio.run(cross_wake(a.url, b.url, args.rounds))
    return figures


def report(backend: str, figures: dict, args: argparse.Namespace) -> None:
    commits = "durable SQLite commits" if backend == "sqlite" else "PostgreSQL commits under the write lock"
    print(f"--- {backend}")
    print(
        f"registrations: {figures['bare_registrations_per_s']:.0f}/s bare HTTP, {figures['registrations_per_s']:.0f}/s "
        f"through httpx (sequential, {commits}, fenced)"
    )
    print(
        f"heartbeats:    {figures['bare_heartbeats_per_s']:.0f}/s bare HTTP, {figures['heartbeats_per_s']:.0f}/s "
        "through httpx (100 agents with their own tokens, 50 in flight)"
    )
    print(
        f"wake-up of 100 long-pollers over {args.rounds} publishes: median {figures['wake_median_ms']:.1f} ms, "
        f"max {figures['wake_max_ms']:.1f} ms"
    )
    print(
        f"1-step plan over {figures['plan_versions']} versions: median {figures['plan_1_step_median_ms']:.2f} ms, "
        f"p95 {figures['plan_1_step_p95_ms']:.2f} ms (HTTP round trip included)"
    )
    if "cross_wake_median_ms" in figures:
        print(
            f"wake-up of 100 long-pollers on coordinator B by a registration through A over {args.rounds} publishes: "
            f"median {figures['cross_wake_median_ms']:.1f} ms, max {figures['cross_wake_max_ms']:.1f} ms"
        )
    print(json.dumps({"backend": backend, **figures}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registrations", type=int, default=2000)
    parser.add_argument("--heartbeats", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plan-versions", type=int, default=100_000)
    pg = parser.add_mutually_exclusive_group()
    pg.add_argument("--postgres", action="store_true", help="also on a throwaway PostgreSQL server (as the tests)")
    pg.add_argument("--db", help="also on this PostgreSQL database (postgresql://...; EMPTIED between phases)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {"sqlite": bench_backend(Path(tmp), "sqlite", args, lambda name: Path(tmp) / name)}
        if args.postgres or args.db:
            server = PostgresServer(os.environ.get("DELTASYNC_TEST_POSTGRES_URL")) if args.postgres else None
            try:

                def fresh(name: str) -> str:
                    if server is not None:
                        return server.create_database()
                    _empty(args.db)
                    return str(args.db)

                if server is not None:
                    server.start()
                results["postgres"] = bench_backend(Path(tmp), "postgres", args, fresh)
            finally:
                if server is not None:
                    server.close()
    for backend, figures in results.items():
        report(backend, figures, args)


if __name__ == "__main__":
    main()
