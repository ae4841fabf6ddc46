from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from deltasync.testing.models import QWEN3_0_6B_CONFIG, build_tiny_model, qwen3_shapes, write_config_only_model
from deltasync.testing.stream import UpdateStream
from tests.conftest import assert_bit_equal


def test_tiny_model_is_deterministic_and_matches_its_shapes(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    a, b = load_file(tiny_model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert_bit_equal(a, b)
    other = load_file(build_tiny_model(tmp_path / "other", seed=1) / "model.safetensors")
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["head_dim"] == 64 and cfg["tie_word_embeddings"]
    assert {k: tuple(v.shape) for k, v in a.items()} == qwen3_shapes(cfg)
    assert all(v.dtype == torch.bfloat16 for v in a.values())
    tok = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == "<|im_end|>"
    assert (tiny_model_dir / "chat_template.jinja").exists() or "chat_template" in tok


def test_qwen3_0_6b_shapes() -> None:
    shapes = qwen3_shapes(QWEN3_0_6B_CONFIG)
    assert len(shapes) == 310
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 596_049_920


def test_config_only_model(tmp_path: Path) -> None:
    path = write_config_only_model(tmp_path / "q")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["vocab_size"] == 151936
    assert not list(path.glob("*.safetensors"))


def test_update_stream_is_deterministic_and_realistic() -> None:
    shapes = {"w": (256, 256), "n": (256,)}
    a, b = UpdateStream.from_shapes(shapes, seed=3), UpdateStream.from_shapes(shapes, seed=3)
    prev = a.bf16()
    for _ in range(4):
        wa, wb = a.step(), b.step()
        assert_bit_equal(wa, wb)
        changed = (wa["w"].view(torch.int16) != prev["w"].view(torch.int16)).float().mean().item()
        prev = wa
    assert 0.003 < changed < 0.05
    assert torch.equal(wa["n"], torch.ones(256, dtype=torch.bfloat16))  # norms of 1.0 never move at lr 1e-6
