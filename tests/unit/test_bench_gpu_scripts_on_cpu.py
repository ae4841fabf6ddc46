"""The GPU benchmarks' CPU runs: they import deltasync as a user does, where vLLM is absent (the GPU machines have
torch but no vLLM), and what they measure is exact, so the figures they print on a GPU come from a path that
works. Also: the patch map, which the benchmarks use, imports without vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


def _without_vllm(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where importing vLLM fails."""
    prelude = "import sys\nsys.modules['vllm'] = None  # importing it now fails\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300)


def _bench(script: str, *args: str) -> list[dict[str, Any]]:
    path = str(GPU / script)
    out = _without_vllm(
        f"import runpy\nsys.argv = [{path!r}, *{list(args)!r}]\nrunpy.run_path({path!r}, run_name='__main__')\n"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    results: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    return results


def test_the_patch_map_imports_and_builds_without_vllm() -> None:
    out = _without_vllm(
        "import torch\n"
        "from deltasync.vllm.patch_map import build_map\n"
        "m = torch.nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)\n"
        "load = lambda ws: [m.weight.data.copy_(w) for _, w in ws]\n"
        "pm = build_map(m, {'weight': ('BF16', (4, 4))}, load)\n"
        "assert list(pm.runs) == ['weight'] and not pm.unmapped, pm.summary()\n"
        "assert not any(k == 'vllm' or k.startswith('vllm.') for k, v in sys.modules.items() if v is not None)\n"
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_bench_scatter_runs_on_cpu_and_is_bit_exact() -> None:
    [result] = _bench("bench_scatter.py", "--device", "cpu", "--quick")
    assert result["bit_exact"] and result["written"] == result["changed"] > 0
    assert 0.01 < result["changed_fraction"] < 0.03


def test_bench_engine_runs_on_cpu_and_is_exact() -> None:
    [result] = _bench("bench_engine.py", "--device", "cpu", "--quick", "--steps", "2")
    assert "error" not in result and "map_error" not in result, result
    assert result["map_layers"] == {"probed": 2, "derived": 2} and not result["unmapped"]
    first = result["first_sync"]
    assert first["bit_exact"] and first["proof_holds"] and first["audit_ok"]
    assert len(result["steps"]) == 2
    for step in result["steps"]:
        assert step["bit_exact"] and step["proof_holds"] and step["audit_ok"] and step["forgery_caught"]
        assert 0.01 < step["changed"] / result["elements"] < 0.04
