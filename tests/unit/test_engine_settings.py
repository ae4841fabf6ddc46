"""The engine's settings are one frozen :class:`EngineConfig`, read from the environment vLLM is started in: each
variable keeps its default when unset, and a value that breaks its rule stops the start with a message naming the
variable, the rule and the value. The helpers the settings tune take plain values and read no variable
themselves."""

from __future__ import annotations

import dataclasses

import pytest

from deltasync import _cpus, _kernels
from deltasync._heap import KEEP_MIB
from deltasync.vllm.config import (
    CPUS_ENV,
    KEEP_ENV,
    KERNEL_BLOCK_ENV,
    KERNELS_ENV,
    MAP_AT_START_ENV,
    PLAIN_ENV,
    SPLIT_AT,
    SPLIT_AT_ENV,
    EngineConfig,
)
from deltasync.vllm.plain import KERNEL_BLOCK_MACS


def test_unset_variables_keep_the_defaults() -> None:
    config = EngineConfig.from_env({})
    assert config == EngineConfig()
    assert (config.map_at_start, config.map_split_at, config.keep_mib) == (True, SPLIT_AT, KEEP_MIB)
    assert (config.kernels, config.cpus, config.plain_weights) == ("numba", None, False)
    assert config.kernel_block_macs == KERNEL_BLOCK_MACS
    names = (MAP_AT_START_ENV, SPLIT_AT_ENV, KEEP_ENV, KERNELS_ENV, CPUS_ENV, PLAIN_ENV, KERNEL_BLOCK_ENV)
    blank = {name: " " for name in names}
    assert EngineConfig.from_env(blank) == EngineConfig()


def test_each_variable_sets_its_field() -> None:
    config = EngineConfig.from_env(
        {
            MAP_AT_START_ENV: "0",
            SPLIT_AT_ENV: "0",
            KEEP_ENV: "64",
            KERNELS_ENV: " NumPy ",
            CPUS_ENV: "0-2,5",
            PLAIN_ENV: "1",
            KERNEL_BLOCK_ENV: "1048576",
        }
    )
    assert config == EngineConfig(
        map_at_start=False,
        map_split_at=0,
        keep_mib=64,
        kernels="numpy",
        cpus=frozenset({0, 1, 2, 5}),
        plain_weights=True,
        kernel_block_macs=1 << 20,
    )
    for word, value in (("yes", True), ("On", True), ("true", True), ("no", False), ("OFF", False), ("false", False)):
        assert EngineConfig.from_env({PLAIN_ENV: word}).plain_weights is value
        assert EngineConfig.from_env({MAP_AT_START_ENV: word}).map_at_start is value


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            MAP_AT_START_ENV,
            "later",
            "DELTASYNC_MAP_AT_START='later': expected 1 or 0 (also true/false, yes/no, on/off): 1 learns the patch "
            "map at start, 0 at the first update",
        ),
        (
            SPLIT_AT_ENV,
            "lots",
            f"DELTASYNC_MAP_SPLIT_AT='lots': expected a number of elements >= 0 (default {SPLIT_AT})",
        ),
        (SPLIT_AT_ENV, "-1", "DELTASYNC_MAP_SPLIT_AT='-1': expected a number of elements >= 0"),
        (
            KEEP_ENV,
            "1.5",
            "DELTASYNC_ENGINE_KEEP_MIB='1.5': expected a whole number of MiB >= 0 (0 keeps glibc's defaults)",
        ),
        (KEEP_ENV, "-1", "DELTASYNC_ENGINE_KEEP_MIB='-1': expected a whole number of MiB >= 0"),
        (KEEP_ENV, "٣", "DELTASYNC_ENGINE_KEEP_MIB='٣': expected a whole number of MiB >= 0"),
        (
            KERNELS_ENV,
            "cuda",
            "DELTASYNC_KERNELS='cuda': expected numba (deltasync's compiled loops, the default) or numpy (the numpy "
            "code they replace)",
        ),
        (
            KERNEL_BLOCK_ENV,
            "0",
            f"DELTASYNC_KERNEL_BLOCK_MACS='0': expected a number of multiply-adds >= 1 (default {KERNEL_BLOCK_MACS})",
        ),
        (KERNEL_BLOCK_ENV, "2**30", "DELTASYNC_KERNEL_BLOCK_MACS='2**30': expected a number of multiply-adds >= 1"),
        (CPUS_ENV, "all", "DELTASYNC_CPUS='all': expected a CPU list such as '0-3,8' (ascending ranges of core ids)"),
        (
            PLAIN_ENV,
            "sometimes",
            "DELTASYNC_VLLM_PLAIN_WEIGHTS='sometimes': expected 1 or 0 (also true/false, yes/no, on/off): 1 keeps "
            "vLLM's CPU linear weights plain, 0 lets it repack",
        ),
    ],
)
def test_a_bad_value_names_the_variable_the_rule_and_the_value(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        EngineConfig.from_env({name: value})
    assert str(caught.value).startswith(message)


def test_the_settings_are_frozen_and_checked_when_built_in_code() -> None:
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.keep_mib = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="kernels must be numba or numpy, got 'cuda'"):
        EngineConfig(kernels="cuda")
    with pytest.raises(ValueError, match="keep_mib must be a whole number of MiB >= 0, got -1"):
        EngineConfig(keep_mib=-1)
    with pytest.raises(ValueError, match="cpus must name cores"):
        EngineConfig(cpus=frozenset())


def test_the_helpers_read_no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the engine's start reads the environment: a variable set in a process that is no engine (an agent,
    a publisher) tunes nothing there."""
    for name, value in ((KERNELS_ENV, "numpy"), (CPUS_ENV, "0")):
        monkeypatch.setenv(name, value)
    _cpus.use_cpus(None)
    _kernels.use_compiled(True)
    assert _kernels.kernels() is not None
    assert _cpus.work_cpus() != frozenset({0}) or len(_cpus.work_cpus()) == 1
    _cpus.use_cpus(EngineConfig.from_env().cpus)  # what an engine does at its start
    try:
        assert _cpus.work_cpus() == frozenset({0})
    finally:
        _cpus.use_cpus(None)
