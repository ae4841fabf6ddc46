"""parallel_map under concurrency, nesting, exceptions, BaseExceptions and fork (adversarial review)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from deltasync._cpus import CPUS_ENV, PARALLEL_MIN_ELEMENTS, parallel_map

BIG = PARALLEL_MIN_ELEMENTS


def _run(script: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in (CPUS_ENV, "OMP_PLACES", "OMP_PROC_BIND")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env={**base, **env}, capture_output=True, text=True,
        timeout=timeout, check=False,
    )


@pytest.fixture(autouse=True)
def _unset(monkeypatch):
    monkeypatch.delenv(CPUS_ENV, raising=False)


def test_many_concurrent_callers_get_their_own_results() -> None:
    errors: list[BaseException] = []

    def caller(k: int) -> None:
        try:
            for rep in range(40):
                items = list(range(k * 1000 + rep, k * 1000 + rep + 1 + (rep * 7 + k) % 23))
                got = parallel_map(lambda x: (x, threading.get_ident()), items, BIG, cost=lambda x: x % 5)
                assert [g[0] for g in got] == items
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=caller, args=(k,)) for k in range(12)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "deadlock"
    assert not errors, errors[:3]


def test_nested_call_runs_serially_and_completes() -> None:
    def inner(x: int) -> list[int]:
        return parallel_map(lambda y: y * x, list(range(4)), BIG)

    def outer(x: int) -> list[list[int]]:
        return parallel_map(inner, list(range(x, x + 3)), BIG)

    assert parallel_map(outer, list(range(5)), BIG) == [[[y * x for y in range(4)] for x in range(o, o + 3)] for o in range(5)]


def test_call_from_a_thread_started_by_fn_does_not_deadlock() -> None:
    """fn starts a helper thread that calls parallel_map and joins it: the helper is no pool thread, so it
    submits to the same pool whose every thread is blocked in join (DEADLOCK candidate)."""
    done = _run(
        f"""
        import threading
        from deltasync._cpus import parallel_map, work_cpus
        n = min(len(work_cpus()), 8)
        def fn(x):
            out = []
            t = threading.Thread(target=lambda: out.append(parallel_map(lambda y: y + x, [1, 2], {BIG})))
            t.start(); t.join()
            return out[0]
        print("threads", n)
        print("result", parallel_map(fn, list(range(n)), {BIG}))
        """,
        timeout=30,
    ) if True else None
    print(done.stdout, done.stderr[-500:])
    assert "result" in done.stdout


def test_error_only_after_every_item_finished() -> None:
    finished: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> int:
        if i == 0:
            raise ValueError("first")
        time.sleep(0.05 * i)
        with lock:
            finished.append(i)
        return i

    with pytest.raises(ValueError, match="first"):
        parallel_map(job, list(range(6)), BIG)
    assert sorted(finished) == [1, 2, 3, 4, 5]


def test_first_error_by_position_whatever_finishes_first() -> None:
    def job(i: int) -> int:
        if i == 1:
            time.sleep(0.2)
            raise KeyError("one")
        if i == 4:
            raise ValueError("four")
        return i

    with pytest.raises(KeyError):
        parallel_map(job, list(range(6)), BIG)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_base_exceptions_reach_the_caller_and_the_pool_survives(exc) -> None:
    done: list[int] = []

    def job(i: int) -> int:
        if i == 2:
            raise exc("boom")
        time.sleep(0.02)
        done.append(i)
        return i

    with pytest.raises(exc):
        parallel_map(job, list(range(6)), BIG)
    assert sorted(done) == [0, 1, 3, 4, 5]
    assert parallel_map(lambda x: x * 3, list(range(10)), BIG) == [x * 3 for x in range(10)]


def test_no_item_lost_or_duplicated() -> None:
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def job(i: int) -> int:
        with lock:
            counts[i] = counts.get(i, 0) + 1
        return i

    items = list(range(3000))
    assert parallel_map(job, items, BIG, cost=lambda i: (i * 7919) % 101) == items
    assert counts == dict.fromkeys(items, 1)


def test_equal_and_unhashable_items() -> None:
    items = [[1], [1], [2], [], [1]]
    assert parallel_map(len, items, BIG, cost=len) == [1, 1, 1, 0, 1]


def test_fork_after_pool_exists() -> None:
    parallel_map(lambda x: x, list(range(4)), BIG)  # the pool exists, with threads
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            out = parallel_map(lambda x: x * 5, list(range(8)), BIG, cost=lambda x: x)
            os.write(w, repr(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.time() + 30
    while time.time() < deadline:
        p, status = os.waitpid(pid, os.WNOHANG)
        if p:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("child hung")
    data = os.read(r, 10000).decode()
    os.close(r)
    assert data == repr([x * 5 for x in range(8)])


def test_fork_from_a_pool_thread() -> None:
    def job(i: int) -> str:
        if i != 0:
            return "x"
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                os.write(w, repr(parallel_map(lambda x: x + 1, [1, 2, 3], BIG)).encode())
            finally:
                os._exit(0)
        os.close(w)
        for _ in range(600):
            p, _s = os.waitpid(pid, os.WNOHANG)
            if p:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return "hung"
        out = os.read(r, 1000).decode()
        os.close(r)
        return out

    with pytest.warns(DeprecationWarning) if sys.version_info >= (3, 12) else _nullctx():
        got = parallel_map(job, [0, 1, 2], BIG)
    assert got[0] == "[2, 3, 4]"


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_fork_while_another_thread_is_in_parallel_map() -> None:
    """The child of a fork taken while another thread holds _POOLS_LOCK (or a pool's internal locks) must still
    run parallel_map. Many forks against a thread that calls parallel_map in a loop (DEADLOCK candidate)."""
    done = _run(
        f"""
        import os, threading, time
        from deltasync._cpus import parallel_map
        stop = False
        def spin():
            while not stop:
                parallel_map(lambda x: x, [1, 2], {BIG})
        ts = [threading.Thread(target=spin) for _ in range(2)]
        for t in ts: t.start()
        hung = ok = 0
        t_end = time.time() + 25
        n = 0
        while time.time() < t_end and n < 300:
            n += 1
            pid = os.fork()
            if pid == 0:
                try:
                    parallel_map(lambda x: x, [1, 2, 3], {BIG})
                finally:
                    os._exit(7)
            for _ in range(100):
                p, st = os.waitpid(pid, os.WNOHANG)
                if p:
                    ok += os.WEXITSTATUS(st) == 7
                    break
                time.sleep(0.01)
            else:
                hung += 1
                os.kill(pid, 9); os.waitpid(pid, 0)
        stop = True
        for t in ts: t.join()
        print("forks", n, "ok", ok, "hung", hung)
        """,
        timeout=90,
    )
    print(done.stdout, done.stderr[-1500:])
    assert "hung 0" in done.stdout


def test_called_from_atexit() -> None:
    """parallel_map from an atexit handler (after threading's shutdown hooks ran)."""
    done = _run(
        f"""
        import atexit
        from deltasync._cpus import parallel_map
        def at_exit():
            try:
                print("atexit", parallel_map(lambda x: x, [1, 2, 3], {BIG}))
            except BaseException as e:
                print("atexit-error", type(e).__name__, e)
        atexit.register(at_exit)
        parallel_map(lambda x: x, [1, 2], {BIG})
        """,
        timeout=30,
    )
    print(done.stdout, done.stderr[-500:])
    assert "atexit [1, 2, 3]" in done.stdout


def test_changing_cpu_lists_leak_pools(monkeypatch) -> None:
    """Each distinct DELTASYNC_CPUS value makes a new pool kept for the process's life (observation)."""
    done = _run(
        f"""
        import os, threading
        from deltasync._cpus import parallel_map
        before = threading.active_count()
        for k in range(50):
            os.environ["{CPUS_ENV}"] = "0-1," + str(100 + k)
            parallel_map(lambda x: x, list(range(3)), {BIG})
        print("threads", before, threading.active_count())
        """,
        timeout=60,
    )
    print(done.stdout, done.stderr[-500:])
    before, after = map(int, done.stdout.split()[1:3])
    assert after - before < 20
