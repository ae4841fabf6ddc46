"""The inference-side agent: poll the coordinator, fetch and verify, then patch a running engine.

It owns the version state machine of one engine. Everything slow (fetch, authenticate, stage; then the engine's
decode and proof) happens **before** the engine is paused; the pause covers only the apply. An engine that decodes
published objects against what it serves (one rank or tensor parallel ranks in place, reload mode) gets them as
fetched, and the agent keeps no copy of the model; for another (pipeline parallel in place), the agent decodes each
object against its host copy, proves it against the manifest's checksums, and stages it decoded. The engine, not
the agent, is the truth about what is served: its version, health, run and the highest version it has served come
from it on every sync. The steps before the pause (fetch, admit, stage, and the host copy) are
:class:`~deltasync._stager.Stager`'s; this module is the state machine around them.

What it promises (docs/RELIABILITY.md):

* **Forward only.** It never takes the engine below the highest version it has served in its run, nor to
  another run, unless the operator says so (``allow_rollback``, logged). A coordinator whose ledger is behind
  the engine, or of another run, is refused: the engine keeps serving, the agent reports ``refused``.
* **Served = registered.** Every manifest must have the digest the coordinator registered (and, given a
  public key, a valid signature); an object for another model is refused before a shard is fetched.
* **Never mixed weights under a label.** A refusal leaves the engine serving its version; a failure past the
  first write leaves it paused and labelled ``unhealthy`` until an anchor restores it, which the agent
  attempts at once (TP = 1).
* **Never dies.** :meth:`Agent.run` survives any single object, exception or store fault: it reports the
  error, backs off and retries.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NotRequired, TypedDict, Unpack

import torch

from . import apply
from ._gc import quiet_gc
from ._run_checks import RunChecks
from ._stager import Stager
from .client import CoordinatorClient, SyncPlan
from .config import AgentConfig
from .errors import (
    ApplyError,
    CoordinatorError,
    EngineUnproven,
    RefusalReason,
    RunMismatch,
    UpdateRefused,
    VersionGapError,
)
from .reader import Trust
from .signing import VerifyKey
from .staging import StagedUpdate
from .store.base import Store
from .targets.base import EngineClaim, EngineState, EngineTarget
from .targets.vllm import OfflineLLMTarget
from .vocab import AgentState

__all__ = ["Agent", "SyncResult"]

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 2000
_PROGRESS_HEARTBEAT_BYTES = 64 << 20
"""Plans this large report ``fetching`` and ``applying`` as they go; smaller ones report once, when done (one
heartbeat per sync keeps a fleet of small agents cheap for the coordinator)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyncResult:
    """What one :meth:`Agent.sync` did."""

    from_version: int | None
    """The engine's version before."""
    to_version: int | None
    """The engine's version after."""
    route: str
    """``none``, ``deltas``, ``anchor`` or ``squash`` (the route the coordinator planned: the fewest bytes)."""
    timings: dict[str, float]
    """Seconds: fetch, decode (incl. checksums), stage, pause (the serving gap), apply."""
    bytes: int
    """Bytes fetched from the store."""


class _AgentOptions(TypedDict):
    """:class:`Agent`'s keyword arguments other than ``target`` (what :meth:`Agent.for_llm` passes on)."""

    store: Store
    coordinator: CoordinatorClient
    config: NotRequired[AgentConfig | None]
    verify_key: NotRequired[VerifyKey | None]


class Agent:
    """Keeps one engine at the latest published version of its run.

    Args:
        store: where the objects are.
        coordinator: the coordinator (with this agent's own token); one client may hold several replicas of
            the ledger (``CoordinatorClient([url_a, url_b])``): it fails over between them.
        target: the engine (see :mod:`deltasync.targets`).
        config: polling, staging, retries, staleness bound, rollback permission.
        verify_key: require every manifest to be signed by this key (default: ``config.public_key``'s file).

    Example:
        >>> agent = Agent.for_llm(llm, store=open_store("/data/run1"), coordinator=client)  # doctest: +SKIP
        >>> agent.start()    # recover the engine, pin the run  # doctest: +SKIP
        >>> agent.sync()     # between generate() calls  # doctest: +SKIP

    Thread safety: one thread drives an agent (``sync`` or ``run``).
    """

    def __init__(
        self,
        *,
        store: Store,
        coordinator: CoordinatorClient,
        target: EngineTarget,
        config: AgentConfig | None = None,
        verify_key: VerifyKey | None = None,
    ) -> None:
        self.store, self.coordinator, self.target = store, coordinator, target
        self.config = config or AgentConfig()
        if verify_key is None and self.config.public_key is not None:
            verify_key = VerifyKey.from_file(self.config.public_key)
        self.verify_key = verify_key
        root = self.config.staging_dir or tempfile.mkdtemp(prefix="deltasync-agent-")
        self.staging = Path(root).resolve()  # no symlink on the way: engines accept files only from under it
        self.stager = Stager(
            store,
            self.staging,
            self.config,
            verify_key=verify_key,
            in_process=getattr(target, "in_process", False),
        )
        """Fetches, admits and stages each update, and keeps the host copy (:mod:`deltasync._stager`)."""
        self.checks = RunChecks(coordinator, store, self.config, self._trust)
        """The run this agent follows, checked against its engine's (:mod:`deltasync._run_checks`)."""
        self.started = False
        self.needs_anchor = False
        self.last_version: int | None = None
        """The engine's version at the end of the last sync."""
        self.last_error: str | None = None
        self._paused_for_lag = False
        self.session = secrets.token_hex(8)
        """This agent process's claim on its engine (:class:`~deltasync.targets.EngineClaim`)."""
        self.drift: str | None = None
        """The last drift a proof found, reported with every heartbeat until a whole-state proof passes again."""
        self._proved_at: float | None = None  # monotonic time of the last whole-state proof that passed

    @property
    def host(self) -> dict[str, torch.Tensor] | None:
        """The agent's copy of the engine's weights (``packed`` deltas decode against it); ``None`` while the
        engine decodes published objects itself, or until the copy is rebuilt."""
        return self.stager.host

    @classmethod
    def for_llm(cls, llm: Any, **options: Unpack[_AgentOptions]) -> Agent:
        """An agent for an offline ``vllm.LLM`` in this process (call :meth:`sync` between generations); ``options``
        are :class:`Agent`'s other keyword arguments."""
        return cls(target=OfflineLLMTarget(llm), **options)

    # ------------------------------------------------------------------ the state machine

    def start(self) -> EngineState:
        """Take charge of the engine: refuse one claimed by another agent or serving another run (before changing
        anything there), claim it with the operator's policy (staging root, rollback; TP > 1: failures recorded,
        never raised), close a session an earlier agent left open, label it with what it really holds (keep it
        paused if it is unhealthy), apply ``assume_version``, and pin the coordinator's run to the engine's.
        Idempotent.

        Raises:
            RunMismatch: the coordinator's ledger is of another run than the engine's (and no ``allow_rollback``).
            UpdateRefused: (reason ``run``) another agent drives this engine; nothing changed there.
        """
        st = self.target.state()
        if st.agent_id is not None and st.agent_id != self.config.agent_id:
            raise UpdateRefused(
                f"agent {self.config.agent_id}: this engine is driven by agent {st.agent_id!r}; refusing to touch it "
                "(each engine has one agent: point this one at its own engine)",
                reason=RefusalReason.RUN,
            )
        run = self.checks.run(st)
        claim = EngineClaim(
            model_fingerprint=self.checks.model(st),
            agent_id=self.config.agent_id,
            session=self.session,
            ttl_s=max(3 * self.config.poll_wait_s, 30.0),
            run_id=run,
            staging_root=str(self.staging),
            allow_rollback=self.config.allow_rollback,
            raise_errors=False if self.config.tp_size > 1 else None,
            mode=self.config.apply_mode or "auto",  # always said: a restart resets what another claim set
            adapter_dir=self.config.adapter_dir,
        )
        self.target.init(claim)
        self._claim = claim
        self.target.recover()
        st = self.target.state()
        if self.config.assume_version is not None and st.version is None and st.healthy:
            self.target.init(dataclasses.replace(claim, base_version=self.config.assume_version))
            st = self.target.state()
        self.started = True
        self.last_version = st.version
        if st.run_id is not None and (run is None or run == st.run_id):
            self.coordinator.pin_run(st.run_id)
        return st

    def engine_state(self) -> EngineState:
        """The engine's state, read from the engine (no side effects)."""
        return self.target.state()

    def _release_if_not_ours(self, exc: UpdateRefused, st: EngineState) -> None:
        """This agent's run is for another model or run than its engine, which serves no version yet: the
        engine is not this agent's, and its claim is given up at once (the engine's own agent takes it)."""
        holding = apply.Holding(version=st.version if st.healthy else None)
        claim = getattr(self, "_claim", None)
        if claim is None or not apply.releases_claim(exc.reason, holding):
            return
        logger.warning("agent %s: its run is not this engine's: giving up the claim", self.config.agent_id)
        self.target.init(dataclasses.replace(claim, release=True))
        self.started = False

    def sync(self, wait_s: float = 0.0) -> SyncResult:
        """Bring the engine to the latest version once (waiting up to ``wait_s`` for news). Starts the agent
        (:meth:`start`) if it was not started.

        Raises:
            UpdateRefused: the engine or the agent refused the update before any write (another model or run, a
                rollback, a ledger behind the engine); it keeps serving its version.
            ApplyError: the engine failed past the first write and no anchor could restore it.
            DeltaSyncError: fetching or verifying failed after the retries (the engine keeps serving).
        """
        if not self.started:
            self.start()
        st = self._engine_state()
        self.checks.run(st)
        st = self._prove_when_due(st)
        held = st.version if st.healthy and not self.needs_anchor else None
        if wait_s > 0 and held is not None and self.config.audit_interval_s is not None:
            due = (self._proved_at or 0.0) + self.config.audit_interval_s - time.monotonic()
            wait_s = min(wait_s, max(due, 0.0))  # wake for the next proof too
        if wait_s > 0:
            self.coordinator.wait_for_versions(held, wait_s=wait_s)
        plan = self._plan(held, st)
        if plan is None or plan.route == "none":
            self._heartbeat(st.version, "paused" if self._paused_for_lag else "idle")
            return SyncResult(from_version=st.version, to_version=st.version, route="none", timings={}, bytes=0)
        self.checks.rollback(plan, st)
        self._bound_lag(plan, held)
        progress = plan.bytes >= _PROGRESS_HEARTBEAT_BYTES  # small syncs report once, when done
        if progress:
            self._heartbeat(st.version, "fetching")
        timings: dict[str, float] = {}
        with quiet_gc():  # no full collection of a large host process in the middle of an update (deltasync._gc)
            try:
                update, staged = self.stager.prepare(plan, st, timings)
            except UpdateRefused as exc:
                self._release_if_not_ours(exc, st)
                raise
            if progress:
                self._heartbeat(st.version, "applying")
            try:
                self._apply(update, timings)
            except ApplyError:
                if self.config.tp_size > 1:
                    raise ApplyError(
                        f"the engine failed past the first write; with TP > 1 that desyncs vLLM's executor "
                        f"(vLLM #49972): restart the vLLM server ({self.target.state().detail})"
                    ) from None
                failed = True
            else:
                failed = False
            finally:
                self.stager.cleanup(staged)
        if failed:
            return self._restore_from_anchor(st.version, timings)
        self.stager.integrity_failures = 0
        self.last_version = plan.to_version
        if self.drift is not None:
            self._proved_at = None  # restored: prove the whole state at the next sync, then stop reporting drift
        self._heartbeat(plan.to_version, "idle", timings=timings)
        logger.info(
            "agent %s: v%s -> v%d (%s, %d objects): pause %.0f ms",
            self.config.agent_id,
            st.version,
            plan.to_version,
            plan.route,
            len(plan.steps),
            timings.get("pause", 0) * 1e3,
        )
        return SyncResult(
            from_version=st.version, to_version=plan.to_version, route=plan.route, timings=timings, bytes=plan.bytes
        )

    def run(self, stop: threading.Event | None = None) -> None:
        """Sync until ``stop`` is set, long-polling for news between syncs. Never raises: every failure (a
        refusal, a corrupt or hostile object, a store or coordinator fault, an unhealthy engine, even
        ``MemoryError``) is logged, reported to the coordinator, and retried with backoff; the engine keeps
        serving its verified version meanwhile (or stays paused when unhealthy)."""
        stop = stop or threading.Event()
        failures = 0
        while not stop.is_set():
            try:
                self.sync(wait_s=self.config.poll_wait_s)
                failures = 0
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - a long-running agent outlives any one failure (docstring)
                failures += 1
                delay = min(self.config.backoff_s * 2 ** min(failures, 6), 30.0)
                self.last_error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
                logger.warning(
                    "agent %s: sync failed (%s); retrying in %.1f s", self.config.agent_id, self.last_error, delay
                )
                try:
                    self._report_failure(exc)
                except Exception as report_exc:  # noqa: BLE001 - reporting is best effort; the loop must go on
                    logger.warning("agent %s: could not report the failure: %s", self.config.agent_id, report_exc)
                stop.wait(delay)

    def _report_failure(self, exc: BaseException) -> None:
        state: AgentState = "refused" if isinstance(exc, UpdateRefused | RunMismatch) else "error"
        try:
            st = self.target.state()
            version = st.version
            if not st.healthy:
                state = "unhealthy"
        except Exception:  # noqa: BLE001 - the engine may be down; report what we know
            version = self.last_version
        self._heartbeat(version, state, last_error=self.last_error)

    # ------------------------------------------------------------------ steps

    def _engine_state(self) -> EngineState:
        st = self.target.state()
        if st.agent_id != self.config.agent_id:  # its claim was released (refused objects) or taken over
            self.started = False
            raise UpdateRefused(
                f"agent {self.config.agent_id}: the engine is no longer claimed by this agent (it names "
                f"{st.agent_id!r}); claiming it again at the next sync",
                reason=RefusalReason.RUN,
            )
        mislabelled = st.healthy and st.version is not None and st.label != str(st.version)
        if st.session_open or mislabelled or (not st.healthy and st.label != "unhealthy"):
            self.target.recover()
            st = self.target.state()
        if not st.healthy:
            self.needs_anchor = True
        return st

    def _prove_when_due(self, st: EngineState) -> EngineState:
        """Every ``audit_interval_s`` (and first after a start or a restore): prove the engine's whole served state
        against its version's published checksums. On drift the engine is unlabelled and paused, the drift is
        reported, and the anchor route restores it in this sync."""
        prove = getattr(self.target, "prove", None)
        interval = self.config.audit_interval_s
        if prove is None or interval is None or not st.healthy or st.version is None or self.needs_anchor:
            return st
        if self._proved_at is not None and time.monotonic() - self._proved_at < interval:
            return st
        try:
            unproven = prove(stall_s=self.config.audit_stall_s or None)
        except ApplyError as exc:
            self.drift = str(exc)
            self._hold_for_anchor()  # never serve weights that differ from their version
            logger.warning("agent %s: %s", self.config.agent_id, exc)
            self._heartbeat(None, "unhealthy", last_error=self.drift)
            return self.target.state()
        if unproven:
            logger.warning(
                "agent %s: %d tensors could not be proven (e.g. %s)", self.config.agent_id, len(unproven), unproven[0]
            )
        self._proved_at = time.monotonic()
        if self.drift is not None:
            logger.info("agent %s: the whole state of v%d is proven again", self.config.agent_id, st.version)
            self.drift = None
        return st

    def _trust(self) -> Trust:
        return Trust(verify_key=self.verify_key, ledger=self.coordinator.registered_digest)

    def _plan(self, held: int | None, st: EngineState) -> SyncPlan | None:
        try:
            plan = self.coordinator.plan(held)
        except CoordinatorError as exc:
            if exc.status_code == 404 and held is None:
                return None  # nothing published yet
            if exc.status_code == 409:  # the engine is ahead of the ledger: never follow it down
                raise UpdateRefused(
                    f"agent {self.config.agent_id}: {exc}; the engine keeps serving v{held}",
                    reason=RefusalReason.ROLLBACK,
                ) from None
            raise
        stager = self.stager
        if plan.route in ("deltas", "squash") and held is not None and not stager.stages_published(st):
            # the delta and squash routes need the engine's version in host memory
            if stager.host_version != held and not stager.rebuild_host(held, self._trust()):
                plan = self.coordinator.plan(None)
        return plan

    def _bound_lag(self, plan: SyncPlan, held: int | None) -> None:
        lag = plan.to_version - (held if held is not None else -1)
        if self.config.max_lag is not None and lag > self.config.max_lag and not self._paused_for_lag:
            logger.warning(
                "agent %s: %d versions behind (max %d): the engine stops serving until caught up",
                self.config.agent_id,
                lag,
                self.config.max_lag,
            )
            self.target.pause()
            self._paused_for_lag = True

    def _apply(self, update: StagedUpdate, timings: dict[str, float]) -> None:
        """Prepare (engines that read and plan before the pause), pause, apply, resume, audit (engines that read
        their live parameters back). On a refusal the engine resumes with its old weights and label; on a
        failure past the first write it stays paused (the target labels it ``unhealthy``)."""
        prepare = getattr(self.target, "prepare", None)
        if prepare is not None:
            tp = time.perf_counter()
            try:
                prepare(update)  # a refusal here comes before the pause: the engine keeps serving
            except VersionGapError:
                self.stager.forget_host()  # re-planned from the engine's real version
                raise
            timings["prepare"] = time.perf_counter() - tp
        t0 = time.perf_counter()
        self.target.pause()
        t1 = time.perf_counter()
        ok_to_serve = True
        try:
            self.target.apply(update)
            self.needs_anchor = False
        except VersionGapError:
            # the engine holds another version than it reported: re-plan from its real version
            self.stager.forget_host()
            raise
        except UpdateRefused as exc:
            if exc.reason is not RefusalReason.UNHEALTHY:
                # nothing was written; an engine that was unhealthy before (drift, a failed update) stays paused
                ok_to_serve = self._engine_healthy()
                raise
            # the engine went unhealthy before this update's first write (building its patch map changed live
            # weights): never serve them; only an anchor restores it
            ok_to_serve = False
            self._hold_for_anchor(pause=False)  # paused already: not resumed below
            raise ApplyError(f"the engine is unhealthy: {exc}") from exc
        except ApplyError:
            ok_to_serve = False
            self._hold_for_anchor(pause=False)
            raise
        finally:
            t2 = time.perf_counter()
            if ok_to_serve:
                self.target.resume()
                self._paused_for_lag = False
            timings.update(apply=t2 - t1, pause=time.perf_counter() - t0)
        st = self.target.state()
        if st.version != update.target_version or st.label != str(update.target_version):
            self.needs_anchor = True
            raise ApplyError(
                f"after applying v{update.target_version} the engine holds v{st.version} and serves {st.label!r} "
                f"({st.detail})"
            )
        audit = getattr(self.target, "audit", None)
        if audit is not None:
            ta = time.perf_counter()
            try:
                audit()
            except ApplyError:
                self._hold_for_anchor()  # never serve weights that fail their checksums
                raise
            timings["audit"] = time.perf_counter() - ta

    def _hold_for_anchor(self, *, pause: bool = True) -> None:
        """The engine serves weights that cannot be vouched for: only an anchor restores it (the next plan takes
        the anchor route), the host copy no longer matches it, and it stays paused meanwhile (``pause=False``:
        the caller holds it paused already)."""
        self.needs_anchor = True
        self.stager.forget_host()
        if pause:
            self.target.pause()

    def _engine_healthy(self) -> bool:
        try:
            return self.target.state().healthy
        except EngineUnproven:
            raise  # not the engine: neither judged nor driven
        except Exception:  # noqa: BLE001 - no answer: do not serve what cannot be vouched for
            return False

    def _restore_from_anchor(self, before: int | None, timings: dict[str, float]) -> SyncResult:
        """After a failure past the first write (TP = 1): the anchor route at once; the engine stays paused
        until it succeeds."""
        logger.warning(
            "agent %s: the engine failed past the first write; restoring it from an anchor", self.config.agent_id
        )
        self._heartbeat(None, "unhealthy", last_error=self.target.state().detail[:_MAX_ERROR_CHARS])
        plan = self.coordinator.plan(None)
        st = self.target.state()
        update, staged = self.stager.prepare(plan, st, timings)
        try:
            self._apply(update, timings)
        finally:
            self.stager.cleanup(staged)
        self.last_version = plan.to_version
        self._proved_at = None  # prove the restored state whole at the next sync
        self._heartbeat(plan.to_version, "idle", timings=timings)
        return SyncResult(
            from_version=before, to_version=plan.to_version, route="anchor", timings=timings, bytes=plan.bytes
        )

    def _heartbeat(
        self,
        version: int | None,
        state: AgentState,
        *,
        timings: dict[str, float] | None = None,
        last_error: str | None = None,
    ) -> None:
        try:
            self.coordinator.heartbeat(
                self.config.agent_id,
                applied_version=version,
                state=state,
                last_error=last_error,
                timings=timings,
                drift=self.drift,
            )
        except Exception as exc:  # noqa: BLE001 - a heartbeat is best effort: the sync itself goes on
            logger.warning("agent %s: heartbeat failed: %s", self.config.agent_id, exc)
