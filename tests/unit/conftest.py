"""Unit-test fixtures: a coordinator app over httpx.ASGITransport; moto's S3 server on 127.0.0.1."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from deltasync.store.s3 import S3Store, S3Transfer
from deltasync.testing.s3 import CREDENTIALS_ENV, MotoServer
from tests.support.asgi import Coordinator, make_settings, open_coordinator
from tests.support.s3 import ENDPOINT_ENV

S3_BUCKET = "deltasync-test"


@pytest.fixture
async def sqlite_coord(tmp_path: Path) -> AsyncIterator[Coordinator]:
    """A coordinator app on a SQLite file (for the cases about the file itself)."""
    app, http = await open_coordinator(make_settings(tmp_path))
    async with http:
        yield Coordinator(app, http)
    app.state.db.close()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """moto's S3 server on 127.0.0.1 (one process for the session) with a bucket ``deltasync-test``."""
    with MotoServer(log=tmp_path_factory.mktemp("moto") / "moto.log") as server:
        server.create_bucket(S3_BUCKET)
        yield server


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto's credentials in the environment, and no endpoint or region from the caller's."""
    for name in ENDPOINT_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in CREDENTIALS_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def s3_store(moto_server: MotoServer, s3_env: None) -> S3Store:
    """An S3Store under a fresh prefix of the session's bucket, straight to moto."""
    return S3Store(
        S3_BUCKET, f"t-{uuid.uuid4().hex[:12]}", endpoint=moto_server.url, transfer=S3Transfer(backoff_s=0.001)
    )


@pytest.fixture
async def coord(tmp_path: Path, ledger_db: Path | str) -> AsyncIterator[Coordinator]:
    """A coordinator app on each backend (SQLite, then PostgreSQL)."""
    app, http = await open_coordinator(make_settings(tmp_path, db=ledger_db))
    async with http:
        yield Coordinator(app, http)
    app.state.db.close()


@pytest.fixture(params=["int32", "int16-halves", "int16-halves-short"])
def probe_passes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A patch map test three times: its groups probed in one int32 pass, and in two int16 halves (what a group
    with a large tensor, an embedding, gets: ``deltasync.vllm.patch_map.SPLIT_AT``), with the halves' period
    as it is (a small tensor's high half is all ones) and cut to 61 (both halves vary; a group with a tensor of
    more than 61 * 61 elements is then probed in int32)."""
    from deltasync.vllm.patch_map import scan

    monkeypatch.setattr(scan, "SPLIT_AT", 1 << 62 if request.param == "int32" else 0)
    if request.param == "int16-halves-short":
        monkeypatch.setattr(scan, "PERIOD", 61)
    return str(request.param)


@pytest.fixture(params=["numba", "numpy"])
def kernel_modes(request: pytest.FixtureRequest) -> Iterator[str]:
    """A codec or sketch test twice: with deltasync's compiled loops (numba, which vLLM installs) and with the
    numpy code they replace (an engine's ``DELTASYNC_KERNELS=numpy``, what a host without numba runs)."""
    from deltasync import _kernels

    _kernels.use_compiled(request.param == "numba")
    if request.param == "numba" and _kernels.kernels() is None:
        pytest.fail("numba is not importable here, so the compiled loops go untested: `make venv` installs it")
    yield str(request.param)
    _kernels.use_compiled(True)
