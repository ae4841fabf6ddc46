"""The operator's final check, run on vLLM's own host: what vLLM computes with, as checksums, and its label.

    DELTASYNC_ENGINE_TOKEN_FILE=... python -m examples.wordle.check_served --vllm-url http://127.0.0.1:8000 \\
        --out served.json [--expect final.json]

It calls vLLM's administrative ``/collective_rpc`` (``deltasync_effective``: each tensor's checksum as vLLM's
kernels use it) with the engine credential, which never leaves this host: across hosts, the trainer writes its
own checksums into ``final.json`` and this check compares them here (``--expect``), or the operator compares the
two files. Exit status 1 when they differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from deltasync.targets import EngineAuth
from deltasync.vllm.guard import load_engine_token


def served(vllm_url: str, token: str | None = None) -> dict[str, object]:
    """vLLM's weight label and the checksum of every tensor as it computes with it (``token``: the engine
    credential; default: ``DELTASYNC_ENGINE_TOKEN`` or ``_FILE``)."""
    token = token if token is not None else load_engine_token()
    if token is None:
        raise SystemExit("the check needs the engine credential (DELTASYNC_ENGINE_TOKEN or _FILE)")
    with httpx.Client(base_url=vllm_url, timeout=120, auth=EngineAuth(token)) as admin:
        label = admin.get("/weight_info").raise_for_status().json()["weight_version"]
        checksums = admin.post("/collective_rpc", json={"method": "deltasync_effective"}).raise_for_status()
    return {"weight_version": label, "effective_checksums": checksums.json()["results"][0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-url", required=True)
    parser.add_argument("--out", type=Path, required=True, help="where to write the label and the checksums")
    parser.add_argument("--expect", type=Path, help="the trainer's final.json: compare its checksums and version")
    args = parser.parse_args()
    result = served(args.vllm_url)
    if args.expect is not None:
        final = json.loads(args.expect.read_text())
        got, want = result["effective_checksums"], final["effective_checksums"]
        assert isinstance(got, dict)
        result["differ"] = sorted(k for k in want if got.get(k) != want[k])
        result["tensors_checked"] = len(want)
        result["version_matches"] = str(final["version"]) == str(result["weight_version"])
        result["bit_exact"] = not result["differ"] and result["version_matches"]
    args.out.write_text(json.dumps(result, indent=1))
    return 0 if result.get("bit_exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())
