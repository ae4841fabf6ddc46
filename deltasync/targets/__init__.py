"""The engines an agent keeps current: vLLM offline or over HTTP, and weights in this process's memory."""

from __future__ import annotations

from .base import UNHEALTHY_LABEL, EngineClaim, EngineState, EngineTarget, parse_weight_version
from .engine_auth import EngineAuth
from .memory import InMemoryTarget
from .vllm import WORKER_EXTENSION, HttpVllmTarget, OfflineLLMTarget

__all__ = [
    "UNHEALTHY_LABEL",
    "WORKER_EXTENSION",
    "EngineAuth",
    "EngineClaim",
    "EngineState",
    "EngineTarget",
    "HttpVllmTarget",
    "InMemoryTarget",
    "OfflineLLMTarget",
    "parse_weight_version",
]
