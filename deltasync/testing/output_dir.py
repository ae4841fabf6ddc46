"""A run's output directory: made fresh for each run, and never a directory the run did not make.

The demos replace their ``--out`` at every start. A directory is replaced only if it is missing, empty, or was
made by an earlier run (it holds :data:`MARKER`): ``--out .`` in a checkout, or a typo naming a home directory,
is refused instead of deleted.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["MARKER", "fresh_output_dir"]

MARKER = ".deltasync-run-output"
"""The file a run leaves in the directory it made."""


def fresh_output_dir(path: Path) -> Path:
    """``path`` (absolute) as a new, empty directory holding only :data:`MARKER`.

    Raises:
        ValueError: ``path`` exists and is not an earlier run's output (a file, or a directory with other
            contents and no marker); nothing was deleted.
    """
    path = path.absolute()
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ValueError(f"{path} is not a directory: give a new or empty --out")
    if path.is_dir() and any(path.iterdir()) and not (path / MARKER).is_file():
        names = sorted(p.name for p in path.iterdir())
        raise ValueError(
            f"{path} holds {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}: not an earlier run's output "
            "(no marker), so it is not replaced; give a new or empty --out"
        )
    if path.is_dir():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARKER).write_text("made by a deltasync demo run; the next run replaces this directory\n")
    return path
