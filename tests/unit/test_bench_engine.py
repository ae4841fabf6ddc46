"""The GPU engine benchmark's CPU run: the engine's update path on the stand-in of vLLM's fused model
(map build, first sync from an anchor, steady packed deltas) is bit-exact, its proofs hold, and a forged value is
caught, so the figures it prints on a GPU come from a path that works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bench_engine.py"


def test_bench_engine_runs_on_cpu_and_is_exact() -> None:
    code = (
        "import sys, runpy\n"
        "sys.modules['vllm'] = None  # the GPU machines have no vLLM: importing it now fails\n"
        f"sys.argv = [{str(BENCH)!r}, '--device', 'cpu', '--quick', '--steps', '2']\n"
        f"runpy.run_path({str(BENCH)!r}, run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    [result] = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert "error" not in result and "map_error" not in result, result
    assert result["map_layers"] == {"probed": 2, "derived": 2} and not result["unmapped"]
    first = result["first_sync"]
    assert first["bit_exact"] and first["proof_holds"] and first["audit_ok"]
    assert len(result["steps"]) == 2
    for step in result["steps"]:
        assert step["bit_exact"] and step["proof_holds"] and step["audit_ok"] and step["forgery_caught"]
        assert 0.01 < step["changed"] / result["elements"] < 0.04
