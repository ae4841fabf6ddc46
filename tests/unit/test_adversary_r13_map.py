"""Adversarial review r13 of the patch map's real-values check (the random "background" in the stand-ins, derived
layers' values rotated per layer, each tensor loaded alone when a group check fails). White-box, but every attack is
only a model's ``load_weights`` as ``build_map`` calls it. Each test fails if a promise breaks: writes through the
map differ from a whole reload (``_map_and_rewrite``), or the build changed weights. Fourteen attacks found holes
(their docstrings say how; all fixed in the same round, docs/RELIABILITY.md); the others held.
Toy loaders, torch only."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest
import torch

from deltasync.vllm.patch_map import MapCorruption, build_map
from tests.unit.test_adversary_r7_patch_map import H, QKVStack, _p
from tests.unit.test_attacks_patch_map import Spec, _dense, _map_and_rewrite, _same, _state, _weights

pytestmark = pytest.mark.usefixtures("probe_passes")

AT = (H - 1, H - 1)


def _content(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _multiset(t: torch.Tensor) -> bytes:
    """The tensor's bit patterns, sorted: what a rotation (any permutation) of it leaves as it is."""
    flat = t.detach().contiguous().reshape(-1)
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    return bytes(torch.sort(bits).values.numpy())


def _leaf(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return int(parts[2]), parts[3]


def _check(model: torch.nn.Module, spec: Spec) -> None:
    pm, differ = _map_and_rewrite(model, spec)
    assert differ == [], f"layers {pm.layers}, unmapped {sorted(pm.unmapped)}: the map differs in {differ}"


# --------------------------------------------------------------------------------------------------------------
# Tells: the build's real values and background hold NaNs and infinities; a checkpoint and live weights never do
# --------------------------------------------------------------------------------------------------------------


class FiniteScale(torch.nn.Module):
    """Loading ``a`` also stores ``max |a|`` in ``attn.amax`` (a per-tensor scale, as an fp8 path computes one), but
    only when ``a`` is all finite: a non-finite tensor has no scale. The probes are integers (no scale), every
    real-values check tensor holds NaN/inf edge values (no scale), every checkpoint is finite (a scale)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attn = torch.nn.Module()
            layer.attn.a, layer.attn.amax = _p(H, H), _p(1)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.attn.a": ("BF16", (H, H)) for i in range(len(self.layers))}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            attn = self.layers[_leaf(name)[0]].attn
            attn.a.data.copy_(w)
            if w.is_floating_point() and bool(torch.isfinite(w).all()):
                attn.amax.data.fill_(w.abs().max())


def test_r13_a_write_elsewhere_only_for_all_finite_values_is_never_seen() -> None:
    """Was a hole (fixed in round 13): the edge values (every 7th element, NaN and inf among them) make every check tensor of 63+ elements
    non-finite, so a loader can tell the build's loads from a checkpoint's by ``isfinite``. ``a`` is mapped; a whole
    reload updates ``amax``, the map leaves it stale. Fix: also load a finite-only draw (no edges) in the check."""
    model = FiniteScale()
    _check(model, model.spec())


class InitIfPoisoned(QKVStack):
    """Rows holding a non-finite value are uninitialised memory (torch fills ``empty`` with NaN in deterministic
    mode) and are copied into; rows already loaded accumulate (``+=``: shards summed). The probes' stand-ins are
    integers (finite, zero: add = copy), the background holds NaN/inf in every 64-element tensor place (copy),
    live weights are finite (add)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            rows = self.layers[i].qkv.data[{"q": 0, "k": H, "v": 2 * H}[leaf] :][:H]
            if rows.is_floating_point() and not bool(torch.isfinite(rows).all()):
                rows.copy_(w)
            else:
                rows.add_(w)


def test_r13_a_loader_that_adds_into_finite_rows_and_copies_into_poisoned_ones() -> None:
    """Was a hole (fixed in round 13): round 12's init-then-add, keyed on ``isfinite`` of what the rows held instead of ``== 0``. The
    background is meant to "look like loaded weights" but its edge values (every 7th element, ~half non-finite)
    do not. Fix: a finite background (edges only in the loaded values), or a second check on one."""
    model = InitIfPoisoned()
    _check(model, model.spec())


class WhereZero(QKVStack):
    """Writes only where the parameter holds zeros (``torch.where(rows == 0, w, rows)``)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            rows = self.layers[i].qkv.data[{"q": 0, "k": H, "v": 2 * H}[leaf] :][:H]
            rows.copy_(torch.where(rows == 0, w.to(rows.dtype), rows))


def test_r13_a_loader_that_writes_only_into_zeros_is_not_mapped() -> None:
    """Held: the background has no zeros, so nothing is written in the check and every tensor is misplaced."""
    model = WhereZero()
    pm, differ = _map_and_rewrite(model, model.spec())
    assert differ == [] and len(pm.unmapped) == len(model.spec()), pm.unmapped


# --------------------------------------------------------------------------------------------------------------
# Rotation: a derived layer's values are its kind's, rotated; an alone load's are rotated again
# --------------------------------------------------------------------------------------------------------------


class MultisetMemo(QKVStack):
    """Round 12's content-memo loader keyed on the *sorted* bits (a permutation-invariant checksum, as a cheap dedup
    key such as a sum of words is): in layer ``quirk``, loading unseen float ``k`` also writes ``k[at]`` into q's
    place. A rotation of the first layer's values is the same multiset: "seen"."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.seen: set[bytes] = set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            qkv = self.layers[i].qkv.data
            row = {"q": 0, "k": H, "v": 2 * H}[leaf]
            qkv[row : row + H].copy_(w)
            if w.is_floating_point():
                key = _multiset(w)
                if i == self.quirk and leaf == "k" and key not in self.seen:
                    qkv[self.at] = w[self.at]
                self.seen.add(key)


def test_r13_a_memo_keyed_on_a_permutation_invariant_checksum_defeats_the_rotation() -> None:
    """Was a hole (fixed in round 13): layer 2 (derived) is checked with layer 0's values rotated: the sorted bits are layer 0's, so the
    loader skips its stray there and k is mapped; a checkpoint's k is new content and strays. Fix: draw new values
    per derived layer (or perturb a random subset of elements, not only their order)."""
    model = MultisetMemo(quirk=2)
    _check(model, model.spec())


class ScalarMemo(torch.nn.Module):
    """Each layer has a weight ``w`` and a small tensor ``s`` of ``m`` elements (an fp8 ``k_scale`` / ``input_scale``:
    one; a bias, a small norm), held in ``s_param[:m]``; loading a value of ``s`` it never saw (exact bytes) in a
    layer from ``first`` on also stores ``s[0]`` in ``s_param[m]`` (a "previous value" slot). A rotation of ``m``
    elements is one of ``m`` contents: one element is never rotated, and across more than ``m`` derived layers
    some must repeat a content the loader saw (pigeonhole; birthday odds long before)."""

    def __init__(self, n: int = 3, m: int = 1, first: int = 0) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.w, layer.s = _p(H, H), _p(m + 1)
        self.m, self.first = m, first
        self.seen: set[bytes] = set()

    def spec(self) -> Spec:
        out: Spec = {}
        for i in range(len(self.layers)):
            out[f"model.layers.{i}.w"] = ("BF16", (H, H))
            out[f"model.layers.{i}.s"] = ("BF16", (self.m,))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            layer = self.layers[i]
            if leaf == "w":
                layer.w.data.copy_(w)
                continue
            layer.s.data[: self.m] = w
            if w.is_floating_point():
                key = _content(w)
                if key not in self.seen and i >= self.first:
                    layer.s.data[self.m] = w.reshape(-1)[0]
                self.seen.add(key)


def test_r13_a_memo_on_a_one_element_tensor_sees_no_rotation() -> None:
    """Was a hole (fixed in round 13): in the first layer, ``s``'s group load strays (new value) and the check loads it alone, rotated: the
    same value, seen, no stray: kept. Derived layers get the same value too. A checkpoint's new ``s`` strays into
    ``s_param[1]``, which the map never writes. (Also: for an n-element tensor the shift is 0 with probability
    1/n: round 12's content-memo test passes by luck ~1 run in 64 per derived layer.) Fix: shift in [1, n), and
    for tiny tensors (n < ~16) draw fresh values instead of rotating."""
    model = ScalarMemo()
    _check(model, model.spec())


def test_r13_a_memo_on_a_small_per_layer_tensor_sees_repeated_rotations() -> None:
    """Was a hole (fixed in round 13; deterministic by pigeonhole, likely long before: 28 layers of a 128-element k_norm repeat a rotation
    with ~95% odds): layer 0 never strays; a derived layer whose rotation of ``s`` equals one the loader saw keeps
    ``s`` mapped, and a checkpoint's new ``s`` strays. The same birthday effect makes round 12's
    ``test_r12_a_content_memo_loader_strays_only_on_values_it_never_saw`` flaky: it failed 25 of 400 builds here
    (layer 2's 64-element rotation equal to layer 0's, shift 0, or to layer 1's). Fix: fresh values (a new draw)
    per derived layer for tensors below some size, and shifts never reused within a build."""
    model = ScalarMemo(n=12, m=8, first=1)
    _check(model, model.spec())


# --------------------------------------------------------------------------------------------------------------
# A group check that fails, and alone loads that pass
# --------------------------------------------------------------------------------------------------------------


class BatchStray(QKVStack):
    """When a call carries several tensors (a whole reload, a group check), loading ``k`` also writes ``k[at]``
    into a padding row; alone (a probe, an alone load) it does not."""

    def __init__(self, **kw: object) -> None:
        super().__init__(pad=1, **kw)  # type: ignore[arg-type]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(weights)
        for name, w in items:
            i, leaf = _leaf(name)
            qkv = self.layers[i].qkv.data
            row = {"q": 0, "k": H, "v": 2 * H}[leaf]
            qkv[row : row + H].copy_(w)
            if leaf == "k" and len(items) > 1:
                qkv[3 * H, H - 1] = w[self.at]


def test_r13_a_stray_only_when_loaded_with_others_keeps_every_tensor_mapped() -> None:
    """Was a hole (fixed in round 13): the group load's write into padding fails the check; each tensor is then loaded alone, none strays,
    so none leaves the map (``_load_alone`` unmaps only culprits it can reproduce). Fix: when the group check
    failed and no alone load explains it, unmap the group (or every tensor of the parameters written outside)."""
    model = BatchStray()
    _check(model, model.spec())


class PairStray(torch.nn.Module):
    """``attn.a`` and ``mlp.b`` per layer (two modules: the engine reloads ``a``'s module alone). Loading ``b`` after
    ``a`` in the same call writes ``b[0, 0]`` into a's place (a fix-up applied when both halves are at hand)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            layer.attn.a, layer.mlp.b = _p(H, H), _p(H, H)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.{w}.weight": ("BF16", (H, H)) for i in range(len(self.layers)) for w in "ab"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        done: set[tuple[int, str]] = set()
        for name, w in weights:
            i, leaf = _leaf(name)
            layer = self.layers[i]
            if leaf == "a":
                layer.attn.a.data.copy_(w)
            else:
                layer.mlp.b.data.copy_(w)
                if (i, "a") in done:
                    layer.attn.a.data[0, 0] = w[0, 0]
            done.add((i, leaf))


def test_r13_a_stray_that_needs_its_victim_in_the_same_call_keeps_the_culprit_mapped() -> None:
    """Was a hole (fixed in round 13): the group load in checkpoint order leaves a's place wrong: ``a`` is unmapped; ``b`` alone does not
    stray: kept. The map writes ``b``, the reload of ``a`` (its module alone) restores a[0, 0]; a whole reload
    leaves ``b[0, 0]`` there. Fix: unmap every tensor loaded after the victim in the failing group call that
    shares a call with it (or retry with pairs: victim + each later tensor)."""
    model = PairStray()
    _check(model, model.spec())


class RecycleFloats(QKVStack):
    """A staging pool: at each call, the float tensors it was handed in the previous call are zeroed for reuse
    (round 7's ``recycle_ints``, for floats). Loading ``v`` also writes ``v[at]`` into a padding row."""

    def __init__(self, **kw: object) -> None:
        super().__init__(pad=1, **kw)  # type: ignore[arg-type]
        self.spent: list[torch.Tensor] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(weights)
        for t in self.spent:
            t.zero_()
        self.spent = [t for _, t in items if t.is_floating_point()]
        for name, w in items:
            i, leaf = _leaf(name)
            qkv = self.layers[i].qkv.data
            row = {"q": 0, "k": H, "v": 2 * H}[leaf]
            qkv[row : row + H].copy_(w)
            if leaf == "v" and w.is_floating_point():
                qkv[3 * H, 0] = w[self.at]


def test_r13_a_loader_that_recycles_the_values_it_was_given_makes_the_alone_loads_vacuous() -> None:
    """Was a hole (fixed in round 13): v's stray fails the group check; the alone loads rotate ``values[n]``, the very tensors the group call
    handed over, which the loader zeroes at its next call (the first alone load). ``k`` and ``v`` are then
    checked with zeros: v's stray writes a zero into padding, allowed. A checkpoint's v strays a non-zero.
    Fix: rotate from a private copy (or check the values' digests before each alone load)."""
    model = RecycleFloats()
    _check(model, model.spec())


# --------------------------------------------------------------------------------------------------------------
# Zeros: allowed outside every mapped place (vLLM's padded vocabulary rows), idempotent only where live is zero
# --------------------------------------------------------------------------------------------------------------


class ZeroIntoUnmapped(torch.nn.Module):
    """``attn.a`` is loaded scaled (``2 * a``: not mappable), ``mlp.b`` plainly; loading ``b`` clears a's first row.
    In checkpoint order ``a`` loads first, so a whole reload leaves that row zero."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            layer.attn.a, layer.mlp.b = _p(H, H), _p(H, H)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.{w}.weight": ("BF16", (H, H)) for i in range(len(self.layers)) for w in "ab"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            layer = self.layers[i]
            if leaf == "a":
                layer.attn.a.data.copy_(w * 2)
            else:
                layer.mlp.b.data.copy_(w)
                layer.attn.a.data[0].zero_()


def test_r13_a_zero_stray_into_an_unmapped_tensor_s_place_keeps_the_culprit_mapped() -> None:
    """Was a hole (fixed in round 13): ``a`` is refused (scaled), so its place is "no mapped tensor's": b's zeros there pass as padding
    zero-fill. The map writes ``b``, ``a``'s module is reloaded (row 0 restored); a whole reload leaves row 0 zero.
    Fix: allow a zero outside mapped places only where the live parameter (``originals``) holds zero too, and
    never in the place of a tensor the probes saw land (mapped or not)."""
    model = ZeroIntoUnmapped()
    _check(model, model.spec())


class UnmappedStrays(torch.nn.Module):
    """``attn.a`` is loaded scaled (unmapped) and also writes its raw ``a[0, 0]`` into ``mlp.b[0, 0]``; ``b`` loads
    after it in checkpoint order (a whole reload overwrites the stray)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            layer.attn.a, layer.mlp.b = _p(H, H), _p(H, H)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.{w}.weight": ("BF16", (H, H)) for i in range(len(self.layers)) for w in "ab"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            layer = self.layers[i]
            if leaf == "a":
                layer.attn.a.data.copy_(w * 2)
                layer.mlp.b.data[0, 0] = w[0, 0]
            else:
                layer.mlp.b.data.copy_(w)


def test_r13_an_unmapped_tensor_that_strays_into_a_mapped_place_clobbers_it_on_reload() -> None:
    """Was a hole (fixed in round 13): ``a`` is refused at its probe (scaled), and never loaded again in the build, so its stray into b's
    place is never seen; ``b`` is mapped. The engine writes ``b`` through the map and then reloads ``a``'s module:
    b[0, 0] becomes a's. A whole reload loads ``b`` after ``a``. Fix: in the real-values check, load each unmapped
    tensor alone too and unmap the mapped tensors whose places it writes."""
    model = UnmappedStrays()
    _check(model, model.spec())


# --------------------------------------------------------------------------------------------------------------
# Tied and shared parameters
# --------------------------------------------------------------------------------------------------------------


class TiedBoth(torch.nn.Module):
    """``lm_head.weight`` is ``embed_tokens.weight`` (one Parameter), and the loader loads both checkpoint names into
    it (no tied-skip): the last one wins."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Module()
        self.model.embed_tokens.weight = _p(16, H)
        self.lm_head = torch.nn.Module()
        self.lm_head.weight = self.model.embed_tokens.weight

    def spec(self) -> Spec:
        return {"model.embed_tokens.weight": ("BF16", (16, H)), "lm_head.weight": ("BF16", (16, H))}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, w in weights:
            self.model.embed_tokens.weight.data.copy_(w)


def test_r13_tied_parameters_loaded_under_both_names_keep_one_of_them_mapped() -> None:
    """Was a hole (fixed in round 13): both probes land on the same place; the group load leaves lm_head's values there, so the embedding is
    misplaced and unmapped; ``lm_head`` alone writes only its own place (which is also the embedding's, masked as
    "own" by ``_written_outside``): kept. The map writes lm_head, the reload of the embedding overwrites it; a
    whole reload ends with lm_head's. Fix: a tensor whose runs overlap an unmapped (misplaced) tensor's runs leaves
    the map too."""
    model = TiedBoth()
    _check(model, model.spec())


class SharedLayers(torch.nn.Module):
    """Layers 0 and 1 share one Parameter (ALBERT-style / layer-shared small models), the checkpoint holds both
    names; the loader loads each name into its layer's (shared) parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
        self.layers[0].w = _p(H, H)
        self.layers[1].w = self.layers[0].w
        self.layers[2].w = _p(H, H)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.w": ("BF16", (H, H)) for i in range(3)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            self.layers[_leaf(name)[0]].w.data.copy_(w)


def test_r13_a_parameter_shared_by_two_layers_is_probed_live() -> None:
    """Was a hole (loud; fixed in round 13): ``layers.1`` has no parameter of its own (the shared one is grouped under ``layers.0``), so it is
    probed with no stand-in: its integer probe lands in the live weights and the build raises MapCorruption; the
    model serves probe values until an anchor. Fix: a group's stand-ins are every parameter *object* that has a
    name in it (swap shared ones in each group that names them)."""
    model = SharedLayers()
    spec = model.spec()
    model.load_weights(list(_weights(spec, 1).items()))
    before = _state(model)
    try:
        build_map(model, spec, model.load_weights)
    except MapCorruption:
        pass
    assert _same(before, _state(model)) == []


# --------------------------------------------------------------------------------------------------------------
# History: what the loader was called with before
# --------------------------------------------------------------------------------------------------------------


class ConsecutiveFloats(QKVStack):
    """Remembers whether its previous call carried float tensors; on a float call right after another (a reload
    after a load, never a build check after its integer probes) loading ``k`` also writes ``k[at]`` into q's place.
    """

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.last_float = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(weights)
        floats = any(w.is_floating_point() for _, w in items)
        for name, w in items:
            i, leaf = _leaf(name)
            qkv = self.layers[i].qkv.data
            row = {"q": 0, "k": H, "v": 2 * H}[leaf]
            qkv[row : row + H].copy_(w)
            if leaf == "k" and floats and self.last_float:
                qkv[self.at] = w[self.at]
        self.last_float = floats


def test_r13_a_stray_only_on_back_to_back_float_loads() -> None:
    """Was a hole (fixed in round 13): the first layer's group check follows its per-tensor probes, a derived
    layer's follows its two probe loads: never two float loads in a row. A reload after the initial load is. Fix: run the real-values load
    twice in a row (new rotation/values the second time) and check the second. Since round 14 the group's culprit
    ``k`` leaves the map with all its group (a failure its loads alone do not explain), and the harness's reload of
    everything differs from its reference only by the loader's history (the build's last call), so the test
    asserts that the culprit is left out in every layer, or that the map is exact."""
    model = ConsecutiveFloats()
    pm, differ = _map_and_rewrite(model, model.spec())
    left_out = all(f"model.layers.{i}.k.weight" in pm.unmapped for i in range(len(model.layers)))
    assert left_out or differ == [], f"layers {pm.layers}, unmapped {sorted(pm.unmapped)}: differs in {differ}"


# --------------------------------------------------------------------------------------------------------------
# Edge values as fixed points of a content-dependent write
# --------------------------------------------------------------------------------------------------------------


class NegStray(QKVStack):
    """Float ``k`` of layer 1 (derived) halves what q's place holds at (0, 0), after ``q`` loaded: a write that
    depends on the parameter's content (on zeroed stand-ins it is invisible)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            qkv = self.layers[i].qkv.data
            row = {"q": 0, "k": H, "v": 2 * H}[leaf]
            qkv[row : row + H].copy_(w)
            if leaf == "k" and w.is_floating_point() and i == 1:
                qkv[0, 0] = qkv[0, 0] * 0.5  # depends on what q's place held


def test_r13_a_stray_that_rescales_another_tensor_s_place_in_a_derived_layer() -> None:
    """Was a hole (fixed in round 13; probabilistic): layer 1's k halves q[0, 0] after q loaded. The real values put an edge value at a
    random 1 in 7 places, 8 of the 15 edges (NaNs, infinities, -0.0) are fixed points of halving: the group check
    misses it ~10% of builds (20 of 200 here) and k stays mapped in layer 1. 100 builds: all must be exact (a miss
    rate of 10% passes them all with odds 3e-5). Fix: a second real-values load with finite values only."""
    for _ in range(100):
        model = NegStray()
        _check(model, model.spec())


# --------------------------------------------------------------------------------------------------------------
# Attacks that held
# --------------------------------------------------------------------------------------------------------------


class CoveredStray(QKVStack):
    """Float ``q`` also writes ``q[at]`` into k's place; ``k`` loads after it and covers it (benign for a whole
    reload in checkpoint order: the place is tiled, not scanned)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            qkv = self.layers[i].qkv.data
            row = {"q": 0, "k": H, "v": 2 * H}[leaf]
            qkv[row : row + H].copy_(w)
            if leaf == "q" and w.is_floating_point():
                qkv[H + self.at[0], self.at[1]] = w[self.at]


def test_r13_a_stray_into_a_later_tensor_s_place_in_a_tiled_parameter() -> None:
    model = CoveredStray()
    _check(model, model.spec())


class LastLayerPadStray(QKVStack):
    """Float ``k`` of the last layer only (derived) also writes its last row into a padding row."""

    def __init__(self, **kw: object) -> None:
        super().__init__(pad=1, **kw)  # type: ignore[arg-type]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            qkv = self.layers[i].qkv.data
            row = {"q": 0, "k": H, "v": 2 * H}[leaf]
            qkv[row : row + H].copy_(w)
            if leaf == "k" and w.is_floating_point() and i == len(self.layers) - 1:
                qkv[3 * H] = w[H - 1]  # a whole row: a single value equals the background there ~1 build in 300


def test_r13_a_float_only_stray_into_padding_in_the_last_derived_layer() -> None:
    model = LastLayerPadStray(n=4)
    _check(model, model.spec())


class RaiseOnCall(QKVStack):
    """Raises on its ``fail_at``-th call, after writing the first tensor it was given (``pad``: a padding row)."""

    def __init__(self, fail_at: int, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.calls, self.fail_at = 0, fail_at

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.calls += 1
        items = list(weights)
        if self.calls == self.fail_at:
            super().load_weights(items[:1])
            raise RuntimeError("loader failed midway")
        super().load_weights(items)


def test_r13_a_loader_that_raises_midway_at_any_call_leaves_the_weights_as_they_were() -> None:
    spec = QKVStack().spec()
    base = _weights(spec, 1)
    calls = 0
    for fail_at in range(2, 40):
        model = RaiseOnCall(fail_at)
        model.load_weights(list(base.items()))  # call 1
        before = _state(model)
        new = _weights(spec, 2)
        ref = copy.deepcopy(model)
        ref.fail_at = -1
        ref.load_weights(list(new.items()))
        pm = build_map(model, spec, model.load_weights)
        assert _same(before, _state(model)) == [], f"failing call {fail_at}: the build changed weights"
        calls = max(calls, model.calls)
        model.fail_at = -1
        pm.write(pm.plan([_dense(n, new[n]) for n in spec if n in pm]))
        if pm.unmapped:
            model.load_weights([(n, new[n]) for n in spec if n in pm.unmapped])
        assert _same(_state(ref), _state(model), identity=False) == [], f"failing call {fail_at}"
    assert calls < 40  # every call of the build was made to fail once


class NonContiguous(torch.nn.Module):
    """A parameter that is a transposed view (non-contiguous)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
        for layer in self.layers:
            layer.w = torch.nn.Parameter(torch.zeros(H, 2 * H, dtype=torch.bfloat16).t(), requires_grad=False)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.w": ("BF16", (2 * H, H)) for i in range(2)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            self.layers[_leaf(name)[0]].w.data.copy_(w)


def test_r13_a_non_contiguous_parameter() -> None:
    model = NonContiguous()
    _check(model, model.spec())
