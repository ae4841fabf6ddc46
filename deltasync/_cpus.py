"""The cores deltasync's own threads run on, and the map that splits a job's tensors over them.

vLLM's CPU worker pins its main thread (its OpenMP master) to one core per rank after its plugins load, and keeps
other cores for the work around inference; every thread the worker starts later inherits the pin. An engine that
decodes and proves an update before the pause on those threads alone gets one core, however many the host has.
The decoder's threads here run on the cores the process could use when deltasync was first imported (before the
pin), or on ``DELTASYNC_CPUS``: a deployment that serves from the CPU and wants the update's work off its inference
cores names the others there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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


def _affinity() -> frozenset[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


_AT_IMPORT = _affinity()


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
    """The cores deltasync's threads run on: ``DELTASYNC_CPUS``, else those this process could use when deltasync
    was first imported.

    Raises:
        ValueError: ``DELTASYNC_CPUS`` is not a CPU list.
    """
    text = os.environ.get(CPUS_ENV, "").strip()
    return parse_cpu_list(text) if text else _AT_IMPORT


def _pin(cpus: frozenset[int]) -> None:
    try:  # Linux: pid 0 is the calling thread, not the process
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError):  # not Linux, or cores this process may no longer use: the inherited pin stands
        pass


def parallel_map(
    fn: Callable[[_T], _R],
    items: Sequence[_T],
    elements: int = PARALLEL_MIN_ELEMENTS,
    cost: Callable[[_T], int] | None = None,
) -> list[_R]:
    """``[fn(x) for x in items]``, on threads over :func:`work_cpus` (``fn`` must release the GIL for its heavy
    parts: zstd, numpy's and torch's large kernels and deltasync's compiled loops do). ``elements``: the job's size;
    small jobs run on the calling thread. ``cost``: each item's share, the largest started first, so that one big
    tensor does not start last and finish alone."""
    cpus = work_cpus()
    limit = len(cpus) if os.environ.get(CPUS_ENV, "").strip() else min(len(cpus), MAX_DEFAULT_THREADS)
    workers = min(len(items), limit)
    if elements < PARALLEL_MIN_ELEMENTS or (workers <= 1 and _affinity() <= cpus):
        return [fn(item) for item in items]
    order = sorted(range(len(items)), key=lambda i: -cost(items[i])) if cost is not None else range(len(items))
    with ThreadPoolExecutor(max_workers=max(workers, 1), initializer=_pin, initargs=(cpus,)) as pool:
        futures = {i: pool.submit(fn, items[i]) for i in order}
        return [futures[i].result() for i in range(len(items))]
