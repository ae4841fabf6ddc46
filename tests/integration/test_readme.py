"""The README's quick start, run exactly as written (issue 16): a coordinator, a publisher and an agent on an
offline vLLM in one process, then the readback of what vLLM computes with."""

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


def test_the_quick_start_runs_as_written(tmp_path: Path, tiny_model_dir: Path) -> None:
    code = quick_start()
    assert len([ln for ln in code.splitlines() if ln.strip()]) <= 10  # ten lines, as promised
    setup = (
        "from safetensors.torch import load_file\n"
        f"model_dir = {str(tiny_model_dir)!r}\n"
        "weights = load_file(f'{model_dir}/model.safetensors')\n"
    )
    body = "\n".join("    " + ln for ln in (setup + code).splitlines())  # vLLM spawns: a __main__ guard
    script = tmp_path / "quick_start.py"
    script.write_text(f"if __name__ == '__main__':\n{body}\n")
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = re.findall(r"^(\w+) (xxh3_128:[0-9a-f]{32})$", proc.stdout, re.M)  # vLLM may print around it
    assert len(printed) == 1, proc.stdout[-4000:]
    route, digest = printed[0]
    assert route == "anchor"
    from safetensors.torch import load_file

    from deltasync.testing.models import qwen3_effective_checksums

    expected = qwen3_effective_checksums(load_file(tiny_model_dir / "model.safetensors"), 2)["lm_head"]
    assert digest == expected  # vLLM computes with exactly the published weights
    assert (tmp_path / "run" / "ledger.db").exists() and (tmp_path / "run" / "store").is_dir()
