"""Every documented command runs as a user runs it: each benchmark's and example's ``--help``, the smallest real
invocation its docstring gives (those that start no vLLM engine), and ``make demo-local`` and ``make bench`` in full.

Each runs in a subprocess from a copy of what a user runs (examples/, benchmarks/, the Makefile) against the
installed package, without ``PYTHONPATH``. The copy's ``tests`` package refuses to be imported, so an entry point
that reaches for the test suite fails here as it fails for a user who has only the package. ``--help`` must start
no work: it returns at once and writes nothing.

The entry points that start vLLM run their smallest real invocation too where it takes about a minute here
(bench_apply, bench_map, bench_lora, bench_lora_sync: 30-65 s each). The Wordle demo's smallest run is
tests/integration/test_wordle_demo.py's (from a user's tree too, with every check of the demo's report). The rest
run ``--help`` only: bench_wordle_learning is several such demos, run_hosts needs root and takes minutes
(tests/integration/test_wordle_hosts.py runs it), and train, check_served and rollout_server are the demo's own
processes (run_demo starts them), train_async_trl needs CUDA.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deltasync.testing.launchers import free_port, stop_process_group, wait_until_serving
from deltasync.testing.postgres import find_binaries
from tests.support.user_tree import POISON, ROOT, make_user_tree, user_env

ENV_TOKEN = "env-token-0123456789abcdef"

SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py") if "__pycache__" not in p.parts)
MODULES = [
    "examples.wordle.check_served",
    "examples.wordle.env_server",
    "examples.wordle.rollout_server",
    "examples.wordle.run_demo",
    "examples.wordle.run_hosts",
    "examples.wordle.solver",
    "examples.wordle.train",
    "examples.wordle.train_async_trl",
    "deltasync.testing.s3_iam",
]
ENTRY_POINTS = [[s] for s in [*SCRIPTS, "examples/local_stream.py"]] + [["-m", m] for m in MODULES]


@pytest.fixture(scope="module")
def user_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a user has: examples/, benchmarks/ and the Makefile; ``tests`` is a package that refuses import."""
    return make_user_tree(tmp_path_factory.mktemp("user") / "tree")


def _run(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=timeout_s)


def _files(tree: Path) -> dict[str, int]:
    return {str(p.relative_to(tree)): p.stat().st_mtime_ns for p in tree.rglob("*") if p.is_file()}


def _ok(out: subprocess.CompletedProcess[str], what: str) -> str:
    assert out.returncode == 0, f"{what} exited with {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out.stdout


def test_the_user_tree_cannot_import_tests(user_tree: Path) -> None:
    out = _run([sys.executable, "-c", "import tests"], user_tree, 60)
    assert out.returncode == 1 and POISON in out.stderr, out.stderr
    out = _run([sys.executable, "-c", "import deltasync.testing.models, deltasync_coordinator"], user_tree, 60)
    _ok(out, "importing the installed package")


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda e: e[-1])
def test_help_starts_no_work(user_tree: Path, entry: list[str]) -> None:
    before = _files(user_tree)
    t0 = time.monotonic()
    try:
        out = _run([sys.executable, *entry, "--help"], user_tree, 120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(entry)} --help ran for 120 s: it started work instead of printing its usage")
    assert _ok(out, f"{' '.join(entry)} --help").startswith("usage:"), out.stdout[:500]
    assert _files(user_tree) == before, f"{' '.join(entry)} --help wrote into {user_tree}"
    assert time.monotonic() - t0 < 60


SMALL_RUNS = [
    ["benchmarks/bench_audit.py", "--repeat", "1", "--layers", "1"],
    ["benchmarks/bench_coordinator.py", "--registrations", "50", "--heartbeats", "50", "--rounds", "1",
     "--plan-versions", "200"],
    ["benchmarks/bench_layouts.py", "--layers", "1", "--steps", "1"],
    ["benchmarks/bench_publish.py", "--steps", "2", "--layers", "1"],
    ["benchmarks/bench_store.py", "--repeat", "1", "--only", "stores"],
    ["benchmarks/scaling_table.py"],
]  # fmt: skip
"""The smallest real invocation of each benchmark that starts no vLLM engine, as its docstring writes it.
bench_codec.py runs in full as ``make bench``; the GPU benchmarks' CPU runs are tests/unit/test_bench_*.py."""


@pytest.mark.slow
@pytest.mark.parametrize("cmd", SMALL_RUNS, ids=lambda c: Path(c[0]).name)
def test_smallest_benchmark_run_completes(user_tree: Path, cmd: list[str]) -> None:
    out = _ok(_run([sys.executable, *cmd], user_tree, 600), " ".join(cmd))
    assert out.strip().splitlines()[-1].startswith(("{", "|")), out[-2000:]  # the figures' JSON line, or the table


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.skipif(find_binaries() is None, reason="no PostgreSQL server binaries (initdb, pg_ctl)")
def test_coordinator_benchmark_runs_on_a_throwaway_postgres(user_tree: Path) -> None:
    cmd = ["benchmarks/bench_coordinator.py", "--registrations", "20", "--heartbeats", "20", "--rounds", "1"]
    out = _ok(_run([sys.executable, *cmd, "--plan-versions", "50", "--postgres"], user_tree, 600), " ".join(cmd))
    assert '"backend": "postgres' in out, out[-2000:]


VLLM_RUNS = [
    (["benchmarks/bench_map.py", "--only", "0.6B"], '"unmapped_count": 0'),
    (["benchmarks/bench_apply.py", "--steps", "1", "--engines", "plain", "--modes", "inplace", "--lr", "1e-6",
      "--tokens", "8"],
     '{"model_elements"'),
    (["benchmarks/bench_lora.py", "--rank", "8", "--versions", "1"], "median: replace"),
    (["benchmarks/bench_lora_sync.py", "--rank", "8", "--steps", "1", "--paths", "adapter"], '{"rank": 8'),
]  # fmt: skip
"""The smallest real invocation of each entry point that starts vLLM and takes about a minute here, and what its
output must hold (its figures, or the demo's final check)."""


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    ("cmd", "expect"), VLLM_RUNS, ids=[c[1] if c[0] == "-m" else Path(c[0]).name for c, _ in VLLM_RUNS]
)
def test_smallest_vllm_run_completes(user_tree: Path, tmp_path: Path, cmd: list[str], expect: str) -> None:
    cmd = [arg.replace("{tmp}", str(tmp_path / "out")) for arg in cmd]
    out = _ok(_run([sys.executable, *cmd], user_tree, 900), " ".join(cmd))
    assert expect in out, out[-3000:]


def test_solver_builds_a_small_tree_where_it_is_told(user_tree: Path, tmp_path: Path) -> None:
    committed = user_tree / "examples" / "wordle" / "data" / "solver_tree.json"
    before = committed.read_bytes()
    out = _run([sys.executable, "-m", "examples.wordle.solver", "--out", str(tmp_path / "t.json"), "--answers", "50"],
               user_tree, 120)  # fmt: skip
    _ok(out, "the solver")
    assert "50 answers" in out.stderr and (tmp_path / "t.json").stat().st_size > 0
    refused = _run([sys.executable, "-m", "examples.wordle.solver", "--out", str(committed)], user_tree, 60)
    assert refused.returncode == 2 and "exists: pass --force to replace it" in refused.stderr, refused.stderr
    assert committed.read_bytes() == before


@pytest.fixture
def env_server(user_tree: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "env.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "examples.wordle.env_server", "--port", str(port)],
            cwd=user_tree,
            env={**user_env(), "WORDLE_ENV_TOKEN": ENV_TOKEN},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url + "/healthz", proc, "the Wordle environment", timeout_s=60, interval_s=0.1, log=log)
        yield url
    finally:
        stop_process_group(proc, 10)


def test_env_server_serves_a_game(env_server: str) -> None:
    auth = {"Authorization": f"Bearer {ENV_TOKEN}"}
    with httpx.Client(base_url=env_server, timeout=30, headers=auth) as client:
        obs = client.post("/v1/sessions", json={"seed": 0}).raise_for_status().json()
        step = client.post(f"/v1/sessions/{obs['session_id']}/guess", json={"guess": "crane"}).raise_for_status()
        assert step.json()["valid"]


@pytest.mark.slow
def test_make_demo_local_in_full(user_tree: Path) -> None:
    out = _make("demo-local", user_tree)
    assert out.count("all checksums match") == 2, out[-3000:]
    assert (user_tree / "demo-out" / "local" / "store").is_dir()


@pytest.mark.slow
def test_make_bench_in_full(user_tree: Path) -> None:
    out = _make("bench", user_tree)
    assert out.strip().splitlines()[-1].startswith('{"changed_fraction"'), out[-3000:]
    assert not (user_tree / "bench-out").exists()  # its scratch directory is gone


def _make(target: str, tree: Path) -> str:
    """``make TARGET`` with this interpreter's environment as the Makefile's virtualenv, its set-up taken as done
    (``-o``: the stamp is not remade; installing is not what these tests are about)."""
    venv = Path(sys.prefix)
    cmd = ["make", "-o", str(venv / ".deltasync-installed"), f"VENV={venv}", f"PY={sys.executable}", target]
    return _ok(_run(cmd, tree, 1200), f"make {target}")
