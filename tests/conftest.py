"""Shared fixtures: seeded bf16 state dicts, the tiny model, local stores, credentials, a coordinator app."""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync.signing import VerifyKey, generate_key_files
from deltasync.store import LocalStore
from deltasync.testing.credentials import (  # noqa: F401 - re-exported for the tests
    AGENT_SECRET,
    AGENT_TOKEN,
    PUBLISHER_TOKEN,
    TOKENS_ENV,
    agent_env,
    agent_token,
)
from deltasync.testing.models import TINY_QWEN3_CONFIG, build_tiny_model, qwen3_shapes
from deltasync.testing.postgres import URL_ENV, PostgresServer
from deltasync.testing.stream import UpdateStream

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SMALL_QWEN3 = {**TINY_QWEN3_CONFIG, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96}
"""Even smaller shapes for unit tests of the update stream (12 layers' worth of names in 2)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that start vLLM engines first, each file's tests in their order: scripts/test's two workers
    (``--dist loadfile``) take files in this order, so the long files start at once and the many short ones fill in
    at the end, instead of one demo running alone while the other worker idles."""
    engine_files = {item.path for item in items if item.get_closest_marker("vllm")}
    items.sort(key=lambda item: item.path not in engine_files)  # stable: the order within each group is kept


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bit patterns, for bit-exact comparisons."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b) or set(a) == set(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(bits(a[name]), bits(b[name])), f"{name} differs"


def assert_agents_hold(agents: Iterable[Any], version: int, weights: dict[str, torch.Tensor]) -> None:
    """Each agent's in-memory engine is at ``version``, applied no version twice nor out of order, and holds
    ``weights`` bit for bit."""
    for agent in agents:
        assert agent.target.version == version and agent.target.applied == sorted(set(agent.target.applied))
        assert_bit_equal(agent.target.weights, weights)


def overwrite(store: LocalStore, key: str, data: bytes) -> None:
    """What an attacker (or a broken disk) with write access to the store's directory does: replace a file
    behind deltasync's back. deltasync itself never overwrites (writes are create-only)."""
    path = store.root.joinpath(*key.split("/"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".attacker")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def remove(store: LocalStore, key: str) -> None:
    """Delete a file behind deltasync's back."""
    store.root.joinpath(*key.split("/")).unlink()


@pytest.fixture
def tiny_state_dict() -> dict[str, torch.Tensor]:
    """A seeded bf16 state dict with Qwen3 checkpoint names."""
    return UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=0).bf16()


@pytest.fixture
def update_stream() -> UpdateStream:
    """A realistic AdamW update stream over small Qwen3 shapes (lr 1e-6)."""
    return UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random bf16 Qwen3 with a locally trained tokenizer (built once per session)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", seed=0)


@pytest.fixture
def publisher_key(tmp_path: Path) -> tuple[Path, VerifyKey]:
    """A publisher's signing key file (its public half beside it, ``.pub``) and the key that verifies it."""
    path = tmp_path / "publisher.key"
    return path, generate_key_files(path)


@pytest.fixture
def local_store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session: ``DELTASYNC_TEST_POSTGRES_URL``'s, else a throwaway one (initdb
    in a temporary directory, a free 127.0.0.1 port), stopped and removed at the end."""
    server = PostgresServer(os.environ.get(URL_ENV))
    atexit.register(server.close)  # even if the session dies before its fixtures are torn down
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture
def pg_url(postgres: PostgresServer) -> Iterator[str]:
    """An empty PostgreSQL database of one test (emptied afterwards for the next one)."""
    url = postgres.create_database()
    yield url
    postgres.give_back(url)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_db(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """The ledger of a backend-neutral test, once per backend: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "ledger.db"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def version_body(version: int, kind: str = "delta", base: int | None = None, nbytes: int = 100) -> dict:
    """A valid ``POST /v1/versions`` body."""
    import hashlib

    if kind == "delta" and base is None:
        base = version - 1
    prefix = f"v{version:08d}/" + ("anchor/" if kind == "anchor" else "")
    return {
        "version": version,
        "kind": kind,
        "base_version": base if kind == "delta" else None,
        "manifest_key": prefix + "manifest.json",
        "bytes": nbytes,
        "nnz": 10,
        "tensors": 3,
        "checksum": "sha256:" + hashlib.sha256(f"{version}{kind}{nbytes}".encode()).hexdigest(),
    }


def coordinator_settings(tmp: Path, **overrides):
    """Settings of a test coordinator (credentials set) with its ledger under ``tmp``."""
    from deltasync_coordinator.settings import Settings

    values = {
        "db": tmp / "ledger.db",
        "store": str(tmp / "store"),
        "publisher_token": PUBLISHER_TOKEN,
        "agent_secret": AGENT_SECRET,
        **overrides,
    }
    return Settings(**values)


class ServerThread:
    """A real uvicorn server for an ASGI app, on a free 127.0.0.1 port, in a background thread (its lifespan
    runs: the database probe, agent expiry, and on exit the WAL checkpoint and close)."""

    def __init__(self, app, **config) -> None:
        import socket
        import threading

        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        scheme = "https" if "ssl_certfile" in config else "http"
        if hasattr(getattr(app, "state", None), "registry"):  # a coordinator app: serve it as the CLI does
            from deltasync_coordinator.http import serve_options

            config = {**serve_options(app), **config}
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", **config)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        import time

        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
