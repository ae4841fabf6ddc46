"""A lora-mode engine digests its base's weights at its first admission, which may come hours after vLLM loaded
them. Where vLLM was started on a path that is later repointed (a ``current`` link an operator moves to a new
base), the digest must still be of the checkpoint vLLM loaded: else an adapter trained on the new base would be
admitted onto the old one vLLM computes with, and one trained on the old base refused.

vLLM itself is not started here (its engine is the expensive part, and only its configuration's model path is
read): the engine's :class:`ServedModel` is built as vLLM's worker builds it, after the weights are loaded."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch

from deltasync.lora import adapter_entry
from deltasync.manifest import model_fingerprint
from deltasync.testing.models import build_tiny_model, peft_model
from deltasync.vllm.config import EngineConfig
from deltasync.vllm.label import Label
from deltasync.vllm.model import ServedModel
from deltasync.vllm.shadow import Shadow


def _engine_started_on(path: Path) -> ServedModel:
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(path), dtype=torch.bfloat16))
    return ServedModel(torch.nn.Linear(1, 1), torch.device("cpu"), config, EngineConfig(), Label())


def test_a_checkpoint_link_repointed_after_the_start_does_not_change_the_base_digest(tmp_path: Path) -> None:
    loaded = build_tiny_model(tmp_path / "loaded", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=5)  # the same names and shapes, other weights
    current = tmp_path / "current"
    current.symlink_to(loaded)
    served = _engine_started_on(current)  # vLLM has loaded `loaded` through the link

    moved = tmp_path / "moved"
    moved.symlink_to(other)
    os.replace(moved, current)  # the operator moves the link to a new base

    assert served.base_content() == Shadow(str(loaded)).content()
    assert served.base_content() == adapter_entry(peft_model(loaded, seed=1)).base_content
    assert served.base_content() != adapter_entry(peft_model(other, seed=1)).base_content
    assert served.base_fingerprint() == model_fingerprint(Shadow(str(loaded)).spec())


def test_an_engine_started_on_a_plain_directory_digests_it(tmp_path: Path) -> None:
    loaded = build_tiny_model(tmp_path / "loaded", seed=0)
    served = _engine_started_on(loaded)
    assert served.base_content(read=False) is None  # never read at a claim or a status read
    assert served.base_content() == adapter_entry(peft_model(loaded, seed=1)).base_content
