"""The long-running commands of the CLI: ``deltasync coordinator`` (and ``coordinator backup``) and
``deltasync agent``. Every flag maps to a field of the coordinator's ``Settings`` or of :class:`AgentConfig`;
secrets come only from the environment."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import resource
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import CoordinatorClient

__all__ = ["add_agent_parser", "add_coordinator_flags", "add_coordinator_parser", "add_s3_endpoint", "open_coordinator"]

logger = logging.getLogger("deltasync.cli")


def _raise_nofile() -> int:
    """Every connection (a long-poll's too) holds an open file: raise the soft limit on open files to the hard
    one (the coordinator's connection caps stay below it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def add_s3_endpoint(parser: Any) -> None:
    """``--s3-endpoint``, for every command that opens a store."""
    parser.add_argument(
        "--s3-endpoint",
        help="endpoint of an S3-compatible service (MinIO, R2, ...) for an s3:// store "
        "(default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS)",
    )


def add_coordinator_flags(parser: Any, coordinator_help: str, *, required: bool = False) -> None:
    """``--coordinator`` (``coordinator_help``), ``--ca-bundle`` and ``--insecure-http``: how a command reaches the
    coordinator (:func:`open_coordinator`), the same for every command that does."""
    parser.add_argument("--coordinator", required=required, help=coordinator_help)
    parser.add_argument("--ca-bundle", help="CA certificates (PEM) for an https coordinator")
    parser.add_argument(
        "--insecure-http",
        action="store_true",
        default=None,
        help="send the token to a plain http:// coordinator on another host, in clear (default: refused)",
    )


def open_coordinator(args: argparse.Namespace, token_env: str, retries: int | None = None) -> CoordinatorClient:
    """The client of :func:`add_coordinator_flags`' flags, with the token from the environment variable
    ``token_env`` (``retries``: rounds after the first, default the client's)."""
    from .client import CoordinatorClient, RetryPolicy

    return CoordinatorClient(
        args.coordinator,
        token=os.environ.get(token_env),
        ca_bundle=args.ca_bundle,
        insecure_http=bool(args.insecure_http),
        retry=RetryPolicy() if retries is None else RetryPolicy(retries=retries),
    )


def password_in_url(url: str | None) -> bool:
    """Whether a database URL carries a password (``scheme://user:password@host``)."""
    if not url or "://" not in url:
        return False
    authority = url.split("://", 1)[1].split("/", 1)[0]
    return "@" in authority and ":" in authority.rsplit("@", 1)[0]


def _cmd_coordinator(args: argparse.Namespace) -> int:
    if password_in_url(getattr(args, "db", None)):
        logger.warning(
            "the database password is on the command line (--db), where every local user can read it in "
            "/proc/PID/cmdline: set DELTASYNC_DB in the environment instead, or keep the password in PGPASSWORD "
            "or ~/.pgpass"
        )
    try:
        from deltasync_coordinator.app import create_app
        from deltasync_coordinator.http import run, serve_options
        from deltasync_coordinator.ledger import Busy, DamagedLedger, LedgerLocked
        from deltasync_coordinator.settings import InsecureConfiguration, Settings
    except ImportError as exc:
        raise SystemExit(
            f"deltasync coordinator needs the service extra: pip install 'deltasync[service]' ({exc})"
        ) from None
    from pydantic import ValidationError

    flags = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    try:
        settings = Settings(**flags)
        _raise_nofile()  # before create_app, which fits the connection caps below the limit
        app = create_app(settings)
    except (InsecureConfiguration, LedgerLocked, DamagedLedger, Busy, ImportError) as exc:
        print(f"deltasync coordinator: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        print(f"deltasync coordinator: invalid settings: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    if settings.insecure and settings.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("INSECURE on %s: every host that reaches this port controls the ledger", settings.host)
    try:
        options = serve_options(app)  # TLS included: the bounded protocol serves it, never uvicorn's ssl_*
    except OSError as exc:  # ssl.SSLError too
        print(
            f"deltasync coordinator: cannot load --ssl-certfile {settings.ssl_certfile} with --ssl-keyfile "
            f"{settings.ssl_keyfile}: {exc}; give a PEM certificate chain and its private key",
            file=sys.stderr,
        )
        return 1
    run(app, host=settings.host, port=settings.port, log_level="info", timeout_graceful_shutdown=5, **options)
    return 0


def _cmd_backup(args: argparse.Namespace) -> int:
    from deltasync_coordinator.db import backup
    from deltasync_coordinator.ledger import DamagedLedger

    if args.db.startswith(("postgresql://", "postgres://")):
        print(
            "deltasync coordinator backup: copies a SQLite ledger; back up a PostgreSQL ledger with pg_dump "
            "(consistent while coordinators run): pg_dump --format=custom --file=ledger.dump DBNAME",
            file=sys.stderr,
        )
        return 1
    try:
        pages = backup(args.db, args.out)
    except (DamagedLedger, FileExistsError, FileNotFoundError) as exc:
        print(f"deltasync coordinator backup: {exc}", file=sys.stderr)
        return 1
    print(f"backed up {args.db} to {args.out} ({pages} pages), consistent as of now")
    return 0


def add_coordinator_parser(sub: Any) -> None:
    """``deltasync coordinator [backup]``."""
    coord = sub.add_parser(
        "coordinator",
        help="run the coordinator service (credentials only from DELTASYNC_PUBLISHER_TOKEN, DELTASYNC_AGENT_SECRET, "
        "DELTASYNC_READ_TOKEN, DELTASYNC_METRICS_TOKEN)",
    )
    coord.add_argument(
        "--db",
        help="SQLite file (default deltasync-coordinator.db; one coordinator), or a PostgreSQL URL "
        "postgresql://user:password@host:port/dbname (several coordinators; pip install 'deltasync[postgres]')",
    )
    coord.add_argument("--store", help="store URI, needed for garbage collection")
    add_s3_endpoint(coord)
    coord.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    coord.add_argument("--port", type=int, help="port to bind (default 8600)")
    coord.add_argument("--insecure", action="store_true", default=None, help="run without credentials (never shared)")
    coord.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    coord.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    coord.add_argument("--max-wait-s", type=float, help="cap of a long-poll's wait (default 60)")
    coord.add_argument("--max-long-polls", type=int, help="concurrent long-polls; more get 503 (default 512)")
    coord.add_argument("--agent-stale-after-s", type=float, help="an agent not seen this long is stale (default 60)")
    coord.add_argument("--agent-expire-after-s", type=float, help="forget agents silent this long (default 86400)")
    coord.add_argument("--plan-lease-s", type=float, help="GC keeps objects of plans this recent (default 600)")
    coord.add_argument("--db-timeout-s", type=float, help="wait this long for the database, then 503 (default 5)")
    coord.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413 (default 1 MiB)")
    coord.add_argument("--max-header-bytes", type=int, help="larger request headers get 431 (default 64 KiB)")
    coord.add_argument(
        "--max-connections",
        type=int,
        help="open connections; more get 503 (default 4096, lowered to the open-files limit less 64)",
    )
    coord.add_argument(
        "--max-connections-per-peer",
        type=int,
        help="open connections from one client address (a proxy or NAT is one); more get 503 (default 1024)",
    )
    coord.add_argument(
        "--request-head-timeout-s", type=float, help="a request head not received in time gets 408 (default 10)"
    )
    coord.add_argument(
        "--request-body-timeout-s",
        type=float,
        help="a request body not received this long after its head gets 408 (default 30)",
    )
    coord.add_argument(
        "--response-write-timeout-s",
        type=float,
        help="close a connection whose unsent answer has not shrunk for this long: its client reads none of it "
        "(default 30)",
    )
    coord.add_argument(
        "--keep-alive-timeout-s", type=float, help="close kept-alive connections idle this long (default 5)"
    )
    coord.add_argument(
        "--tls-handshake-timeout-s",
        type=float,
        help="with --ssl-certfile: close connections whose TLS handshake is not done this long after they opened "
        "(default 5)",
    )
    coord.add_argument(
        "--trusted-proxies",
        help="comma-separated addresses or networks of reverse proxies whose X-Forwarded-For is believed (only the "
        "hop before them is used; default none: clients are logged by their socket's address)",
    )
    coord.set_defaults(func=_cmd_coordinator)
    tools = coord.add_subparsers(dest="tool")
    backup = tools.add_parser("backup", help="a consistent online copy of a (running) coordinator's ledger")
    backup.add_argument("--db", required=True, help="the SQLite ledger to back up (PostgreSQL: use pg_dump)")
    backup.add_argument("--out", required=True, help="the backup file to create (never overwritten)")
    backup.set_defaults(func=_cmd_backup)


def _cmd_agent(args: argparse.Namespace) -> int:
    from .agent import Agent
    from .config import AgentConfig
    from .store import open_store
    from .targets import HttpVllmTarget

    fields = {f.name for f in dataclasses.fields(AgentConfig)}
    config = AgentConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    if config.allow_rollback:
        logger.warning(
            "agent %s: --allow-rollback: the engine may go back to a lower version or another run", config.agent_id
        )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    target = HttpVllmTarget(args.vllm_url, pause_mode=config.pause_mode)
    with open_coordinator(args, "DELTASYNC_AGENT_TOKEN") as coordinator:
        agent = Agent(
            store=open_store(args.store, s3_endpoint=args.s3_endpoint),
            coordinator=coordinator,
            target=target,
            config=config,
        )
        logger.info("agent %s: %s -> %s", config.agent_id, args.store, args.vllm_url)
        try:
            agent.run(stop)
        finally:
            target.close()
    return 0


def add_agent_parser(sub: Any) -> None:
    """``deltasync agent``."""
    agent = sub.add_parser(
        "agent",
        help="keep a vLLM server at the latest version (a sidecar; its own token comes from DELTASYNC_AGENT_TOKEN)",
    )
    agent.add_argument(
        "--vllm-url",
        required=True,
        help="the vLLM server (started with VLLM_PLUGINS=deltasync); the engine credential comes from "
        "DELTASYNC_ENGINE_TOKEN or DELTASYNC_ENGINE_TOKEN_FILE",
    )
    add_coordinator_flags(
        agent,
        "the coordinator's URL (https:// with --ca-bundle), or several replicas of one ledger: URL1,URL2 "
        "(sticky, failing over in order); token: DELTASYNC_AGENT_TOKEN",
        required=True,
    )
    agent.add_argument("--store", required=True, help="store URI or path")
    add_s3_endpoint(agent)
    agent.add_argument("--agent-id", help="name shown by the coordinator, bound to its token (default agent-0)")
    agent.add_argument("--poll-wait-s", type=float, help="long-poll wait (default 30)")
    agent.add_argument("--max-lag", type=int, help="stop serving while more than N versions behind")
    agent.add_argument(
        "--audit-interval-s",
        type=float,
        help="prove the engine's whole served state at least this often (default 60); drift unlabels it and an "
        "anchor restores it",
    )
    agent.add_argument(
        "--audit-stall-s",
        type=float,
        help="hold the engine's workers at most about this long per call of that proof (default 0.05): the state is "
        "proven in windows, vLLM serves between them; 0: the whole state in one call",
    )
    agent.add_argument("--staging-dir", help="where shards are cached and staged (default: a temporary dir)")
    agent.add_argument("--fetch-workers", type=int, help="shards fetched in parallel (default 4)")
    agent.add_argument("--retries", type=int, help="retries of a fetch or checksum mismatch (default 5)")
    agent.add_argument("--backoff-s", type=float, help="first backoff, doubling (default 0.5)")
    agent.add_argument("--assume-version", type=int, help="the server was started from this version's weights")
    agent.add_argument("--pause-mode", choices=["keep", "wait", "abort"], help="vLLM /pause mode (default keep)")
    agent.add_argument("--tp-size", type=int, help="the server's tensor-parallel size (default 1)")
    agent.add_argument(
        "--apply-mode",
        choices=["auto", "inplace", "patches", "reload", "lora"],
        help="how the engine applies updates (default auto: inplace where parameters are plain, else reload; lora: "
        "the run publishes a LoRA adapter, served from --adapter-dir)",
    )
    agent.add_argument(
        "--adapter-dir", help="apply mode lora: the absolute directory the adapter is served from (its lora_path)"
    )
    agent.add_argument(
        "--allow-rollback",
        action="store_true",
        default=None,
        help="let the engine go below the highest version it served, or to another run (logged)",
    )
    agent.add_argument("--public-key", help="refuse manifests not signed by this Ed25519 public key (PEM)")
    agent.add_argument(
        "--integrity-fallback-after", type=int, help="anchor route after this many integrity failures (default 3)"
    )
    agent.set_defaults(func=_cmd_agent)
