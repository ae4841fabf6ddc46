"""Deterministic tiny models (random Qwen3 weights, a locally trained tokenizer) and the shapes vLLM serves.

Tests, demos and benchmarks build their models instead of downloading them (nothing is fetched from the Hub).
Building one needs ``transformers`` and ``tokenizers`` (the ``test`` extra), imported inside the functions;
:func:`qwen3_shapes` and the configs need neither.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..format import tensor_checksum

__all__ = [
    "ARCHITECTURES",
    "LORA_TARGETS",
    "QWEN3_0_6B_CONFIG",
    "TINY_LLAMA_CONFIG",
    "TINY_MIXTRAL_CONFIG",
    "TINY_QWEN2_CONFIG",
    "TINY_QWEN2_MOE_CONFIG",
    "TINY_QWEN3_CONFIG",
    "TINY_QWEN3_MOE_CONFIG",
    "build_tiny_model",
    "peft_model",
    "qwen3_effective",
    "qwen3_effective_checksums",
    "qwen3_shapes",
    "write_config_only_model",
]

TINY_QWEN3_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,  # vLLM's CPU attention rejects head_dim 16
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
"""A random Qwen3 of 0.36M parameters that vLLM on CPU serves."""

QWEN3_0_6B_CONFIG: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}
"""Qwen3-0.6B's shapes: 310 tensors, 596,049,920 elements, 1.19 GB in bf16."""

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 200,  # not a multiple of 64
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,  # GQA
    "head_dim": 128,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,  # its own lm_head
}
"""A random Llama: untied ``lm_head``, head_dim 128, GQA, an intermediate size that is not a multiple of 64."""

TINY_QWEN2_CONFIG: dict[str, Any] = {k: v for k, v in TINY_QWEN3_CONFIG.items() if k != "head_dim"} | {
    "tie_word_embeddings": False
}
"""A random Qwen2 of the tiny Qwen3's shapes: q, k and v biases (fused into ``qkv_proj.bias``), head_dim 64 (from
the hidden size and heads), its own ``lm_head``."""

TINY_QWEN3_MOE_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 80,  # vLLM's CPU kernel pads it to 96 (a multiple of 32) before repacking
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
"""A random Qwen3-MoE: 4 experts per layer (fused 3-D expert parameters in transformers 5 and in vLLM; the
checkpoint names each expert: ``mlp.experts.<e>.{gate_proj,up_proj,down_proj}.weight``)."""

TINY_QWEN2_MOE_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 96,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
"""A random Qwen2-MoE: 6 routed experts per layer beside a shared expert (``mlp.shared_expert.*``, gated by
``mlp.shared_expert_gate``), q/k/v biases, head_dim 64 (from the hidden size and heads), its own ``lm_head``."""

TINY_MIXTRAL_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
"""A random Mixtral: 4 experts per layer, named ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` in the
checkpoint (gate, up, down) and its router ``block_sparse_moe.gate.weight``."""

ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", TINY_QWEN3_CONFIG),
    "llama": ("LlamaConfig", "LlamaForCausalLM", TINY_LLAMA_CONFIG),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", TINY_QWEN2_CONFIG),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", TINY_QWEN3_MOE_CONFIG),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", TINY_QWEN2_MOE_CONFIG),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", TINY_MIXTRAL_CONFIG),
}
"""Tiny architectures the tests serve: transformers config class, model class, default config values."""

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "You are playing Wordle. Guess the secret five letter word in six tries.",
    "Feedback: G means the letter is right, Y means it is in the word elsewhere, X means it is absent.",
    "crane slate audio raise stare trace adieu guess: <guess>crane</guess> reply with your next guess",
    "the quick brown fox jumps over the lazy dog 0123456789 !?.,:;'\"()[]{}<>",
]


def qwen3_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of a Qwen3 causal LM (tied embeddings: no ``lm_head``)."""
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def qwen3_effective(weights: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """What vLLM's Qwen3 at TP=1 holds, by module or parameter name, for checkpoint ``weights``: q, k and v
    fused into ``qkv_proj``, gate and up into ``gate_up_proj``, ``lm_head`` tied to the embeddings. Compare it
    with the engine's ``collective_rpc("deltasync_effective")`` to prove what it serves."""
    w = weights
    out = {"model.embed_tokens.weight": w["model.embed_tokens.weight"], "model.norm.weight": w["model.norm.weight"]}
    out["lm_head"] = out["lm_head.weight"] = w["model.embed_tokens.weight"]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj"] = torch.cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[p + "self_attn.o_proj"] = w[p + "self_attn.o_proj.weight"]
        out[p + "mlp.gate_up_proj"] = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        out[p + "mlp.down_proj"] = w[p + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            out[p + norm + ".weight"] = w[p + norm + ".weight"]
    return out


def qwen3_effective_checksums(weights: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, str]:
    """:func:`qwen3_effective` as ``xxh3_128`` digests (what ``deltasync_effective`` returns by default)."""
    return {k: tensor_checksum(v) for k, v in qwen3_effective(weights, num_layers).items()}


def _build_tokenizer(path: Path, vocab_size: int, corpus: list[str] | None = None) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or _CORPUS) * 20, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def _config(values: Mapping[str, Any], eos_token_id: int, arch: str = "qwen3") -> Any:
    import transformers

    cls = getattr(transformers, ARCHITECTURES[arch][0])
    return cls(**values, eos_token_id=eos_token_id, pad_token_id=0, dtype="bfloat16")


def build_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
    corpus: list[str] | None = None,
    arch: str = "qwen3",
) -> Path:
    """Write a random bf16 model (Qwen3 by default; see :data:`ARCHITECTURES`) with a locally trained tokenizer
    and a chat template.

    The same seed gives bit-identical weights. Takes about a second.

    Args:
        path: output directory (created).
        seed: torch seed of the random weights.
        config: config values; default: the architecture's tiny config.
        corpus: texts to train the byte-level BPE tokenizer on (default: a few Wordle-like lines).
        arch: a key of :data:`ARCHITECTURES`.

    Returns:
        ``path``, loadable by ``transformers`` and by vLLM.
    """
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    values = dict(ARCHITECTURES[arch][2] if config is None else config)
    tok = _build_tokenizer(path, values["vocab_size"] if corpus else min(values["vocab_size"], 512), corpus)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        config_obj = _config(values, tok.convert_tokens_to_ids("<|im_end|>"), arch)
        model = getattr(transformers, ARCHITECTURES[arch][1])(config_obj).to(torch.bfloat16)
    model.save_pretrained(str(path))
    return path


def write_config_only_model(path: str | Path, config: Mapping[str, Any] | None = None, *, arch: str = "qwen3") -> Path:
    """Write ``config.json`` and a tokenizer only, for vLLM's ``load_format="dummy"``.

    Args:
        path: output directory (created).
        config: config values of ``arch``; default :data:`QWEN3_0_6B_CONFIG`.
        arch: a key of :data:`ARCHITECTURES` (``qwen3_moe``: Qwen3-30B-A3B's shapes with ``config``).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    values = dict(QWEN3_0_6B_CONFIG if config is None else config)
    tok = _build_tokenizer(path, 512)
    cfg = _config(values, tok.convert_tokens_to_ids("<|im_end|>"), arch)
    cfg.architectures = [ARCHITECTURES[arch][1]]
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
    return path


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear module of the tiny Qwen3 and Llama decoder layers."""


def peft_model(
    model_dir: str | Path,
    *,
    seed: int,
    rank: int = 8,
    random: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    **config: Any,
) -> Any:
    """A PEFT LoRA model on the base in ``model_dir`` (loaded in ``dtype``; PEFT keeps its adapters in float32):
    ``lora_alpha`` 16 and :data:`LORA_TARGETS` unless ``config`` says otherwise. ``random``: A and B drawn from
    N(0, 0.05) (a trained adapter: B not zero); else PEFT's own initialization (B = 0)."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    settings: dict[str, Any] = {"lora_alpha": 16, "target_modules": LORA_TARGETS, **config}
    if random:
        settings["init_lora_weights"] = False
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, **settings))
    if random:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.05)
    return model
