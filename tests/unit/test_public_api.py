from __future__ import annotations

import importlib
import pkgutil

import deltasync


def test_all_is_sorted_and_complete() -> None:
    assert deltasync.__all__ == sorted(deltasync.__all__)
    public = {
        n for n in dir(deltasync) if not n.startswith("_") and not isinstance(getattr(deltasync, n), type(deltasync))
    }
    assert public - {"annotations"} == set(deltasync.__all__)


def test_every_module_declares_all() -> None:
    for mod in pkgutil.walk_packages(deltasync.__path__, "deltasync."):
        module = importlib.import_module(mod.name)
        assert isinstance(getattr(module, "__all__", None), list), mod.name
        for name in module.__all__:
            assert hasattr(module, name), f"{mod.name}.__all__ lists missing {name}"


def test_error_tree_keeps_builtin_bases() -> None:
    assert issubclass(deltasync.ObjectNotFound, FileNotFoundError)
    assert issubclass(deltasync.StoreError, OSError)
    assert issubclass(deltasync.FormatError, ValueError)
    assert issubclass(deltasync.IntegrityError, deltasync.FormatError)
    assert issubclass(deltasync.ApplyError, RuntimeError)
    for cls in (
        deltasync.FormatError,
        deltasync.StoreError,
        deltasync.VersionGapError,
        deltasync.CoordinatorError,
    ):
        assert issubclass(cls, deltasync.DeltaSyncError)
