"""The GPU benchmark's CPU fallback: it runs here, with torch only (the GPU machines have neither
vLLM nor zstandard), and its scatter through the patch map is bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bench_scatter.py"


def test_bench_scatter_runs_with_torch_only_and_is_bit_exact() -> None:
    code = (
        "import sys, runpy\n"
        "for blocked in ('zstandard', 'vllm', 'deltasync', 'xxhash'):\n"
        "    sys.modules[blocked] = None  # importing any of them now fails\n"
        f"sys.argv = [{str(BENCH)!r}, '--device', 'cpu', '--quick']\n"
        f"runpy.run_path({str(BENCH)!r}, run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    [result] = report["results"]
    assert result["bit_exact"] and result["written"] == result["changed"] > 0
    assert 0.01 < result["changed_fraction"] < 0.03
