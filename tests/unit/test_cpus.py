"""deltasync's threads run on the cores the process was started with (or an engine's ``DELTASYNC_CPUS``), not on the one core
the OpenMP runtime pins vLLM's CPU worker's main thread to; a job's items come back in order, errors and all."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from deltasync import _cpus
from deltasync._cpus import PARALLEL_MIN_ELEMENTS, parallel_map, parse_cpu_list, use_cpus, work_cpus
from deltasync.vllm.config import CPUS_ENV, EngineConfig

BIG = PARALLEL_MIN_ELEMENTS


@pytest.fixture(autouse=True)
def _default_cores():  # type: ignore[no-untyped-def]
    """Each test starts, and leaves this process, on the cores it was started with."""
    use_cpus(None)
    yield
    use_cpus(None)


def _use(text: str) -> None:
    """The cores an engine started with ``DELTASYNC_CPUS=text`` runs its threads on."""
    use_cpus(EngineConfig.from_env({CPUS_ENV: text}).cpus)


needs_two = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
    reason="needs two cores this process may use (Linux)",
)


@pytest.mark.parametrize(
    ("text", "cpus"), [("0", {0}), ("0-3", {0, 1, 2, 3}), ("1,3-4", {1, 3, 4}), (" 2 , 0 ", {0, 2}), ("5-5", {5})]
)
def test_cpu_lists_parse(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text, what=CPUS_ENV) == cpus
    assert EngineConfig.from_env({CPUS_ENV: text}).cpus == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "1,,2", "0x1", "1.5"])
def test_bad_cpu_lists_name_the_setting(text: str) -> None:
    with pytest.raises(ValueError, match=f"{CPUS_ENV}=.*expected a CPU list"):
        parse_cpu_list(text, what=CPUS_ENV)
    if text:  # unset (empty): the cores the process was started with
        with pytest.raises(ValueError, match=f"{CPUS_ENV}=.*expected a CPU list"):
            EngineConfig.from_env({CPUS_ENV: text})


def _on_one_core(job):  # type: ignore[no-untyped-def]
    """``job()`` run on a thread pinned to core 0, as vLLM's CPU worker pins its main thread."""
    out: dict[str, object] = {}

    def run() -> None:
        os.sched_setaffinity(0, {0})
        try:
            out["result"] = job()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["result"]


def _where() -> tuple[frozenset[int], int]:
    return frozenset(os.sched_getaffinity(0)), threading.get_ident()


_REPORT = (  # as an engine starts: its settings from the environment, then its threads' cores
    "from deltasync._cpus import format_cpu_list, use_cpus, work_cpus; from deltasync.vllm.config import EngineConfig; "
    "use_cpus(EngineConfig.from_env().cpus); print(format_cpu_list(work_cpus()))"
)


def _child(script: str, **env: str) -> str:
    """What a fresh interpreter prints, started with this process's cores and ``env`` on top of its environment."""
    base = {k: v for k, v in os.environ.items() if k not in (CPUS_ENV, "OMP_PLACES", "OMP_PROC_BIND")}
    done = subprocess.run(
        [sys.executable, "-c", script], env={**base, **env}, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@needs_two
def test_a_worker_that_openmp_pinned_at_torch_import_works_on_the_cores_it_was_started_with() -> None:
    """The bug the first cut had: vLLM starts a CPU worker with ``OMP_PLACES``/``OMP_PROC_BIND`` set, and the
    OpenMP runtime pins the main thread when torch loads, before deltasync is first imported: the cores read at
    import were that one core, and every update's work ran there."""
    script = f"import os, torch; print(sorted(os.sched_getaffinity(0)))\n{_REPORT}"
    pinned = _child(script.replace(_REPORT, ""), OMP_PLACES="{0}", OMP_PROC_BIND="true")
    assert pinned == "[0]"  # the runtime did pin the main thread: the case is real
    assert _child(script, OMP_PLACES="{0}", OMP_PROC_BIND="true") == _cpus.format_cpu_list(os.sched_getaffinity(0))
    assert _child(script, OMP_PLACES="{0}", OMP_PROC_BIND="true", **{CPUS_ENV: "1"}) == "1"


@needs_two
def test_a_process_started_on_fewer_cores_keeps_them() -> None:
    """A ``taskset`` (or a process that pins itself) without OpenMP's bind: the narrower set is the operator's
    choice, not a runtime's pin."""
    assert _child(f"import os; os.sched_setaffinity(0, {{1}})\n{_REPORT}") == "1"
    assert _child(f"import os, torch; os.sched_setaffinity(0, {{0}})\n{_REPORT}", OMP_PROC_BIND="false") == "0"


@needs_two
def test_a_pinned_caller_still_spreads_the_work_over_the_cores_it_had_at_import(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The bug this fixes: the pool sized itself by the calling thread's affinity, one core in vLLM's CPU worker,
    and so decoded and proved serially there."""
    start = threading.Barrier(2, timeout=10)

    def job(i: int) -> tuple[frozenset[int], int]:
        if i < 2:
            start.wait()  # two items at once: two threads
        return _where()

    seen = _on_one_core(lambda: parallel_map(job, range(6), BIG))
    assert {cpus for cpus, _ in seen} == {work_cpus()} and len(work_cpus()) >= 2
    assert len({ident for _, ident in seen}) >= 2
    assert os.sched_getaffinity(0) == set(work_cpus())  # the pool's threads pinned themselves, not the caller


@needs_two
def test_the_setting_moves_the_work_off_the_callers_core(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _use("1")
    seen = _on_one_core(lambda: parallel_map(lambda i: _where(), range(3), BIG))
    assert {cpus for cpus, _ in seen} == {frozenset({1})}
    caller = _on_one_core(lambda: threading.get_ident())
    assert caller not in {ident for _, ident in seen}


def test_small_jobs_run_on_the_caller(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    here = threading.get_ident()
    assert {ident for _, ident in parallel_map(lambda i: _where(), range(4), BIG - 1)} == {here}


def test_results_come_back_in_order_whatever_runs_first(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    items = [3, 1, 4, 1, 5, 9, 2, 6]
    assert parallel_map(lambda x: x * 10, items, BIG, cost=lambda x: x) == [x * 10 for x in items]
    assert parallel_map(lambda x: x * 10, items, BIG) == [x * 10 for x in items]


def test_the_largest_item_starts_first(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _use("0")  # one thread: the order of starts is the order of submission
    started: list[int] = []
    parallel_map(started.append, [2, 7, 1, 7, 3], BIG, cost=lambda x: x)
    assert started == [7, 7, 3, 2, 1]


def test_an_error_in_one_item_reaches_the_caller(monkeypatch) -> None:  # type: ignore[no-untyped-def]

    def job(i: int) -> int:
        if i == 3:
            raise ValueError("item 3 is bad")
        return i

    with pytest.raises(ValueError, match="item 3 is bad"):
        parallel_map(job, range(8), BIG)


def test_a_bad_setting_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=f"{CPUS_ENV}='all'"):
        EngineConfig.from_env({CPUS_ENV: "all"})


def test_cores_it_may_not_use_leave_the_inherited_pin(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A core this process may not run on (a cpuset narrowed, a core offline): the threads keep what they
    inherited rather than fail the job."""
    _use("4095")
    assert parallel_map(lambda i: i + 1, range(3), BIG) == [1, 2, 3]
    assert _cpus.work_cpus() == {4095}


@pytest.mark.parametrize("cpus", [{0}, {0, 1, 2, 5}, {3, 4, 7, 8, 9, 12}, set(range(64))])
def test_cpu_lists_round_trip(cpus: set[int]) -> None:
    text = _cpus.format_cpu_list(cpus)
    assert parse_cpu_list(text, what=CPUS_ENV) == cpus and " " not in text
    assert _cpus.format_cpu_list({0, 1, 2, 5}) == "0-2,5"


@needs_two
def test_the_same_threads_serve_every_job(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Updates reuse the threads (and the glibc arenas they allocated from) instead of starting new ones."""
    threads = min(len(work_cpus()), _cpus.MAX_DEFAULT_THREADS)
    start = threading.Barrier(threads, timeout=10)

    def job(i: int) -> int:
        if i < threads:
            start.wait()  # the first job keeps every thread of the pool busy at once
        return threading.get_ident()

    first = set(parallel_map(job, range(16), BIG))
    assert len(first) == threads and threading.get_ident() not in first
    for _ in range(5):
        start.reset()
        assert set(parallel_map(job, range(16), BIG)) == first  # no new thread for later jobs


def test_a_job_started_on_a_pool_thread_runs_there(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A job that maps again from inside the pool runs its inner items on its own thread: a pool that waited on
    itself would hang once every thread waited."""
    _use("0")  # one thread: an inner job queued behind its caller would never run

    def outer(i: int) -> list[int]:
        me = threading.get_ident()
        return parallel_map(lambda j: int(threading.get_ident() == me), range(4), BIG)

    done: list[list[list[int]]] = []
    t = threading.Thread(target=lambda: done.append(parallel_map(outer, range(3), BIG)), daemon=True)
    t.start()
    t.join(timeout=30)
    assert done == [[[1, 1, 1, 1]] * 3]


# Hostile settings and jobs for the threaded apply: each must be refused at once or run correctly, never hang,
# crash or misread.


@pytest.mark.parametrize("text", ["²", "0-²", "¹,0", "٣", "99999999999", "0-100000000", "0-" + "9" * 5000])
def test_hostile_settings_are_refused_at_once_naming_the_setting(monkeypatch, text: str) -> None:  # type: ignore[no-untyped-def]
    """Non-ASCII digits (``int`` takes Arabic-Indic ones, ``isdigit`` superscripts it then rejects), a core id
    past any kernel's (the pool's threads failed to pin, and every later job raised ``BrokenThreadPool``), a range
    of a hundred million cores (a set of GBs, parsed again on every job)."""
    with pytest.raises(ValueError, match=f"{CPUS_ENV}="):
        EngineConfig.from_env({CPUS_ENV: text})
    with pytest.raises(ValueError, match=f"{CPUS_ENV}="):
        parse_cpu_list(text, what=CPUS_ENV)


def test_the_largest_core_id_still_parses(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _use(f"0,{_cpus.MAX_CPU_ID}")
    assert parallel_map(lambda i: i * 3, range(5), BIG) == [0, 3, 6, 9, 12]  # the big core cannot be pinned: kept


def _finishes(script: str, timeout: float = 60) -> str:
    """Run ``script`` in a fresh interpreter that must exit by itself within ``timeout`` (a hang fails the test,
    not the suite)."""
    try:
        return _child(script)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung: {script}")


def test_two_callers_whose_items_wait_on_each_other_both_finish() -> None:
    """A job's items wait on another caller's items. With one pool shared by every caller, the first job filled
    its threads and the second queued behind them for ever; a pool now serves one job at a time."""
    out = _finishes(
        f"""
import threading, time
from deltasync._cpus import parallel_map
ev = threading.Event(); out = {{}}
a = threading.Thread(target=lambda: out.setdefault("a", parallel_map(lambda i: ev.wait(20), range(8), {BIG})))
a.start(); time.sleep(0.3)
b = threading.Thread(target=lambda: out.setdefault("b", parallel_map(lambda i: ev.set(), range(2), {BIG})))
b.start(); a.join(); b.join()
print(sorted(out), out["a"])
"""
    )
    assert out == "['a', 'b'] [True, True, True, True, True, True, True, True]"


def test_an_item_that_waits_on_its_own_thread_running_a_job_finishes() -> None:
    """An item starts a plain thread that runs a job and joins it: the thread is no pool thread, so it did not
    run its job serially, and queued it behind the items that waited on it."""
    out = _finishes(
        f"""
import threading
from deltasync._cpus import parallel_map
def fn(x):
    got = []
    t = threading.Thread(target=lambda: got.append(parallel_map(lambda y: y + x, [1, 2], {BIG})))
    t.start(); t.join(20)
    return got[0]
print(parallel_map(fn, list(range(4)), {BIG}))
"""
    )
    assert out == "[[1, 2], [2, 3], [3, 4], [4, 5]]"


def test_a_job_in_an_atexit_hook_runs() -> None:
    """At interpreter exit no new thread may start (``submit`` raises): the job runs on the caller instead."""
    out = _finishes(
        f"""
import atexit
from deltasync._cpus import parallel_map
parallel_map(lambda i: i, range(4), {BIG})  # a pool kept from before
atexit.register(lambda: print("at exit", parallel_map(lambda i: i * 2, range(4), {BIG}), flush=True))
"""
    )
    assert out == "at exit [0, 2, 4, 6]"


@needs_two
def test_a_reparented_process_keeps_its_own_cores(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Under an OpenMP bind, a process whose parent is gone (re-parented to init) read init's cores as the ones
    it was started with."""
    out = tmp_path / "out.txt"
    script = (
        "import os, time; time.sleep(1.0); from deltasync._cpus import format_cpu_list, work_cpus; "
        f"open({str(out)!r}, 'w').write(str(os.getppid()) + ' ' + format_cpu_list(work_cpus()))"
    )
    env = {k: v for k, v in os.environ.items() if k != CPUS_ENV}
    subprocess.run(  # sh starts the pinned child in the background and exits: the child is re-parented
        ["sh", "-c", f'taskset -c 0 {sys.executable} -c "{script}" &'], env={**env, "OMP_PROC_BIND": "true"}, check=True
    )
    for _ in range(300):
        if out.exists() and out.read_text():
            break
        threading.Event().wait(0.1)
    ppid, cores = out.read_text().split()
    assert cores == "0", ppid


def test_idle_pools_are_bounded_however_many_core_sets_are_used(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for text in ["0", "0-1", "1", "0,1", "0-3", "2", "0-7"]:
        _use(text)
        assert parallel_map(lambda i: i, range(3), BIG) == [0, 1, 2]
    assert len(_cpus._IDLE) <= _cpus._MAX_IDLE
