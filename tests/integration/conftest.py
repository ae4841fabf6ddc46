"""Integration fixtures: one real vLLM engine per session (2 cores fit one at a time)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltasync.testing.launchers import offline_llm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir: Path) -> Iterator[Any]:
    """An offline ``vllm.LLM`` on the tiny model (bf16, eager, CPU) with the deltasync backend."""
    pytest.importorskip(
        "vllm", reason="vLLM is not installed (pip install 'deltasync[vllm]' on GPU, 'deltasync[cpu]' on CPU)"
    )
    llm = offline_llm(tiny_model_dir)
    yield llm
    llm.llm_engine.engine_core.shutdown()
