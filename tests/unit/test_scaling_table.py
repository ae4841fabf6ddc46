"""benchmarks/scaling_table.py runs, and docs/SCALING.md's per-replica table is what it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scaling_table_matches_the_doc() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scaling_table.py")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    per_replica, per_fleet = out.stdout.strip().split("\n\n")
    assert len(per_replica.splitlines()) == 2 + 4 and len(per_fleet.splitlines()) == 2 + 12
    doc = (ROOT / "docs" / "SCALING.md").read_text()
    assert per_replica in doc, (
        "docs/SCALING.md's per-replica table is stale: paste benchmarks/scaling_table.py's first table"
    )
