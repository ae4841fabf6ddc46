"""Keep an engine's scratch memory between updates (glibc's ``malloc``).

An update's work before the pause allocates temporaries the size of the delta (decoded values, indices, the
plan's scatters, the proof's differences): tens to hundreds of MB, in blocks of up to ~30 MB, every step.
glibc serves a block above its mmap threshold (128 KiB at start, raised only as such blocks are freed) with
fresh pages from the kernel and returns it on ``free``, and trims the heap's top once 2x that threshold is
free. Fresh pages are paid for on first touch (zeroed by the kernel; on a VM also backed by the hypervisor):
measured here at 1-3 ns per byte, more than the arithmetic on them. Until the adaptive threshold had settled,
the same plan took 0.25-1.3 s instead of ~20 ms (``benchmarks/bench_apply.py``, Qwen3-0.6B, lr 1e-6).

:func:`keep_scratch` sets both limits once, where the engine starts (``DELTASYNC_ENGINE_KEEP_MIB``, read with the
engine's other settings: :class:`deltasync.vllm.config.EngineConfig`): blocks up to glibc's largest mmap
threshold (32 MiB on 64-bit) come from the heap, and up to ``mib`` free at its top are kept for the next
update instead of being given back. The memory kept is what the last updates used at most (it is reused, not
added to: the peak of an update does not grow), and is visible in the worker's resident size between updates.
vLLM's CPU build preloads tcmalloc when it ships one, for the same reason; under another allocator this does
nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["KEEP_MIB", "keep_scratch"]

logger = logging.getLogger("vllm.deltasync.heap")

KEEP_MIB = 512
"""The default: an lr 1e-6 update of Qwen3-0.6B uses ~100-250 MB of temporaries, an lr 1e-5 one ~500 MB."""

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more


def keep_scratch(mib: int) -> bool:
    """Make this process's glibc ``malloc`` keep up to ``mib`` MiB of freed memory and serve blocks up to 32 MiB
    from it; returns whether it was set.

    Nothing is set (``False``) with ``mib`` 0, off Linux glibc, or where ``mallopt`` refuses a value.
    """
    if mib <= 0 or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    keep = min(mib << 20, 2**31 - 1)  # mallopt takes an int
    if mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) != 1 or mallopt(_M_TRIM_THRESHOLD, keep) != 1:
        logger.info("deltasync: glibc refused the scratch memory limits; its defaults stay")
        return False
    return True
