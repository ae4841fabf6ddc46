"""The cores deltasync's own threads run on, and the map that splits a job's tensors over them.

vLLM's CPU build starts each worker with OpenMP told to bind (``OMP_PLACES``/``OMP_PROC_BIND``, or the GNU and
Intel equivalents), and the OpenMP runtime pins the worker's main thread to its cores when torch loads, before any
plugin runs; every thread the worker starts later inherits the pin (one core per rank on a 2-core host, vLLM keeps
the rest for its scheduler). An engine that decodes and proves an update on those threads alone gets that one core,
however many the host gives the engine. The threads here run on the cores of the process that started this one
when OpenMP was told to bind this one and its main thread's cores are a strict subset of the parent's (the pin
came from OpenMP, not from the launcher), else on this process's own (a ``taskset`` stands; under an OpenMP bind
it reads as the bind), or on the cores :func:`use_cpus` names (an engine's ``DELTASYNC_CPUS``, read with its other
settings: :class:`deltasync.vllm.config.EngineConfig`): a deployment that serves from the CPU and wants the update's
work off its inference cores names the others there.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = [
    "MAX_CPU_ID",
    "MAX_DEFAULT_THREADS",
    "PARALLEL_MIN_ELEMENTS",
    "format_cpu_list",
    "parallel_map",
    "parse_cpu_list",
    "use_cpus",
    "work_cpus",
]

MAX_DEFAULT_THREADS = 8
"""Threads at most, unless :func:`use_cpus` names more cores: the work is memory-bound past a few cores, and a
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
    own. A parent that is gone (this process re-parented to init) or unreadable leaves this process's own. Under
    an OpenMP bind, a ``taskset`` narrower than the parent's cores cannot be told from the bind: name the cores
    with ``DELTASYNC_CPUS`` there. (The OpenMP variables are read as facts about how this process was started,
    not as deltasync settings.)"""
    own = _affinity(os.getpid())
    if not any(os.environ.get(name, "").strip().lower() not in ("", "false") for name in _OPENMP_BIND_ENV):
        return own
    ppid = os.getppid()
    if ppid <= 1:  # re-parented to init (or a reaper that is): not the process that started this one
        return own
    try:
        parent = _affinity(ppid)
    except OSError:
        return own
    return parent if own < parent else own


_LAUNCH: dict[int, frozenset[int]] = {}  # per process id: a forked child asks again


MAX_CPU_ID = (1 << 16) - 1
"""The largest core id a CPU list may name (Linux builds for at most 8,192): a larger one is a typo, and a range up
to it would be a set of billions."""


def parse_cpu_list(text: str, *, what: str) -> frozenset[int]:
    """The cores of a Linux CPU list (``"0-3,8"``, as ``taskset -c`` and cpusets write them); ``what``: where it
    comes from, for messages (the setting's name).

    Raises:
        ValueError: not a CPU list (ASCII digits, ascending ranges), empty, or a core id over :data:`MAX_CPU_ID`.
    """
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        ends = (lo, hi) if sep else (lo,)
        if not all(_DIGITS.fullmatch(e) for e in ends):
            raise ValueError(f"{what}={text!r}: expected a CPU list such as '0-3,8' (ascending ranges of core ids)")
        first, last = (int(e) if len(e) <= 9 else MAX_CPU_ID + 1 for e in (lo, ends[-1]))
        if last > MAX_CPU_ID:
            raise ValueError(f"{what}={text!r}: core {ends[-1]} is over {MAX_CPU_ID}; name cores the host has")
        if last < first:
            raise ValueError(f"{what}={text!r}: expected a CPU list such as '0-3,8' (ascending ranges of core ids)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


_DIGITS = re.compile(r"[0-9]+")


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """The shortest CPU list of ``cpus`` (``{0, 1, 2, 5}``: ``"0-2,5"``), as :func:`parse_cpu_list` reads it."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


_NAMED: dict[str, frozenset[int]] = {}  # "cpus": the cores use_cpus named for this process


def use_cpus(cpus: frozenset[int] | None) -> None:
    """Run deltasync's threads in this process on ``cpus`` from now on, up to one thread per core (``None``: on the
    cores this process was started with, up to :data:`MAX_DEFAULT_THREADS`). An engine calls it at its start with
    its ``DELTASYNC_CPUS``."""
    if cpus is None:
        _NAMED.pop("cpus", None)
    else:
        _NAMED["cpus"] = frozenset(cpus)


def work_cpus() -> frozenset[int]:
    """The cores deltasync's threads run on: those :func:`use_cpus` named, else those this process was started with
    (its parent's when it was pinned to fewer since; read once per process)."""
    named = _NAMED.get("cpus")
    if named is not None:
        return named
    pid = os.getpid()
    if pid not in _LAUNCH:
        _LAUNCH[pid] = _launch_cpus()
    return _LAUNCH[pid]


_IDLE: list[tuple[tuple[int, frozenset[int], int], ThreadPoolExecutor]] = []  # the most recently used last
_IDLE_LOCK = threading.Lock()
_MAX_IDLE = 2
_IN_POOL = threading.local()


def _pin(cpus: frozenset[int]) -> None:
    _IN_POOL.active = True
    try:  # Linux: pid 0 is the calling thread, not the process
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError, OverflowError, ValueError):  # not Linux, or cores it may not use: the pin stands
        pass


def _take(key: tuple[int, frozenset[int], int]) -> ThreadPoolExecutor:
    """An idle pool for ``key`` (process, cores, threads), else a new one. A pool serves one job at a time: two
    callers never queue behind each other's items (one job's items may wait on another's; a job that waits on a
    thread it started, which runs a job of its own, would otherwise wait on itself)."""
    with _IDLE_LOCK:
        for i in range(len(_IDLE) - 1, -1, -1):
            if _IDLE[i][0] == key:
                return _IDLE.pop(i)[1]
    return ThreadPoolExecutor(max_workers=key[2], thread_name_prefix="deltasync", initializer=_pin, initargs=(key[1],))


def _give_back(key: tuple[int, frozenset[int], int], pool: ThreadPoolExecutor) -> None:
    """Keep the pool for the next job: the same threads serve every update, each with the glibc arena it allocated
    from before (a new thread's arena faults its pages in afresh, which cost more than the work in the first
    updates after it: measured 0.5-0.6 s against 0.2 s). At most :data:`_MAX_IDLE` are kept, the oldest let go."""
    with _IDLE_LOCK:
        _IDLE.append((key, pool))
        gone = [p for _, p in _IDLE[:-_MAX_IDLE]]
        del _IDLE[:-_MAX_IDLE]
    for p in gone:
        p.shutdown(wait=False)  # its threads end once idle (a forked child's copies of a parent's have none)


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
    cap = (os.cpu_count() or 1) if "cpus" in _NAMED else MAX_DEFAULT_THREADS
    limit = max(min(len(cpus), cap), 1)
    workers = min(len(items), limit)
    if elements < PARALLEL_MIN_ELEMENTS or getattr(_IN_POOL, "active", False) or (workers <= 1 and _affinity() <= cpus):
        return [fn(item) for item in items]
    order = sorted(range(len(items)), key=lambda i: -cost(items[i])) if cost is not None else range(len(items))
    key = (os.getpid(), cpus, limit)
    pool = _take(key)
    futures: dict[int, Future[_R]] = {}
    try:
        for i in order:
            futures[i] = pool.submit(fn, items[i])
    except RuntimeError:  # the interpreter is shutting down (an atexit hook): no new threads, run here
        wait(futures.values())
        pool.shutdown(wait=False)
        return [futures[i].result() if i in futures else fn(items[i]) for i in range(len(items))]
    try:
        return [futures[i].result() for i in range(len(items))]
    finally:  # an error returns only once every item has finished: none still runs on the caller's buffers
        wait(futures.values())
        _give_back(key, pool)
