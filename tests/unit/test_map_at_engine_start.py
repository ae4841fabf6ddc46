"""The patch map built while vLLM starts (code paths only, no vLLM started): whatever the build raises, vLLM still
starts; a map that cannot be built is recorded for the engine's status, and a build that changed live weights
(:class:`MapCorruption`) leaves the engine unhealthy."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from deltasync.errors import MapCorruption

pytest.importorskip("vllm")


def _served(model: torch.nn.Module | None = None) -> Any:
    """The engine's served model (:class:`~deltasync.vllm.model.ServedModel`: the map's lifecycle) over a toy
    module, with just the vLLM configuration it reads (no engine is started)."""
    from deltasync.vllm.config import EngineConfig
    from deltasync.vllm.label import Label
    from deltasync.vllm.model import ServedModel

    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=None, dtype=torch.bfloat16, hf_config=None),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        quant_config=None,
        lora_config=None,
    )
    return ServedModel(model or torch.nn.Module(), torch.device("cpu"), config, EngineConfig(), Label())


def _unreadable_index() -> None:
    raise OSError("cannot read the checkpoint index")


def test_a_map_build_that_fails_at_start_never_raises_and_is_recorded() -> None:
    served = _served()
    served.spec = _unreadable_index
    served.map_at_start()  # must not raise
    assert served.map_error is not None


def test_map_corruption_at_start_leaves_the_engine_unhealthy(monkeypatch: pytest.MonkeyPatch) -> None:
    from deltasync.vllm import model as served_model

    model = torch.nn.Module()
    model.load_weights = lambda weights: None
    served = _served(model)
    served.spec = lambda: {"w": ("BF16", (4,))}

    def corrupt(*a: Any, **k: Any) -> None:
        raise MapCorruption("changed live weights")

    monkeypatch.setattr(served_model, "build_map", corrupt)
    served.map_at_start()
    assert served.label.healthy is False
