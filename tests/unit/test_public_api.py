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


def test_publisher_and_agent_are_lazy() -> None:
    """`from deltasync import Publisher, Agent` works, and `import deltasync` stays light."""
    import subprocess
    import sys

    code = (
        "import sys, deltasync; light = 'deltasync.publisher' not in sys.modules and 'httpx' not in sys.modules; "
        "from deltasync import Publisher, Agent, CoordinatorClient, InMemoryTarget; print(light, Publisher.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "deltasync.publisher"]


def test_every_module_declares_all() -> None:
    import deltasync_coordinator

    modules = [*pkgutil.walk_packages(deltasync.__path__, "deltasync.")]
    modules += [*pkgutil.walk_packages(deltasync_coordinator.__path__, "deltasync_coordinator.")]
    for mod in modules:
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
    assert issubclass(deltasync.ObjectExists, FileExistsError)
    assert issubclass(deltasync.SignatureError, deltasync.IntegrityError)
    assert issubclass(deltasync.VersionGapError, deltasync.UpdateRefused)
    assert not issubclass(deltasync.UpdateRefused, deltasync.ApplyError)  # a refusal is not a failure past a write
    for cls in (
        deltasync.FormatError,
        deltasync.StoreError,
        deltasync.UpdateRefused,
        deltasync.CoordinatorError,
        deltasync.RunMismatch,
        deltasync.LeaseError,
    ):
        assert issubclass(cls, deltasync.DeltaSyncError)
