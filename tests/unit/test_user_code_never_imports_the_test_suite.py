"""What users run (examples/, benchmarks/) imports the installed package, never the repository's ``tests``; the
harness they share with the tests (:mod:`deltasync.testing`) is imported by nothing else in the package, and
importing it pulls in none of the heavy optional libraries.

The documented commands themselves run from a copy without ``tests`` in
tests/integration/test_documented_commands.py; this file also reads the code paths those runs do not reach (the
vLLM benchmarks' functions, the hosts demo's process command lines)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (absolute, or relative resolved against its package), with its line."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    if package[:1] == ("services",):
        package = package[1:]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            out += [(node.lineno, module)] + [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return out


def _strings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_examples_and_benchmarks_never_import_tests() -> None:
    found = []
    for path in _python_files("examples", "benchmarks"):
        rel = path.relative_to(ROOT)
        found += [f"{rel}:{line}: import {m}" for line, m in _imports(path) if m == "tests" or m.startswith("tests.")]
        # a child process started with `python -m tests...` imports it just the same
        found += [f"{rel}:{line}: runs -m {s}" for line, s in _strings(path) if s.startswith("tests.")]
    assert not found, "user-facing code depends on the test suite:\n" + "\n".join(found)


def test_the_package_never_imports_its_harness() -> None:
    found = []
    for path in _python_files("deltasync", "services"):
        if (ROOT / "deltasync" / "testing") in path.parents:
            continue
        rel = path.relative_to(ROOT)
        found += [f"{rel}:{line}: {m}" for line, m in _imports(path) if m.startswith("deltasync.testing")]
    assert not found, "deltasync.testing is for tests, demos and benchmarks only:\n" + "\n".join(found)


def test_importing_the_harness_pulls_in_no_heavy_library() -> None:
    heavy = ("transformers", "tokenizers", "vllm", "peft", "moto", "boto3", "cryptography", "psycopg")
    modules = ("credentials", "launchers", "models", "postgres", "s3", "s3_iam", "stream", "tls")
    code = (
        "import sys\n"
        + "".join(f"import deltasync.testing.{m}\n" for m in modules)
        + f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]"], out.stdout
