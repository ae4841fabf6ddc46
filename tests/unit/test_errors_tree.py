"""Every exception deltasync raises on purpose derives from DeltaSyncError, and the tree drawn in
``deltasync.errors``' docstring (and README.md's copy of it) is the tree the classes form."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import deltasync
from deltasync import errors

README = Path(__file__).resolve().parents[2] / "README.md"
_ROW = re.compile(r"^[\s|]*\+-- (\w+)\(([^)]*)\)", re.M)
_ROOT = re.compile(r"^\s*DeltaSyncError\s*$", re.M)


def _public_modules() -> list[str]:
    """Every module of the package whose dotted path has no private part (``_requests``, ``_kernels``)."""
    names = [deltasync.__name__]
    for info in pkgutil.walk_packages(deltasync.__path__, prefix="deltasync."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


@pytest.mark.vllm  # imports deltasync.vllm (vLLM installed; no engine is started)
def test_every_public_exception_class_derives_from_deltasync_error() -> None:
    strays = []
    for name in _public_modules():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if attr.startswith("_") or not inspect.isclass(obj) or not issubclass(obj, BaseException):
                continue
            if obj.__module__.startswith("deltasync") and not issubclass(obj, errors.DeltaSyncError):
                strays.append(f"{obj.__module__}.{obj.__qualname__}")
    assert not strays, f"exceptions outside DeltaSyncError: {sorted(set(strays))}"


def _tree(text: str) -> dict[str, tuple[str, ...]]:
    """``name -> parents`` of the ``+-- Name(Parent, Builtin)`` rows of a drawn tree, each row's first parent also
    checked against where the row is drawn (the row above it one level less indented)."""
    out: dict[str, tuple[str, ...]] = {}
    drawn: list[tuple[int, str]] = [(-4, "DeltaSyncError")]  # (column of "+--", name), the path to the last row
    for m in _ROW.finditer(text):
        column = m[0].index("+--")
        while drawn[-1][0] >= column:
            drawn.pop()
        parents = tuple(p.strip() for p in m[2].split(","))
        assert parents[0] == drawn[-1][1], f"{m[1]} is drawn under {drawn[-1][1]}, its parent is {parents[0]}"
        drawn.append((column, m[1]))
        out[m[1]] = parents
    return out


def _actual() -> dict[str, tuple[str, ...]]:
    out = {}
    for name in errors.__all__:
        cls = getattr(errors, name)
        if inspect.isclass(cls) and issubclass(cls, errors.DeltaSyncError) and cls is not errors.DeltaSyncError:
            out[name] = tuple(b.__name__ for b in cls.__bases__)
    return out


def test_the_tree_in_the_errors_docstring_is_the_class_tree() -> None:
    assert _ROOT.search(errors.__doc__ or "")
    assert _tree(errors.__doc__ or "") == _actual()


def test_the_readme_draws_the_same_tree() -> None:
    text = README.read_text(encoding="utf-8")
    assert _ROOT.search(text), "README.md draws no error tree"
    assert _tree(text) == _actual()
