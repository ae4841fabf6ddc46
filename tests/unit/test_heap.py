"""deltasync._heap: an engine worker keeps an update's freed scratch memory for the next one."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deltasync._heap import keep_scratch

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

# a fresh process: malloc 24 MiB, touch every page, free it, then do it again; print the page faults the second
# round took (each 4 KiB page that malloc gave back and took anew is faulted in again)
_ROUNDS = textwrap.dedent(
    """
    import ctypes, resource, sys
    sys.path.insert(0, {root!r})
    from deltasync._heap import keep_scratch
    print("kept", keep_scratch({mib}))
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 24 << 20
    def touch():
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        libc.free(p)
    touch()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    touch()
    print("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _second_round_faults(mib: int) -> tuple[bool, int]:
    code = _ROUNDS.format(root=str(Path(__file__).parents[2]), mib=mib)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return out[1] == "True", int(out[3])


def _thp_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@glibc
def test_freed_scratch_is_kept_and_reused_without_page_faults() -> None:
    pages = (24 << 20) // 4096
    kept, faults = _second_round_faults(512)
    assert kept
    assert faults < pages // 20, f"the second 24 MiB round faulted {faults} of {pages} pages in again"
    if not _thp_always():  # the control: glibc's own defaults give the block back, and the next one faults anew
        kept, faults = _second_round_faults(0)
        assert not kept
        assert faults > pages // 2, f"glibc's defaults kept the block ({faults} faults): this test proves nothing here"


def test_zero_keeps_glibc_s_defaults() -> None:
    assert keep_scratch(0) is False
