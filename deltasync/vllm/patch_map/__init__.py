"""Where each checkpoint element lives in a running vLLM model, learned by watching the model's own loader.

vLLM's ``load_weights`` maps a checkpoint tensor onto live parameters: renames (``q_proj`` into ``qkv_proj``),
fused offsets (q, k, v rows; gate and up rows; biases), TP slices, vocabulary padding, tied ``lm_head``.
Instead of re-implementing that per architecture, :func:`build_map` feeds the loader *probe* tensors whose
values are their own flat indices (1-based, integers) into parameters temporarily swapped for zeroed integer
tensors, and reads back which parameter element received which checkpoint element. The result, per checkpoint
tensor, is a few runs ``(parameter, checkpoint start, parameter start, length)``; an update is then one
vectorized scatter per live parameter (``index_copy_``), with no loader call and no Python loop over elements.

The loader is trusted but surprising: it is code running inside the engine with the engine's full power. The map
must be exact for every loader that does what real loaders do (the above, and value transforms such as offset
norms, repacking, permuted or interleaved rows, attributes cached on a module at the first call, re-registered
parameters, expert stacking), and whatever it cannot map exactly (a quantized or repacked parameter, a loader
that does arithmetic on the values, one element written twice, a write into another tensor's place) is left
out of the map: the engine reloads its modules instead and says so in its status. A loader written to deceive
the build (one that behaves otherwise while it is watched than at a reload) is out of scope: it could write the
served weights at any moment anyway; the whole-state proof and the drift audit are the defence against any
write after the build.

Modules: :mod:`.core` the map and its update-time use (imports nothing of the build); :mod:`.build` the build
(:class:`~.build.MapBuild`), with :mod:`.scan` (reading probes), :mod:`.values` (real values, background),
:mod:`.checks` (the real-values checks), :mod:`.derive` (repeating layers), :mod:`.as_found` (the model left as
found), :mod:`.swap` and :mod:`.tensors` beneath them.
"""

from __future__ import annotations

from ...errors import MapCorruption
from .build import MapBuild, build_map
from .core import Blocks, PatchMap, Runs, Scatter
from .scan import SPLIT_AT

__all__ = ["SPLIT_AT", "Blocks", "MapBuild", "MapCorruption", "PatchMap", "Runs", "Scatter", "build_map"]
