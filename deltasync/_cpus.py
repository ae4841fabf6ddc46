"""The cores deltasync's own threads run on, and the map that splits a job's tensors over them.

vLLM's CPU build starts each worker with OpenMP told to bind (``OMP_PLACES``/``OMP_PROC_BIND``, or the GNU and
Intel equivalents), and the OpenMP runtime pins the worker's main thread to its cores when torch loads, before any
plugin runs; every thread the worker starts later inherits the pin (one core per rank on a 2-core host, vLLM keeps
the rest for its scheduler). An engine that decodes and proves an update on those threads alone gets that one core,
however many the host gives the engine. The threads here run on the cores of the process that started this one
when OpenMP was told to bind this one and its main thread's cores are a strict subset of the parent's (the pin
came from OpenMP, not from the launcher), else on this process's own (a ``taskset`` stands), or on
``DELTASYNC_CPUS``: a deployment that serves from the CPU and wants the update's work off its inference cores names
the others there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = [
    "CPUS_ENV",
    "MAX_DEFAULT_THREADS",
    "PARALLEL_MIN_ELEMENTS",
    "format_cpu_list",
    "parallel_map",
    "parse_cpu_list",
    "work_cpus",
]

CPUS_ENV = "DELTASYNC_CPUS"
"""A CPU list (``0-3,8``) for deltasync's threads; unset: the cores the process could use at import."""

MAX_DEFAULT_THREADS = 8
"""Threads at most, unless ``DELTASYNC_CPUS`` names more cores: the work is memory-bound past a few cores, and a
tensor-parallel engine runs one decoder per rank."""

PARALLEL_MIN_ELEMENTS = 1 << 18
"""Below this many elements a job runs serially, on the calling thread: a thread pool costs more than it saves."""

_T = TypeVar("_T")
_R = TypeVar("_R")


def _affinity(pid: int = 0) -> frozenset[int]:
    """The cores thread ``pid`` may run on (Linux: 0 is the calling thread, a process id its main thread)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(pid))
    return frozenset(range(os.cpu_count() or 1))


_OPENMP_BIND_ENV = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
"""What vLLM's CPU executor sets for a worker (one of them, by OpenMP runtime) for that runtime to pin it."""


def _launch_cpus() -> frozenset[int]:
    """The cores this process was started with: its parent's when OpenMP binds this process's threads and its main
    thread's cores are a strict subset of the parent's (pinned by the OpenMP runtime since its start), else its
    own. A parent that is gone (this process re-parented) or unreadable leaves this process's own."""
    own = _affinity(os.getpid())
    if not any(os.environ.get(name, "").strip().lower() not in ("", "false") for name in _OPENMP_BIND_ENV):
        return own
    try:
        parent = _affinity(os.getppid())
    except OSError:
        return own
    return parent if own < parent else own


_LAUNCH: dict[int, frozenset[int]] = {}  # per process id: a forked child asks again


def parse_cpu_list(text: str, *, what: str = CPUS_ENV) -> frozenset[int]:
    """The cores of a Linux CPU list (``"0-3,8"``, as ``taskset -c`` and cpusets write them).

    Raises:
        ValueError: not a CPU list, or empty.
    """
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"{what}={text!r}: expected a CPU list such as '0-3,8' (ascending ranges of core ids)")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """The shortest CPU list of ``cpus`` (``{0, 1, 2, 5}``: ``"0-2,5"``), as :func:`parse_cpu_list` reads it."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def work_cpus() -> frozenset[int]:
    """The cores deltasync's threads run on: ``DELTASYNC_CPUS``, else those this process was started with (its
    parent's when it was pinned to fewer since; read once per process).

    Raises:
        ValueError: ``DELTASYNC_CPUS`` is not a CPU list.
    """
    text = os.environ.get(CPUS_ENV, "").strip()
    if text:
        return parse_cpu_list(text)
    pid = os.getpid()
    if pid not in _LAUNCH:
        _LAUNCH[pid] = _launch_cpus()
    return _LAUNCH[pid]


_POOLS: dict[tuple[int, frozenset[int], int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()
_IN_POOL = threading.local()


def _pin(cpus: frozenset[int]) -> None:
    _IN_POOL.active = True
    try:  # Linux: pid 0 is the calling thread, not the process
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError):  # not Linux, or cores this process may no longer use: the inherited pin stands
        pass


def _pool(workers: int, cpus: frozenset[int]) -> ThreadPoolExecutor:
    """One pool per thread count and core set, kept for the process's life: the same threads serve every update,
    each with the glibc arena it allocated from before (a new thread's arena faults its pages in afresh, which
    cost more than the work in the first updates after it: measured 0.5-0.6 s against 0.2 s)."""
    key = (os.getpid(), cpus, workers)  # a forked child starts with none of its parent's threads
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="deltasync", initializer=_pin, initargs=(cpus,)
            )
        return pool


def parallel_map(
    fn: Callable[[_T], _R],
    items: Sequence[_T],
    elements: int = PARALLEL_MIN_ELEMENTS,
    cost: Callable[[_T], int] | None = None,
) -> list[_R]:
    """``[fn(x) for x in items]``, on threads over :func:`work_cpus` (``fn`` must release the GIL for its heavy
    parts: zstd, numpy's and torch's large kernels and deltasync's compiled loops do). ``elements``: the job's size;
    small jobs run on the calling thread, as does a job started from one of these threads (no pool waits on
    itself). ``cost``: each item's share, the largest started first, so that one big tensor does not start last
    and finish alone."""
    cpus = work_cpus()
    limit = len(cpus) if os.environ.get(CPUS_ENV, "").strip() else min(len(cpus), MAX_DEFAULT_THREADS)
    workers = min(len(items), limit)
    if elements < PARALLEL_MIN_ELEMENTS or getattr(_IN_POOL, "active", False) or (workers <= 1 and _affinity() <= cpus):
        return [fn(item) for item in items]
    order = sorted(range(len(items)), key=lambda i: -cost(items[i])) if cost is not None else range(len(items))
    pool = _pool(max(limit, 1), cpus)
    futures = {i: pool.submit(fn, items[i]) for i in order}
    try:
        return [futures[i].result() for i in range(len(items))]
    finally:  # an error returns only once every item has finished: none still runs on the caller's buffers
        wait(futures.values())
