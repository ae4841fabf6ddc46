"""The Wordle demo, shortened (3 steps): real processes, every version applied in order, bit-exact at the end,
and no process left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _alive(pid: int) -> bool:
    """Running (a zombie, already dead and only waiting to be reaped by init, does not count)."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state != "Z"


def test_shortened_demo(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "examples.wordle.run_demo", "--out", str(out), "--steps", "3", "--warmup-steps", "20"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "BIT-EXACT" in proc.stdout and (out / "demo.png").stat().st_size > 10_000
    report = json.loads((out / "report.json").read_text())
    final = report["final"]
    assert final["bit_exact"] and final["served_weight_version"] == str(final["version"]) == "3"
    published = sorted({p["version"] for p in final["published"]})
    assert published == [0, 1, 2, 3]
    # the engine's own log: every version applied, in order, none skipped or repeated (regression, found by CI:
    # importing TRL sets VLLM_LOGGING_LEVEL=ERROR in os.environ, which silenced the server; its level is now explicit)
    applied = [int(v) for v in re.findall(r"deltasync: now at v(\d+)", (out / "logs" / "vllm.log").read_text())]
    assert applied == published, applied
    assert [r["served_version"] for r in report["steps"]] == [0, 1, 2]  # each rollout used the previous step's weights
    # every process the demo started is gone, and nothing else still runs from its directory
    pids = json.loads((out / "pids.json").read_text())
    assert set(pids) == {"coordinator", "env", "vllm", "agent", "trainer"}
    assert not [name for name, pid in pids.items() if _alive(pid)]
    leftovers = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out).encode() in cmdline.read_bytes():
                leftovers.append(cmdline.parent.name)
        except OSError:
            continue
    assert not leftovers, leftovers
