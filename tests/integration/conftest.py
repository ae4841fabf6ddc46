"""Integration fixtures: one real vLLM engine per session (2 cores fit one at a time)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
WORKER_EXTENSION = "deltasync.vllm.worker_ext.DeltaSyncWorkerExtension"


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir: Path) -> Iterator[Any]:
    """An offline ``vllm.LLM`` on the tiny model (bf16, eager, CPU) with the deltasync backend."""
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'deltasync[vllm]')")
    llm = vllm.LLM(
        model=str(tiny_model_dir),
        dtype="bfloat16",
        max_model_len=512,
        enforce_eager=True,
        seed=0,
        weight_transfer_config={"backend": "deltasync"},
        worker_extension_cls=WORKER_EXTENSION,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()
