"""The README's quick start, run exactly as pasted: a coordinator, a publisher and an agent on an offline vLLM in
one process, then the readback of what vLLM computes with."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
README = Path(__file__).parents[2] / "README.md"


def quick_start() -> str:
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_the_quick_start_runs_as_pasted(tmp_path: Path) -> None:
    """The block, saved as a file and run in an empty directory, with nothing added around it: it builds its
    own tiny model, and vLLM then computes with exactly the weights it published."""
    import json
    import os

    script = tmp_path / "quick_start.py"
    script.write_text(quick_start())
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # the block sets what it needs
    proc = subprocess.run(
        [sys.executable, script.name], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = re.findall(r"^(\w+) (xxh3_128:[0-9a-f]{32})$", proc.stdout, re.M)  # vLLM may print around it
    assert len(printed) == 1, proc.stdout[-4000:]
    route, digest = printed[0]
    assert route == "anchor"
    from safetensors.torch import load_file

    from deltasync.testing.models import qwen3_effective_checksums

    model = tmp_path / "run" / "model"
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    expected = qwen3_effective_checksums(load_file(model / "model.safetensors"), layers)["lm_head"]
    assert digest == expected  # vLLM computes with exactly the published weights
    assert (tmp_path / "run" / "ledger.db").exists() and (tmp_path / "run" / "store").is_dir()
