"""Registers the ``deltasync`` weight-transfer backend with vLLM (a ``vllm.general_plugins`` entry point).

vLLM calls general plugins in every process it starts (front end, EngineCore, each worker), possibly more
than once per process; registering only in the driver is not enough. Registration is lazy (by module path),
so the engine's imports happen only when a worker builds it.
"""

from __future__ import annotations

from . import BACKEND

__all__ = ["register"]


def register() -> None:
    """Register the backend with ``WeightTransferEngineFactory``, and keep CPU linear weights plain when the
    engine's settings say so (``DELTASYNC_VLLM_PLAIN_WEIGHTS=1``: :mod:`deltasync.vllm.plain`; here, before vLLM
    loads the model); idempotent.

    Raises:
        ValueError: an engine setting breaks its rule (:meth:`~deltasync.vllm.config.EngineConfig.from_env`):
            vLLM does not start.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from .config import EngineConfig
    from .plain import install

    if EngineConfig.from_env().plain_weights:
        install()
    if BACKEND in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(BACKEND, "deltasync.vllm.engine", "DeltaSyncWeightTransferEngine")
