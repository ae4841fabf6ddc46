"""The inference-side agent: poll the coordinator, fetch and verify, then patch a running vLLM.

It owns the version state machine of one engine. Everything slow (fetch, checksum, decode, apply to the
agent's host copy, checksum the result, stage raw shards for the engine) happens **before** the engine is
paused; the pause covers only the apply. Wrong weights are never served silently: an engine that fails an
update is reported unhealthy and resynced from an anchor (TP=1) or must be restarted (TP>1, vLLM #49972).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .client import CoordinatorClient, SyncPlan
from .config import AgentConfig
from .errors import ApplyError, CoordinatorError, DeltaSyncError, IntegrityError, StoreError, VersionGapError
from .format import TensorDelta, encode_shard
from .manifest import DeltaManifest, ShardEntry
from .store.base import Store
from .targets import EngineTarget, OfflineLLMTarget
from .versions import apply_object, check_shard, decode_object, manifest_key, object_prefix, read_weights

__all__ = ["Agent", "SyncResult"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyncResult:
    """What one :meth:`Agent.sync` did."""

    from_version: int | None
    """The engine's version before."""
    to_version: int | None
    """The engine's version after."""
    route: str
    """``none``, ``deltas`` or ``anchor``."""
    timings: dict[str, float]
    """Seconds: fetch, decode (incl. checksums), stage, pause (the serving gap), apply."""
    bytes: int
    """Bytes fetched from the store."""


class Agent:
    """Keeps one vLLM engine at the latest published version.

    Args:
        store: where the objects are.
        coordinator: the coordinator (with the agent token).
        target: the engine (see :mod:`deltasync.targets`).
        config: polling, staging, retries, staleness bound.

    Example:
        >>> agent = Agent.for_llm(llm, store=open_store("/data/run1"), coordinator=client)  # doctest: +SKIP
        >>> agent.sync()   # between generate() calls  # doctest: +SKIP

    Thread safety: one thread drives an agent (``sync`` or ``run``).
    """

    def __init__(
        self, *, store: Store, coordinator: CoordinatorClient, target: EngineTarget, config: AgentConfig | None = None
    ) -> None:
        self.store, self.coordinator, self.target = store, coordinator, target
        self.config = config or AgentConfig()
        root = self.config.staging_dir or tempfile.mkdtemp(prefix="deltasync-agent-")
        self.staging = Path(root)
        (self.staging / "cache").mkdir(parents=True, exist_ok=True)
        self.host: dict[str, torch.Tensor] | None = None
        self.host_version: int | None = None
        self.needs_anchor = False
        self._initialized = False
        self._paused_for_lag = False
        self.last_version: int | None = None
        """The engine's version at the end of the last sync."""

    @classmethod
    def for_llm(
        cls, llm: Any, *, store: Store, coordinator: CoordinatorClient, config: AgentConfig | None = None
    ) -> Agent:
        """An agent for an offline ``vllm.LLM`` in this process (call :meth:`sync` between generations)."""
        return cls(store=store, coordinator=coordinator, target=OfflineLLMTarget(llm), config=config)

    # ------------------------------------------------------------------ the state machine

    def engine_version(self) -> int | None:
        """The engine's real version (``None``: unknown, the next sync starts from an anchor)."""
        if not self._initialized:
            self._initialized = True
            self.target.recover()
            if self.config.assume_version is not None and self.target.engine_version() is None:
                self.target.init(base_version=self.config.assume_version)
        self.last_version = None if self.needs_anchor else self.target.engine_version()
        return self.last_version

    def sync(self, wait_s: float = 0.0) -> SyncResult:
        """Bring the engine to the latest version once (waiting up to ``wait_s`` for news).

        Raises:
            ApplyError: the engine failed an update and, with TP > 1, must be restarted.
            DeltaSyncError: fetching or verifying failed after the retries (the engine keeps serving
                its current, verified version).
        """
        engine_v = self.engine_version()
        if wait_s > 0:
            self.coordinator.wait_for_versions(engine_v, wait_s=wait_s)
        plan = self._plan(engine_v)
        if plan is None or plan.route == "none":
            self._heartbeat(engine_v, "paused" if self._paused_for_lag else "idle")
            return SyncResult(from_version=engine_v, to_version=engine_v, route="none", timings={}, bytes=0)
        lag = plan.to_version - (engine_v if engine_v is not None else -1)
        if self.config.max_lag is not None and lag > self.config.max_lag and not self._paused_for_lag:
            logger.warning(
                "agent %s: %d versions behind (max %d): the engine stops serving until caught up",
                self.config.agent_id,
                lag,
                self.config.max_lag,
            )
            self.target.pause()
            self._paused_for_lag = True
        self._heartbeat(engine_v, "fetching")
        timings: dict[str, float] = {}
        updates, objects = self._prepare(plan, timings)
        self._heartbeat(engine_v, "applying")
        self._apply(plan, updates, timings)
        self._cleanup(objects)
        self.last_version = plan.to_version
        self._heartbeat(plan.to_version, "idle", timings=timings)
        logger.info(
            "agent %s: v%s -> v%d (%s, %d objects): pause %.0f ms",
            self.config.agent_id,
            engine_v,
            plan.to_version,
            plan.route,
            len(plan.steps),
            timings.get("pause", 0) * 1e3,
        )
        return SyncResult(
            from_version=engine_v, to_version=plan.to_version, route=plan.route, timings=timings, bytes=plan.bytes
        )

    def run(self, stop: threading.Event | None = None) -> None:
        """Sync forever (until ``stop`` is set), long-polling for news between syncs.

        Transient failures (coordinator, store, a corrupt object) are reported and retried with backoff;
        the engine keeps serving its verified version meanwhile.

        Raises:
            ApplyError: the engine must be restarted (TP > 1).
        """
        stop = stop or threading.Event()
        failures = 0
        while not stop.is_set():
            try:
                self.sync(wait_s=self.config.poll_wait_s)
                failures = 0
            except ApplyError:
                raise
            except (DeltaSyncError, OSError) as exc:  # keep serving the verified version; retry later
                failures += 1
                delay = min(self.config.backoff_s * 2 ** min(failures, 6), 30.0)
                logger.warning(
                    "agent %s: sync failed (%s: %s); retrying in %.1f s",
                    self.config.agent_id,
                    type(exc).__name__,
                    exc,
                    delay,
                )
                self._heartbeat(self.last_version, "error", last_error=f"{type(exc).__name__}: {exc}")
                stop.wait(delay)

    # ------------------------------------------------------------------ steps

    def _plan(self, engine_v: int | None) -> SyncPlan | None:
        if engine_v is not None and self.host_version != engine_v:
            try:  # the delta route needs the engine's version in host memory
                self.host = read_weights(self.store, engine_v)
                self.host_version = engine_v
            except DeltaSyncError as exc:
                logger.warning(
                    "agent %s: cannot rebuild v%d on the host (%s): catching up from an anchor",
                    self.config.agent_id,
                    engine_v,
                    exc,
                )
                engine_v = None
        try:
            return self.coordinator.plan(engine_v)
        except CoordinatorError as exc:
            if exc.status_code == 404:
                return None  # nothing published yet
            raise

    def _prepare(self, plan: SyncPlan, timings: dict[str, float]) -> tuple[list[dict[str, Any]], list[Path]]:
        """Fetch, verify, decode into the host copy, check checksums, and stage raw shards. No engine calls."""
        t0 = time.perf_counter()
        manifests = [self._manifest(step.version, step.kind, step.checksum) for step in plan.steps]
        shards = self._fetch_all(manifests)
        t1 = time.perf_counter()
        updates: list[dict[str, Any]] = []
        staged: list[Path] = []
        stage_s = 0.0
        host, host_version = self.host, self.host_version
        try:
            for m, data in zip(manifests, shards, strict=True):
                deltas = decode_object(m, data, where=f"{self.store.uri}/{object_prefix(m.version, m.kind)}", base=host)
                host = apply_object(host, m, deltas, verify=True)  # proves the decoded values are the trainer's
                host_version = m.version
                ts = time.perf_counter()
                info, path = self._stage(m, deltas)
                stage_s += time.perf_counter() - ts
                updates.append(info)
                staged.append(path)
        except BaseException:
            self.host, self.host_version = None, None  # partly updated: rebuild on the next sync
            raise
        self.host, self.host_version = host, host_version
        timings.update(fetch=t1 - t0, decode=time.perf_counter() - t1 - stage_s, stage=stage_s)
        return updates, staged

    def _manifest(self, version: int, kind: str, checksum: str) -> DeltaManifest:
        key = manifest_key(version, "anchor" if kind == "anchor" else "delta")
        data = self._with_retries(lambda: self.store.get(key), f"{self.store.uri}/{key}")
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if digest != checksum:
            raise IntegrityError(f"{self.store.uri}/{key}: sha256 is {digest}, the coordinator registered {checksum}")
        return DeltaManifest.from_json(data, name=f"{self.store.uri}/{key}")

    def _fetch_all(self, manifests: list[DeltaManifest]) -> list[list[bytes]]:
        jobs = [(i, j, m, e) for i, m in enumerate(manifests) for j, e in enumerate(m.shards)]
        out: list[list[bytes]] = [[b""] * len(m.shards) for m in manifests]

        def fetch(job: tuple[int, int, DeltaManifest, ShardEntry]) -> None:
            i, j, m, entry = job
            out[i][j] = self._fetch_shard(object_prefix(m.version, m.kind) + entry.file, entry)

        with ThreadPoolExecutor(max_workers=self.config.fetch_workers) as pool:
            list(pool.map(fetch, jobs))
        return out

    def _fetch_shard(self, key: str, entry: ShardEntry) -> bytes:
        """A shard, checksum-verified; refetched on a mismatch; cached by sha256 so a retry resumes."""
        cached = self.staging / "cache" / entry.sha256
        name = f"{self.store.uri}/{key}"
        if cached.exists():
            data = cached.read_bytes()
            try:
                check_shard(data, entry, name=str(cached))
                return data
            except IntegrityError:
                cached.unlink()

        def get_checked() -> bytes:
            data = self.store.get(key)
            check_shard(data, entry, name=name)
            return data

        data = self._with_retries(get_checked, name)
        tmp = cached.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, cached)
        return data

    def _with_retries(self, fn: Callable[[], bytes], what: str) -> bytes:
        for attempt in range(self.config.retries + 1):
            try:
                return fn()
            except (StoreError, IntegrityError) as exc:
                if attempt == self.config.retries:
                    raise
                delay = min(self.config.backoff_s * 2**attempt, 30.0)
                logger.warning(
                    "agent %s: %s: %s; retry %d/%d in %.1f s",
                    self.config.agent_id,
                    what,
                    exc,
                    attempt + 1,
                    self.config.retries,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _stage(self, m: DeltaManifest, deltas: list[TensorDelta]) -> tuple[dict[str, Any], Path]:
        """Write the decoded object as one raw shard the engine reads (no base needed to decode it)."""
        directory = self.staging / (f"v{m.version:08d}" + ("-anchor" if m.kind == "anchor" else ""))
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "shard-00000.safetensors"
        plain = [dataclasses.replace(d, base_values=None) for d in deltas]
        data = encode_shard(plain, kind=m.kind, encoding="raw", target_version=m.version, base_version=m.base_version)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        touched = {d.ckpt_name for d in deltas}
        info = {
            "files": [str(path)],
            "kind": m.kind,
            "target_version": m.version,
            "base_version": m.base_version,
            "checksums": {n: [list(p) for p in m.tensors[n].checksums] for n in sorted(touched)},
        }
        return info, directory

    def _apply(self, plan: SyncPlan, updates: list[dict[str, Any]], timings: dict[str, float]) -> None:
        t0 = time.perf_counter()
        self.target.pause()
        t1 = time.perf_counter()
        try:
            self.target.apply(updates, weight_version=plan.to_version)
            self.needs_anchor = False
        except VersionGapError:
            # the engine holds another version than it reported: re-plan from its real version
            self.host, self.host_version = None, None
            raise
        except ApplyError as exc:
            self.needs_anchor = True
            if self.config.tp_size > 1:
                raise ApplyError(
                    f"{exc}; with TP > 1 a failed update desyncs vLLM's executor (vLLM issue "
                    "49972): restart the vLLM server"
                ) from exc
            raise
        finally:
            t2 = time.perf_counter()
            if not (self.needs_anchor and self.config.tp_size > 1):
                self.target.resume()
                self._paused_for_lag = False
            timings.update(apply=t2 - t1, pause=time.perf_counter() - t0)
        real, served = self.target.engine_version(), self.target.weight_version()
        if real != plan.to_version or served != plan.to_version:
            self.needs_anchor = True
            raise ApplyError(
                f"after applying v{plan.to_version} the engine holds v{real} and serves v{served}; "
                f"ranks: {self.target.status()}"
            )

    def _cleanup(self, objects: list[Path]) -> None:
        for directory in objects:
            shutil.rmtree(directory, ignore_errors=True)
        for cached in (self.staging / "cache").iterdir():
            cached.unlink(missing_ok=True)

    def _heartbeat(
        self, version: int | None, state: str, *, timings: dict[str, float] | None = None, last_error: str | None = None
    ) -> None:
        try:
            self.coordinator.heartbeat(
                self.config.agent_id, applied_version=version, state=state, last_error=last_error, timings=timings
            )
        except CoordinatorError as exc:  # a heartbeat is best effort: the sync itself goes on
            logger.warning("agent %s: heartbeat failed: %s", self.config.agent_id, exc)
