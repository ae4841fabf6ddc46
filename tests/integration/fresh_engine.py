"""A fresh vLLM engine on a checkpoint: greedy ids, logprobs and effective-weight checksums as JSON.

python -m tests.integration.fresh_engine MODEL_DIR PROMPTS_JSON [TP]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def generate(llm, prompts: list[str], max_tokens: int = 16) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        {
            "ids": list(o.outputs[0].token_ids),
            "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)],
        }
        for o in outs
    ]


def fresh_run(model_dir: Path, weights: dict, ckpt: Path, prompts: list[str], tp: int = 1) -> dict:
    """Write ``weights`` as a checkpoint beside ``model_dir``'s config and tokenizer (at ``ckpt``), start a fresh
    engine on it in a subprocess (a clean vLLM, no deltasync backend) and return its ``outputs`` and
    ``effective`` (per rank)."""
    from safetensors.torch import save_file

    shutil.copytree(model_dir, ckpt)
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.fresh_engine", str(ckpt), json.dumps(prompts), str(tp)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def assert_as_fresh(
    model_dir: Path, weights: dict, ckpt: Path, prompts: list[str], tp: int, ranks: list, outputs: list, why: str = ""
) -> None:
    """What an engine served (``ranks``: each rank's ``deltasync_effective``; ``outputs``: :func:`generate` of
    ``prompts``) equals a fresh engine loaded from ``weights`` (:func:`fresh_run`): every live parameter, the token
    ids and the logprobs. ``why`` is added to a parameter mismatch's message."""
    fresh = fresh_run(model_dir, weights, ckpt, prompts, tp)
    differ = sorted({k for a, b in zip(fresh["effective"], ranks, strict=True) for k in a if a[k] != b.get(k)})
    assert not differ, f"the live parameters differ from a fresh load: {differ[:8]}{why}"
    assert [o["ids"] for o in outputs] == [o["ids"] for o in fresh["outputs"]]
    assert [o["logprobs"] for o in outputs] == [o["logprobs"] for o in fresh["outputs"]]


if __name__ == "__main__":
    from deltasync.testing.launchers import offline_llm

    model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    llm = offline_llm(model_dir, tensor_parallel_size=tp, weight_transfer_config=None)
    result = {"outputs": generate(llm, prompts), "effective": llm.collective_rpc("deltasync_effective")}
    print("RESULT " + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()
