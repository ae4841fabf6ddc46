"""The trainer side: copy the weights of a step, then diff, encode, upload and register in the background.

A plain state dict or module (one process), or FSDP2 DTensors: each rank diffs its own ``Shard(0)`` rows
against its own previous copy and writes its own shard file (:mod:`deltasync._sharding`); rank 0 writes the
manifest last and registers once (:mod:`deltasync._commit`). Nothing is ever gathered.

One publisher per run: rank 0 takes the coordinator's publisher lease at start (a second publisher gets a
clear error naming the first) and every registration carries it, so a publisher that lost it can never
register again. Every store write is create-only.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from typing import TypeVar

import torch
import torch.distributed as dist

from ._commit import LeaseKeeper, RankCommit, first_free_version, taken_versions
from ._sharding import TensorView, dense_entries, globalize, local_tensors
from ._squash import SquashTracker, fleet_bases
from .client import CoordinatorClient, Lease
from .config import PublisherConfig
from .diff import compute_delta
from .errors import CoordinatorError, DeltaSyncError, LeaseError, VersionTaken
from .format import TensorDelta
from .lora import ADAPTER_PREFIX, AdapterNames, adapter_state, lora_merged_state
from .manifest import AdapterEntry, DeltaManifest
from .names import NameMap
from .runrecord import adopt_run, claim_run, record_epoch
from .signing import SigningKey
from .sketch import Sketch, parse_sketch
from .store import Store, open_store
from .vocab import DTYPE_NAMES, MAX_VERSION, Kind
from .writer import ObjectWriter

__all__ = ["ADAPTER_ANCHOR_BYTES_FRACTION", "MODEL_ANCHOR_BYTES_FRACTION", "Publisher"]

MODEL_ANCHOR_BYTES_FRACTION = 0.5
"""``anchor_bytes_fraction="auto"`` for a model's weights: an anchor once the deltas since the last one pass half
its bytes (a new agent fetches at most 1.5 anchors' bytes)."""
ADAPTER_ANCHOR_BYTES_FRACTION = 4.0
"""``anchor_bytes_fraction="auto"`` for a LoRA adapter: its deltas are near-dense (each about an anchor's bytes),
so 0.5 would write an anchor every other version; at 4 a new agent fetches at most about five anchors' bytes."""

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Item:
    version: int
    step: int | None
    buffers: dict[str, torch.Tensor]
    coalesced: list[int] = dataclasses.field(default_factory=list)


class Publisher:
    """Publishes a training run's weights as deltas and anchors, off the training thread.

    ``publish`` copies the weights (cast to the published dtype) into a host buffer and **returns before
    anything is written**; a background worker diffs against the last published version, encodes, writes
    shards and then the manifest, and registers the version with the coordinator. Call :meth:`flush` to wait
    until every queued version is registered (``close`` and the context manager flush too). Besides the
    version being written, the queue holds ``config.queue_size`` versions: when it is full ``publish`` waits,
    or (``coalesce=True``) merges into the newest queued version, which is then one exact delta against the
    last published base. No version is dropped silently and memory is bounded: ``queue_size + 2`` copies of
    this rank's weights (queued, being written, last published).

    With ``torch.distributed`` initialized, construct it on every rank (it creates a gloo group for its
    metadata) and call ``publish`` on every rank in the same order.

    A background failure is raised by the next ``publish``, ``flush`` or ``close``; the publisher is then
    unusable, and a new one starts with an anchor.

    Args:
        store: a store or store URI.
        coordinator: where to register versions (rank 0), or ``None`` to only write the store; several
            replicas of one ledger in one client fail over safely (a retried registration is idempotent).
        config: encoding, anchors, queue, signing key, lease.
        name_map: runtime to checkpoint names (default: strip FSDP, DDP, compile and PEFT wrappers).
        merge_lora: publish a PEFT model's LoRA adapters merged into the base weights.
        adapter: publish a PEFT model's LoRA adapter itself, not merged (:func:`deltasync.lora.adapter_entry`
            describes it): each version is the adapter's tensors (a PEFT model, or its adapter state dict by
            PEFT's saved names), and every manifest names the adapter and its base model, so that an engine
            serving another base or another adapter refuses it before the first write.

    Raises:
        LeaseError: another publisher holds the run (the message names it and when its lease expires).

    Example:
        >>> with Publisher("/data/run1", CoordinatorClient(url, token=t)) as pub:  # doctest: +SKIP
        ...     for step in range(steps):
        ...         train_step()
        ...         pub.publish(model, step)   # returns after the copy
        ...     pub.flush()                    # every version written and registered
    """

    def __init__(
        self,
        store: Store | str,
        coordinator: CoordinatorClient | None = None,
        config: PublisherConfig | None = None,
        *,
        name_map: NameMap | None = None,
        merge_lora: bool = False,
        adapter: AdapterEntry | None = None,
    ) -> None:
        if adapter is not None and merge_lora:
            raise ValueError(
                "merge_lora publishes the adapter merged into the base weights, adapter= the adapter itself: choose one"
            )
        self.store = open_store(store) if isinstance(store, str) else store
        self.coordinator = coordinator
        self.config = config or PublisherConfig()
        self.name_map, self.merge_lora, self.adapter = name_map or NameMap(), merge_lora, adapter
        if adapter is not None:
            self.name_map = name_map or AdapterNames()
        self.dtype: torch.dtype = getattr(torch, self.config.dtype)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self._group = dist.new_group(backend="gloo") if self.world > 1 else None
        self._lease = self._take_lease()
        signing = SigningKey.from_file(self.config.signing_key) if self.config.signing_key else None
        run_id, epoch = self._start_run(signing)
        writer = ObjectWriter(
            store=self.store,
            encoding=self.config.encoding,
            anchor_encoding=self.config.anchor_encoding,
            zstd_level=self.config.zstd_level,
            max_shard_bytes=self.config.max_shard_bytes,
            signing_key=signing,
            model_id=self.config.model_id,
            run_id=run_id,
            lease_epoch=epoch,
            adapter=adapter,
        )
        self._commit = RankCommit(
            writer,
            coordinator if self.rank == 0 else None,
            self._lease,
            rank=self.rank,
            world=self.world,
            group=self._group,
        )
        self._next_version = self._first_version()
        self._views: dict[str, TensorView] | None = None
        self._free: list[dict[str, torch.Tensor]] = []
        self._allocated = 0
        self._queue: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self.last_blocked_s = 0.0
        """Seconds the last ``publish`` held the caller (resolve + copy + any back-pressure wait)."""
        self.last_timings: dict[str, float] = {}
        """Seconds of each stage of the background work of the last version written (read after :meth:`flush`):
        ``diff`` (with the changed tensors' checksums), ``sketch`` (the changed tensors' sketches), ``encode``,
        ``write`` (the shards), ``register`` (the manifest and the registration), ``anchor`` and ``squash`` (the
        objects beside a delta, when due) and ``total``."""
        # worker-only state
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._sketches: dict[str, Sketch] = {}
        self._checksums: dict[str, str] = {}
        """The checksum of each tensor (this rank's span) in ``_snapshot``: a squash's entries carry them."""
        """The sketch of each tensor (this rank's span) in ``_snapshot``, moved by each delta's changes."""
        self._last_version: int | None = None
        self._last_anchor: tuple[int, int] = (0, 0)  # (version, bytes)
        self._bytes_since_anchor = 0
        self._squashes: SquashTracker | None = None  # made at the first delta, once the views are known
        self._worker = threading.Thread(target=self._run, name="deltasync-publisher", daemon=True)
        self._worker.start()

    @property
    def published(self) -> list[DeltaManifest]:
        """Rank 0: the manifests committed so far (deltas and anchors), in order."""
        return self._commit.published

    @property
    def squashes(self) -> list[DeltaManifest]:
        """Rank 0: the squashes committed so far (deltas from a lagging agent's version, beside the chain)."""
        return self._commit.squashes

    @property
    def lease(self) -> Lease | None:
        """Rank 0: the run's publisher lease this publisher holds (``None`` without a coordinator)."""
        return self._lease.lease if self._lease is not None else None

    # ------------------------------------------------------------------ start-up

    def _broadcast(self, value: _T) -> _T:
        if self._group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _take_lease(self) -> LeaseKeeper | None:
        if self.rank != 0 or self.coordinator is None:
            return None
        # unique per publisher: a lease held under this name is this publisher's own (see below)
        holder = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(3)}"
        deadline = time.monotonic() + self.config.lease_wait_s
        while True:
            try:
                lease = self.coordinator.acquire_lease(holder, ttl_s=self.config.lease_ttl_s)
                break
            except LeaseError as exc:
                if exc.orphaned:  # our own attempt took it and its answer was lost (a replica went away): it
                    # is never renewed, so wait for it to lapse rather than fail; no other publisher holds the run
                    logger.warning("publisher lease: waiting for this publisher's orphaned lease to lapse (%s)", exc)
                    deadline = max(deadline, time.monotonic() + self.config.lease_ttl_s + 1)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(1.0, self.config.lease_ttl_s / 10))
        logger.info("publisher lease taken: run %s, epoch %d", lease.run_id, lease.epoch)
        return LeaseKeeper(self.coordinator, lease, self.config.lease_ttl_s)

    def _start_run(self, signing: SigningKey | None) -> tuple[str, int | None]:
        """Every rank: the run and epoch rank 0 recorded; a refusal is raised on every rank."""
        found: tuple[str, int | None] | None = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                found = self._record_run(signing)
            except BaseException as exc:
                error = exc
                if self._lease is not None:
                    self._lease.close()  # the next publisher need not wait for the lease to lapse
        shared = self._broadcast((found, None if error is None else f"{type(error).__name__}: {error}"))
        if error is not None:
            raise error
        if shared[1] is not None:
            raise RuntimeError(f"rank 0 could not start the run: {shared[1]}")
        assert shared[0] is not None
        return shared[0]

    def _record_run(self, signing: SigningKey | None) -> tuple[str, int | None]:
        """Rank 0: the run and lease epoch every manifest names, recorded in the store (:mod:`.runrecord`).

        With a coordinator the run is the ledger's, and this publisher's epoch is recorded with the newest
        version the ledger had registered: an older epoch's object above it is a fenced writer's. Without
        one the run is the store's own (made now for a new store).

        Raises:
            ForeignObject: the store belongs to another run.
        """
        if self._lease is None:
            return adopt_run(self.store, signing), None
        lease = self._lease.lease
        claim_run(self.store, lease.run_id, signing)
        through = lease.next_version - 1 if lease.next_version > 0 else None
        record_epoch(self.store, lease.run_id, lease.epoch, through, signing)
        return lease.run_id, lease.epoch

    def _first_version(self) -> int:
        """Every rank: the first version to publish (rank 0 decides).

        Raises:
            VersionTaken: no version is left above the keys in the store (the publisher's lease is given back).
        """
        version = self.config.start_version
        problem: tuple[str, str, int] | None = None
        if version is None and self.rank == 0:
            keys = self._store_keys()
            taken = taken_versions(keys)
            if self._lease is not None:
                # the ledger is the run's record of its versions: the first one above them that holds no key
                # (a key above the ledger is a crash's leftover or a planted one, never the run's: no version is
                # written twice, and a key planted far ahead does not use up the versions)
                version = first_free_version(taken, self._lease.lease.next_version)
            else:
                # without a ledger, above every key in the store (committed, left by a crash, or planted)
                version = first_free_version(set(), max(taken, default=-1) + 1)
            if version is None:
                top = max(taken)
                key = min(k for k in keys if taken_versions([k]) == {top})
                problem = (
                    f"{self.store.uri}/{key}: a key at v{top} leaves this publisher no version to publish (it "
                    f"starts above {'the ledger and ' if self._lease is not None else ''}every key in the store, "
                    f"and v{MAX_VERSION} is the last). If no publisher of this run wrote it (a store writer "
                    "planted it), delete it; else publish the run to a fresh store prefix",
                    key,
                    top,
                )
        version, problem = self._broadcast((version, problem))
        if problem is not None:
            if self._lease is not None:
                self._lease.close()  # the next publisher need not wait for the lease to lapse
            message, key, top = problem
            raise VersionTaken(message, key=key, version=top)
        assert isinstance(version, int)
        return version

    def _store_keys(self) -> list[str]:
        try:
            return self.store.list("")
        except FileNotFoundError:
            return []

    # ------------------------------------------------------------------ the training thread

    def publish(self, state: torch.nn.Module | Mapping[str, torch.Tensor], step: int | None = None) -> int:
        """Copy the weights of this step and queue them; returns the version they will have. Nothing is
        written yet when it returns (see :meth:`flush`). Where a store writer takes a key of that version first,
        it and every later version move up past it (with a coordinator; see :meth:`_publish_object`): the
        warning says so, and :attr:`published` holds the versions written.

        Blocks only for the copy (and while the queue is full, unless ``coalesce``).

        Raises:
            Exception: the error of a failed background publish, if any.
            ValueError: the model's names or shapes changed since the first publish.
        """
        t0 = time.perf_counter()
        self._raise_if_failed()
        local = self._resolve(state)
        with self._cond:
            while not self._free and self._allocated > self.config.queue_size and self._error is None:
                if self.config.coalesce and self._queue:
                    return self._coalesce(local, step, t0)
                self._cond.wait()
            self._raise_if_failed()
            buffers = self._free.pop() if self._free else self._allocate(local)
            version = self._next_version
            self._next_version += 1
        self._copy(local, buffers)
        with self._cond:
            self._queue.append(_Item(version=version, step=step, buffers=buffers))
            self._cond.notify_all()
        self.last_blocked_s = time.perf_counter() - t0
        return version

    def _coalesce(self, local: dict[str, torch.Tensor], step: int | None, t0: float) -> int:
        # called with the lock held: the worker cannot take this item while we overwrite it
        item = self._queue[-1]
        self._copy(local, item.buffers)
        item.coalesced.append(item.version)
        item.version, item.step = self._next_version, step
        self._next_version += 1
        logger.info(
            "coalesced queued v%d into v%d (one exact delta against the last published base)",
            item.coalesced[-1],
            item.version,
        )
        self.last_blocked_s = time.perf_counter() - t0
        return item.version

    def flush(self) -> None:
        """Wait until every queued version is written and registered; raise a background failure."""
        with self._cond:
            while (self._queue or self._busy) and self._error is None:
                self._cond.wait()
        self._raise_if_failed()

    def close(self) -> None:
        """Flush, stop the worker and release the lease. Idempotent."""
        try:
            if not self._closed:
                self.flush()
        finally:
            with self._cond:
                was_closed, self._closed = self._closed, True
                self._cond.notify_all()
            self._worker.join()
            if self._lease is not None and not was_closed:
                self._lease.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _resolve(self, state: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's local tensors by checkpoint name; fixes the views at the first call."""
        if self.adapter is not None:
            state = adapter_state(state, self.adapter.adapter_name) if isinstance(state, torch.nn.Module) else state
            if not state or not all(n.startswith(ADAPTER_PREFIX) for n in state):
                wrong = next((n for n in state if not n.startswith(ADAPTER_PREFIX)), "nothing")
                raise ValueError(
                    f"an adapter publisher publishes a PEFT model's adapter tensors (names {ADAPTER_PREFIX}...), "
                    f"got {wrong!r}: pass the PEFT model or its get_peft_model_state_dict()"
                )
        if self.merge_lora and isinstance(state, torch.nn.Module):
            state = lora_merged_state(state, self.dtype)  # merged on copies: the trainer's weights stay as they are
        local, views = local_tensors(state, name_map=self.name_map, rank=self.rank)
        if self._views is None:
            self._views = views
        elif views != self._views:
            changed = sorted(set(views) ^ set(self._views) | {n for n in views if self._views.get(n) != views[n]})
            raise ValueError(
                f"the model changed since the first publish ({changed[:5]}): names, shapes and "
                "sharding must stay the same; start a new Publisher (it begins with an anchor)"
            )
        return local

    def _allocate(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pin = any(t.is_cuda for t in local.values())
        self._allocated += 1
        return {n: torch.empty(t.shape, dtype=self.dtype, pin_memory=pin) for n, t in local.items()}

    def _copy(self, local: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in local.items():
                buffers[name].copy_(tensor, non_blocking=tensor.is_cuda)
        if any(t.is_cuda for t in local.values()):
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ the worker thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy = True
            spare: dict[str, torch.Tensor] | None = None
            try:
                spare = self._process(item)
            except BaseException as exc:  # surfaced by the next publish/flush/close on the training thread
                logger.error("publishing v%d failed: %s: %s", item.version, type(exc).__name__, exc)
                with self._cond:
                    self._error = exc
                    self._queue.clear()
            finally:
                with self._cond:
                    if spare is not None:
                        self._free.append(spare)
                    elif self._snapshot is item.buffers:
                        self._allocated -= 1  # it became the snapshot: no longer part of the queue's budget
                    self._busy = False
                    self._cond.notify_all()

    def _process(self, item: _Item) -> dict[str, torch.Tensor] | None:
        """Publish one version; returns the buffer set that is free again."""
        t0 = time.perf_counter()
        new = item.buffers
        timings: dict[str, float] = {}
        assert self._views is not None
        if self._snapshot is None:
            entries = dense_entries(new, self._views)
            self._sketches = {d.ckpt_name: parse_sketch(str(d.sketch)) for d in entries}
            self._checksums = {d.ckpt_name: str(d.checksum) for d in entries}
            timings["sketch"] = time.perf_counter() - t0
            self._publish_object(item, "anchor", entries, base_version=None, timings=timings)
            self._snapshot, spare = new, None
        else:
            # one pass over both versions: the changes and each changed tensor's digest; its sketch is the served
            # one moved by the changes (linear), so the background work is that pass plus O(changed)
            changes = compute_delta(self._snapshot, new, checksums=True)
            t1 = time.perf_counter()
            deltas = []
            for d in changes.values():
                name = d.ckpt_name
                entry, self._sketches[name] = globalize(d, new[name], self._views[name], served=self._sketches[name])
                self._checksums[name] = str(entry.checksum)
                deltas.append(entry)
            timings.update(diff=t1 - t0, sketch=time.perf_counter() - t1)
            self._bytes_since_anchor += self._publish_object(
                item, "delta", deltas, base_version=self._last_version, timings=timings
            )
            self._snapshot, spare = new, self._snapshot  # double buffering: no copy, no scatter
            t2 = time.perf_counter()
            if self._anchor_due(item.version):
                self._publish_object(
                    item, "anchor", dense_entries(new, self._views), base_version=None, beside_delta=True
                )
            t3 = time.perf_counter()
            self._squash(item.version, self._last_version, changes, new)
            timings.update(anchor=t3 - t2, squash=time.perf_counter() - t3)
        self._last_version = item.version
        timings["total"] = time.perf_counter() - t0
        self.last_timings = timings
        logger.info(
            "published v%d (step %s%s) in %.0f ms",
            item.version,
            item.step,
            f", coalesced {item.coalesced}" if item.coalesced else "",
            timings["total"] * 1e3,
        )
        return spare

    def _publish_object(
        self,
        item: _Item,
        kind: Kind,
        deltas: list[TensorDelta],
        *,
        base_version: int | None,
        beside_delta: bool = False,
        timings: dict[str, float] | None = None,
    ) -> int:
        """Publish one object of ``item``'s version; returns its bytes (``timings``: :meth:`RankCommit.publish`'s).

        A version whose key a store writer took first is skipped for the next free one, where the publisher holds
        the run's lease (:meth:`RankCommit._decide`): this item and every later one move up alike on every rank.
        An anchor beside its version's committed delta is not written then (the next version's check tries again).

        Raises:
            VersionTaken: a key is taken, and the publisher holds no lease (or no version is free).
        """
        assert self._views is not None
        while True:
            try:
                total = self._commit.publish(
                    item.version,
                    kind,
                    deltas,
                    base_version=base_version,
                    views=self._views,
                    dtype_name=DTYPE_NAMES[self.dtype],
                    timings=timings,
                )
                break
            except VersionTaken as exc:
                if exc.next_free is None:
                    raise
                if beside_delta:
                    logger.warning(
                        "%s: no anchor at v%d (the next version's anchor check tries again)", exc, item.version
                    )
                    return 0
                self._move_up(item, exc.next_free, exc)
        if kind == "anchor":
            self._last_anchor = (item.version, total)
            self._bytes_since_anchor = 0
        return total

    def _move_up(self, item: _Item, version: int, exc: VersionTaken) -> None:
        """Publish ``item`` as ``version`` instead, and every version queued or published later as many up."""
        with self._cond:
            shift = version - item.version
            for queued in [item, *self._queue]:
                queued.version += shift
            self._next_version += shift
        logger.warning(
            "%s: v%d is skipped, this version is published as v%d and every later one moves up by %d (publish() "
            "returned the numbers before); the ledger never registers v%d, and the coordinator's gc deletes what is "
            "under it",
            exc,
            exc.version,
            version,
            shift,
            exc.version,
        )

    def _squash(
        self,
        version: int,
        base_version: int | None,
        changes: Mapping[str, TensorDelta],
        new: dict[str, torch.Tensor],
    ) -> None:
        """After ``version`` is registered: track its delta, then write a squash to it from each version a lagging
        agent holds (:mod:`deltasync._squash`). Every rank writes its own span, rank 0 commits, as for a delta.

        Best effort: a squash that cannot be written (a taken key, a store fault, a coordinator that does not
        answer) is logged and skipped, never failing the version (agents then take the chain or an anchor). A lost
        lease is raised (the publisher must stop)."""
        window = self.config.squash_window
        if window is None or self.coordinator is None and self.world == 1 or base_version is None:
            return
        assert self._views is not None
        if self._squashes is None:
            self._squashes = SquashTracker(
                window=window,
                max_bases=self.config.squash_bases,
                max_fraction=self.config.squash_max_fraction,
                elements=sum(t.numel() for t in new.values()),
            )
        held = None
        if self.rank == 0 and self.coordinator is not None:
            try:
                held = fleet_bases([a.applied_version for a in self.coordinator.agents() if not a.stale])
            except CoordinatorError as exc:
                logger.warning("no squashes at v%d: the fleet view is unavailable (%s)", version, exc)
        held = self._broadcast(held)  # every rank tracks and writes the same bases
        # bases no agent needs are dropped before this delta is merged into the rest: with no agent behind, the
        # only base is the version before this one, whose union is this delta itself (kept by reference)
        if held is not None:
            self._squashes.keep(version, held)
        self._squashes.observe(base_version, changes)
        if held is None:
            return
        for base in self._squashes.keep(version, held):
            entries = []
            for d in self._squashes.deltas(base, new):
                # each tensor's checksum and sketch at ``version`` are kept up to date by the deltas: no pass
                name = d.ckpt_name
                stamped = dataclasses.replace(d, checksum=self._checksums[name])
                entries.append(globalize(stamped, new[name], self._views[name], sketch=self._sketches[name])[0])
            try:
                self._commit.publish(
                    version, "squash", entries, base_version=base, views=self._views, dtype_name=DTYPE_NAMES[self.dtype]
                )
            except LeaseError:
                raise
            except (DeltaSyncError, RuntimeError, OSError) as exc:  # an optimization: the chain still serves
                logger.warning("squash v%d -> v%d not written: %s", base, version, exc)

    def _anchor_due(self, version: int) -> bool:
        every, fraction = self.config.anchor_every, self.config.anchor_bytes_fraction
        if fraction == "auto":
            fraction = ADAPTER_ANCHOR_BYTES_FRACTION if self.adapter is not None else MODEL_ANCHOR_BYTES_FRACTION
        last_version, last_bytes = self._last_anchor
        due = every is not None and version - last_version >= every
        due = due or (fraction is not None and self._bytes_since_anchor > fraction * last_bytes)
        return bool(self._broadcast(due))  # every rank must agree (rank 0's byte count decides)
