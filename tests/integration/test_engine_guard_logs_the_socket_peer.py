"""The engine guard's log names each caller by its socket's address, whatever ``X-Forwarded-For`` says.

vLLM serves with uvicorn's ``proxy_headers`` on and builds its ``uvicorn.Config`` without
``forwarded_allow_ips``, so uvicorn believes the header from ``FORWARDED_ALLOW_IPS``, by default 127.0.0.1: a
process on the engine's host could have its refused administrative requests logged under any address. The
``deltasync`` endpoint plugin sets ``FORWARDED_ALLOW_IPS=""`` while ``build_app`` runs it, before vLLM builds the
``Config`` (vllm/entrypoints/launchers: ``build_and_serve`` calls ``build_app``, then ``serve_http`` builds
``uvicorn.Config(app, **uvicorn_kwargs)``).

Without a vLLM engine: the plugin attaches to a FastAPI app (given vLLM's administrative routes, so it imports
none of vLLM's), and the app is served on 127.0.0.1 by a ``uvicorn.Config`` built as vLLM's ``serve_http``
builds it. The attack comes from the network: a refused request with a forged ``X-Forwarded-For``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from deltasync.vllm.endpoints import DeltaSyncEndpoints
from tests.conftest import ServerThread

FORGED = "203.0.113.66"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def guard_log() -> Iterator[list[str]]:
    """The guard's log lines (its logger is under vLLM's, which vLLM may have made not propagate)."""
    handler, guard = _Lines(), logging.getLogger("vllm.deltasync.guard")
    guard.addHandler(handler)
    level, guard.level = guard.level, logging.WARNING
    yield handler.lines
    guard.removeHandler(handler)
    guard.setLevel(level)


def _served_app() -> FastAPI:
    app = FastAPI()
    for path in ("/update_weights", "/collective_rpc", "/reset_prefix_cache"):  # vLLM's, already attached
        app.add_api_route(path, lambda: {}, methods=["POST"])
    DeltaSyncEndpoints().attach_router(app)
    return app


def _refused_from(guard_log: list[str]) -> list[str]:
    app = _served_app()
    with ServerThread(app) as server:  # uvicorn.Config(app, host=..., port=..., ...): no forwarded_allow_ips
        answer = httpx.post(server.url + "/collective_rpc", json={}, headers={"X-Forwarded-For": FORGED}, timeout=10)
    assert answer.status_code == 401, answer.text
    return [line for line in guard_log if 'refused POST "/collective_rpc"' in line]


def test_a_forwarded_for_header_names_nobody_in_the_guards_log(
    monkeypatch: pytest.MonkeyPatch, guard_log: list[str]
) -> None:
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    monkeypatch.setenv("DELTASYNC_ENGINE_TOKEN", "engine-credential-0123456789")
    [line] = _refused_from(guard_log)
    assert 'deltasync guard: refused POST "/collective_rpc" from 127.0.0.1:' in line and FORGED not in line


def test_an_operators_proxy_list_is_kept(monkeypatch: pytest.MonkeyPatch, guard_log: list[str]) -> None:
    """Behind a reverse proxy the operator lists, the hop before it is what the log should name."""
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "127.0.0.1")
    monkeypatch.setenv("DELTASYNC_ENGINE_TOKEN", "engine-credential-0123456789")
    [line] = _refused_from(guard_log)
    assert f'refused POST "/collective_rpc" from {FORGED}:' in line
