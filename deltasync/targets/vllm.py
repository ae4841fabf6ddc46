"""The vLLM engines an agent drives: an offline ``vllm.LLM`` in this process, or a vLLM server over HTTP.

Both speak vLLM's weight-transfer lifecycle with the ``deltasync`` backend: start_weight_update ->
update_weights (one call carrying the whole :class:`~deltasync.staging.StagedUpdate`) -> finish_weight_update
-> only then, once every rank reports the target version, the ``weight_version`` label -> reset the prefix
cache. The engine's own state (each rank's ``deltasync_status`` RPC, from the worker extension) is the truth;
failures are read from it as structured outcomes, never from error text.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

import httpx

from ..engine_credential import load_engine_token
from ..errors import ApplyError, EngineUnproven, RefusalReason, UpdateRefused, VersionGapError
from ..staging import StagedUpdate
from .base import (
    UNHEALTHY_LABEL,
    EngineClaim,
    EngineState,
    check_claim,
    combine_changes,
    combine_proofs,
    combine_ranks,
    raise_outcome,
)
from .engine_auth import EngineAuth

__all__ = ["WORKER_EXTENSION", "HttpVllmTarget", "OfflineLLMTarget"]

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "deltasync.vllm.worker_ext.DeltaSyncWorkerExtension"
"""vLLM ``worker_extension_cls`` that adds the ``deltasync_status`` and ``deltasync_effective`` RPCs."""


_KERNEL = "kernel:"
"""A sliced audit's window over a repacked module's kernel: ``[kernel:<module>, b0, b1]``, blocks ``[b0, b1)`` of
its input columns (``0, 0``: all of them)."""


def _kernel_blocks(plan: list[dict[str, Any]]) -> dict[str, int]:
    """The repacked modules every rank references in the same number of blocks (more than one): read a run of
    blocks at a time. A module whose ranks disagree is read whole (a window names blocks of one count)."""
    counts = [r.get("kernel_blocks") or {} for r in plan]
    names = set(counts[0]) if counts else set()
    return {n: int(counts[0][n]) for n in names if all(c.get(n) == counts[0][n] for c in counts)}


_FIRST_SECONDS_PER_ELEMENT = 4e-9
"""What a sliced audit's first window assumes a proof costs per element: a slow engine's (numpy's sketch, a
gathered layout); later windows are sized from the time the last one took."""
_FIRST_SECONDS_PER_MAC = 2e-11
"""What a sliced audit's first kernel read-back assumes a multiply-add costs (50 GMAC/s: a slow CPU GEMM)."""
_MIN_WINDOW = 1 << 16
"""Elements per window at least: a call costs a round trip."""
_STALL_MARGIN = 0.7
"""Windows are sized to this fraction of the bound, for the variance between one window and the next (a window's
cost per element varied by 1.5x over a 0.6B engine's tensors)."""


def _stops(ranks: list[dict[str, Any]], version: Any) -> bool:
    """Whether a sliced audit stops after these answers: a rank found drift or failed, or serves another version."""
    return any(r.get("bad") or not r.get("ok") or r.get("version") != version for r in ranks)


class _VllmTarget:
    """The session logic shared by both targets, over a few primitives."""

    audit_stalls: list[float] = []  # noqa: RUF012 - replaced, never changed in place
    """Each call of the last sliced whole-state proof: seconds on its slowest rank."""

    def _ranks(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _label(self) -> str | None:
        raise NotImplementedError

    def _set_label(self, label: str) -> None:
        raise NotImplementedError

    def _rpc(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        """A worker-extension RPC on every rank; each rank's answer."""
        raise NotImplementedError

    def prepare(self, update: StagedUpdate) -> None:
        """Before the pause: every rank reads, validates and plans the update (``inplace`` mode writes nothing
        but the planned scatters inside the session). A refusal found here is found again by :meth:`apply`.

        With tensor parallelism each rank decodes and proves the elements it holds; the changes of the tensors
        held in parts come back here and are added up over the ranks before the pause.

        Raises:
            UpdateRefused: a rank refused the update (``VersionGapError``: it holds another base), or (reason
                ``integrity``) the ranks' changes do not give a published checksum; nothing was written.
        """
        self._proven_before: list[str] = []
        try:
            ranks = self._rpc("deltasync_prepare", update_info=json.dumps(update.to_update_info()))
        except Exception as exc:  # noqa: BLE001 - an optimization: apply() does the work if prepare could not
            logger.warning("could not prepare the update before the pause: %s", exc)
            return
        refused = [r for r in ranks if isinstance(r, dict) and r.get("refused")]
        if refused:  # before the pause, on every rank alike (with TP > 1 each rank decodes its own part: a rank that
            # refuses while another would write must stop them all here, never leave them split)
            reason = RefusalReason(refused[0]["refused"])
            message = f"prepare: {refused[0].get('message', '')}"
            if reason is RefusalReason.BASE:
                raise VersionGapError(message)
            raise UpdateRefused(message, reason=reason)
        failed = [r for r in ranks if not (isinstance(r, dict) and r.get("ok"))]
        bad, unproven = combine_changes([r for r in ranks if r not in failed])
        if failed and len(failed) < len(ranks) and not bad:  # ranks decode their own parts: none writes alone
            raise UpdateRefused(
                f"prepare: a rank could not prepare the update ({str(failed[0])[:300]}); nothing was written",
                reason=RefusalReason.MALFORMED,
            )
        if failed and not bad:
            return  # every rank alike, without a refusal (no map yet, ...): apply() does the work and says why
        if bad:
            raise UpdateRefused(
                f"the ranks' changes to {len(bad)} tensors do not give the published checksums (e.g. {bad[0]}); "
                "nothing was written",
                reason=RefusalReason.INTEGRITY,
            )
        changed = {n for r in ranks if isinstance(r, dict) for n in r.get("changes") or {}}
        self._proven_before = sorted(changed - set(unproven))  # the audit need not add their parts up again
        if unproven:  # parts that overlap (a replicated slice): the audit after the pause proves the result
            logger.info(
                "%d tensors held in overlapping parts are proven after the pause: %s", len(unproven), unproven[:3]
            )

    def audit(self) -> None:
        """After the pause: every rank reads the update's writes back from its live parameters and compares
        them bit for bit with its plan (which the engine proved against the published checksums before writing).

        Raises:
            ApplyError: a rank's parameters differ (the engine is unhealthy and unlabelled).
        """
        proven, self._proven_before = getattr(self, "_proven_before", []), []
        ranks = self._rpc("deltasync_audit", proven=proven)
        bad = [r for r in ranks if not r.get("ok", False)]
        if bad:
            self._invalidate()
            raise ApplyError(f"the read-back audit failed: {bad[0]}")
        proofs = [r["proof"] for r in ranks if r.get("proof")]  # TP > 1: the written tensors' parts, added up
        if proofs:
            self._judge(proofs)

    def prove(self, names: list[str] | None = None, *, stall_s: float | None = None) -> list[str]:
        """Prove the engine's whole served state (or ``names``) against its version's published checksums: each
        rank proves what it holds whole, and the sketches of what ranks hold in part are added up here.

        ``stall_s`` (the whole state only): prove it in windows, one call each, sized so that a call holds the
        workers about that long (from the time the last one took per element; the first assumes a slow engine),
        and vLLM serves between the calls. The sketches of every window and rank are added up here, and a
        tensor is proven only when its windows cover it exactly once, all from one served version; the state
        beside the tensors (repacked kernels, padding, adapter directories) is proven in a last call.
        :attr:`audit_stalls` keeps each call's time on its slowest rank.

        Returns:
            the tensors that could not be proven (no published sketch, or a layout whose parts overlap).

        Raises:
            ApplyError: drift: the engine is marked unhealthy on every rank and unlabelled; only an anchor
                restores it.
        """
        if stall_s is None or names is not None:
            return self._judge(self._rpc("deltasync_prove", names=names))
        plan = self._rpc("deltasync_prove", windows=[], extras=False)
        tensors = plan[0].get("tensors") if plan and all(r.get("ok") and r.get("proven") for r in plan) else None
        if not isinstance(tensors, dict):  # nothing to prove in windows (no version, no published checksums)
            return self._judge(plan)
        version = plan[0].get("version")
        answers: list[dict[str, Any]] = []
        stalls: list[float] = []
        queue = [(str(name), 0, int(numel)) for name, numel in sorted(tensors.items()) if int(numel) > 0]
        per_element = _FIRST_SECONDS_PER_ELEMENT
        last = 0
        while queue:
            budget = max(int(stall_s / per_element), _MIN_WINDOW)
            if last:  # no more than twice the last window: the cost per element varies with the tensors' layout
                budget = min(budget, 2 * last)
            windows, elements = [], 0
            while queue and elements < budget:
                name, lo, hi = queue[0]
                take = min(hi - lo, budget - elements)
                windows.append([name, lo, lo + take])
                elements += take
                if lo + take == hi:
                    queue.pop(0)
                else:
                    queue[0] = (name, lo + take, hi)
            ranks, took = self._prove_call(answers, stalls, windows=windows, extras=False)
            if _stops(ranks, version):
                break
            if took > 0:
                per_element = took / elements / _STALL_MARGIN
            last = elements
        kernels = plan[0].get("kernels") or {}
        if not _stops(answers, version):
            answers += self._prove_kernels_sliced(kernels, _kernel_blocks(plan), version, stall_s, stalls)
        if not _stops(answers, version):
            self._prove_call(answers, stalls, windows=[], extras=True, kernels=not kernels)
        self.audit_stalls = stalls
        # a rank that found drift (it unlabelled itself) or failed is judged at once, on what was proven so far
        if any(r.get("bad") or not r.get("ok") for r in answers):
            return self._judge(answers)
        if any(r.get("version") != version for r in answers):  # the engine was updated meanwhile: next pass
            return [f"the served version changed during the audit (v{version})"]
        return self._judge(answers)

    def _prove_call(
        self, answers: list[dict[str, Any]], stalls: list[float], **kwargs: Any
    ) -> tuple[list[dict[str, Any]], float]:
        """One call of a sliced audit: every rank's answer, added to ``answers``, and the time it held the slowest
        rank, added to ``stalls``."""
        ranks = self._rpc("deltasync_prove", **kwargs)
        took = max(float(r.get("prove_s") or 0.0) for r in ranks)
        answers.extend(ranks)
        stalls.append(took)
        return ranks, took

    def _prove_kernels_sliced(
        self, kernels: dict[str, int], blocks: dict[str, int], version: Any, stall_s: float, stalls: list[float]
    ) -> list[dict[str, Any]]:
        """The repacked modules read back through their kernels, as many blocks of input columns per call as fit
        ``stall_s`` by their multiply-adds (from the time the last call took per one): each rank's answers. A
        module referenced in ``blocks[module]`` blocks is read a run of them at a time, any other whole."""
        answers: list[dict[str, Any]] = []
        queue: list[tuple[str, int | None, float]] = []  # (module, block or None: whole, multiply-adds)
        for module, total in sorted(kernels.items()):
            n = blocks.get(module, 1)
            queue += [(module, b, int(total) / n) for b in range(n)] if n > 1 else [(module, None, float(total))]
        per_mac = _FIRST_SECONDS_PER_MAC
        while queue:
            batch: list[list[Any]] = []
            macs = 0.0
            while queue and (not batch or (macs + queue[0][2]) * per_mac <= stall_s):
                name, block, cost = queue.pop(0)
                macs += cost
                if block is None:
                    batch.append([f"{_KERNEL}{name}", 0, 0])
                elif batch and batch[-1][0] == f"{_KERNEL}{name}" and batch[-1][2] == block:
                    batch[-1][2] = block + 1  # the next block of the same module: one longer run
                else:
                    batch.append([f"{_KERNEL}{name}", block, block + 1])
            ranks, took = self._prove_call(answers, stalls, windows=batch, extras=False)
            if _stops(ranks, version):
                break
            if took > 0 and macs:
                per_mac = took / macs / _STALL_MARGIN
        return answers

    def _judge(self, ranks: list[dict[str, Any]]) -> list[str]:
        drifted, unproven = combine_proofs(ranks)
        failed = [r.get("reason") for r in ranks if not r.get("ok") and not r.get("bad")]
        if drifted:
            version = next((r.get("version") for r in ranks if r.get("version") is not None), None)
            self._rpc("deltasync_drift", tensors=drifted, by="the agent's proof")
            self._invalidate()
            raise ApplyError(
                f"drift: {len(drifted)} tensors differ from v{version}'s published checksums (e.g. {drifted[0]}), "
                f"found {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; the engine is unlabelled until an "
                "anchor restores it"
            )
        if failed:
            raise ApplyError(f"the engine could not prove its state: {failed[0]}")
        # an engine that knows no published checksums for its version (assume_version): nothing is proven yet
        return unproven + [str(r.get("reason")) for r in ranks if r.get("proven") is False][:1]

    def _call(self, method: str, body: dict[str, Any] | None = None) -> None:
        """One lifecycle call: ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
        ``finish_weight_update`` or ``reset_prefix_cache``; raises on failure."""
        raise NotImplementedError

    def pause(self) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def state(self) -> EngineState:
        return combine_ranks(self._ranks(), self._label())

    def _close_dangling(self) -> bool:
        """Finish a session an earlier caller left open (the engine's finish is a no-op after a failure)."""
        if not self.state().session_open:
            return False
        try:
            self._call("finish_weight_update")
        except Exception as exc:  # noqa: BLE001 - reported, and the engine state below says what holds
            logger.warning("could not close the dangling update session: %s", exc)
            return False
        logger.warning("closed an update session that an earlier call left open")
        return True

    def recover(self) -> None:
        self._close_dangling()
        st = self.state()
        if not st.healthy:
            self.pause()  # it must not serve mixed weights; an anchor restores it
            if st.label != UNHEALTHY_LABEL:
                self._set_label(UNHEALTHY_LABEL)
            return
        self.resume()
        if st.version is not None and st.label != str(st.version):
            logger.warning("weight_version said %s, the engine holds v%d: relabelled", st.label, st.version)
            self._set_label(str(st.version))

    _session: str | None = None

    def init(self, claim: EngineClaim) -> None:
        self._session = claim.session or None
        self._call("init_weight_transfer_engine", {"init_info": claim.to_init_info()})
        ranks = self._ranks()
        check_claim(ranks, claim)
        st = combine_ranks(ranks, self._label())
        if claim.base_version is not None and st.version == claim.base_version:
            self._set_label(str(claim.base_version))

    def apply(self, update: StagedUpdate) -> None:
        what = f"applying {update.objects[0].label}" + (
            f" .. v{update.target_version}" if len(update.objects) > 1 else ""
        )
        try:
            self._call("start_weight_update")
            self._call("update_weights", {"update_info": update.to_update_info()})
            self._call("finish_weight_update")
            ranks = self._ranks()
            raise_outcome(ranks, what)  # engines started with raise_errors=False (TP > 1) report, never raise
        except UpdateRefused:
            self._close_dangling()
            raise
        except EngineUnproven:  # whoever answers is not the engine: nothing more is sent to it, nothing is judged
            raise
        except Exception as exc:
            self._close_dangling()
            try:
                ranks = self._ranks()
            except Exception:  # noqa: BLE001 - no status: all we know is the failure itself
                self._invalidate()
                raise ApplyError(f"{what}: {str(exc)[:800]}") from exc
            try:
                raise_outcome(ranks, what, exc)
            except UpdateRefused:
                raise
            except ApplyError:
                if not combine_ranks(ranks, None).healthy:
                    self._invalidate()
                raise
        st = combine_ranks(ranks, None)
        if st.version != update.target_version:
            self._invalidate()
            raise ApplyError(f"{what}: the engine reports v{st.version} after the update ({st.detail})")
        self._set_label(str(update.target_version))
        self._call("reset_prefix_cache")

    def _invalidate(self) -> None:
        try:
            self._set_label(UNHEALTHY_LABEL)
        except Exception as exc:  # noqa: BLE001 - the engine is unhealthy anyway; its status says so
            logger.warning("could not relabel the engine %r: %s", UNHEALTHY_LABEL, exc)


class OfflineLLMTarget(_VllmTarget):
    """An offline ``vllm.LLM`` started with ``weight_transfer_config={"backend": "deltasync"}`` and
    ``worker_extension_cls=`` :data:`WORKER_EXTENSION`.

    Offline generation runs in the caller's thread, so ``pause``/``resume`` are no-ops: call the agent's
    ``sync()`` between ``generate`` calls, never concurrently with them. After a failure past the first write
    the label becomes :data:`~deltasync.targets.UNHEALTHY_LABEL` and ``sync()`` raises until an anchor restores
    the engine: do not generate meanwhile.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def effective_weights(self, *, checksums: bool = True) -> list[dict[str, Any]]:
        """What each rank's kernels really use, by vLLM module or parameter name (``xxh3_128`` digests, or
        tensors): the only exact readback on vLLM's CPU build, where linear weights are repacked."""
        ranks: list[dict[str, Any]] = self.llm.collective_rpc("deltasync_effective", kwargs={"checksums": checksums})
        return ranks

    def _ranks(self) -> list[dict[str, Any]]:
        try:
            ranks: list[dict[str, Any]] = self.llm.collective_rpc("deltasync_status", kwargs={"session": self._session})
        except Exception as exc:
            raise ApplyError(
                f"the engine has no deltasync_status RPC ({exc}); start vLLM with "
                f"worker_extension_cls={WORKER_EXTENSION!r}"
            ) from exc
        return ranks

    def _rpc(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        ranks: list[dict[str, Any]] = self.llm.collective_rpc(method, kwargs=kwargs)
        return ranks

    def _label(self) -> str | None:
        return str(self.llm.get_weight_version())

    def _set_label(self, label: str) -> None:
        self.llm.update_weight_version(label)

    def _call(self, method: str, body: dict[str, Any] | None = None) -> None:
        if method == "update_weights":
            self.llm.update_weights(body)
        elif method == "init_weight_transfer_engine":
            self.llm.init_weight_transfer_engine(body)
        else:
            getattr(self.llm, method)()

    def pause(self) -> None:
        """Nothing to do offline."""

    def resume(self) -> None:
        """Nothing to do offline."""


class HttpVllmTarget(_VllmTarget):
    """A vLLM server started with ``VLLM_PLUGINS=deltasync`` (the engine guard, and the agent's routes without
    dev mode: :mod:`deltasync.vllm.endpoints`), the engine credential in its environment
    (``DELTASYNC_ENGINE_TOKEN`` or ``DELTASYNC_ENGINE_TOKEN_FILE``), ``--weight-transfer-config
    '{"backend":"deltasync"}'`` and ``--worker-extension-cls`` :data:`WORKER_EXTENSION`.

    Every administrative call is signed with the credential (:class:`~deltasync.targets.EngineAuth`), which never
    leaves the agent: the server first proves it holds the same credential, and signs each answer; one that
    cannot is reported (:class:`~deltasync.errors.EngineUnproven`) and never driven. :meth:`check_boundary`
    (run by :meth:`recover`, so at every agent start) also refuses a server whose administrative routes answer
    without a credential. A failed RL route answers 500 and drops the keep-alive connection, so every call uses a fresh
    one.

    Args:
        url: the server.
        engine_token: the engine credential (default: from the environment, :func:`load_engine_token`).
        pause_mode: vLLM's ``/pause`` mode.
        timeout_s: per call.
    """

    def __init__(
        self,
        url: str,
        *,
        engine_token: str | None = None,
        pause_mode: Literal["keep", "wait", "abort"] = "keep",
        timeout_s: float = 600,
    ):
        self.url = url.rstrip("/")
        self.pause_mode = pause_mode
        token = engine_token if engine_token is not None else load_engine_token()
        if token is None:
            raise ValueError(
                f"HttpVllmTarget({self.url}): no engine credential; set DELTASYNC_ENGINE_TOKEN or "
                "DELTASYNC_ENGINE_TOKEN_FILE to the credential the vLLM server was started with"
            )
        self._http = httpx.Client(
            base_url=self.url,
            timeout=timeout_s,
            headers={"Connection": "close"},
            auth=EngineAuth(token),
            transport=httpx.HTTPTransport(retries=3),
        )
        self._boundary_checked = False

    def check_boundary(self) -> None:
        """Prove the server's administrative routes are closed to callers without the credential, and open to
        this one.

        Raises:
            EngineUnproven: the server did not prove it holds the engine credential (nothing was sent to it).
            ApplyError: they answer without it (no guard: anyone who reaches the port could change the engine),
                or are missing, or refuse this credential.
        """
        fix = "start vLLM with VLLM_PLUGINS=deltasync and DELTASYNC_ENGINE_TOKEN (or _FILE) in its environment"
        mine = self._http.get("/is_paused")  # first: the server proves it holds the credential (EngineUnproven)
        if mine.status_code != 200:
            raise ApplyError(
                f"{self.url}: the server refuses this agent's engine credential ({mine.status_code} "
                f"{mine.text[:300]}); give the agent the credential the server was started with"
            )
        bare = httpx.get(self.url + "/is_paused", timeout=self._http.timeout, headers={"Connection": "close"})
        if bare.status_code == 200:
            raise ApplyError(
                f"{self.url}: GET /is_paused answers without the engine credential: its administrative routes are "
                f"open to anyone who reaches the port; refusing to drive it ({fix})"
            )
        if bare.status_code != 401:
            raise ApplyError(f"{self.url}: GET /is_paused without a credential: {bare.status_code} {bare.text[:300]}")
        self._boundary_checked = True

    def recover(self) -> None:
        if not self._boundary_checked:
            self.check_boundary()
        super().recover()

    def state(self) -> EngineState:
        if not self._boundary_checked:
            self.check_boundary()
        return super().state()

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.post(path, **kwargs)
        if response.status_code >= 400:
            raise ApplyError(f"POST {self.url}{path}: {response.status_code} {response.text[:800]}")
        return response

    def _ranks(self) -> list[dict[str, Any]]:
        response = self._http.post(
            "/collective_rpc", json={"method": "deltasync_status", "kwargs": {"session": self._session}}
        )
        if response.status_code >= 400:
            raise ApplyError(
                f"POST {self.url}/collective_rpc deltasync_status: {response.status_code} {response.text[:300]}; "
                f"start the server with --worker-extension-cls {WORKER_EXTENSION}"
            )
        ranks: list[dict[str, Any]] = response.json().get("results", [])
        return ranks

    def _rpc(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        response = self._post("/collective_rpc", json={"method": method, "kwargs": kwargs})
        ranks: list[dict[str, Any]] = response.json().get("results", [])
        return ranks

    def _label(self) -> str | None:
        response = self._http.get("/weight_info")
        if response.status_code >= 400:
            raise ApplyError(f"GET {self.url}/weight_info: {response.status_code} {response.text[:300]}")
        raw = response.json().get("weight_version")
        return None if raw is None else str(raw)

    def _set_label(self, label: str) -> None:
        self._post("/update_weight_version", json={"new_version": label})

    def _call(self, method: str, body: dict[str, Any] | None = None) -> None:
        self._post(f"/{method}", json=body if body is not None else {})

    def is_paused(self) -> bool:
        """Whether the server is paused."""
        return bool(self._http.get("/is_paused").json().get("is_paused"))

    def pause(self) -> None:
        self._post("/pause", params={"mode": self.pause_mode})

    def resume(self) -> None:
        self._post("/resume")
