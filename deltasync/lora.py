"""LoRA adapters of PEFT models, for publishing: merged into their base weights on copies
(:func:`lora_merged_state`), or as themselves (:func:`adapter_state`, described by :func:`adapter_entry`), which an
engine in apply mode ``lora`` serves."""

from __future__ import annotations

from typing import Any

import torch

from ._sharding import TensorView, local_tensors
from .manifest import AdapterEntry, ModelSpec, content_fingerprint, model_fingerprint
from .names import WRAPPER_PREFIXES, NameMap
from .vocab import DTYPE_NAMES

__all__ = [
    "ADAPTER_PREFIX",
    "AdapterNames",
    "adapter_config_json",
    "adapter_entry",
    "adapter_state",
    "lora_merged_state",
]


def lora_merged_state(module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The state dict of a PEFT LoRA model with every adapter merged into its base weight.

    The merge is computed on copies (``base + get_delta_weight()`` in float32, then cast), so the
    trainer's weights are never merged and unmerged in place (which would not round-trip exactly).
    """
    from peft.tuners.lora import LoraLayer

    state = dict(module.state_dict())
    for qualname, m in module.named_modules():
        if isinstance(m, LoraLayer) and not getattr(m, "merged", False):
            base_layer: Any = getattr(m, "get_base_layer")()  # noqa: B009
            base = base_layer.weight
            merged = base.detach().float().clone()
            for adapter in m.active_adapters:
                if adapter in m.lora_A or adapter in getattr(m, "lora_embedding_A", {}):
                    merged += m.get_delta_weight(adapter).float()  # type: ignore[attr-defined]
            state[f"{qualname}.base_layer.weight"] = merged.to(dtype)
    return state


ADAPTER_PREFIX = "base_model.model."
"""PEFT's prefix of every adapter tensor name, as ``adapter_model.safetensors`` holds them (vLLM reads it)."""

_WRAPPERS = tuple(p for p in WRAPPER_PREFIXES if p != ADAPTER_PREFIX)  # PEFT's own prefix stays in the name


class AdapterNames(NameMap):
    """An adapter publisher's names: PEFT's saved names, kept as they are (vLLM's LoRA loader reads them)."""

    def __call__(self, runtime_name: str) -> str | None:
        return self.rename(runtime_name) if self.rename is not None else runtime_name


def _adapter_name(module: torch.nn.Module, adapter: str | None) -> str:
    """The adapter of a PEFT model to publish: ``adapter``, else the one active adapter.

    Raises:
        ValueError: not a PEFT model, no such adapter, or several adapters active and none named.
    """
    configs = getattr(module, "peft_config", None)
    if not configs:
        raise ValueError(f"{type(module).__name__} is not a PEFT model (no peft_config): wrap it with get_peft_model")
    if adapter is None:
        active = getattr(module, "active_adapters", None) or [getattr(module, "active_adapter", None)]
        if len(active) != 1 or active[0] is None:
            raise ValueError(
                f"{type(module).__name__} has {len(active)} active adapters {list(active)}: name the one to publish "
                "(adapter_entry(model, adapter=NAME))"
            )
        adapter = str(active[0])
    if adapter not in configs:
        raise ValueError(f"{type(module).__name__} has no adapter {adapter!r} (its adapters: {sorted(configs)})")
    return adapter


def adapter_state(module: torch.nn.Module, adapter: str | None = None) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's adapter tensors by the names ``save_pretrained`` writes (``base_model.model....lora_A.
    weight``, the adapter's own name left out): what vLLM loads as the adapter. ``adapter``: which of the model's
    adapters (default: the active one). FSDP2 shards stay shards."""
    from peft import get_peft_model_state_dict

    out = {}
    state = get_peft_model_state_dict(module, adapter_name=_adapter_name(module, adapter))
    for name, tensor in state.items():
        for prefix in _WRAPPERS:
            name = name.replace(prefix, "")
        if not name.startswith(ADAPTER_PREFIX):
            raise ValueError(f"adapter tensor {name!r}: expected PEFT's {ADAPTER_PREFIX!r} prefix (a PEFT LoRA model)")
        out[name] = tensor
    return out


_DESCRIBED = frozenset({"r", "lora_alpha", "target_modules", "use_rslora"})
"""The LoraConfig fields an :class:`~deltasync.manifest.AdapterEntry` carries: compared wherever it is admitted."""
_INERT = frozenset(
    {
        # bookkeeping: which model and library wrote the adapter, and for which task head
        "task_type",
        "peft_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        # training-time only: no effect on what a saved adapter computes at inference
        "inference_mode",
        "lora_dropout",
        "runtime_config",
        "megatron_core",  # read only with megatron_config, which must stay unset
        "qalora_group_size",  # read only with use_qalora, which must stay unset
        "eva_config",  # EVA's data-driven initialization: the saved adapter is plain LoRA
    }
)
"""LoraConfig fields that do not change what a saved adapter computes once loaded by vLLM."""
_SERVABLE_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica"})
"""``init_lora_weights`` values that only set the adapter's first weights; PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA
also rewrite the base model's weights (LoRA-GA subtracts its first B A from each adapted base weight, PEFT 0.21's
``lora/layer.py``), so their adapters are wrong on the served base (vLLM 0.32 admits ``lora_ga``: the publisher
must refuse it)."""


def _unservable_fields(config: Any) -> list[str]:
    """Every field of a PEFT ``LoraConfig`` that would make the adapter compute otherwise than the plain LoRA an
    :class:`~deltasync.manifest.AdapterEntry` describes (rank, alpha, target modules, rsLoRA). Enumerated from
    the installed PEFT itself: a field that is neither described, nor inert at inference, nor a servable
    initialization must hold PEFT's default, so a field a later PEFT adds is refused until it is classified."""
    import dataclasses

    why = []
    default = type(config)()
    for f in dataclasses.fields(config):
        if f.name in _DESCRIBED or f.name in _INERT:
            continue
        value = getattr(config, f.name)
        if f.name == "init_lora_weights":
            if not isinstance(value, bool) and str(value).lower() not in _SERVABLE_INITS:
                why.append(f"init_lora_weights={value!r} (it rewrites the base weights)")
            continue
        try:
            same = bool(value == getattr(default, f.name))
        except Exception:  # noqa: BLE001 - a value that cannot be compared is not known to be the default
            same = False
        if not same:
            why.append(f"{f.name}={value!r}")
    return why


def adapter_entry(
    module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, adapter: str | None = None
) -> AdapterEntry:
    """The :class:`~deltasync.manifest.AdapterEntry` of a PEFT LoRA model's active adapter: its rank, alpha,
    target modules and rsLoRA flag, the fingerprint of its base model's checkpoint (names, shapes, ``dtype``) as an
    engine serving that base sees it, and the digest of the base's weights in ``dtype`` (``base_content``: every
    base weight is read once, about a second per GB; ``None`` where this process holds only FSDP shards of them).
    Call it once per run: the base is frozen under LoRA, and the publisher keeps the entry.

    Raises:
        ValueError: not a PEFT LoRA model, or an adapter deltasync cannot publish: any ``LoraConfig`` field that
            changes what the adapter computes beyond rank, alpha, target modules and rsLoRA (per-module ranks or
            alphas, DoRA, extra trained modules, biases, layer selection, an initialization that rewrites the
            base, ...; each named with its value): an engine could not serve it as that one plain adapter. Or a
            model with an adapter merged into its base weights: its base is not the checkpoint's.
    """
    name = _adapter_name(module, adapter)
    config: Any = getattr(module, "peft_config")[name]  # noqa: B009 - a PEFT attribute torch does not type
    why = []
    if str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1] != "LORA":
        why.append(f"peft_type {config.peft_type}")
    else:
        why += _unservable_fields(config)
    targets = config.target_modules
    if isinstance(targets, str):
        why.append(f"target_modules as a pattern ({targets!r}): list the modules")
    else:
        names = [n.removesuffix(".base_layer") for n, m in module.named_modules() if isinstance(m, torch.nn.Embedding)]
        embeddings = sorted({t for n in names for t in targets if n == t or n.endswith("." + t)})
        if embeddings:
            why.append(f"embedding targets {embeddings} (lora_embedding tensors)")
    if why:
        raise ValueError(f"adapter {name!r}: deltasync publishes plain LoRA adapters only, not {'; '.join(why)}")
    _refuse_merged(module, name)
    local, views = local_tensors(module, name_map=NameMap(), rank=0)
    base = {n: (DTYPE_NAMES[dtype], tuple(v.shape)) for n, v in views.items()}
    return AdapterEntry(
        r=int(config.r),
        lora_alpha=config.lora_alpha,
        target_modules=tuple(sorted(set(targets))),
        use_rslora=bool(getattr(config, "use_rslora", False)),
        base_fingerprint=model_fingerprint(base),
        adapter_name=name,
        base_content=_base_content(base, local, views, dtype),
    )


def _refuse_merged(module: torch.nn.Module, name: str) -> None:
    """Refuse a model whose base weights hold a merged adapter (PEFT's ``merge_adapter()``): their digest would be
    of the merged weights, not the checkpoint's, and every engine serving the right base would refuse each version
    as "another base model"; unmerging in bf16 does not give the checkpoint's bits back either."""
    from peft.tuners.lora import LoraLayer

    merged = [
        (NameMap()(f"{qualname}.weight") or qualname).removesuffix(".weight")
        for qualname, m in module.named_modules()
        if isinstance(m, LoraLayer) and getattr(m, "merged", False)
    ]
    if merged:
        raise ValueError(
            f"adapter {name!r}: the model has an adapter merged into its base weights (merge_adapter()) in "
            f"{len(merged)} modules, e.g. {merged[0]!r}, so its base is not the checkpoint an engine serves: call "
            "adapter_entry before merging (once, at the start of the run, on the base as loaded)"
        )


def _base_content(
    spec: ModelSpec, local: dict[str, torch.Tensor], views: dict[str, TensorView], dtype: torch.dtype
) -> str | None:
    """:func:`~deltasync.manifest.content_fingerprint` of the base weights as ``dtype`` (the bytes an engine reads
    from the base's checkpoint); ``None`` when this process does not hold each of them whole (FSDP2 shards, the
    meta device)."""
    if any(v.span is not None or n not in local or local[n].device.type == "meta" for n, v in views.items()):
        return None

    def read(name: str) -> memoryview:
        t = local[name].detach().to("cpu", dtype).contiguous().reshape(-1)
        return t.view(torch.uint8).numpy().data

    return content_fingerprint(spec, read)


def adapter_config_json(entry: AdapterEntry, base_model: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of a published adapter (what vLLM's loader reads next to its tensors)."""
    return {
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "lora_alpha": entry.lora_alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": entry.r,
        "target_modules": list(entry.target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": entry.use_rslora,
    }
