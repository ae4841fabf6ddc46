"""Registers the ``deltasync`` weight-transfer backend with vLLM (a ``vllm.general_plugins`` entry point).

vLLM calls general plugins in every process it starts (front end, EngineCore, each worker), possibly more
than once per process; registering only in the driver is not enough. Registration is lazy (by module path),
so the engine's imports happen only when a worker builds it.
"""

from __future__ import annotations

from . import BACKEND

__all__ = ["register"]


def register() -> None:
    """Register the backend with ``WeightTransferEngineFactory``, and keep CPU linear weights plain when
    ``DELTASYNC_VLLM_PLAIN_WEIGHTS=1`` (:mod:`deltasync.vllm.plain`); idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from .plain import install

    install()
    if BACKEND in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(BACKEND, "deltasync.vllm.engine", "DeltaSyncWeightTransferEngine")
