"""What a user has after cloning, for the tests that run documented commands as the user runs them: examples/,
benchmarks/ and the Makefile against the installed package, where ``tests`` is a package that refuses import."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["POISON", "ROOT", "make_user_tree", "user_env"]

ROOT = Path(__file__).resolve().parents[2]
POISON = "the test suite is not part of what a user runs: import deltasync.testing instead"


def make_user_tree(tree: Path) -> Path:
    """Copies examples/, benchmarks/, the Makefile and pyproject.toml into ``tree`` (made here), with a ``tests``
    package whose import raises ``ImportError(POISON)``: an entry point that reaches for the test suite fails as it
    fails for a user who has only the package. Returns ``tree``."""
    tree.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "demo-out", "bench-out")
    for name in ("examples", "benchmarks"):
        shutil.copytree(ROOT / name, tree / name, ignore=ignore)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tree / name)
    (tree / "tests").mkdir()
    (tree / "tests" / "__init__.py").write_text(f"raise ImportError({POISON!r})\n")
    return tree


def user_env() -> dict[str, str]:
    """A user's shell: no PYTHONPATH, no pytest's variables, and no outer make's (``make test`` runs the suite, and
    a make started under MAKELEVEL prints "Entering/Leaving directory" around what the user would see); this
    interpreter's bin first on PATH (make, the deltasync CLI)."""
    outer = ("PYTHONPATH", "MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")
    env = {k: v for k, v in os.environ.items() if k not in outer and not k.startswith(("PYTEST_", "MAKE_TERMINAL"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # so that an entry point that writes nothing leaves the tree as it was
    return env
