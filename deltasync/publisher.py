"""The trainer side: copy the weights of a step, then diff, encode, upload and register in the background.

A plain state dict or module (one process), or FSDP2 DTensors: each rank diffs its own ``Shard(0)`` rows
against its own previous copy, writes its own shard file (global flat indices and a ``span``), and sends only
small metadata to rank 0, which writes the manifest last and registers once. Nothing is ever gathered.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ._header import DTYPE_NAMES, Kind
from .client import CoordinatorClient
from .config import PublisherConfig
from .diff import compute_delta
from .format import TensorDelta, encode_shard, tensor_checksum
from .manifest import ChecksumPart, DeltaManifest, ShardEntry, TensorEntry
from .names import NameMap, checkpoint_state, lora_merged_state
from .protocol import VersionCreate
from .store import Store, open_store
from .versions import commit_manifest, group_by_size, list_versions, object_prefix, shard_entry

__all__ = ["Publisher"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _View:
    """One tensor as this rank sees it."""

    shape: tuple[int, ...]
    """Full (global) shape."""
    span: tuple[int, int] | None
    """This rank's flat element range (FSDP ``Shard(0)`` rows); ``None``: the whole tensor."""
    owned: bool
    """This rank publishes it (its rows, or rank 0 for replicated tensors)."""


@dataclasses.dataclass
class _Item:
    version: int
    step: int | None
    buffers: dict[str, torch.Tensor]
    coalesced: list[int] = dataclasses.field(default_factory=list)


class Publisher:
    """Publishes a training run's weights as deltas and anchors, off the training thread.

    ``publish`` copies the weights (cast to the published dtype) into a host buffer and returns; a
    background worker diffs against the last published version, encodes, writes shards and then the
    manifest, and registers the version with the coordinator. Besides the version being written, the
    queue holds ``config.queue_size`` versions: when it is full ``publish`` waits, or (``coalesce=True``)
    merges into the newest queued version, which is then one exact delta against the last published base.
    No version is dropped silently and memory is bounded: ``queue_size + 2`` copies of this rank's weights
    (queued, being written, last published).

    With ``torch.distributed`` initialized, construct it on every rank (it creates a gloo group for its
    metadata) and call ``publish`` on every rank in the same order.

    A background failure is raised by the next ``publish``, ``flush`` or ``close``; the publisher is then
    unusable, and a new one starts with an anchor.

    Args:
        store: a store or store URI.
        coordinator: where to register versions (rank 0), or ``None`` to only write the store.
        config: encoding, anchors, queue.
        name_map: runtime to checkpoint names (default: strip FSDP, DDP, compile and PEFT wrappers).
        merge_lora: publish a PEFT model's LoRA adapters merged into the base weights.

    Example:
        >>> with Publisher("/data/run1", CoordinatorClient(url, token=t)) as pub:  # doctest: +SKIP
        ...     for step in range(steps):
        ...         train_step()
        ...         pub.publish(model, step)
    """

    def __init__(
        self,
        store: Store | str,
        coordinator: CoordinatorClient | None = None,
        config: PublisherConfig | None = None,
        *,
        name_map: NameMap | None = None,
        merge_lora: bool = False,
    ) -> None:
        self.store = open_store(store) if isinstance(store, str) else store
        self.coordinator = coordinator
        self.config = config or PublisherConfig()
        self.name_map, self.merge_lora = name_map or NameMap(), merge_lora
        self.dtype: torch.dtype = getattr(torch, self.config.dtype)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self._group = dist.new_group(backend="gloo") if self.world > 1 else None
        self._next_version = self._first_version()
        self._views: dict[str, _View] | None = None
        self._free: list[dict[str, torch.Tensor]] = []
        self._allocated = 0
        self._queue: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self.last_blocked_s = 0.0
        """Seconds the last ``publish`` held the caller (resolve + copy + any back-pressure wait)."""
        self.published: list[DeltaManifest] = []
        """Rank 0: the manifests committed so far (deltas and anchors), in order."""
        # worker-only state
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._parts: dict[str, list[ChecksumPart]] = {}
        self._last_version: int | None = None
        self._last_anchor: tuple[int, int] = (0, 0)  # (version, bytes)
        self._bytes_since_anchor = 0
        self._worker = threading.Thread(target=self._run, name="deltasync-publisher", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ the training thread

    def publish(self, state: torch.nn.Module | Mapping[str, torch.Tensor], step: int | None = None) -> int:
        """Copy the weights of this step and queue them; returns the version they will have.

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
        """Flush, then stop the worker. Idempotent."""
        try:
            if not self._closed:
                self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._worker.join()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _first_version(self) -> int:
        version = self.config.start_version
        if version is None and self.rank == 0:
            committed = list_versions(self.store) if self._store_exists() else []
            version = committed[-1].version + 1 if committed else 0
        if self._group is not None:
            box = [version]
            dist.broadcast_object_list(box, src=0, group=self._group)
            version = box[0]
        assert version is not None
        return version

    def _store_exists(self) -> bool:
        try:
            self.store.list("")
            return True
        except FileNotFoundError:
            return False

    def _resolve(self, state: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's local tensors by checkpoint name; fixes the views at the first call."""
        if isinstance(state, torch.nn.Module):
            raw = lora_merged_state(state, self.dtype) if self.merge_lora else state.state_dict()
        else:
            raw = dict(state)
        named = checkpoint_state(raw, self.name_map)
        local: dict[str, torch.Tensor] = {}
        views: dict[str, _View] = {}
        for name, tensor in named.items():
            if not tensor.is_floating_point():
                continue  # integer buffers are not weights vLLM loads
            view, part = self._view(name, tensor)
            views[name] = view
            if view.owned and part is not None:
                local[name] = part
        if self._views is None:
            self._views = views
        elif views != self._views:
            changed = sorted(set(views) ^ set(self._views) | {n for n in views if self._views.get(n) != views[n]})
            raise ValueError(
                f"the model changed since the first publish ({changed[:5]}): names, shapes and "
                "sharding must stay the same; start a new Publisher (it begins with an anchor)"
            )
        return local

    def _view(self, name: str, tensor: torch.Tensor) -> tuple[_View, torch.Tensor | None]:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(tensor, DTensor):
            return _View(tuple(tensor.shape), None, self.rank == 0), tensor.detach()
        placements = tensor.placements
        if all(isinstance(p, Replicate) for p in placements):
            return _View(tuple(tensor.shape), None, self.rank == 0), tensor.to_local().detach()
        if len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local_shape, offset = compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )
            row = math.prod(tensor.shape[1:])
            rows = local_shape[0] if local_shape else 0
            if rows == 0:  # uneven sharding: this rank holds no rows of this tensor
                return _View(tuple(tensor.shape), None, False), None
            span = (offset[0] * row, (offset[0] + rows) * row)
            return _View(tuple(tensor.shape), span, True), tensor.to_local().detach()
        raise ValueError(
            f"tensor {name!r}: placement {placements} is not supported; deltasync publishes Shard(0) "
            "on a 1-D mesh (FSDP2) or replicated tensors without gathering"
        )

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
        if self._snapshot is None:
            self._publish_object(item.version, "anchor", self._dense(new), base_version=None)
            self._snapshot, spare = new, None
        else:
            changes = compute_delta(self._snapshot, new)
            deltas = [self._globalize(d, new[d.ckpt_name]) for d in changes.values()]
            manifest_bytes = self._publish_object(item.version, "delta", deltas, base_version=self._last_version)
            self._bytes_since_anchor += manifest_bytes
            self._snapshot, spare = new, self._snapshot  # double buffering: no copy, no scatter
            if self._anchor_due(item.version):
                self._publish_object(item.version, "anchor", self._dense(new), base_version=None)
        self._last_version = item.version
        logger.info(
            "published v%d (step %s%s) in %.0f ms",
            item.version,
            item.step,
            f", coalesced {item.coalesced}" if item.coalesced else "",
            (time.perf_counter() - t0) * 1e3,
        )
        return spare

    def _anchor_due(self, version: int) -> bool:
        every, fraction = self.config.anchor_every, self.config.anchor_bytes_fraction
        last_version, last_bytes = self._last_anchor
        due = every is not None and version - last_version >= every
        due = due or (fraction is not None and self._bytes_since_anchor > fraction * last_bytes)
        if self._group is not None:  # every rank must agree (rank 0's byte count decides)
            box = [due]
            dist.broadcast_object_list(box, src=0, group=self._group)
            due = bool(box[0])
        return due

    def _span_of(self, name: str) -> tuple[int, int] | None:
        assert self._views is not None
        return self._views[name].span

    def _dense(self, buffers: dict[str, torch.Tensor]) -> list[TensorDelta]:
        out = []
        for name, t in buffers.items():
            view = self._views[name] if self._views else None
            assert view is not None
            span = view.span
            out.append(
                TensorDelta(
                    ckpt_name=name,
                    shape=view.shape,
                    dtype=t.dtype,
                    indices=None,
                    values=t if span is None else t.reshape(-1),
                    span=span,
                    checksum=tensor_checksum(t),
                )
            )
        return out

    def _globalize(self, d: TensorDelta, new: torch.Tensor) -> TensorDelta:
        """A local delta (this rank's rows) in global flat coordinates."""
        span = self._span_of(d.ckpt_name)
        assert self._views is not None
        shape = self._views[d.ckpt_name].shape
        checksum = tensor_checksum(new)
        if span is None:
            return dataclasses.replace(d, checksum=checksum)
        if d.indices is None:
            base = d.base_values.reshape(-1) if d.base_values is not None else None
            return dataclasses.replace(
                d, shape=shape, values=d.values.reshape(-1), base_values=base, span=span, checksum=checksum
            )
        return dataclasses.replace(d, shape=shape, indices=d.indices + span[0], span=span, checksum=checksum)

    def _publish_object(self, version: int, kind: Kind, deltas: list[TensorDelta], *, base_version: int | None) -> int:
        """Write this rank's shards; rank 0 writes the manifest last and registers. Returns the object's bytes."""
        cfg = self.config
        entries: list[tuple[int, ShardEntry, list[str]]] = []
        blobs: list[tuple[str, bytes]] = []
        groups = [deltas] if self.world > 1 else group_by_size(deltas, cfg.max_shard_bytes)
        for g, group in enumerate(groups):
            if not group:
                continue
            index = self.rank if self.world > 1 else g
            data = encode_shard(
                group,
                kind=kind,
                encoding=cfg.encoding,
                target_version=version,
                base_version=base_version,
                zstd_level=cfg.zstd_level,
            )
            entry = shard_entry(index, data)
            blobs.append((object_prefix(version, kind) + entry.file, data))
            entries.append((index, entry, [d.ckpt_name for d in group]))
        self.store.put_many(blobs)  # this rank's shards in one batch; rank 0 commits the manifest later
        meta: dict[str, Any] = {
            "entries": entries,
            "tensors": {d.ckpt_name: (d.nnz, (*(d.span or (0, math.prod(d.shape))), d.checksum)) for d in deltas},
        }
        metas: list[Any] = [meta]
        if self._group is not None:
            metas = [None] * self.world
            dist.all_gather_object(metas, meta, group=self._group)
        status: list[Any] = [None]
        if self.rank == 0:
            try:
                total = self._commit(version, kind, base_version, metas)
                status = [("ok", total)]
            except BaseException as exc:
                status = [("error", f"{type(exc).__name__}: {exc}")]
                if self._group is None:
                    raise
        if self._group is not None:
            dist.broadcast_object_list(status, src=0, group=self._group)
        outcome, detail = status[0]
        if outcome != "ok":
            raise RuntimeError(f"rank 0 could not commit {kind} v{version}: {detail}")
        return int(detail)

    def _commit(self, version: int, kind: Kind, base_version: int | None, metas: list[dict[str, Any]]) -> int:
        assert self._views is not None
        shards = sorted((index, entry, names) for m in metas for index, entry, names in m["entries"])
        position = {index: i for i, (index, _, _) in enumerate(shards)}
        where: dict[str, set[int]] = collections.defaultdict(set)
        for index, _, names in shards:
            for n in names:
                where[n].add(position[index])
        nnz: dict[str, int] = collections.Counter()
        for m in metas:
            for name, (count, part) in m["tensors"].items():
                nnz[name] += count
                parts = [p for p in self._parts.get(name, []) if (p[0], p[1]) != (part[0], part[1])]
                self._parts[name] = sorted([*parts, tuple(part)])
        tensors = {
            name: TensorEntry(
                shape=view.shape,
                dtype=DTYPE_NAMES[self.dtype],
                nnz=nnz.get(name, 0),
                shards=tuple(sorted(where.get(name, ()))),
                checksums=tuple(self._parts[name]),
            )
            for name, view in sorted(self._views.items())
        }
        manifest = DeltaManifest(
            kind=kind,
            version=version,
            base_version=base_version,
            encoding=self.config.encoding,
            shards=tuple(e for _, e, _ in shards),
            tensors=tensors,
        )
        manifest = DeltaManifest.from_json(manifest.to_json(), name=f"{kind} v{version}")  # validate before commit
        commit_manifest(self.store, manifest)
        if self.coordinator is not None:
            self.coordinator.register_version(VersionCreate.for_manifest(manifest))
        if kind == "anchor":
            self._last_anchor = (version, manifest.total_bytes)
            self._bytes_since_anchor = 0
        self.published.append(manifest)
        return manifest.total_bytes
