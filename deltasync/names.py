"""Runtime names (what ``module.state_dict()`` says under FSDP, ``torch.compile``, DDP or PEFT) to
checkpoint names (what vLLM's ``load_weights`` expects), tied tensors published once, fused MoE experts split into
the checkpoint's per-expert tensors."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

__all__ = [
    "EXPERT_NAMES",
    "MIXTRAL_EXPERTS",
    "QWEN_MOE_EXPERTS",
    "WRAPPER_PREFIXES",
    "ExpertNames",
    "ExpertSlice",
    "NameMap",
    "checkpoint_state",
    "experts_of",
    "is_fused_experts",
]

WRAPPER_PREFIXES = (
    "_orig_mod.",
    "module.",
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
    "base_model.model.",
)
"""Prefixes (anywhere in a dotted name) added by torch.compile, DDP, FSDP1, activation checkpointing and PEFT."""

_LORA_PART = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")
_FUSED = re.compile(r"^(?P<experts>(?:.*\.)?experts)\.(?P<kind>gate_up_proj|down_proj)$")


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertNames:
    """A MoE family's checkpoint names for the routed experts that transformers (5.x) fuses into 3-D parameters.

    transformers holds a layer's experts as ``<block>.experts.gate_up_proj`` of shape (E, 2I, H), each expert's
    gate rows first and its up rows after, and ``<block>.experts.down_proj`` of shape (E, H, I); ``save_pretrained``
    and vLLM's loaders name expert ``e``'s matrices ``<block>.experts.<e>.<gate|up|down>.weight``, of shapes
    (I, H), (I, H) and (H, I). Each is a 2-D slice of the fused parameter, published as a view (no copy).
    """

    gate: str
    up: str
    down: str
    block: str = "mlp"
    """The checkpoint's name of the block that holds the router and the experts (transformers names it ``mlp``)."""


QWEN_MOE_EXPERTS = ExpertNames("gate_proj", "up_proj", "down_proj")
"""Qwen2-MoE and Qwen3-MoE: ``mlp.experts.<e>.{gate_proj,up_proj,down_proj}.weight``."""
MIXTRAL_EXPERTS = ExpertNames("w1", "w3", "w2", block="block_sparse_moe")
"""Mixtral: ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` (gate, up, down), router ``block_sparse_moe.gate``."""
EXPERT_NAMES: dict[str, ExpertNames] = {
    "qwen2_moe": QWEN_MOE_EXPERTS,
    "qwen3_moe": QWEN_MOE_EXPERTS,
    "mixtral": MIXTRAL_EXPERTS,
}
"""The families whose checkpoint names were checked against ``save_pretrained``, by ``config.model_type``."""


class ExpertSlice(NamedTuple):
    """One per-expert checkpoint tensor: rows ``rows`` of expert ``expert`` of a fused parameter."""

    name: str
    expert: int
    rows: tuple[int, int]


def is_fused_experts(name: str) -> bool:
    """``name`` is a fused 3-D expert parameter as transformers names it (``...experts.gate_up_proj``)."""
    return _FUSED.match(name) is not None


def experts_of(module: torch.nn.Module) -> ExpertNames | None:
    """The checkpoint names of ``module``'s experts, from its transformers config; ``None`` if unknown."""
    for m in module.modules():
        model_type = getattr(getattr(m, "config", None), "model_type", None)
        if isinstance(model_type, str):
            return EXPERT_NAMES.get(model_type)
    return None


def _fused_expected(kind: str, shape: tuple[int, ...], sibling: tuple[int, ...] | None) -> tuple[int, ...] | str:
    """The shape a fused parameter of this ``kind`` must have, from its sibling's (gate_up's for down and the
    reverse) where that is itself well-formed; else the rule, in words."""
    if kind == "gate_up_proj":
        if sibling is not None and len(sibling) == 3:
            return (sibling[0], 2 * sibling[2], sibling[1])
        if len(shape) == 3 and shape[1] % 2 == 0:
            return shape
        return "(experts, 2 x intermediate, hidden): gate rows then up rows, an even second dimension"
    if sibling is not None and len(sibling) == 3 and sibling[1] % 2 == 0:
        return (sibling[0], sibling[2], sibling[1] // 2)
    return shape if len(shape) == 3 else "(experts, hidden, intermediate)"


class NameMap:
    """Maps a runtime name to a checkpoint name, or to ``None`` to leave a tensor out.

    A fused expert parameter (see :class:`ExpertNames`) maps to one name here and is split into its per-expert
    checkpoint tensors by :meth:`expert_slices`.

    Args:
        rename: applied after the built-in rules, for anything model-specific (return ``None`` to skip). It sees
            a fused expert parameter's name, not the per-expert names derived from it.
        experts: the checkpoint names of fused experts; ``None``: the publisher takes them from the module's
            ``config.model_type`` (:data:`EXPERT_NAMES`), and a state dict holding fused experts is refused.

    Example:
        >>> NameMap()("_orig_mod.model.layers.0.mlp.up_proj.base_layer.weight")
        'model.layers.0.mlp.up_proj.weight'
        >>> NameMap(experts=MIXTRAL_EXPERTS)("model.layers.0.mlp.gate.weight")
        'model.layers.0.block_sparse_moe.gate.weight'
    """

    def __init__(self, rename: Callable[[str], str | None] | None = None, experts: ExpertNames | None = None) -> None:
        self.rename = rename
        self.experts = experts

    def with_experts(self, experts: ExpertNames | None) -> NameMap:
        """A copy that names fused experts ``experts`` (this map itself when it already names them)."""
        if self.experts is not None or experts is None:
            return self
        out = copy.copy(self)
        out.experts = experts
        return out

    def expert_slices(self, name: str, shapes: Mapping[str, tuple[int, ...]]) -> list[ExpertSlice] | None:
        """The per-expert checkpoint tensors of fused expert parameter ``name`` (a checkpoint-side name, a key of
        ``shapes``, which holds every tensor's full shape); ``None`` if ``name`` is not one.

        Raises:
            ValueError: no checkpoint names are known for the experts, or the shape cannot be split (a gate_up
                whose second dimension is odd, or that disagrees with its down_proj).
        """
        m = _FUSED.match(name)
        if m is None:
            return None
        shape, prefix, kind = tuple(shapes[name]), m["experts"], m["kind"]
        if self.experts is None:
            raise ValueError(
                f"tensor {name!r} of shape {shape} holds a layer's experts fused (transformers' layout) and this "
                f"model's checkpoint names for them are unknown (a published model's config.model_type picks them "
                f"for {sorted(EXPERT_NAMES)}): pass NameMap(experts=ExpertNames(gate=..., up=..., down=...))"
            )
        sibling = shapes.get(f"{prefix}.{'down_proj' if kind == 'gate_up_proj' else 'gate_up_proj'}")
        expected = _fused_expected(kind, shape, None if sibling is None else tuple(sibling))
        if shape != expected:
            parts = f"{self.experts.gate}/{self.experts.up}" if kind == "gate_up_proj" else self.experts.down
            raise ValueError(
                f"tensor {name!r}: fused experts of shape {shape} cannot be split into the checkpoint's per-expert "
                f"{parts} tensors: expected {expected}. Give the model transformers' expert layout, or leave the "
                "tensor out with NameMap(rename=...)"
            )
        n = self.experts
        if kind == "down_proj":
            return [ExpertSlice(f"{prefix}.{e}.{n.down}.weight", e, (0, shape[1])) for e in range(shape[0])]
        inter = shape[1] // 2
        return [
            ExpertSlice(f"{prefix}.{e}.{part}.weight", e, rows)
            for e in range(shape[0])
            for part, rows in ((n.gate, (0, inter)), (n.up, (inter, 2 * inter)))
        ]

    def __call__(self, runtime_name: str) -> str | None:
        if _LORA_PART.search(runtime_name):
            return None  # adapters are published merged (deltasync.lora) or not at all
        name = runtime_name
        for prefix in WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        name = name.replace(".base_layer.", ".")
        if self.experts is not None and self.experts.block != "mlp":
            name = name.replace(".mlp.", f".{self.experts.block}.")
        return self.rename(name) if self.rename is not None else name


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What tied tensors share: their storage (a DTensor's: its shard's on this rank, FSDP2 keeps one parameter for
    both names); ``None`` when it cannot tell (meta, empty shards, other subclasses)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    local = t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]
    if type(local) is not torch.Tensor or local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape), tuple(local.stride()), t.dtype)


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def checkpoint_state(state: Mapping[str, torch.Tensor], name_map: NameMap | None = None) -> dict[str, torch.Tensor]:
    """Rename a runtime state dict to checkpoint names and drop tied duplicates.

    Tensors that share storage (``lm_head.weight`` tied to ``model.embed_tokens.weight``) are
    published once, under the name that is not ``lm_head.*``, as HF checkpoints of tied models do.

    Raises:
        ValueError: two different tensors map to one checkpoint name.
    """
    name_map = name_map or NameMap()
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for runtime_name, tensor in state.items():
        name = name_map(runtime_name)
        if name is None:
            continue
        key = _storage_key(tensor)
        if key is not None and key in seen:
            if name.startswith("lm_head.") or not seen[key].startswith("lm_head."):
                continue  # a tied duplicate
            del out[seen[key]]
        if name in out:
            raise ValueError(
                f"tensors {runtime_name!r} and another one both map to checkpoint name {name!r}; "
                "pass NameMap(rename=...) to tell them apart"
            )
        out[name] = tensor
        if key is not None:
            seen[key] = name
    return out
