"""The ``deltasync`` command line: list, inspect and verify published versions; run the coordinator or an
agent (:mod:`deltasync._cli_run`); collect garbage; make keys and agent tokens."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import apply
from ._cli_run import add_agent_parser, add_coordinator_flags, add_coordinator_parser, add_s3_endpoint, open_coordinator
from ._logging import setup_logging
from ._shard_header import parse_shard
from .errors import (
    DeltaSyncError,
    FencedObject,
    ForeignObject,
    FormatError,
    ObjectNotFound,
    SignatureError,
    StoreError,
)
from .layout import manifest_key, object_prefix
from .manifest import MAX_MANIFEST_BYTES
from .reader import Trust, list_versions, read_chain, read_manifest, read_weights
from .runrecord import RunView, read_run_view
from .signing import VerifyKey, generate_key_files
from .store import Store, open_store
from .vocab import Kind

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


_LS_FIELDS = (
    "base_version",
    "encoding",
    "tensors_changed",
    "tensors",
    "nnz",
    "changed_fraction",
    "bytes",
    "shards",
)
"""What ``ls`` tells of an object from its manifest (``null`` where the manifest cannot be read)."""


def _unreadable(store_uri: str, key: str, exc: Exception) -> str:
    """Why ``ls`` cannot read an object, without the object's name in front."""
    return str(exc).removeprefix(f"{store_uri}/{key}: ").removeprefix(f"{store_uri}: ")


def _ls_row(store: Store, version: int, kind: Kind, trust: Trust | None, view: RunView) -> dict[str, Any]:
    """One object of ``ls``: what its manifest says, and whether a reader pinned like ``view`` takes it."""
    key = manifest_key(version, kind)
    row: dict[str, Any] = {"version": version, "kind": kind, "run_id": None, "status": "ok"}
    try:
        m = read_manifest(store, version, kind)
    except (FormatError, StoreError) as exc:  # listed as such: one planted file must not hide the others
        unknown = dict.fromkeys(_LS_FIELDS)
        return {**row, **unknown, "status": f"UNREADABLE: {_unreadable(store.uri, key, exc)}"}
    try:
        if trust is not None:
            trust.check(store, version, kind, store.get(key, max_bytes=MAX_MANIFEST_BYTES))
        view.admit(m, name=f"{kind} v{version}")
    except ForeignObject:
        row["status"] = f"FOREIGN: run {m.run_id or '(none)'}"
        if view.run_id is None and view.unpinned is not None:
            try:
                view.resolve()
            except ForeignObject:  # no record pins the run and the signed objects name several
                row["status"] = f"UNPINNED: run {m.run_id or '(none)'}"
    except FencedObject:
        row["status"] = f"FENCED: epoch {m.lease_epoch}"
    except SignatureError:
        row["status"] = "UNSIGNED: not by the key"
    except (FormatError, StoreError) as exc:  # e.g. a planted signature file over its cap
        row["status"] = f"UNREADABLE: {_unreadable(store.uri, key, exc)}"
    return {
        **row,
        "run_id": m.run_id,
        "base_version": m.base_version,
        "encoding": m.encoding,
        "tensors_changed": sum(1 for t in m.tensors.values() if t.nnz),
        "tensors": len(m.tensors),
        "nnz": m.nnz,
        "changed_fraction": m.nnz / max(m.numel, 1),
        "bytes": m.total_bytes,
        "shards": len(m.shards),
    }


def _cmd_ls(args: argparse.Namespace) -> int:
    store = open_store(args.store, s3_endpoint=args.s3_endpoint)
    verify_key = VerifyKey.from_file(args.public_key) if args.public_key else None
    view = read_run_view(store, run_id=args.run_id, verify_key=verify_key)
    trust = Trust(verify_key=verify_key) if verify_key is not None else None
    out: list[dict[str, Any]] = []
    for listing in list_versions(store):
        pairs: tuple[tuple[Kind, bool], ...] = (("delta", listing.delta), ("anchor", listing.anchor))
        out.extend(_ls_row(store, listing.version, kind, trust, view) for kind, present in pairs if present)
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{'version':>8s} {'kind':6s} {'base':>6s} {'encoding':8s} {'changed':>9s} {'nnz':>12s} "
        f"{'fraction':>8s} {'bytes':>12s}  status"
    )
    for r in out:
        if r["encoding"] is None:  # unreadable: nothing but its key is known
            dashes = f"{'-':>6s} {'-':8s} {'-':>9s} {'-':>12s} {'-':>8s} {'-':>12s}"
            print(f"{r['version']:8d} {r['kind']:6s} {dashes}  {r['status']}")
            continue
        base = "-" if r["base_version"] is None else str(r["base_version"])
        print(
            f"{r['version']:8d} {r['kind']:6s} {base:>6s} {r['encoding']:8s} "
            f"{r['tensors_changed']:4d}/{r['tensors']:<4d} {r['nnz']:12d} "
            f"{r['changed_fraction']:8.3%} {r['bytes']:12d}  {r['status']}"
        )
    try:
        run, pinned_by = view.resolve()
    except ForeignObject as exc:
        run, pinned_by = None, str(exc)
    pinned = f"run {run} ({pinned_by})" if run else f"no run pinned ({pinned_by or 'no run.json, no --run-id'})"
    print(f"{len(out)} objects in {store.uri}; {pinned}")
    refused = [r for r in out if r["status"] != "ok"]
    if refused:
        print(
            f"{len(refused)} objects are not this run's own registered writes, or cannot be read (FOREIGN, FENCED, "
            "UNSIGNED, UNPINNED or UNREADABLE): readers refuse them",
            file=sys.stderr,
        )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.target)
    shards: list[tuple[bytes, str]] = []
    if args.version is None:
        if not path.is_file():
            raise ObjectNotFound(f"{args.target}: no such shard file (to inspect a store, pass --version N)")
        shards.append((path.read_bytes(), str(path)))
    else:
        store = open_store(args.target, s3_endpoint=args.s3_endpoint)
        kind: Kind = "anchor" if args.anchor else "delta"
        manifest = read_manifest(store, args.version, kind)
        prefix = object_prefix(args.version, kind)
        shards.extend(
            (store.get(prefix + s.file, max_bytes=s.bytes), f"{store.uri}/{prefix}{s.file}") for s in manifest.shards
        )
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
    store = open_store(args.store, s3_endpoint=args.s3_endpoint)
    verify_key = VerifyKey.from_file(args.public_key) if args.public_key else None
    client = open_coordinator(args, "DELTASYNC_TOKEN", retries=3) if args.coordinator else None
    ledger = None if client is None else client.registered_digest
    trust = Trust(verify_key=verify_key, ledger=ledger, run_id=args.run_id)
    try:
        chain = read_chain(store, args.version, trust=trust)
        weights = read_weights(store, args.version, trust=trust, verify=True)
        apply.verify(weights, chain[-1])
    finally:
        if client is not None:
            client.close()
    checks = ["all checksums match"]
    if verify_key is not None:
        checks.append(f"every manifest signed by {verify_key.key_id[:19]}...")
    if client is not None:
        checks.append(f"every manifest registered with {args.coordinator}")
    if chain[-1].run_id is not None and (args.run_id or (verify_key is not None and client is None)):
        checks.append(f"every manifest of run {chain[-1].run_id}")
    result = {
        "version": args.version,
        "ok": True,
        "anchor": chain[0].version,
        "deltas": [m.version for m in chain[1:]],
        "tensors": len(weights),
        "elements": sum(t.numel() for t in weights.values()),
        "signed": verify_key is not None,
        "ledger": client is not None,
        "run_id": chain[-1].run_id,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"v{args.version}: ok, {result['tensors']} tensors ({result['elements']} elements) "
            f"rebuilt from anchor v{result['anchor']} + {len(result['deltas'])} deltas, {', '.join(checks)}"
        )
        if verify_key is None and client is None:
            print(
                "note: without --public-key or --coordinator this proves the store is consistent, not that the "
                "publisher wrote it",
                file=sys.stderr,
            )
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    with open_coordinator(args, "DELTASYNC_PUBLISHER_TOKEN", retries=3) as client:
        report = client.collect_garbage(dry_run=args.dry_run)
    out = {
        "dry_run": args.dry_run,
        "kept_anchor": report.kept_anchor,
        "keep_from": report.keep_from,
        "candidates": [[v.version, v.kind] for v in report.candidates],
        "deleted": [[v.version, v.kind] for v in report.deleted],
        "problems": list(report.problems),
        "leftovers": list(report.leftovers),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    objects = report.candidates if args.dry_run else report.deleted
    print(f"kept anchor: {report.kept_anchor}; deltas above {report.keep_from} kept")
    for v in objects:
        print(f"{verb} {v.kind} v{v.version} ({v.bytes} bytes)")
    for prefix in report.leftovers:
        print(f"{verb} {prefix} (never registered)")
    for problem in report.problems:
        print(f"problem: {problem}")
    print(f"{len(objects) + len(report.leftovers)} objects {verb}")
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    try:
        key = generate_key_files(args.path)
    except FileExistsError as exc:
        raise FileExistsError(
            f"{exc.filename} exists: keygen never replaces a key (a published run's readers trust it); remove it "
            "first if it is really unused, or give another path"
        ) from exc
    print(f"wrote {args.path} (private, mode 0600) and {args.path}.pub (public); key id {key.key_id}")
    return 0


def _cmd_token(args: argparse.Namespace) -> int:
    from .tokens import make_agent_token

    secret = os.environ.get("DELTASYNC_AGENT_SECRET")
    if not secret:
        raise SystemExit("deltasync token: set DELTASYNC_AGENT_SECRET (the coordinator's agent secret)")
    print(make_agent_token(secret, args.agent_id))
    return 0


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="deltasync",
        description="Bit-exact sparse weight sync for asynchronous RL: list, inspect and verify the versions a "
        "publisher wrote to a store; run the coordinator or an engine's agent; collect garbage; make signing keys "
        "and agent tokens. Each command's --help says more.",
    )
    parser.add_argument("--version", action="version", version=f"deltasync {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list the committed versions of a store")
    ls.add_argument("store", help="store URI or path")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--public-key", help="mark manifests not signed by this Ed25519 public key (PEM)")
    ls.add_argument(
        "--run-id",
        help="mark objects of any other run (default: the run the store's run.json names; with --public-key, a "
        "run.json the key did not sign is ignored for the one run the key's signed objects name)",
    )
    add_s3_endpoint(ls)
    ls.set_defaults(func=_cmd_ls)
    inspect = sub.add_parser("inspect", help="tensors, nnz, density and bytes of a shard file or a store version")
    inspect.add_argument("target", help="a shard file, or a store URI with --version")
    inspect.add_argument("--version", type=int, help="version to inspect in a store")
    inspect.add_argument("--anchor", action="store_true", help="inspect the version's anchor, not its delta")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    add_s3_endpoint(inspect)
    inspect.set_defaults(func=_cmd_inspect)
    verify = sub.add_parser("verify", help="rebuild a version and check every checksum (and its authenticity)")
    verify.add_argument("store", help="store URI or path")
    verify.add_argument("--version", type=int, required=True, help="version to rebuild")
    verify.add_argument("--public-key", help="refuse manifests not signed by this Ed25519 public key (PEM)")
    verify.add_argument(
        "--run-id",
        help="refuse objects of any other run; the store's run.json is then never relied on (with --public-key "
        "alone: the run the store's signed run.json names, else the one run the key's signed objects name)",
    )
    add_coordinator_flags(
        verify,
        "refuse manifests whose sha256 is not the one registered there (token: DELTASYNC_TOKEN); several "
        "replicas of one ledger: URL1,URL2",
    )
    verify.add_argument("--json", action="store_true", help="print JSON")
    add_s3_endpoint(verify)
    verify.set_defaults(func=_cmd_verify)
    gc = sub.add_parser("gc", help="garbage collection through the coordinator (token: DELTASYNC_PUBLISHER_TOKEN)")
    add_coordinator_flags(
        gc,
        "the coordinator's URL, or several replicas of one ledger: URL1,URL2 (token: DELTASYNC_PUBLISHER_TOKEN)",
        required=True,
    )
    gc.add_argument("--dry-run", action="store_true", help="prove the kept anchor and list what would go")
    gc.add_argument("--json", action="store_true", help="print JSON")
    gc.set_defaults(func=_cmd_gc)
    keygen = sub.add_parser("keygen", help="make an Ed25519 key pair to sign manifests (PATH and PATH.pub)")
    keygen.add_argument("path", help="the private key file to create")
    keygen.set_defaults(func=_cmd_keygen)
    token = sub.add_parser("token", help="print an agent's token (needs DELTASYNC_AGENT_SECRET)")
    token.add_argument("--agent-id", required=True, help="the agent id the token is bound to")
    token.set_defaults(func=_cmd_token)
    add_coordinator_parser(sub)
    add_agent_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI. Exit codes: 0 ok, 1 a deltasync error, 2 a usage error."""
    parser = _parser()
    args = parser.parse_args(argv)
    quiet = args.command in ("ls", "inspect", "verify", "gc", "keygen", "token")
    setup_logging(logging.DEBUG if args.debug else logging.WARNING if quiet else logging.INFO)
    try:
        return int(args.func(args))
    except (DeltaSyncError, OSError) as exc:  # OSError: a file outside a store (keygen's key, a backup's target)
        if args.debug:
            traceback.print_exc()
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # bad arguments the parser cannot see (store URI, version range)
        print(f"deltasync: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
