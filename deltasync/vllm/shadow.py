"""The host copy ("shadow") of the served checkpoint, in checkpoint names, and where the served model's spec
(names, dtypes, shapes) comes from."""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

import torch

from ..manifest import content_fingerprint
from ..vocab import DTYPE_NAMES

__all__ = ["Shadow", "spec_from_config"]

logger = logging.getLogger("vllm.deltasync.shadow")

_ST_DTYPES = {"BF16": "BF16", "F16": "F16", "F32": "F32"}


class Shadow:
    """Host copy of the checkpoint in checkpoint names: lazily read from safetensors, copy-on-write.

    Args:
        path: the served checkpoint's directory (``None`` or without safetensors: empty until an anchor).
    """

    def __init__(self, path: str | None) -> None:
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        self._file_spec: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        if path is None or not os.path.isdir(path):
            return
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = [os.path.join(path, x) for x in sorted(set(json.load(f)["weight_map"].values()))]
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        from safetensors import safe_open

        for file in files:
            handle = self._handles[file] = safe_open(file, framework="pt", device="cpu")
            for key in handle.keys():  # type: ignore[no-untyped-call]
                sl = handle.get_slice(key)  # type: ignore[no-untyped-call]
                self._where[key] = file
                self._file_spec[key] = (_ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape()))

    @property
    def empty(self) -> bool:
        """Nothing is known: no checkpoint files and no anchor yet."""
        return not self._where and not self.tensors

    def spec(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (dtype, shape) of what the shadow holds."""
        out = {n: s for n, s in self._file_spec.items() if n not in self.tensors}
        out.update({n: (DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape)) for n, t in self.tensors.items()})
        return out

    def content(self) -> str | None:
        """:func:`~deltasync.manifest.content_fingerprint` of what the shadow holds, over the names, dtypes and
        shapes of :meth:`spec` (each tensor read once, one at a time); ``None`` when it holds nothing."""
        if self.empty:
            return None

        def read(name: str) -> memoryview:
            return self.get(name).contiguous().reshape(-1).view(torch.uint8).numpy().data

        return content_fingerprint(self.spec(), read)

    def names(self) -> list[str]:
        return sorted(set(self._where) | set(self.tensors))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self._where

    def get(self, name: str) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            t = self._handles[self._where[name]].get_tensor(name)
        return t

    def materialize(self, name: str) -> torch.Tensor:
        """A writable tensor owned by the shadow."""
        t = self.tensors.get(name)
        if t is None:
            t = self.tensors[name] = self.get(name).clone()
        return t

    def view(self) -> _ShadowView:
        """A mutable mapping over the shadow for :func:`deltasync.apply.write` (copy-on-write on access)."""
        return _ShadowView(self)

    def replace_all(self, tensors: dict[str, torch.Tensor]) -> None:
        """Become exactly ``tensors`` (an anchor)."""
        self._handles, self._where, self._file_spec, self.tensors = {}, {}, {}, tensors


class _ShadowView(dict[str, torch.Tensor]):
    """``dict`` protocol over a :class:`Shadow`: ``get`` materializes (copy-on-write) before writes."""

    def __init__(self, shadow: Shadow) -> None:
        super().__init__()
        self._shadow = shadow

    def get(self, name: str, default: Any = None) -> Any:
        return self._shadow.materialize(name) if name in self._shadow else default

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shadow:
            raise KeyError(name)
        return self._shadow.get(name)


def spec_from_config(hf_config: Any, dtype: torch.dtype) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """The checkpoint spec of a model served without a checkpoint (``load_format="dummy"``): its Hugging Face
    architecture built on the meta device (no memory), tied ``lm_head`` left out as checkpoints do.
    ``None`` when transformers cannot build it (then the first anchor defines the spec)."""
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    except Exception as exc:  # noqa: BLE001 - any failure means "unknown": the first anchor defines the spec
        logger.warning("deltasync: cannot derive the served model's spec from its config (%s)", exc)
        return None
    from ..names import EXPERT_NAMES, NameMap

    name = DTYPE_NAMES.get(dtype, str(dtype))
    # transformers 5 fuses a layer's experts (mlp.experts.gate_up_proj (E, 2I, H)): the checkpoint names each
    # expert's tensors, as the publisher does (deltasync.names)
    names = NameMap(experts=EXPERT_NAMES.get(getattr(hf_config, "model_type", "")))
    shapes: dict[str, tuple[int, ...]] = {}
    for k, v in model.state_dict().items():
        ck = names(k)
        if ck is not None and v.is_floating_point():
            shapes[ck] = tuple(v.shape)
    spec: dict[str, tuple[str, tuple[int, ...]]] = {}
    for k, shape in shapes.items():
        try:
            pieces = names.expert_slices(k, shapes)
        except ValueError as exc:  # a family whose expert names are unknown: the first anchor defines the spec
            logger.warning("deltasync: cannot derive the served model's spec from its config (%s)", exc)
            return None
        if pieces is None:
            spec[k] = (name, shape)
        else:
            spec.update({p.name: (name, (p.rows[1] - p.rows[0], *shape[2:])) for p in pieces})
    if getattr(hf_config, "tie_word_embeddings", False):
        spec.pop("lm_head.weight", None)
    return spec
