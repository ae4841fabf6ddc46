"""Hostile DELTASYNC_CPUS values against work_cpus / parallel_map (adversarial review)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from deltasync._cpus import CPUS_ENV, PARALLEL_MIN_ELEMENTS, parallel_map, parse_cpu_list, work_cpus

BIG = PARALLEL_MIN_ELEMENTS


def _run(script: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in (CPUS_ENV, "OMP_PLACES", "OMP_PROC_BIND")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env={**base, **env}, capture_output=True, text=True,
        timeout=timeout, check=False,
    )


@pytest.mark.parametrize("text", ["0-", "-1", "0,,1", "0,", ",0", "1-0", "0x1", "+1", "1_0", "0-1-2", "a", "0 -", "0\t1"])
def test_bad_values_name_the_setting(monkeypatch, text: str) -> None:
    monkeypatch.setenv(CPUS_ENV, text)
    with pytest.raises(ValueError, match=CPUS_ENV):
        work_cpus()


@pytest.mark.parametrize("text", ["\u00b2", "0-\u00b2", "\u00b9,0"])  # superscript digits: str.isdigit() is True
def test_unicode_digit_values_name_the_setting(monkeypatch, text: str) -> None:
    """BREAK candidate: str.isdigit() accepts superscripts, int() then raises its own ValueError."""
    monkeypatch.setenv(CPUS_ENV, text)
    with pytest.raises(ValueError) as info:
        work_cpus()
    assert CPUS_ENV in str(info.value), f"message does not name the setting: {info.value}"


def test_non_ascii_decimal_digits_are_taken_as_cores(monkeypatch) -> None:
    """Observation: Arabic-Indic / mathematical digits parse silently as core numbers."""
    monkeypatch.setenv(CPUS_ENV, "\u0663")  # ARABIC-INDIC DIGIT THREE
    assert work_cpus() == {3}


@pytest.mark.parametrize("text", ["", " ", "   "])
def test_empty_means_unset(monkeypatch, text: str) -> None:
    monkeypatch.setenv(CPUS_ENV, text)
    assert work_cpus() == frozenset(os.sched_getaffinity(0)) or work_cpus()  # falls back; never raises


def test_duplicates_collapse(monkeypatch) -> None:
    monkeypatch.setenv(CPUS_ENV, "0,0,0-0")
    assert work_cpus() == {0}
    assert parallel_map(lambda x: x + 1, list(range(5)), BIG) == [1, 2, 3, 4, 5]


def test_core_not_allowed_still_gives_results(monkeypatch) -> None:
    monkeypatch.setenv(CPUS_ENV, "4095")  # not on this host: the pin fails with OSError, inherited pin stands
    assert parallel_map(lambda x: x * 2, list(range(7)), BIG) == [x * 2 for x in range(7)]


def test_huge_single_core_number() -> None:
    """BREAK candidate: a syntactically fine CPU number above INT_MAX makes os.sched_setaffinity raise
    OverflowError (not OSError) in the pool's initializer: the pool is broken, parallel_map raises
    BrokenThreadPool, never a ValueError naming the setting."""
    done = _run(
        f"""
        from deltasync._cpus import parallel_map, work_cpus
        print("cpus", sorted(work_cpus()))
        try:
            print("result", parallel_map(lambda x: x, [1, 2, 3], {BIG}))
        except BaseException as e:
            print("error", type(e).__module__, type(e).__name__, str(e)[:200])
        try:
            print("again", parallel_map(lambda x: x, [1, 2, 3], {BIG}))
        except BaseException as e:
            print("again-error", type(e).__name__)
        """,
        **{CPUS_ENV: "99999999999"},
    )
    print(done.stdout, done.stderr[-2000:])
    assert "result [1, 2, 3]" in done.stdout or ("error" in done.stdout and CPUS_ENV in done.stdout), done.stdout


def test_huge_range_memory() -> None:
    """BREAK candidate: "0-100000000" is parsed by materialising 10^8 ints in a set (GBs of memory);
    under a 1.5 GiB address-space limit the process dies with MemoryError instead of a clear ValueError."""
    done = _run(
        """
        import resource, time
        resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
        from deltasync._cpus import work_cpus
        t = time.time()
        try:
            n = len(work_cpus()); print("parsed", n, round(time.time() - t, 1))
        except MemoryError:
            print("MemoryError", round(time.time() - t, 1))
        except ValueError as e:
            print("ValueError", e)
        """,
        timeout=120,
        **{CPUS_ENV: "0-100000000"},
    )
    print(done.stdout, done.stderr[-1000:])
    assert "ValueError" in done.stdout, done.stdout


def test_absurd_range_time() -> None:
    """BREAK candidate: "0-99999999999" never finishes parsing (10^11 ints): bounded here by a 20 s timeout."""
    try:
        done = _run(
            """
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
            from deltasync._cpus import work_cpus
            try:
                work_cpus(); print("parsed")
            except MemoryError:
                print("MemoryError")
            except ValueError as e:
                print("ValueError", e)
            """,
            timeout=20,
            **{CPUS_ENV: "0-99999999999"},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("timeout")
    print(done.stdout)
    assert "ValueError" in done.stdout, done.stdout
