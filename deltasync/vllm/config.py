"""The engine's settings: one frozen :class:`EngineConfig`, read from the environment of vLLM's processes once, where
the engine starts (and, for :attr:`EngineConfig.plain_weights`, where the deltasync plugin loads, before the model).

The engine is started by vLLM, not by deltasync, so its tuning comes from the environment vLLM is started in; every
variable is read here and nowhere else, and a value that breaks its rule stops the start with a message that names
the variable, the rule and the value (never the first update, minutes later). The parts it tunes take plain values:
:func:`deltasync._heap.keep_scratch`, :func:`deltasync._kernels.use_compiled`, :func:`deltasync._cpus.use_cpus`, the
patch map's build. Other deltasync processes (the agent, the publisher) are not tuned by these variables.

No vLLM import here: the settings can be read, and their errors tested, without an engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .._cpus import MAX_CPU_ID, parse_cpu_list
from .._heap import KEEP_MIB
from .patch_map import scan
from .plain import KERNEL_BLOCK_MACS

__all__ = [
    "CPUS_ENV",
    "KEEP_ENV",
    "KERNELS_ENV",
    "KERNEL_BLOCK_ENV",
    "MAP_AT_START_ENV",
    "PLAIN_ENV",
    "SPLIT_AT_ENV",
    "EngineConfig",
]

MAP_AT_START_ENV = "DELTASYNC_MAP_AT_START"
SPLIT_AT_ENV = "DELTASYNC_MAP_SPLIT_AT"
KEEP_ENV = "DELTASYNC_ENGINE_KEEP_MIB"
KERNELS_ENV = "DELTASYNC_KERNELS"
CPUS_ENV = "DELTASYNC_CPUS"
PLAIN_ENV = "DELTASYNC_VLLM_PLAIN_WEIGHTS"
KERNEL_BLOCK_ENV = "DELTASYNC_KERNEL_BLOCK_MACS"

SPLIT_AT = scan.SPLIT_AT
"""The default of :attr:`EngineConfig.map_split_at`: the embedding of a 0.6B model and up."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How one ``deltasync`` engine runs: the settings an operator gives vLLM's processes (:meth:`from_env`).

    Example:
        >>> EngineConfig.from_env({"DELTASYNC_KERNELS": "numpy"}).kernels
        'numpy'
    """

    map_at_start: bool = True
    """``DELTASYNC_MAP_AT_START``: learn the patch map while vLLM starts, after it loads the model and before it
    serves (``1``, the default), or at the first update that needs it (``0``)."""
    map_split_at: int = SPLIT_AT
    """``DELTASYNC_MAP_SPLIT_AT``: a group of tensors (a layer, or the model outside its layers) whose largest tensor
    has this many elements or more is probed in two int16 passes instead of one int32 pass, with half the memory."""
    keep_mib: int = KEEP_MIB
    """``DELTASYNC_ENGINE_KEEP_MIB``: MiB of the memory an update freed that each engine worker's ``malloc`` keeps
    for the next update (:mod:`deltasync._heap`); ``0`` leaves glibc's defaults."""
    kernels: str = "numba"
    """``DELTASYNC_KERNELS``: ``numba`` decodes and proves an update with deltasync's compiled loops where numba is
    installed (vLLM installs it); ``numpy`` runs the numpy code they replace, bit for bit the same results."""
    cpus: frozenset[int] | None = None
    """``DELTASYNC_CPUS``: the cores (a CPU list, ``2-7``) the decode's, the proof's and the read-back's threads run
    on, up to one thread per core named; ``None`` (unset): the cores the worker was started with, up to 8 threads
    (:mod:`deltasync._cpus`)."""
    plain_weights: bool = False
    """``DELTASYNC_VLLM_PLAIN_WEIGHTS``: on vLLM's CPU build, keep linear weights as the tensors the loader wrote
    (``F.linear``) instead of repacking them, so that ``auto`` patches them in place (:mod:`deltasync.vllm.plain`)."""
    kernel_block_macs: int = KERNEL_BLOCK_MACS
    """``DELTASYNC_KERNEL_BLOCK_MACS``: on vLLM's CPU build with repacked weights, the multiply-adds one block of a
    module's kernel read-back costs at most (the audit reads a repacked module back in blocks of its input columns,
    a run of blocks per call of a sliced audit): lower it where one block holds the worker longer than the
    agent's ``--audit-stall-s`` (:func:`deltasync.vllm.plain.kernel_block`)."""

    def __post_init__(self) -> None:
        if self.map_split_at < 0:
            raise ValueError(f"map_split_at must be a number of elements >= 0, got {self.map_split_at}")
        if self.keep_mib < 0:
            raise ValueError(f"keep_mib must be a whole number of MiB >= 0, got {self.keep_mib}")
        if self.kernels not in ("numba", "numpy"):
            raise ValueError(f"kernels must be numba or numpy, got {self.kernels!r}")
        if self.kernel_block_macs < 1:
            raise ValueError(f"kernel_block_macs must be a number of multiply-adds >= 1, got {self.kernel_block_macs}")
        if self.cpus is not None and (not self.cpus or max(self.cpus) > MAX_CPU_ID or min(self.cpus) < 0):
            raise ValueError(f"cpus must name cores 0-{MAX_CPU_ID}, got {sorted(self.cpus)[:8]}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineConfig:
        """The settings in ``environ`` (default: this process's environment); unset variables keep the defaults.

        Raises:
            ValueError: a variable breaks its rule; the message names the variable, the rule and the value.
        """
        env = os.environ if environ is None else environ
        fields: dict[str, object] = {}
        if (raw := env.get(MAP_AT_START_ENV, "").strip()) != "":
            fields["map_at_start"] = _flag(
                MAP_AT_START_ENV, raw, "1 learns the patch map at start, 0 at the first update"
            )
        if (raw := env.get(SPLIT_AT_ENV, "").strip()) != "":
            fields["map_split_at"] = _count(SPLIT_AT_ENV, raw, f"a number of elements >= 0 (default {SPLIT_AT})")
        if (raw := env.get(KEEP_ENV, "").strip()) != "":
            fields["keep_mib"] = _count(KEEP_ENV, raw, "a whole number of MiB >= 0 (0 keeps glibc's defaults)")
        if (raw := env.get(KERNELS_ENV, "").strip()) != "":
            if raw.lower() not in ("numba", "numpy"):
                raise ValueError(
                    f"{KERNELS_ENV}={raw!r}: expected numba (deltasync's compiled loops, the default) or numpy (the "
                    "numpy code they replace)"
                )
            fields["kernels"] = raw.lower()
        if (raw := env.get(CPUS_ENV, "").strip()) != "":
            fields["cpus"] = parse_cpu_list(raw, what=CPUS_ENV)
        if (raw := env.get(KERNEL_BLOCK_ENV, "").strip()) != "":
            rule = f"a number of multiply-adds >= 1 (default {KERNEL_BLOCK_MACS})"
            fields["kernel_block_macs"] = _count(KERNEL_BLOCK_ENV, raw, rule)
            if fields["kernel_block_macs"] == 0:
                raise ValueError(f"{KERNEL_BLOCK_ENV}={raw!r}: expected {rule}")
        if (raw := env.get(PLAIN_ENV, "").strip()) != "":
            fields["plain_weights"] = _flag(PLAIN_ENV, raw, "1 keeps vLLM's CPU linear weights plain, 0 lets it repack")
        return cls(**fields)  # type: ignore[arg-type]


def _flag(name: str, raw: str, rule: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected 1 or 0 (also true/false, yes/no, on/off): {rule}")


def _count(name: str, raw: str, rule: str) -> int:
    if not (raw.isascii() and raw.isdigit()):  # int() would also read "-1", "1_000" and other scripts' digits
        raise ValueError(f"{name}={raw!r}: expected {rule}")
    return int(raw)
