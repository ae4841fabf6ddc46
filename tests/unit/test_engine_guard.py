"""The engine guard over vLLM's own app: every route the pinned vLLM registers, enumerated from its
source (``build_app``), with and without dev mode, runtime LoRA and the profiler, is either on the inference
surface or refused without the engine credential."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from deltasync.engine_credential import ENGINE_TOKEN_HEADER, load_engine_token
from deltasync.vllm.guard import LOG_BURST, LOG_WINDOW_S, EngineGuard, is_inference_route

pytestmark = pytest.mark.vllm  # imports vLLM (no engine is started)

TOKEN = "engine-credential-for-the-tests"
MUST_BE_GUARDED = {
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/start_weight_update"),
    ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"),
    ("POST", "/update_weight_version"),
    ("POST", "/collective_rpc"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/scale_elastic_ep"),
}


def _app(monkeypatch: pytest.MonkeyPatch, *, dev: bool, extra: list[str] | None = None) -> Any:
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setenv("VLLM_PLUGINS", "deltasync")
    monkeypatch.setenv("DELTASYNC_ENGINE_TOKEN", TOKEN)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1" if dev else "0")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", "--enable-scale-out", *(extra or [])])
    return build_app(args, ("generate",), None)


def _routes(app: Any) -> Iterator[tuple[str, str]]:
    for route in app.routes:
        path = getattr(route, "path", "")
        for method in sorted(getattr(route, "methods", None) or {"GET", "POST"}):
            yield method, path.replace("{response_id}", "resp-1")


@pytest.mark.parametrize("dev", [False, True], ids=["plain", "dev-mode"])
def test_every_route_of_vllm_is_inference_or_needs_the_credential(monkeypatch: pytest.MonkeyPatch, dev: bool) -> None:
    from starlette.testclient import TestClient

    app = _app(monkeypatch, dev=dev)
    routes = set(_routes(app))
    assert MUST_BE_GUARDED <= routes  # the plugin attaches the agent's routes without dev mode
    guarded = {r for r in routes if not is_inference_route(*r)}
    assert MUST_BE_GUARDED <= guarded and ("POST", "/v1/load_lora_adapter") in guarded
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: no engine behind it
    if True:
        for method, path in sorted(guarded):
            bare = client.request(method, path, json={})
            assert bare.status_code == 401, (method, path, bare.status_code)
            if method != "HEAD":
                assert bare.json()["error"].startswith(f"deltasync: {method} {path} is not an inference route")
            wrong = client.request(method, path, json={}, headers={ENGINE_TOKEN_HEADER: "x" * 20})
            assert wrong.status_code == 403, (method, path)
            right = client.request(method, path, json={}, headers={ENGINE_TOKEN_HEADER: TOKEN})
            assert right.status_code not in (401, 403), (method, path)  # the handler runs (no engine here)
        for method, path in sorted(routes - guarded):
            assert client.request(method, path, json={}).status_code not in (401, 403), (method, path)
        assert client.get("/deltasync/guard").json() == {"guard": "deltasync", "credential_configured": True}
        if not dev:  # the plugin's routes keep vLLM's schema building (vLLM's own dev routes break it)
            assert client.get("/openapi.json").status_code == 200
        for path in ("/collective_rpc", "/sleep", "/v1/load_lora_adapter", "/pause/"):  # no route map by OPTIONS
            assert client.options(path).status_code == 401, path
        assert client.options("/v1/completions").status_code != 401  # CORS preflight where vLLM serves inference


def test_inference_keeps_vllms_own_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette.testclient import TestClient

    app = _app(monkeypatch, dev=False, extra=["--api-key", "inference-key"])
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: no engine behind it
    if True:
        assert client.post("/v1/completions", json={}).status_code == 401  # vLLM's, not ours
        assert (
            client.post("/v1/completions", json={}, headers={"Authorization": "Bearer inference-key"}).status_code
            != 401
        )
        # the engine credential is no API key, and the API key is no engine credential
        assert client.post("/pause", headers={"Authorization": "Bearer inference-key"}).status_code == 401


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_server_without_a_credential_refuses_every_administrative_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: a refusal's log line cannot be forged through the path (``%0a``, ``%00``)."""
    from starlette.testclient import TestClient

    monkeypatch.delenv("DELTASYNC_ENGINE_TOKEN", raising=False)
    monkeypatch.delenv("DELTASYNC_ENGINE_TOKEN_FILE", raising=False)
    guard = EngineGuard(_ok)
    client = TestClient(guard)
    if True:
        r = client.post("/pause", headers={ENGINE_TOKEN_HEADER: "anything-at-all-here"})
        assert r.status_code == 403 and "no engine credential configured" in r.json()["error"]
        assert client.post("/v1/completions").status_code == 200
    assert guard.refused == 1
    records: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Catch()
    log = logging.getLogger("vllm.deltasync.guard")
    log.addHandler(handler)
    disabled, level = log.disabled, log.level
    log.disabled = False  # vLLM's logging config (an earlier test imported vLLM) may disable or quiet it
    log.setLevel(logging.WARNING)
    try:
        client.post("/x%0a(APIServer%20pid=1)%20INFO%20FORGED%00")
    finally:
        log.removeHandler(handler)
        log.disabled = disabled
        log.setLevel(level)
    assert records and "\n" not in records[0] and "\x00" not in records[0] and "\\n(APIServer" in records[0]
    records.clear()  # a flood of refusals costs at most LOG_BURST lines a window; the rest are counted
    log.addHandler(handler)
    log.disabled = False
    log.setLevel(logging.WARNING)
    try:
        guard._window_start = -LOG_WINDOW_S  # a fresh window
        for _ in range(LOG_BURST + 5):
            client.post("/pause")
        guard._window_start = -LOG_WINDOW_S  # the window is over: the next line says how many were not logged
        client.post("/pause")
    finally:
        log.removeHandler(handler)
        log.disabled = disabled
        log.setLevel(level)
    assert len(records) == LOG_BURST + 1 and records[-1].endswith("; 5 more refusals not logged")


def test_the_credential_comes_from_the_environment_or_a_file(tmp_path: Any) -> None:
    f = tmp_path / "engine.token"
    f.write_text(TOKEN + "\n")
    assert load_engine_token({"DELTASYNC_ENGINE_TOKEN_FILE": str(f)}) == TOKEN
    assert load_engine_token({"DELTASYNC_ENGINE_TOKEN": TOKEN}) == TOKEN
    with pytest.raises(ValueError, match="at least 16 are needed"):
        load_engine_token({"DELTASYNC_ENGINE_TOKEN": "short"})
    with pytest.raises(ValueError, match="not both"):
        load_engine_token({"DELTASYNC_ENGINE_TOKEN": TOKEN, "DELTASYNC_ENGINE_TOKEN_FILE": str(f)})
    with pytest.raises(ValueError, match="cannot read the engine credential"):
        load_engine_token({"DELTASYNC_ENGINE_TOKEN_FILE": str(tmp_path / "missing")})
