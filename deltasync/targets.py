"""The vLLM engines an agent drives: an offline ``vllm.LLM`` in this process, or a vLLM server over HTTP.

Both speak vLLM's weight-transfer lifecycle with the ``deltasync`` backend: start_weight_update ->
update_weights (one per object) -> finish_weight_update(weight_version) -> reset the prefix cache. The
engine's own version (reported by every rank through the ``deltasync_status`` worker RPC) is the truth;
vLLM's ``weight_version`` is the label served to clients, and :meth:`EngineTarget.recover` keeps them equal.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol, runtime_checkable

import httpx

from .errors import ApplyError, VersionGapError

__all__ = ["EngineTarget", "HttpVllmTarget", "OfflineLLMTarget", "parse_weight_version"]

logger = logging.getLogger(__name__)

_REFUSED = "refused: this engine holds"


def parse_weight_version(raw: object) -> int | None:
    """vLLM's ``weight_version`` string as a deltasync version (``None`` for 'default' or unknown)."""
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and raw.isdigit():
        return int(raw)
    return None


def _translate(exc: BaseException, what: str) -> Exception:
    text = str(exc)
    if _REFUSED in text:
        return VersionGapError(f"{what}: the engine refused the update ({text[:400]})")
    return ApplyError(f"{what}: {text[:800]}")


@runtime_checkable
class EngineTarget(Protocol):
    """What an agent needs from an engine."""

    def weight_version(self) -> int | None:
        """vLLM's served ``weight_version`` (``None``: 'default' or not a deltasync version)."""
        ...

    def engine_version(self) -> int | None:
        """The version every rank's deltasync engine holds (``None``: unknown, disagreeing or unhealthy)."""
        ...

    def status(self) -> list[dict[str, Any]] | None:
        """Each rank's ``deltasync_status`` (``None`` without the worker extension)."""
        ...

    def init(self, *, base_version: int | None) -> None:
        """Tell the engine which version it holds (``None``: unknown)."""
        ...

    def recover(self) -> None:
        """After an agent restart: serve again, close a dangling update session, and make
        ``weight_version`` say what the engine really holds."""
        ...

    def pause(self) -> None:
        """Stop serving (in-flight requests are kept, waited for or aborted, per the target)."""
        ...

    def resume(self) -> None:
        """Serve again."""
        ...

    def apply(self, updates: list[dict[str, Any]], *, weight_version: int) -> None:
        """One update session: every ``update_info``, finish with ``weight_version``, reset the prefix cache.

        Raises:
            VersionGapError: the engine refused a base (nothing was written).
            ApplyError: anything else.
        """
        ...


class _Target:
    """The version logic shared by both targets, over a few primitives."""

    def weight_version(self) -> int | None:
        raise NotImplementedError

    def status(self) -> list[dict[str, Any]] | None:
        raise NotImplementedError

    def _set_weight_version(self, version: int) -> None:
        raise NotImplementedError

    def _finish_dangling(self) -> bool:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def engine_version(self) -> int | None:
        ranks = self.status()
        if ranks is None:
            return self.weight_version()
        versions = {r.get("version") for r in ranks}
        if len(versions) != 1 or not all(r.get("healthy", False) for r in ranks):
            return None
        version = versions.pop()
        return version if isinstance(version, int) else None

    def recover(self) -> None:
        self.resume()
        ranks = self.status() or []
        # finish only a session that is open: a failing finish would raise in the workers, which with TP > 1
        # desyncs vLLM's executor (vLLM issue 49972)
        if any(r.get("session_active") for r in ranks) and self._finish_dangling():
            logger.warning("closed an update session an earlier agent left open")
        real = self.engine_version()
        if real is not None and self.weight_version() != real:
            logger.warning("weight_version said %s, the engine holds v%d: relabelled", self.weight_version(), real)
            self._set_weight_version(real)


class OfflineLLMTarget(_Target):
    """An offline ``vllm.LLM`` started with ``weight_transfer_config={"backend": "deltasync"}`` (and, for
    status checks, ``worker_extension_cls="deltasync.vllm.worker_ext.DeltaSyncWorkerExtension"``).

    Offline generation runs in the caller's thread, so ``pause``/``resume`` are no-ops: call the agent's
    ``sync()`` between ``generate`` calls, never concurrently with them.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def weight_version(self) -> int | None:
        return parse_weight_version(self.llm.get_weight_version())

    def status(self) -> list[dict[str, Any]] | None:
        try:
            ranks: list[dict[str, Any]] = self.llm.collective_rpc("deltasync_status")
        except Exception:  # no worker extension: status is optional
            return None
        return ranks

    def _set_weight_version(self, version: int) -> None:
        self.llm.update_weight_version(str(version))

    def _finish_dangling(self) -> bool:
        return False  # offline calls are synchronous: no session outlives an agent

    def init(self, *, base_version: int | None) -> None:
        self.llm.init_weight_transfer_engine({"init_info": {"base_version": base_version}})
        if base_version is not None:
            self._set_weight_version(base_version)

    def pause(self) -> None:
        """Nothing to do offline."""

    def resume(self) -> None:
        """Nothing to do offline."""

    def apply(self, updates: list[dict[str, Any]], *, weight_version: int) -> None:
        try:
            self.llm.start_weight_update()
            for info in updates:
                self.llm.update_weights({"update_info": info})
            self.llm.finish_weight_update(str(weight_version))
        except Exception as exc:  # vLLM wraps worker errors in a plain Exception
            raise _translate(exc, f"applying v{weight_version}") from exc
        self.llm.reset_prefix_cache()


class HttpVllmTarget(_Target):
    """A vLLM server started with ``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config
    '{"backend":"deltasync"}'`` and ``--worker-extension-cls deltasync.vllm.worker_ext.DeltaSyncWorkerExtension``.
    Keep that port private: dev mode also exposes administrative routes.

    A failed RL route answers 500 and drops the keep-alive connection, so every call uses a fresh one.
    """

    def __init__(self, url: str, *, pause_mode: Literal["keep", "wait", "abort"] = "keep", timeout_s: float = 600):
        self.url = url.rstrip("/")
        self.pause_mode = pause_mode
        self._http = httpx.Client(
            base_url=self.url,
            timeout=timeout_s,
            headers={"Connection": "close"},
            transport=httpx.HTTPTransport(retries=3),
        )

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.post(path, **kwargs)
        if response.status_code >= 400:
            raise ApplyError(f"POST {self.url}{path}: {response.status_code} {response.text[:800]}")
        return response

    def weight_version(self) -> int | None:
        response = self._http.get("/weight_info")
        if response.status_code >= 400:
            raise ApplyError(f"GET {self.url}/weight_info: {response.status_code} {response.text[:300]}")
        return parse_weight_version(response.json().get("weight_version"))

    def status(self) -> list[dict[str, Any]] | None:
        response = self._http.post("/collective_rpc", json={"method": "deltasync_status"})
        if response.status_code >= 400:
            return None
        ranks: list[dict[str, Any]] = response.json().get("results", [])
        return ranks

    def _set_weight_version(self, version: int) -> None:
        self._post("/update_weight_version", json={"new_version": str(version)})

    def _finish_dangling(self) -> bool:
        return self._http.post("/finish_weight_update", json={}).status_code < 400

    def init(self, *, base_version: int | None) -> None:
        self._post("/init_weight_transfer_engine", json={"init_info": {"base_version": base_version}})
        if base_version is not None:
            self._set_weight_version(base_version)

    def pause(self) -> None:
        self._post("/pause", params={"mode": self.pause_mode})

    def resume(self) -> None:
        self._post("/resume")

    def apply(self, updates: list[dict[str, Any]], *, weight_version: int) -> None:
        try:
            self._post("/start_weight_update")
            for info in updates:
                self._post("/update_weights", json={"update_info": info})
            self._post("/finish_weight_update", json={"weight_version": str(weight_version)})
        except ApplyError as exc:
            raise _translate(exc, f"applying v{weight_version}") from exc
        self._post("/reset_prefix_cache")
