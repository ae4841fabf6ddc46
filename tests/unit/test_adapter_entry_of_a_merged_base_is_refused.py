"""A trainer that describes its adapter while the adapter is merged into its base (PEFT's ``merge_adapter()``, as
trainers do around generation) would publish the digest of the merged weights as its base's: every engine serving
the right checkpoint would then refuse each version as "an adapter for another base model". ``adapter_entry``
refuses the merged model at once instead, naming what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltasync.lora import adapter_entry
from deltasync.testing.models import build_tiny_model, peft_model
from deltasync.vllm.shadow import Shadow


def test_a_merged_adapter_is_refused_by_adapter_entry_naming_the_merge(tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", seed=0)
    served = Shadow(str(base)).content()  # what a lora-mode engine serving this checkpoint computes
    model = peft_model(base, seed=1)  # a trained adapter: B is not zero
    assert adapter_entry(model).base_content == served

    model.merge_adapter()
    with pytest.raises(ValueError) as err:
        adapter_entry(model)
    message = str(err.value)
    assert "adapter 'default'" in message
    assert "merged into its base weights" in message
    assert "14 modules, e.g. 'model.layers.0.self_attn.q_proj'" in message  # the first merged module, by name
    assert "before merging" in message


def test_a_merged_zero_adapter_is_refused_too_and_an_unmerged_one_admitted(tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", seed=0)
    served = Shadow(str(base)).content()
    model = peft_model(base, seed=1, random=False)  # PEFT's own initialization: B = 0, merging adds nothing
    model.merge_adapter()
    with pytest.raises(ValueError, match="merged into its base weights"):
        adapter_entry(model)
    model.unmerge_adapter()  # a zero delta round-trips exactly: the base is the checkpoint's again
    assert adapter_entry(model).base_content == served
    assert adapter_entry(peft_model(base, seed=1, dtype=torch.float32)).base_content == served
