"""The ``deltasync`` command line: list, inspect and verify published versions."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._header import Kind, parse_shard
from ._logging import setup_logging
from .errors import DeltaSyncError, ObjectNotFound
from .store import open_store
from .versions import list_versions, object_prefix, read_chain, read_manifest, read_weights, verify_weights

__all__ = ["main"]

_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


def _shard_rows(data: bytes, name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    header, st = parse_shard(data, name)
    rows = []
    for t, info in header.tensors.items():
        keys = [k for k in st.entries if k == t or k.startswith(t + ":")]
        stored = sum(st.entries[k].data.nbytes for k in keys)
        start, stop = info.bounds
        idx_bytes = 0 if info.layout == "dense" else (4 if info.numel <= 2**31 - 1 else 8)
        rows.append(
            {
                "tensor": t,
                "layout": info.layout,
                "dtype": info.dtype,
                "shape": list(info.shape),
                "nnz": info.nnz,
                "density": info.nnz / max(stop - start, 1),
                "bytes": stored,
                "raw_bytes": info.nnz * (_ITEMSIZE[info.dtype] + idx_bytes),
            }
        )
    summary = {
        "file": name,
        "kind": header.kind,
        "encoding": header.encoding,
        "base_version": header.base_version,
        "target_version": header.target_version,
        "bytes": len(data),
    }
    return summary, rows


def _print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'tensor':60s} {'layout':6s} {'nnz':>12s} {'density':>8s} {'bytes':>12s} {'B/elem':>7s} {'raw B':>12s}")
    for r in rows:
        per = r["bytes"] / r["nnz"] if r["nnz"] else 0.0
        print(
            f"{r['tensor']:60s} {r['layout']:6s} {r['nnz']:12d} {r['density']:8.2%} {r['bytes']:12d} "
            f"{per:7.3f} {r['raw_bytes']:12d}"
        )
    nnz, stored, raw = (sum(r[k] for r in rows) for k in ("nnz", "bytes", "raw_bytes"))
    print(
        f"{'total: ' + str(len(rows)) + ' tensors':60s} {'':6s} {nnz:12d} {'':8s} {stored:12d} "
        f"{stored / nnz if nnz else 0.0:7.3f} {raw:12d}"
    )


def _cmd_ls(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    out = []
    for listing in list_versions(store):
        pairs: tuple[tuple[Kind, bool], ...] = (("delta", listing.delta), ("anchor", listing.anchor))
        for kind, present in pairs:
            if present:
                m = read_manifest(store, listing.version, kind)
                out.append(
                    {
                        "version": m.version,
                        "kind": kind,
                        "base_version": m.base_version,
                        "encoding": m.encoding,
                        "tensors_changed": sum(1 for t in m.tensors.values() if t.nnz),
                        "tensors": len(m.tensors),
                        "nnz": m.nnz,
                        "changed_fraction": m.nnz / max(m.numel, 1),
                        "bytes": m.total_bytes,
                        "shards": len(m.shards),
                    }
                )
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{'version':>8s} {'kind':6s} {'base':>6s} {'encoding':8s} {'changed':>9s} {'nnz':>12s} "
        f"{'fraction':>8s} {'bytes':>12s}"
    )
    for r in out:
        base = "-" if r["base_version"] is None else str(r["base_version"])
        print(
            f"{r['version']:8d} {r['kind']:6s} {base:>6s} {r['encoding']:8s} "
            f"{r['tensors_changed']:4d}/{r['tensors']:<4d} {r['nnz']:12d} "
            f"{r['changed_fraction']:8.3%} {r['bytes']:12d}"
        )
    print(f"{len(out)} objects in {store.uri}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.target)
    shards: list[tuple[bytes, str]] = []
    if args.version is None:
        if not path.is_file():
            raise ObjectNotFound(f"{args.target}: no such shard file (to inspect a store, pass --version N)")
        shards.append((path.read_bytes(), str(path)))
    else:
        store = open_store(args.target)
        kind: Kind = "anchor" if args.anchor else "delta"
        manifest = read_manifest(store, args.version, kind)
        prefix = object_prefix(args.version, kind)
        shards.extend((store.get(prefix + s.file), f"{store.uri}/{prefix}{s.file}") for s in manifest.shards)
    reports = [(*_shard_rows(data, name),) for data, name in shards]
    if args.json:
        print(json.dumps([{**summary, "tensors": rows} for summary, rows in reports]))
        return 0
    for summary, rows in reports:
        base = "" if summary["base_version"] is None else f"v{summary['base_version']} -> "
        print(
            f"{summary['file']}: {summary['kind']} {base}v{summary['target_version']}, "
            f"{summary['encoding']}, {summary['bytes']} bytes"
        )
        _print_rows(rows)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    chain = read_chain(store, args.version)
    weights = read_weights(store, args.version, verify=True)
    verify_weights(weights, chain[-1])
    result = {
        "version": args.version,
        "ok": True,
        "anchor": chain[0].version,
        "deltas": [m.version for m in chain[1:]],
        "tensors": len(weights),
        "elements": sum(t.numel() for t in weights.values()),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"v{args.version}: ok, {result['tensors']} tensors ({result['elements']} elements) "
            f"rebuilt from anchor v{result['anchor']} + {len(result['deltas'])} deltas, all checksums match"
        )
    return 0


def _cmd_coordinator(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from services.coordinator.app import create_app
        from services.coordinator.settings import Settings
    except ImportError as exc:
        raise SystemExit(
            f"deltasync coordinator needs the service extra: pip install 'deltasync[service]' ({exc})"
        ) from None
    flags = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    settings = Settings(**flags)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    return 0


def _cmd_agent(args: argparse.Namespace) -> int:
    import dataclasses
    import os
    import signal
    import threading

    from .agent import Agent
    from .client import CoordinatorClient
    from .config import AgentConfig
    from .targets import HttpVllmTarget

    fields = {f.name for f in dataclasses.fields(AgentConfig)}
    config = AgentConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    target = HttpVllmTarget(args.vllm_url, pause_mode=config.pause_mode)
    with CoordinatorClient(args.coordinator, token=os.environ.get("DELTASYNC_AGENT_TOKEN")) as coordinator:
        agent = Agent(store=open_store(args.store), coordinator=coordinator, target=target, config=config)
        logging.getLogger("deltasync").info("agent %s: %s -> %s", config.agent_id, args.store, args.vllm_url)
        try:
            agent.run(stop)
        finally:
            target.close()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltasync", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list the committed versions of a store")
    ls.add_argument("store", help="store URI or path")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=_cmd_ls)
    inspect = sub.add_parser("inspect", help="tensors, nnz, density and bytes of a shard file or a store version")
    inspect.add_argument("target", help="a shard file, or a store URI with --version")
    inspect.add_argument("--version", type=int, help="version to inspect in a store")
    inspect.add_argument("--anchor", action="store_true", help="inspect the version's anchor, not its delta")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.set_defaults(func=_cmd_inspect)
    verify = sub.add_parser("verify", help="rebuild a version and check every checksum")
    verify.add_argument("store", help="store URI or path")
    verify.add_argument("--version", type=int, required=True, help="version to rebuild")
    verify.add_argument("--json", action="store_true", help="print JSON")
    verify.set_defaults(func=_cmd_verify)
    coord = sub.add_parser(
        "coordinator",
        help="run the coordinator service (tokens come from DELTASYNC_PUBLISHER_TOKEN, DELTASYNC_AGENT_TOKEN, "
        "DELTASYNC_READ_TOKEN, never from flags)",
    )
    coord.add_argument("--db", help="SQLite file (default deltasync-coordinator.db)")
    coord.add_argument("--store", help="store URI, needed for garbage collection")
    coord.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    coord.add_argument("--port", type=int, help="port to bind (default 8600)")
    coord.add_argument("--max-wait-s", type=float, help="cap of a long-poll's wait (default 60)")
    coord.add_argument("--agent-stale-after-s", type=float, help="an agent not seen this long is stale (default 60)")
    coord.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413 (default 1 MiB)")
    coord.add_argument("--max-header-bytes", type=int, help="larger request headers get 431 (default 64 KiB)")
    coord.add_argument("--read-requires-token", action="store_true", default=None, help="reads need a token")
    coord.set_defaults(func=_cmd_coordinator)
    agent = sub.add_parser(
        "agent",
        help="keep a vLLM server at the latest version (a sidecar; the token comes from DELTASYNC_AGENT_TOKEN)",
    )
    agent.add_argument("--vllm-url", required=True, help="the vLLM server (VLLM_SERVER_DEV_MODE=1; keep it private)")
    agent.add_argument("--coordinator", required=True, help="the coordinator's URL")
    agent.add_argument("--store", required=True, help="store URI or path")
    agent.add_argument("--agent-id", help="name shown by the coordinator (default agent-0)")
    agent.add_argument("--poll-wait-s", type=float, help="long-poll wait (default 30)")
    agent.add_argument("--max-lag", type=int, help="stop serving while more than N versions behind")
    agent.add_argument("--staging-dir", help="where shards are cached and staged (default: a temporary dir)")
    agent.add_argument("--fetch-workers", type=int, help="shards fetched in parallel (default 4)")
    agent.add_argument("--retries", type=int, help="retries of a fetch or checksum mismatch (default 5)")
    agent.add_argument("--backoff-s", type=float, help="first backoff, doubling (default 0.5)")
    agent.add_argument("--assume-version", type=int, help="the server was started from this version's weights")
    agent.add_argument("--pause-mode", choices=["keep", "wait", "abort"], help="vLLM /pause mode (default keep)")
    agent.add_argument("--tp-size", type=int, help="the server's tensor-parallel size (default 1)")
    agent.set_defaults(func=_cmd_agent)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI. Exit codes: 0 ok, 1 a deltasync error, 2 a usage error."""
    parser = _parser()
    args = parser.parse_args(argv)
    quiet = args.command in ("ls", "inspect", "verify")
    setup_logging(logging.DEBUG if args.debug else logging.WARNING if quiet else logging.INFO)
    try:
        return int(args.func(args))
    except DeltaSyncError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # bad arguments the parser cannot see (store URI, version range)
        print(f"deltasync: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
