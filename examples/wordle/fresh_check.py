"""The final check of the MoE demo: what a fresh vLLM engine computes with, loaded from the final version.

vLLM's CPU build pads and repacks a MoE's experts after loading, in a layout only vLLM itself knows, so the trainer
cannot write down the checksums the kernels should see, as it does for the dense model. Instead the demo rebuilds the
final version from the store (every tensor checked against its object's checksums), starts a fresh engine on it
(vLLM's own loader, no deltasync backend) and compares the checksum of every parameter as the kernels use it with
the served engine's (:func:`compare`).

    python -m examples.wordle.fresh_check MODEL_DIR STORE VERSION OUT_DIR
        # prints "RESULT {...}": the fresh engine's checksums (a tensor of parameters, by vLLM name)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def fresh_checksums(model_dir: Path, store: Path, version: int, out: Path) -> dict[str, str]:
    """The checksums of a fresh engine started on version ``version`` of ``store`` (the config and tokenizer of
    ``model_dir``), run in a subprocess (vLLM spawns its own), with the plain weights the served one has."""
    env = {**os.environ, "DELTASYNC_VLLM_PLAIN_WEIGHTS": "1"}
    cmd = [sys.executable, "-m", "examples.wordle.fresh_check", str(model_dir), str(store), str(version), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the fresh engine for the final check failed: {proc.stderr[-3000:]}")
    result: dict[str, str] = json.loads(lines[-1][len("RESULT ") :])
    return result


def compare(served: dict[str, Any], fresh: dict[str, str], version: int) -> dict[str, Any]:
    """The final check's fields: which parameters differ, how many were checked, whether the label is the version."""
    got = served["effective_checksums"]
    differ = sorted(k for k in set(fresh) | set(got) if got.get(k) != fresh.get(k))
    label_ok = str(served["weight_version"]) == str(version)
    return {
        "differ": differ,
        "tensors_checked": len(fresh),
        "served_weight_version": str(served["weight_version"]),
        "bit_exact": not differ and label_ok,
    }


def main() -> int:
    from safetensors.torch import save_file

    from deltasync import LocalStore
    from deltasync.reader import read_weights
    from deltasync.testing.launchers import offline_llm

    model_dir, store, version, out = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    weights = read_weights(LocalStore(store), version)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(model_dir, out)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    llm = offline_llm(out, weight_transfer_config=None)
    try:
        (checksums,) = llm.collective_rpc("deltasync_effective")
    finally:
        llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(checksums), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
