"""A demo replaces its ``--out`` only when an earlier run made it: ``--out .`` in a checkout, or a typo naming a
directory of the user's, is refused before anything is deleted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deltasync.testing.output_dir import MARKER, fresh_output_dir

ROOT = Path(__file__).resolve().parents[2]


def test_only_a_missing_empty_or_earlier_output_directory_is_replaced(tmp_path: Path) -> None:
    made = fresh_output_dir(tmp_path / "new" / "out")
    (made / "result.json").write_text("{}")
    assert fresh_output_dir(made) == made and sorted(p.name for p in made.iterdir()) == [MARKER]
    (tmp_path / "empty").mkdir()
    assert (fresh_output_dir(tmp_path / "empty") / MARKER).is_file()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match=r"holds thesis.tex: not an earlier run's output \(no marker\)"):
        fresh_output_dir(mine)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        fresh_output_dir(tmp_path / "file")
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(ValueError, match="is not a directory"):
        fresh_output_dir(tmp_path / "link")
    assert (mine / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "examples.wordle.run_demo"],
        ["-m", "examples.wordle.run_hosts"],
        [str(ROOT / "examples" / "local_stream.py")],
    ],
    ids=["run_demo", "run_hosts", "local_stream"],
)
def test_a_demo_refuses_to_replace_a_directory_it_did_not_make(tmp_path: Path, argv: list[str]) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    proc = subprocess.run(
        [sys.executable, *argv, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "not an earlier run's output (no marker), so it is not replaced" in proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "keep me"
