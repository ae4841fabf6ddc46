"""``lora`` mode (:class:`ServedAdapter`): the engine serves a LoRA adapter's versions on its base model, from the
directory its requests name (``lora_path``), and from a private copy of it that vLLM's loads of the served adapter
read (:func:`~deltasync.vllm.lora_slots.track_served_loads`).

A host copy of the adapter (the shadow, small) receives the objects as in ``reload`` mode; at the end of the session
both directories are made to hold the new version (each file renamed over the served one), and vLLM's own session
end drops every loaded adapter, so the next step loads this version through vLLM's LoRA manager, validated as any
load is. The whole-state proof reads both directories back (:func:`adapter_dir_differs`).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch

from ..errors import ApplyError, RefusalReason, UpdateRefused
from ..format import TensorDelta, tensor_checksum
from ..lora import adapter_config_json
from ..manifest import AdapterEntry, DeltaManifest
from ..vocab import DTYPES
from .label import Label
from .lora_slots import ADAPTER_FILE, CONFIG_FILE, read_adapter_config, track_served_loads, write_adapter
from .model import ServedModel

__all__ = ["ServedAdapter", "adapter_dir_differs"]


class ServedAdapter:
    """The adapter one engine serves in ``lora`` mode.

    Args:
        served: the served (base) model: its shadow holds the adapter, its fingerprint is the adapters' base.
        label: the engine's label (the served version's manifest names the adapter).
        lora_config: vLLM's LoRA configuration (``None``: started without ``--enable-lora``).
    """

    def __init__(self, served: ServedModel, label: Label, lora_config: Any) -> None:
        self.served, self.label, self.lora_config = served, label, lora_config
        self.directory: str | None = None
        """The directory the adapter is served from (its requests' ``lora_path``)."""
        self.copy: str | None = None
        """This worker's private copy of the served version, which vLLM's loads of the served adapter read (written
        with :attr:`directory`, at each session's end)."""

    def serve_from(self, directory: str) -> None:
        """The claim names the served directory: the shadow reads the adapter there."""
        if directory != self.directory:
            self.directory = directory
            self.served.set_source(directory)
            self.copy = None

    def served_entry(self) -> AdapterEntry | None:
        """The adapter served (the last applied object's, or the one in :attr:`directory` at the claim); ``None``:
        none yet (the first anchor defines it) or not ``lora`` mode."""
        if self.served.mode != "lora":
            return None
        manifest = self.label.manifest
        if manifest is not None and manifest.adapter is not None:
            return manifest.adapter
        base = self.served.base_fingerprint()
        if self.directory is None or base is None:
            return None
        return read_adapter_config(self.directory, base)

    def status(self) -> dict[str, Any] | None:
        """``status()["adapter"]``: the directory, the base (its weights' digest once the first admission read it)
        and the adapter served (``None`` outside ``lora`` mode)."""
        if self.served.mode != "lora":
            return None
        entry = self.served_entry()
        return {
            "dir": self.directory,
            "base_fingerprint": self.served.base_fingerprint(),
            "base_content": self.served.base_content(read=False),
            "served": None if entry is None else entry.to_dict(),
        }

    def files(self) -> dict[str, Any]:
        """The adapter this rank serves, as the files vLLM loads it from: ``{"dir": path, "version": int,
        "checksums": {tensor: xxh3_128}}``; ``{}`` outside ``lora`` mode."""
        if self.served.mode != "lora" or self.directory is None:
            return {}
        path = os.path.join(self.directory, ADAPTER_FILE)
        if not os.path.exists(path):
            return {"dir": self.directory, "version": self.label.version, "checksums": {}}
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            sums = {n: tensor_checksum(f.get_tensor(n)) for n in f.keys()}
        return {"dir": self.directory, "version": self.label.version, "checksums": sums}

    def track(self, worker: Any) -> bool:
        """``lora`` mode: make sure ``worker`` records which adapter ids vLLM loads from the served directory (the
        whole-state proof reads them back, and each such load reads this engine's copy); whether an adapter is
        served."""
        if self.served.mode != "lora" or self.directory is None:
            return False
        return track_served_loads(worker, self.directory, self.copy) is not None

    def refuse_unloadable(self, manifests: list[DeltaManifest]) -> None:
        """Refuse, before anything is decoded, adapters this vLLM could not load (no LoRA, a rank above its
        ``max_lora_rank``).

        Raises:
            UpdateRefused: nothing was written.
        """
        if self.lora_config is None:
            raise UpdateRefused(
                "deltasync: apply mode lora needs vLLM started with LoRA enabled (--enable-lora)",
                reason=RefusalReason.UNSUPPORTED,
            )
        for m in manifests:
            if m.adapter is not None and m.adapter.r > self.lora_config.max_lora_rank:
                raise UpdateRefused(
                    f"deltasync: v{m.version} is an adapter of rank {m.adapter.r}, this vLLM serves ranks up to "
                    f"{self.lora_config.max_lora_rank} (--max-lora-rank)",
                    reason=RefusalReason.UNSUPPORTED,
                )

    def refuse_unservable(self, checked: list[tuple[DeltaManifest, list[TensorDelta]]]) -> None:
        """Refuse, before any write, an adapter vLLM's loader would take but that must never be served (infinite
        values: readers refuse only NaN), and any :meth:`refuse_unloadable` refuses.

        Raises:
            UpdateRefused: nothing was written.
        """
        bad = next((d.ckpt_name for _, ds in checked for d in ds if not bool(torch.isfinite(d.values).all())), None)
        if bad is not None:
            raise UpdateRefused(
                f"deltasync: the adapter's {bad} holds infinite values; nothing was written",
                reason=RefusalReason.MALFORMED,
            )
        self.refuse_unloadable([m for m, _ in checked])

    def publish(self) -> None:
        """At the session's end: make the served directory, and the engine's own copy of it, hold the staged
        version (proven in the host copy against the published checksums when it was written there). vLLM's
        session end then drops every loaded adapter, and its next load of the served adapter reads the engine's
        copy (a private directory of this worker), whatever the served directory holds by then.

        Raises:
            ApplyError: nothing is staged to serve.
        """
        manifest, shadow = self.label.staged_manifest, self.served.shadow()
        if manifest is None or manifest.adapter is None or self.directory is None:
            raise ApplyError("deltasync: no adapter staged for the served directory")
        tensors = {n: shadow.get(n) for n in shadow.names()}
        if self.copy is None:
            self.copy = tempfile.mkdtemp(prefix="deltasync-served-adapter-")  # 0700, this worker's
        write_adapter(self.copy, tensors, manifest.adapter)
        write_adapter(self.directory, tensors, manifest.adapter)

    def prove_dirs(self, manifest: DeltaManifest) -> list[str]:
        """The served directory and the engine's own copy of it, each read afresh against the served version
        ``manifest`` (:func:`adapter_dir_differs`). Returns what differs."""
        assert self.directory is not None and manifest.adapter is not None
        bad = []
        for directory in (self.directory, self.copy):
            if directory is not None:
                bad += adapter_dir_differs(directory, manifest)
        return bad


def adapter_dir_differs(directory: str, manifest: DeltaManifest) -> list[str]:
    """What of a PEFT adapter directory differs from the published version ``manifest``: its tensors file against
    the published checksums, and its configuration, every key of it, against the one the engine writes for the
    published adapter (a key added, removed or changed is drift; so is a file that cannot be read or parsed)."""
    assert manifest.adapter is not None
    config_path = os.path.join(directory, CONFIG_FILE)
    expected = adapter_config_json(manifest.adapter)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:  # a file nested too deep to parse is no version either
        return [f"{config_path} ({type(exc).__name__})"]
    if not isinstance(config, dict):
        return [f"{config_path} (not a JSON object)"]

    # the whole file, not the fields known to matter today: vLLM applies rank_pattern, alpha_pattern and the
    # like per module, and refuses init_lora_weights it cannot take when a request names the adapter
    def canonical(obj: dict[str, Any], key: str) -> str | None:  # 1 is not true, 8.0 is not 8
        return json.dumps(obj[key], sort_keys=True) if key in obj else None

    differ = sorted(k for k in set(config) | set(expected) if canonical(config, k) != canonical(expected, k))
    if differ:
        return [f"{config_path} ({', '.join(differ)})"]
    path = os.path.join(directory, ADAPTER_FILE)
    from safetensors import safe_open

    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # noqa: BLE001 - missing or unreadable: vLLM would load another file, or fail
        return [f"{path} ({type(exc).__name__}: {exc})"]
    bad = []
    with handle as f:
        names = set(f.keys())
        bad += sorted(f"{n} (in {path})" for n in names ^ set(manifest.tensors))
        for n in sorted(names & set(manifest.tensors)):
            t = f.get_tensor(n)
            entry = manifest.tensors[n]
            ok = t.dtype == DTYPES[entry.dtype] and tuple(t.shape) == entry.shape
            if not ok or not all(tensor_checksum(t.reshape(-1), (a, b)) == d for a, b, d in entry.checksums):
                bad.append(f"{n} (in {path})")
    return bad
