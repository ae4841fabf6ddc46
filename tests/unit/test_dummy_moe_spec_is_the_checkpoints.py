"""A checkpoint-less engine (``load_format="dummy"``) derives what it serves from its config: for a MoE model, whose
experts transformers 5 fuses into 3-D parameters, that is the checkpoint's per-expert tensors (the names the
publisher writes and vLLM's loader takes), not the fused ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from deltasync.testing.models import build_tiny_model
from deltasync.vllm.shadow import spec_from_config


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "qwen3"])
def test_the_spec_from_a_config_is_the_checkpoints_names_and_shapes(tmp_path: Path, arch: str) -> None:
    model_dir = build_tiny_model(tmp_path / arch, arch=arch, seed=1)
    spec = spec_from_config(AutoConfig.from_pretrained(model_dir), torch.bfloat16)
    assert spec is not None
    checkpoint = load_file(model_dir / "model.safetensors")
    assert {k: v[1] for k, v in spec.items()} == {k: tuple(t.shape) for k, t in checkpoint.items()}
    assert {v[0] for v in spec.values()} == {"BF16"}


def test_a_moe_family_whose_expert_names_are_unknown_has_no_spec(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Unknown expert names: no guess (the first anchor defines the spec), and the log says why."""
    config = AutoConfig.from_pretrained(build_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=1))
    config.model_type = "someone_elses_moe"
    with caplog.at_level("WARNING"):
        assert spec_from_config(config, torch.bfloat16) is None
    assert "checkpoint names for them are unknown" in caplog.text
