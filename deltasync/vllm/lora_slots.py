"""A served LoRA adapter's weights replaced in place, in the slot vLLM already holds it in.

vLLM keeps each active adapter in one slot of per-layer stacked buffers (``lora_a_stacked[i][slot, 0, :r, :in]``,
``lora_b_stacked[i][slot, 0, :out, :r]``, one per packed slice, sliced per rank at TP > 1), with the scaling
(``alpha / r``) folded into B when the adapter is loaded. Its own way to change an adapter's weights,
``load_inplace``, removes the adapter, frees its slot and loads it again, and stays set on the request, so every
later step reloads it from disk.

:func:`replace_adapter` goes through vLLM's own steps instead, for one adapter already loaded, between two engine
steps (the agent's pause):

1. the staged adapter (a PEFT directory: ``adapter_config.json`` and ``adapter_model.safetensors``) is read and
   validated by vLLM's loader (``_load_adapter``: rank, target modules, dtype), packed and scaled by its manager
   (``_create_merged_loras_inplace``), exactly as a fresh load would;
2. it is refused, before anything is written, unless it has the same modules with the same shapes as the adapter
   it replaces (another rank or other target modules is another adapter, not a version of this one) and holds
   only finite values;
3. each module's slot is written by the layer's own ``set_lora`` (which slices for the rank, zeroes the slot and
   copies), the registered copy is replaced (an adapter that leaves its slot and is activated again comes back at
   this version; one loaded again from disk comes back from its request's path, see :func:`replace_adapter`),
   and a write that fails part-way deactivates the adapter (its next use activates the new version whole:
   never a mix in a slot).

The adapter keeps its slot, its id and its name: requests that name it use the new weights from the next step on.
A request in flight during the swap (the engine paused with ``keep``) continues on the new weights; its earlier
tokens were sampled with the old ones, as for full weights. vLLM keys the prefix cache of an adapter's requests by
its name and path, not its weights: after a replace the caller resets the prefix cache (as the agent does after a
full-weight update), or a later request could reuse KV blocks computed with the old version.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..errors import AdapterRefused, AdapterWriteFailed

if TYPE_CHECKING:
    from ..manifest import AdapterEntry

__all__ = [
    "AdapterRefused",
    "AdapterWriteFailed",
    "adapter_buffers",
    "prove_served_slots",
    "read_adapter_config",
    "replace_adapter",
    "track_served_loads",
    "write_adapter",
]

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def _managers(worker: Any) -> tuple[Any, Any]:
    runner = getattr(worker, "model_runner", None)
    wm = getattr(runner, "lora_manager", None)
    if wm is None:
        raise AdapterRefused("this engine serves no LoRA adapters (start vLLM with --enable-lora)")
    return wm, wm._adapter_manager


def _parts(lora_model: Any) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(module, tensor) for every A and B of every module, packed slices one by one (``None``: a slice the adapter
    does not have)."""
    for name, w in lora_model.loras.items():
        for t in (w.lora_a, w.lora_b):
            for part in t if isinstance(t, list) else [t]:
                yield name, part


def _shapes(lora_model: Any) -> dict[str, list[tuple[int, ...]]]:
    """Module -> the shapes of its (packed) A and B tensors."""
    out: dict[str, list[tuple[int, ...]]] = {name: [] for name in lora_model.loras}
    for name, part in _parts(lora_model):
        out[name].append(tuple(part.shape) if part is not None else ())
    return out


def replace_adapter(worker: Any, lora_int_id: int, adapter_dir: str) -> dict[str, Any]:
    """Replace the weights of the loaded adapter ``lora_int_id`` by the PEFT adapter in ``adapter_dir`` (see the
    module). Returns ``{"slot": int | None, "modules": int, "written": int}`` (``slot`` ``None``: the adapter is
    loaded but not active; its registered copy was replaced and the next activation uses it).

    ``adapter_dir`` should be the directory the adapter is served from, the new version written there atomically
    (a new directory renamed over the old): vLLM loads an adapter again from its request's path when it left the
    CPU cache (more adapters than ``max_cpu_loras``) or after ``finish_weight_update``, which drops every adapter.

    Raises:
        AdapterRefused: not a version of the served adapter (other rank, modules or shapes; a classification head
            or MoE experts, not replaced in place yet; a value that is not finite), the adapter is not loaded, or
            ``adapter_dir`` is not an absolute directory; nothing was written.
        AdapterWriteFailed: a layer's write failed part-way; the adapter was deactivated (its next use activates
            the new version whole).
    """
    import os

    from vllm.lora.request import LoRARequest

    wm, mm = _managers(worker)
    # not a relative name: vLLM would take it for a Hub repository and download it on the engine loop
    if not os.path.isabs(adapter_dir) or not os.path.isdir(adapter_dir):
        raise AdapterRefused(f"{adapter_dir!r} is not an absolute path to a directory holding the staged adapter")
    registered = mm.list_adapters()  # a copy: reading it leaves the cache's eviction order alone
    if lora_int_id not in registered:
        raise AdapterRefused(f"adapter {lora_int_id} is not loaded in this engine: load it once, then replace it")
    old = registered[lora_int_id]
    if getattr(old, "modules_to_save", None) or any(n.endswith(".experts") for n in old.loras):
        raise AdapterRefused(f"adapter {lora_int_id}: a classification head or MoE experts are not replaced in place")
    lora = wm._load_adapter(LoRARequest(f"deltasync-{lora_int_id}", lora_int_id, adapter_dir))
    mm._create_merged_loras_inplace(lora)  # packed and scaled as vLLM's _add_adapter does
    if getattr(lora, "modules_to_save", None):
        raise AdapterRefused(f"{adapter_dir}: a classification head (modules_to_save) is not replaced in place")
    if lora.rank != old.rank:
        raise AdapterRefused(f"{adapter_dir}: rank {lora.rank}, the served adapter {lora_int_id} has rank {old.rank}")
    new_shapes, old_shapes = _shapes(lora), _shapes(old)
    if new_shapes != old_shapes:
        diff = sorted(set(new_shapes) ^ set(old_shapes)) or sorted(
            n for n in new_shapes if new_shapes[n] != old_shapes[n]
        )
        raise AdapterRefused(
            f"{adapter_dir}: not a version of the served adapter {lora_int_id} (modules or shapes differ: "
            f"{diff[:4]}); load it as another adapter"
        )
    for name, part in _parts(lora):
        if part is not None and part.is_floating_point() and not bool(torch.isfinite(part).all()):
            raise AdapterRefused(f"{adapter_dir}: {name} holds NaN or infinite values; nothing was written")
    mm._registered_adapters[lora_int_id] = lora
    slot = mm.lora_index_to_id.index(lora_int_id) if lora_int_id in mm.lora_index_to_id else None
    written = 0
    if slot is not None:
        try:
            for module_name, module in mm.modules.items():
                weights = mm._get_lora_layer_weights(lora, module_name)
                if not weights:
                    module.reset_lora(slot)
                    continue
                module.set_lora(slot, weights.lora_a, weights.lora_b)
                written += 1
        except Exception as exc:
            # never a mix in a slot: the adapter leaves it, and its next use activates the new version whole
            mm.deactivate_adapter(lora_int_id)
            raise AdapterWriteFailed(
                f"adapter {lora_int_id}: writing slot {slot} failed after {written} modules ({exc}); the adapter was "
                "deactivated, its next use loads this version into a slot"
            ) from exc
    return {"slot": slot, "modules": len(lora.loras), "written": written}


def adapter_buffers(worker: Any, lora_int_id: int) -> dict[str, torch.Tensor]:
    """What this rank holds in its LoRA buffers for adapter ``lora_int_id`` (active), by
    ``module.a{i}`` / ``module.b{i}``: the whole slot of each stacked buffer (copies). Two adapters hold the same
    weights when these are equal, bit for bit."""
    _, mm = _managers(worker)
    if lora_int_id not in mm.lora_index_to_id:
        raise AdapterRefused(f"adapter {lora_int_id} is not active in this engine")
    slot = mm.lora_index_to_id.index(lora_int_id)
    out: dict[str, torch.Tensor] = {}
    for module_name, module in mm.modules.items():
        for kind in ("a", "b"):
            stacked = getattr(module, f"lora_{kind}_stacked", None)
            if stacked is None or isinstance(stacked, list):  # MoE keeps per-expert views: not read here
                continue
            for i, t in enumerate(stacked if isinstance(stacked, tuple) else (stacked,)):
                out[f"{module_name}.{kind}{i}"] = t[slot].detach().to("cpu", copy=True)
    return out


def read_adapter_config(adapter_dir: str, base_fingerprint: str) -> AdapterEntry | None:
    """The adapter a PEFT directory holds (its ``adapter_config.json``), as a manifest would name it on the base
    ``base_fingerprint``; ``None`` when there is none yet or it is not a plain LoRA adapter deltasync can serve
    (then the first anchor defines the adapter)."""
    import json
    import os

    from ..manifest import AdapterEntry

    try:
        with open(os.path.join(adapter_dir, CONFIG_FILE), encoding="utf-8") as f:
            config = json.load(f)
        targets = config["target_modules"]
        if config.get("peft_type", "LORA") != "LORA" or not isinstance(targets, list):
            return None
        return AdapterEntry(
            r=int(config["r"]),
            lora_alpha=config["lora_alpha"],
            target_modules=tuple(sorted(set(targets))),
            use_rslora=bool(config.get("use_rslora", False)),
            base_fingerprint=base_fingerprint,
        )
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # a file nested too deep: no adapter
        return None


def write_adapter(adapter_dir: str, tensors: dict[str, torch.Tensor], entry: AdapterEntry) -> None:
    """Make ``adapter_dir`` hold exactly this adapter version, as PEFT saves it: the tensors file first, then the
    config, each written to a fresh private temporary file, flushed and renamed over the served one (a reader never
    sees a torn file; two ranks writing the same version race harmlessly)."""
    import contextlib
    import json
    import os
    import tempfile

    from safetensors.torch import save

    from ..lora import adapter_config_json

    os.makedirs(adapter_dir, exist_ok=True)
    config = (json.dumps(adapter_config_json(entry), indent=2, sort_keys=True) + "\n").encode()
    data = save({n: t.contiguous() for n, t in sorted(tensors.items())}, metadata={"format": "pt"})
    for name, blob in ((ADAPTER_FILE, data), (CONFIG_FILE, config)):
        # a fresh file of ours (O_EXCL, unpredictable name): nothing planted in the directory redirects the write
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=adapter_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # vLLM may read it as another user, as PEFT's own files
            os.replace(tmp, os.path.join(adapter_dir, name))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    fd = os.open(adapter_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _ServedLoads:
    """vLLM's ``_load_adapter`` of one worker, for the adapter served from ``adapter_dir``: each load of it reads the
    engine's own copy of the version (:attr:`copy_dir`, written by the engine with the served directory and proven
    with it), never the served directory itself, so that whoever can write that directory cannot make vLLM
    compute with anything else, even between two proofs; and the ids loaded are recorded, for the whole-state
    proof to read back (vLLM keeps no adapter's path once it is loaded)."""

    def __init__(self, load: Any) -> None:
        self.load = load
        self.adapter_dir: str | None = None
        self.copy_dir: str | None = None
        self.ids: set[int] = set()

    def __call__(self, lora_request: Any) -> Any:
        import os

        import msgspec

        path = os.path.realpath(os.path.expanduser(str(lora_request.lora_path)))
        served = self.adapter_dir is not None and path == self.adapter_dir
        if served and self.copy_dir is not None:
            lora_request = msgspec.structs.replace(lora_request, lora_path=self.copy_dir)
        lora = self.load(lora_request)
        if served:
            self.ids.add(int(lora_request.lora_int_id))
        else:  # the id now names an adapter from elsewhere
            self.ids.discard(int(lora_request.lora_int_id))
        return lora


def track_served_loads(worker: Any, adapter_dir: str, copy_dir: str | None = None) -> _ServedLoads | None:
    """From now on, load the adapter served from ``adapter_dir`` from ``copy_dir`` (the engine's own copy, once it
    has written one) and record the ids of its loads (idempotent; ``None``: the engine serves no LoRA adapters)."""
    import os

    wm = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if wm is None:
        return None
    tracker = wm.__dict__.get("_load_adapter")
    if not isinstance(tracker, _ServedLoads):
        tracker = _ServedLoads(wm._load_adapter)
        wm._load_adapter = tracker  # an instance attribute: every load, vLLM's own included, goes through it
    if tracker.adapter_dir != os.path.realpath(adapter_dir):
        tracker.adapter_dir, tracker.ids = os.path.realpath(adapter_dir), set()
    tracker.copy_dir = copy_dir
    return tracker


def prove_served_slots(worker: Any, adapter_dir: str, copy_dir: str | None = None) -> tuple[list[str], int]:
    """What vLLM computes with for the adapter served from ``adapter_dir``, read back on this rank: every loaded
    copy of it (by the ids :func:`track_served_loads` saw loaded) and, where one is active, its slot in every
    layer's stacked buffers, against vLLM's own fresh load of the engine's copy ``copy_dir`` (else of
    ``adapter_dir``; the caller has proven it against the published checksums): the same loader, packing and
    scaling, and each layer's own ``set_lora`` (which slices for the rank) run on scratch buffers of one slot.
    Nothing live is written. Returns what differs and how many copies were read."""
    from vllm.lora.request import LoRARequest

    tracker = track_served_loads(worker, adapter_dir, copy_dir)
    if tracker is None:
        return [], 0
    wm, mm = _managers(worker)
    registered = mm.list_adapters()
    ids = sorted(i for i in tracker.ids if i in registered)
    if not ids:
        return [], 0
    source = copy_dir or adapter_dir
    fresh = tracker.load(LoRARequest("deltasync-proof", ids[0], source))  # not recorded: proves, serves nothing
    mm._create_merged_loras_inplace(fresh)
    bad: list[str] = []
    for lora_id in ids:
        held = registered[lora_id]
        for module_name in mm.modules:
            want, have = mm._get_lora_layer_weights(fresh, module_name), mm._get_lora_layer_weights(held, module_name)
            if not _same_weights(want, have):
                bad.append(f"adapter {lora_id}: {module_name} (vLLM's loaded copy)")
        if lora_id not in mm.lora_index_to_id:
            continue
        slot = mm.lora_index_to_id.index(lora_id)
        for module_name, module in mm.modules.items():
            for part in _slot_differs(module, slot, mm._get_lora_layer_weights(fresh, module_name)):
                bad.append(f"adapter {lora_id}: {module_name}.{part} (slot {slot})")
    return bad, len(ids)


def _same_weights(a: Any, b: Any) -> bool:
    """Two layers' LoRA weights (``None``, or lists of packed slices) equal bit for bit."""
    if a is None or b is None:
        return a is None and b is None
    for x, y in ((a.lora_a, b.lora_a), (a.lora_b, b.lora_b)):
        xs, ys = (x if isinstance(x, list) else [x]), (y if isinstance(y, list) else [y])
        if len(xs) != len(ys):
            return False
        for p, q in zip(xs, ys, strict=True):
            if (p is None) != (q is None):
                return False
            if p is not None and (p.dtype != q.dtype or p.shape != q.shape or not torch.equal(p, q)):
                return False
    return True


def _slot_differs(module: Any, slot: int, weights: Any) -> list[str]:
    """The stacked buffers (``a0``, ``b1``, ...) of ``module``'s ``slot`` that differ from what the layer's own
    ``set_lora`` (or ``reset_lora``, where the adapter has no weights for it) writes there, computed on a shallow
    copy of the layer whose buffers are scratch tensors of one slot."""
    import copy

    stacks = {kind: getattr(module, f"lora_{kind}_stacked", None) for kind in ("a", "b")}
    if any(s is None for s in stacks.values()):
        return []
    if any(isinstance(s, list) for s in stacks.values()):  # MoE experts: refused in lora mode, not read here
        return ["experts (not read back)"]
    scratch = copy.copy(module)
    for kind, stack in stacks.items():
        parts = stack if isinstance(stack, tuple) else (stack,)
        fresh = tuple(torch.zeros_like(t[slot : slot + 1]) for t in parts)
        setattr(scratch, f"lora_{kind}_stacked", fresh if isinstance(stack, tuple) else fresh[0])
    with torch.no_grad():
        if weights is None:
            scratch.reset_lora(0)
        else:
            scratch.set_lora(0, weights.lora_a, weights.lora_b)
    out = []
    for kind, stack in stacks.items():
        parts = stack if isinstance(stack, tuple) else (stack,)
        want = getattr(scratch, f"lora_{kind}_stacked")
        for i, (live, expected) in enumerate(zip(parts, want if isinstance(want, tuple) else (want,), strict=True)):
            if not torch.equal(live[slot], expected[0]):
                out.append(f"{kind}{i}")
    return out
