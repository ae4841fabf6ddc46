"""The patch map built while vLLM starts (code paths only, no vLLM started): whatever the build raises, vLLM still
starts; a map that cannot be built is recorded for the engine's status, and a build that changed live weights
(:class:`MapCorruption`) leaves the engine unhealthy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltasync.errors import MapCorruption

proof = pytest.importorskip("deltasync.vllm.proof")


class _Engine(proof.ProvingEngine):  # type: ignore[misc, name-defined]
    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    finish_weight_update = receive_weights = shutdown = start_weight_update = _nothing


def _bare_engine() -> Any:
    eng = object.__new__(_Engine)
    eng._map, eng._map_failed, eng.healthy, eng.version = None, None, True, None
    eng._staged, eng._manifest, eng.detail = None, None, ""
    eng._untrusted = lambda param: None
    return eng


def _unreadable_index() -> None:
    raise OSError("cannot read the checkpoint index")


def test_a_map_build_that_fails_at_start_never_raises_and_is_recorded() -> None:
    eng = _bare_engine()
    eng.served_spec = _unreadable_index
    eng._map_at_start()  # must not raise
    assert eng._map_failed is not None


def test_map_corruption_at_start_leaves_the_engine_unhealthy(monkeypatch: pytest.MonkeyPatch) -> None:
    from deltasync.vllm import base

    eng = _bare_engine()
    eng.served_spec = lambda: {"w": ("BF16", (4,))}
    eng.model = torch.nn.Module()
    eng.model.load_weights = lambda weights: None

    def corrupt(*a: Any, **k: Any) -> None:
        raise MapCorruption("changed live weights")

    monkeypatch.setattr(base, "build_map", corrupt)
    eng._map_at_start()
    assert eng.healthy is False
