"""Keep Python's cyclic garbage collector out of an update's critical path.

A full (generation 2) collection walks every container object the process tracks. In a process that also hosts
vLLM's front end, torch and transformers (an offline ``LLM`` with its agent, a trainer), that is millions of
objects: measured at 25-340 ms per collection here, growing with the heap, and one lands inside a sync every few
updates (``benchmarks/bench_apply.py``, Qwen3-0.6B: a 336 ms collection in a step whose other work took 200 ms).
vLLM keeps its engine core's startup heap out of collections for the same reason (``freeze_gc_heap``).

:func:`quiet_gc` turns the automatic collector off while an agent fetches, prepares and applies one update, and
back on (if it was on) when the last such section in the process ends: the collection then runs at the next
allocation after it, while the agent idles or long-polls. What the update leaves as cyclic garbage waits that
long (one update's, bounded); nothing is frozen, so no garbage is kept for good.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["quiet_gc"]

_LOCK = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """No automatic collection inside (sections nest and may overlap across threads: the collector is back on,
    if it was on before the first, once the last one ends)."""
    global _depth, _was_enabled
    with _LOCK:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
