"""Adversarial review r14 of the patch map (round 13's fixes: a finite zero-free background, edge-then-finite real
values, new values per derived layer and per alone load, the unmapped tensors' load and the strict check, overlap
with a misplaced tensor, parameters shared by layers). White-box, but every attack is only a model's
``load_weights`` as ``build_map`` calls it. Each test fails if a promise breaks: writes through the map (then a
reload of what it leaves out) differ from a whole reload, or the build changed weights or raised. Twelve attacks
found holes (docstrings: mechanism and fix); eight were fixed in round 14, and four are left open, documented in
docs/RELIABILITY.md, each ``xfail(strict=True)`` (a loader that tells a build from a reload by its history, by
the statistics of the values, by remembering every 4-gram it was given, or by calls spanning layers); the other
attacks held.
Toy loaders, torch only."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np
import pytest
import torch

from deltasync.vllm.patch_map import PatchMap, build_map
from tests.unit.test_adversary_r7_patch_map import H, QKVStack, _p
from tests.unit.test_attacks_patch_map import Spec, _dense, _map_and_rewrite, _same, _state, _weights

pytestmark = pytest.mark.usefixtures("probe_passes")


def _leaf(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return int(parts[2]), parts[3]


def _rewrite(
    model: torch.nn.Module,
    spec: Spec,
    base: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    reverse: bool = False,
) -> tuple[PatchMap, list[str]]:
    """:func:`_map_and_rewrite` with chosen base and new values (``reverse``: the map's writes in the other order:
    a map places each parameter element once, so its writes commute, and the engine runs them on threads)."""
    model.load_weights(list(base.items()))  # type: ignore[operator]
    ref = copy.deepcopy(model)
    ref.load_weights(list(new.items()))  # type: ignore[operator]
    before = _state(model)
    pm = build_map(model, spec, model.load_weights)  # type: ignore[arg-type]
    assert _same(before, _state(model)) == [], "the build changed weights"
    names = [n for n in spec if n in pm]
    pm.write(pm.plan([_dense(n, new[n]) for n in (reversed(names) if reverse else names)]), threads=False)
    if pm.unmapped:
        model.load_weights([(n, new[n]) for n in spec if n in pm.unmapped])  # type: ignore[operator]
    return pm, _same(_state(ref), _state(model), identity=False)


def _check(model: torch.nn.Module, spec: Spec, new: dict[str, torch.Tensor] | None = None) -> None:
    pm, differ = _map_and_rewrite(model, spec, new)
    assert differ == [], f"layers {pm.layers}, unmapped {sorted(pm.unmapped)}: the map differs in {differ}"


class TwoModules(torch.nn.Module):
    """Per layer an ``attn`` and an ``mlp`` module (the engine reloads an unmapped tensor's module alone)."""

    def __init__(self, n: int = 3, a_dtype: torch.dtype = torch.bfloat16, b_rows: int = H) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            layer.attn.a, layer.mlp.b = _p(H, H, dtype=a_dtype), _p(b_rows, H)

    def spec(self) -> Spec:
        return {
            f"model.layers.{i}.{m}.weight": ("BF16", (H, H)) for i in range(len(self.layers)) for m in ("attn", "mlp")
        }


# --------------------------------------------------------------------------------------------------------------
# The unmapped tensors' load (d): skipped when the loader replaces a parameter's data or raises
# --------------------------------------------------------------------------------------------------------------


class ReplacingStray(TwoModules):
    """``attn.a`` is loaded by replacing its data (``param.data = w.clone()``: a loader that re-lays out a weight),
    so the map refuses it at its probe; loading ``a`` also writes ``a[0, 0]`` into ``mlp.b[0, 0]`` (round 13's
    ``UnmappedStrays``). ``b`` loads after ``a`` in checkpoint order: a whole reload overwrites the stray."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            layer = self.layers[i]
            if leaf == "attn":
                layer.attn.a.data = w.to(torch.bfloat16).clone()
                layer.mlp.b.data[0, 0] = w[0, 0]
            else:
                layer.mlp.b.data.copy_(w)


def test_r14_an_unmapped_tensor_whose_loader_replaces_its_data_strays_unseen() -> None:
    """Was a hole (deterministic; fixed in round 14). ``_unmapped_writes`` returns ``set()`` at once when
    ``_load_swapped`` says the loader replaced a parameter or its data, before it looks at the mapped tensors' places:
    ``a`` (refused at its probe with "the loader replaced ... its data") is loaded there and writes into ``b``'s place,
    but ``b`` stays mapped. The engine writes ``b`` through the map, then reloads ``a``'s module: b[0, 0] becomes a's; a
    whole reload loads ``b`` after ``a``. Fix: after a replacing load, still scan the mapped places (the stand-ins were
    put back by ``_restore_identity`` and hold what the loader wrote through them), and count every parameter as strict;
    or leave the group's mapped tensors out."""
    model = ReplacingStray()
    _check(model, model.spec())


class RaisingScaleStray(torch.nn.Module):
    """Per layer: ``attn.a`` (an fp32 parameter for a BF16 tensor: unmapped by dtype) whose load also writes
    ``a[0, 0]`` into ``mlp.b[0, 0]``; ``attn.s``, per-channel scales (fp32: unmapped) the loader validates
    (``ValueError`` unless all positive, as any scale is); ``mlp.b`` plain. Checkpoint order a, s, b."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            layer.attn.a, layer.attn.s = _p(H, H, dtype=torch.float32), _p(H * H, dtype=torch.float32)
            layer.mlp.b = _p(H, H)

    def spec(self) -> Spec:
        out: Spec = {}
        for i in range(len(self.layers)):
            out[f"model.layers.{i}.attn.a"] = ("BF16", (H, H))
            out[f"model.layers.{i}.attn.s"] = ("BF16", (H * H,))
            out[f"model.layers.{i}.mlp.b"] = ("BF16", (H, H))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            layer = self.layers[i]
            if name.endswith("attn.a"):
                layer.attn.a.data.copy_(w)
                layer.mlp.b.data[0, 0] = w[0, 0]
            elif name.endswith("attn.s"):
                if not bool((w > 0).all()):
                    raise ValueError(f"{name}: scales must be positive")
                layer.attn.s.data.copy_(w)
            else:
                layer.mlp.b.data.copy_(w)


def test_r14_an_unmapped_load_that_raises_hides_a_stray_into_a_mapped_place() -> None:
    """Was a hole (fixed in round 14; deterministic: 64 scales are all positive in 1 build in 2^64). The unmapped
    tensors of a group are loaded together with random finite values; a loader that validates one of them (scales must
    be positive; the check's values are N(0, 1)) raises, and ``_unmapped_writes`` returns ``set()`` without scanning:
    ``a`` was loaded first in that call and wrote into ``b``'s place, ``b`` stays mapped. The engine's reload of the
    unmapped tensors (real, positive scales) goes through: b[0, 0] becomes a's. Fix: on an exception, scan anyway (what
    was written before the raise is in the stand-ins) and treat every parameter as strict, or load each unmapped tensor
    alone (then one that raises alone tells nothing about the others), or leave the group out."""
    model = RaisingScaleStray()
    spec = model.spec()
    base, new = _weights(spec, 1), _weights(spec, 2)
    for n in spec:
        if n.endswith(".s"):
            base[n], new[n] = base[n].abs() + 0.5, new[n].abs() + 0.5
    pm, differ = _rewrite(model, spec, base, new)
    assert differ == [], f"unmapped {sorted(pm.unmapped)}: the map differs in {differ}"


# --------------------------------------------------------------------------------------------------------------
# Mapped and unmapped tensors are never loaded in one call
# --------------------------------------------------------------------------------------------------------------


class PairStrayIntoUnmapped(TwoModules):
    """Round 13's ``PairStray`` with the victim unmapped from the start: ``attn.a`` is fp32 (the checkpoint's is
    BF16: unmapped by dtype); loading ``b`` after ``a`` in the same call also writes ``b[0, 0]`` into ``a[0, 0]`` (a
    fix-up applied when both halves are at hand)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__(n, a_dtype=torch.float32)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        done: set[tuple[int, str]] = set()
        for name, w in weights:
            i, leaf = _leaf(name)
            layer = self.layers[i]
            if leaf == "attn":
                layer.attn.a.data.copy_(w)
            else:
                layer.mlp.b.data.copy_(w)
                if (i, "attn") in done:
                    layer.attn.a.data[0, 0] = w[0, 0]
            done.add((i, leaf))


def test_r14_a_stray_into_an_unmapped_tensor_s_place_only_in_its_company() -> None:
    """Was a hole (deterministic; fixed in round 14). Every real-values check loads the mapped tensors only, and the
    unmapped tensors' load (``_unmapped_writes``) loads the unmapped ones only: a mapped tensor whose stray needs an
    unmapped one in the same call (round 13's ``PairStray``, fixed only for a *mapped* victim) never strays in the
    build. The engine writes ``b`` through the map and reloads ``a``'s module alone (a[0, 0] is a's); a whole reload
    leaves b[0, 0] there. Fix: one check that loads the whole group (mapped and unmapped, checkpoint order) on the
    background, then the unmapped ones alone with the same values on the same background: the unmapped tensors' places
    must hold the same bits both times (else leave the group's mapped tensors out), and the mapped ones their values."""
    model = PairStrayIntoUnmapped()
    _check(model, model.spec())


class VictimStraysAlone(torch.nn.Module):
    """One parameter per layer, rows a | b | c | padding. Float ``a`` also writes its first row into the padding row
    (a float-only stray: ``a`` is mapped by its probe, and strays alone); loading ``c`` after ``a`` in the same
    call writes ``c[0, 0]`` into a's place."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.w = _p(3 * H + 1, H)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.{x}": ("BF16", (H, H)) for i in range(len(self.layers)) for x in "abc"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        done: set[tuple[int, str]] = set()
        for name, w in weights:
            i, leaf = _leaf(name)
            p = self.layers[i].w.data
            row = {"a": 0, "b": H, "c": 2 * H}[leaf]
            p[row : row + H].copy_(w)
            if leaf == "a" and w.is_floating_point():
                p[3 * H] = w[0]  # a whole row: one value may equal the background there (~1 in 1,100)
            if leaf == "c" and (i, "a") in done:
                p[0, 0] = w[0, 0]
            done.add((i, leaf))


def test_r14_a_together_only_stray_whose_victim_also_strays_alone() -> None:
    """Was a hole (deterministic; fixed in round 14). The group check fails: a's place holds c[0, 0] (c wrote it, a in
    the same call) and the padding holds a[0, 0]. Alone, ``a`` strays (padding) and ``c`` does not: every misplaced
    tensor "strayed alone", so ``_verify_group`` re-checks the rest ({b, c}) together, without ``a``, and ``c`` never
    strays again. The engine writes b, c through the map and reloads ``a``: a[0, 0] is a's; a whole reload leaves c[0,
    0]. Fix: a misplaced tensor is explained only if it is *misplaced* alone in the same place (not merely strays
    elsewhere); more robustly, the fix of the test above (load the culprits with the rest, compare the unmapped places
    with their alone load)."""
    model = VictimStraysAlone()
    _check(model, model.spec())


# --------------------------------------------------------------------------------------------------------------
# History and tells: the check's values still look unlike a checkpoint's, and its loads unlike a reload's
# --------------------------------------------------------------------------------------------------------------


def _finite_call(items: list[tuple[str, torch.Tensor]]) -> bool:
    floats = [w for _, w in items if w.is_floating_point()]
    return bool(floats) and all(bool(torch.isfinite(w).all()) for w in floats)


class ConsecutiveFinite(QKVStack):
    """Round 13's ``ConsecutiveFloats`` keyed on finite float calls: on a call of finite floats right after another
    (a reload after the initial load) loading ``k`` also writes ``k[at]`` into q's place."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.last_finite = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(weights)
        finite = _finite_call(items)
        for name, w in items:
            i, leaf = _leaf(name)
            qkv = self.layers[i].qkv.data
            row = {"q": 0, "k": H, "v": 2 * H}[leaf]
            qkv[row : row + H].copy_(w)
            if leaf == "k" and finite and self.last_finite:
                qkv[self.at] = w[self.at]
        self.last_finite = finite


@pytest.mark.xfail(strict=True, reason="r14 hole: never two finite real-value loads in a row (edges load is a tell)")
def test_r14_a_stray_only_on_back_to_back_finite_loads() -> None:
    """Hole (deterministic). Round 13 fixed ``ConsecutiveFloats`` by loading real values twice in a row, but the
    first load holds the edge values (NaN, inf in every 7th place): to a loader that asks ``isfinite`` the two are
    not alike, and the finite load always follows integers (probes) or an edge load. A reload after the initial load
    is two finite calls in a row: ``k`` strays into q's place. (Without unmapped tensors there is no strict check,
    the only other finite load right after a finite one.) Fix: end every group's check with two finite loads in a
    row (new values each), the second one checked."""
    model = ConsecutiveFinite()
    _check(model, model.spec())


class NormOffset(torch.nn.Module):
    """Per layer a weight ``w`` and a norm ``norm`` (64 elements). The loader detects a norm stored with the +1
    offset (Gemma's ``(1 + w)`` convention) by its mean, and subtracts it: ``if 0.5 < mean < 1.5: w - 1`` (for
    float weights: an integer tensor is no norm)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.w, layer.norm = _p(H, H), _p(H * H)

    def spec(self) -> Spec:
        out: Spec = {}
        for i in range(len(self.layers)):
            out[f"model.layers.{i}.w"] = ("BF16", (H, H))
            out[f"model.layers.{i}.norm"] = ("BF16", (H * H,))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            if leaf == "w":
                self.layers[i].w.data.copy_(w)
                continue
            offset = w.is_floating_point() and 0.5 < float(w.double().mean()) < 1.5
            self.layers[i].norm.data.copy_(w - 1 if offset else w)


@pytest.mark.xfail(strict=True, reason="r14 hole: the check's values are N(0, 1); a checkpoint's norms are near 1")
def test_r14_a_transform_only_for_checkpoint_like_statistics() -> None:
    """Hole (deterministic; the check's 64 N(0, 1) values have a mean above 0.5 about 3 loads in 100,000). The real
    values' mean is about 0 (std 0.125), so the offset is never subtracted in the build (integer probes are not
    inspected; without that test the split probes' high half, all ones, has mean 1 and is refused): ``norm`` is
    mapped as a copy. A checkpoint's norm weights sit near 1: a whole reload subtracts 1, the map writes them as
    they are. The same holds for any content predicate N(0, 1) values fail and trained weights
    pass (magnitude: weights ~0.02, an amax below 1; a mean; a spread). Fix: make the check's values look like the
    model's own: e.g. the live weights read back through the candidate map (``read_whole``), with a random subset of
    elements replaced by other live values (new content, a checkpoint's statistics); or scale and offset each
    tensor's draw by random amounts over a wide range (per load), so no fixed threshold separates them."""
    model = NormOffset()
    spec = model.spec()
    new = _weights(spec, 2)
    for n in spec:
        if n.endswith("norm"):
            new[n] = (1 + 0.05 * new[n].float()).bfloat16()
    _check(model, spec, new)


# --------------------------------------------------------------------------------------------------------------
# Parameters that share memory without being one object
# --------------------------------------------------------------------------------------------------------------


class TiedByStorage(torch.nn.Module):
    """``lm_head.weight = Parameter(embed_tokens.weight.data)``: two Parameter objects over one storage (tying by
    data, not by object); the loader loads each name into its own parameter (no tied-skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Module()
        self.model.embed_tokens.weight = _p(16, H)
        self.lm_head = torch.nn.Module()
        self.lm_head.weight = torch.nn.Parameter(self.model.embed_tokens.weight.data, requires_grad=False)

    def spec(self) -> Spec:
        return {"model.embed_tokens.weight": ("BF16", (16, H)), "lm_head.weight": ("BF16", (16, H))}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            (self.lm_head if name.startswith("lm_head") else self.model.embed_tokens).weight.data.copy_(w)


class SharedByStorage(torch.nn.Module):
    """Layer 1's ``w`` is ``Parameter(layers[0].w.data)`` (sharing by data, ALBERT-style); the checkpoint holds
    both names, each loaded into its layer's parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
        self.layers[0].w = _p(H, H)
        self.layers[1].w = torch.nn.Parameter(self.layers[0].w.data, requires_grad=False)
        self.layers[2].w = _p(H, H)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.w": ("BF16", (H, H)) for i in range(3)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            self.layers[_leaf(name)[0]].w.data.copy_(w)


@pytest.mark.parametrize("make", [TiedByStorage, SharedByStorage])
def test_r14_two_parameters_over_one_storage_are_both_mapped(make: type[torch.nn.Module]) -> None:
    """Was a hole (deterministic; fixed in round 14). Round 13 found tied and shared parameters by object (``id``); two
    Parameter objects over one storage (``Parameter(other.data)``) were swapped for stand-ins of their own, so both
    tensors landed "right" and both were mapped, on the same memory. ``_check_disjoint`` compares runs by parameter name
    only. The map's writes then do not commute (the engine runs them on threads), and the first tensor's audit reads the
    second's values: drift after every update. Fixed: parameters whose memory overlaps another parameter object's are
    shared, and the tensors landing in them are left out (reloaded in checkpoint order, which is a whole reload: this
    harness's deep copy would untie the reference, so the test asserts the map itself). The weights are as they were."""
    model = make()
    spec = model.spec()  # type: ignore[operator]
    model.load_weights(list(_weights(spec, 1).items()))  # type: ignore[operator]
    before = _state(model)
    pm = build_map(model, spec, model.load_weights)  # type: ignore[arg-type]
    assert not pm.runs and set(pm.unmapped) == set(spec), (sorted(pm.runs), pm.unmapped)
    assert all("shares memory" in why for why in pm.unmapped.values()), pm.unmapped
    assert _same(before, _state(model)) == []


# --------------------------------------------------------------------------------------------------------------
# The finite-values block is one per build: derived layers' values are windows (or tiles) of what layer 0 saw
# --------------------------------------------------------------------------------------------------------------

BIG = (1024, 1025)  # 1,049,600 elements: more than the block (1,000,003), so every load of it is tiles of the block


def _anchors(t: torch.Tensor) -> np.ndarray:
    """A content-defined sample of a bf16 tensor's 4-grams (its bits, overlapping: any alignment), as int64: those
    whose hash falls in 1/64 of the range (the same 4-gram is picked wherever it sits)."""
    b = t.detach().contiguous().reshape(-1).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    grams = (b[:-3] << 48) | (b[1:-2] << 32) | (b[2:-1] << 16) | b[3:]
    with np.errstate(over="ignore"):
        h = grams * np.int64(-7046029254386353131)
    return np.unique(grams[(h >> 58) == 0])


class FuzzyMemo(torch.nn.Module):
    """One big weight per layer (plus a padding row). The loader remembers (a content-defined sample of) the
    4-grams of every finite float tensor it loaded; a finite tensor of which fewer than half the sampled 4-grams
    were seen is new content (a checkpoint), and in layers from ``first`` on, loading new content also writes
    ``w[0, 0]`` into the padding row."""

    def __init__(self, n: int = 2, first: int = 1) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.w = _p(BIG[0] + 1, BIG[1])
        self.first = first
        self.seen = np.zeros(0, dtype=np.int64)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.w": ("BF16", BIG) for i in range(len(self.layers))}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i = _leaf(name)[0]
            p = self.layers[i].w.data
            p[: BIG[0]].copy_(w)
            if not (w.dtype == torch.bfloat16 and bool(torch.isfinite(w).all())):
                continue
            grams = _anchors(w)
            seen = float(np.isin(grams, self.seen).mean()) if self.seen.size and grams.size else 0.0
            if seen < 0.5 and i >= self.first:
                p[BIG[0], 0] = w[0, 0]
            self.seen = np.union1d(self.seen, grams)


@pytest.mark.xfail(strict=True, reason="r14 hole: derived layers' finite values are tiles of the build's one block")
def test_r14_a_fuzzy_memo_recognises_the_build_s_value_block() -> None:
    """Hole (deterministic for a tensor larger than the block, 1,000,003 elements: an MLP weight of a 0.6B model is
    3M). ``_Background.values`` gives each derived layer tiles of one block per dtype and build, rotated, with 4,096
    new elements: 99.6% of its 4-grams are layer 0's. A loader that strays only on content it has not (mostly)
    seen is never caught past layer 0 (its edge-value loads are non-finite: skipped). Smaller tensors are windows of
    the block and overlap a previous layer's window in proportion to their size. Fix: new content throughout
    (a fast counter-based generator over the whole tensor, ~a copy's cost), not a window plus a small patch."""
    model = FuzzyMemo()
    _check(model, model.spec())


# --------------------------------------------------------------------------------------------------------------
# A write only into zeros: the background has none, the probes see it and their refusal forgets it
# --------------------------------------------------------------------------------------------------------------


class FillZeros(TwoModules):
    """``attn.a`` is fp32 (unmapped by dtype); loading it writes ``a[0, 0]`` into b's padding row where that row is
    zero (initialising what no one filled); loading ``b`` zero-fills its padding row (as vLLM's padded vocabulary).
    Checkpoint order a, b: a whole reload leaves the padding zero."""

    def __init__(self, n: int = 3) -> None:
        super().__init__(n, a_dtype=torch.float32, b_rows=H + 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            layer = self.layers[i]
            if leaf == "attn":
                layer.attn.a.data.copy_(w)
                pad = layer.mlp.b.data[H]
                pad.copy_(torch.where(pad == 0, w[0, 0].to(pad.dtype), pad))
            else:
                layer.mlp.b.data[:H].copy_(w)
                layer.mlp.b.data[H].zero_()


def test_r14_an_unmapped_tensor_that_writes_only_into_zeros_keeps_a_zero_filler_mapped() -> None:
    """Was a hole (deterministic; fixed in round 14). ``a``'s probe writes into b's padding (zero in the integer
    stand-ins) and is refused ("written twice" / dtype), but what the probe showed is dropped. The unmapped load runs on
    the zero-free background: ``a`` writes nothing into ``mlp.b``, which is not strict, so b's zero-fill of its padding
    passes as vLLM's. The engine writes ``b`` through the map (padding untouched, zero) and reloads ``a``: the padding
    gets a[0, 0]; a whole reload ends with b's zeros. Fix: make strict every parameter that any unmapped tensor's probe
    (refused or not) wrote; or run the unmapped load once more on zeroed stand-ins."""
    model = FillZeros()
    _check(model, model.spec())


class LeftByStrict(torch.nn.Module):
    """Per layer ``attn.a`` (fp32: unmapped by dtype) and ``mlp.w`` holding rows b | c. Loading ``b`` clears a's
    first row (round 13's ``ZeroIntoUnmapped``) and, for float values, also writes ``b[0, 0]`` into c's place,
    which ``c``, loaded after it, covers (benign in a whole reload). Checkpoint order a, b, c."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            layer.attn.a, layer.mlp.w = _p(H, H, dtype=torch.float32), _p(2 * H, H)

    def spec(self) -> Spec:
        out: Spec = {}
        for i in range(len(self.layers)):
            for leaf in ("attn.a", "mlp.b", "mlp.c"):
                out[f"model.layers.{i}.{leaf}"] = ("BF16", (H, H))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i = _leaf(name)[0]
            layer = self.layers[i]
            if name.endswith("attn.a"):
                layer.attn.a.data.copy_(w)
            elif name.endswith("mlp.b"):
                layer.mlp.w.data[:H].copy_(w)
                layer.attn.a.data[0].zero_()
                if w.is_floating_point():
                    layer.mlp.w.data[H, 0] = w[0, 0]
            else:
                layer.mlp.w.data[H:].copy_(w)


def test_r14_a_tensor_left_out_by_the_strict_check_strays_into_a_mapped_place() -> None:
    """Was a hole (deterministic; fixed in round 14). ``_check_with_unmapped`` loads the unmapped tensors (``a``) once,
    then re-checks the rest with a's parameter strict: b's zeros there leave ``b`` out, and b's alone load (which also
    shows its stray into c's place) leaves only ``b``; ``c`` is re-checked alone-together and kept. But ``b`` is now
    unmapped and was never part of the unmapped tensors' load: the engine writes ``c`` through the map, then reloads a
    and b's module, and b's stray lands in c's place after c was written; a whole reload loads ``c`` after ``b``. Fix:
    repeat ``_unmapped_writes`` (and the strict check) until no more tensors leave; or, when the strict check leaves a
    tensor out, leave out every mapped tensor of the parameters its alone load wrote."""
    model = LeftByStrict()
    _check(model, model.spec())


# --------------------------------------------------------------------------------------------------------------
# A derived layer's real values go in its kind's first layer's order, not its own checkpoint order
# --------------------------------------------------------------------------------------------------------------


class CoveredFloatStray(QKVStack):
    """Float ``q`` also writes ``q[at]`` into k's place: benign where ``k`` loads after ``q`` (it covers it)."""

    def __init__(self, order: tuple[str, ...] = ("k", "q", "v")) -> None:
        super().__init__()
        self.order = order

    def spec(self) -> Spec:
        out: Spec = {}
        for i in range(len(self.layers)):  # layer 0 in q, k, v order; the others in ``order``
            for w in "qkv" if i == 0 else self.order:
                out[f"model.layers.{i}.{w}.weight"] = ("BF16", (H, H))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            qkv = self.layers[i].qkv.data
            row = {"q": 0, "k": H, "v": 2 * H}[leaf]
            qkv[row : row + H].copy_(w)
            if leaf == "q" and w.is_floating_point():
                qkv[H + self.at[0], self.at[1]] = w[self.at]


def test_r14_a_derived_layer_whose_checkpoint_order_differs_from_its_kind_s() -> None:
    """Was a hole (deterministic; fixed in round 14). ``_layer_kind`` sorts the names, so a layer whose tensors come in
    another checkpoint order (a sharded checkpoint split inside a layer, files read in their order; a converter that
    writes k before q) is the same kind as the first. ``_derive`` builds its runs, and so its real-values loads, in the
    first layer's order (q, k, v): q's float stray into k's place is covered there. A whole reload loads the layer in
    its own order (k, q, v) and the stray stays in k's place; the map writes k's values. Fix: order a derived layer's
    runs (and the checkpoint-order probe load) by the layer's own names as the spec lists them; or make the order part
    of the kind."""
    model = CoveredFloatStray()
    _check(model, model.spec())


# --------------------------------------------------------------------------------------------------------------
# No build call carries two groups' tensors; a whole reload carries them all
# --------------------------------------------------------------------------------------------------------------


class GlobalScale(torch.nn.Module):
    """Per layer a weight ``k``; outside the layers ``kv_amax`` (one element). When a call carries ``k`` of several
    layers (a full load), the loader stores ``max |k|`` over them in ``kv_amax`` (a model-wide scale); a call with one
    layer's ``k`` has nothing to take a model-wide maximum over and leaves it."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.k = _p(H, H)
        self.kv_amax = _p(1)

    def spec(self) -> Spec:
        return {f"model.layers.{i}.k": ("BF16", (H, H)) for i in range(len(self.layers))}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen: list[torch.Tensor] = []
        for name, w in weights:
            self.layers[_leaf(name)[0]].k.data.copy_(w)
            if w.is_floating_point():
                seen.append(w)
        if len(seen) > 1:
            self.kv_amax.data.fill_(max(float(w.float().abs().max()) for w in seen))


@pytest.mark.xfail(strict=True, reason="r14 hole (by design?): no build call spans two groups; a whole reload does")
def test_r14_a_write_only_in_a_call_that_spans_layers() -> None:
    """Hole (deterministic; round 13's ``BatchStray`` at model scale). Every build call carries one group's tensors
    (a probe, a layer's check, an alone load), so what a loader does only with several layers in one call (a
    model-wide scale, a cross-layer fix-up) is never seen: ``k`` is mapped, ``kv_amax`` goes stale. (The same loader
    taking the maximum over any call writes ``kv_amax``, outside the probed layer, and the build raises
    ``MapCorruption`` after writing probe values into the live weight: promise 2 is then broken loudly, as
    documented for writes outside the probed layer.) Fix: one closing check that loads every mapped tensor of the
    model in one call (new finite values, all probed parameters on stand-ins, or in layer-sized batches of
    several groups, with the parameters outside the layers swapped too) and leaves out what strays; or document
    that calls spanning groups are not modelled."""
    model = GlobalScale()
    _check(model, model.spec())


# --------------------------------------------------------------------------------------------------------------
# Attacks that held
# --------------------------------------------------------------------------------------------------------------


class TiedRefusedFirst(torch.nn.Module):
    """``lm_head.weight`` is ``embed_tokens.weight`` (one object); the loader loads the embedding scaled (refused at
    its probe) and ``lm_head`` as it is, both into the one parameter: the last one loaded wins."""

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
        for name, w in weights:
            self.model.embed_tokens.weight.data.copy_(w if name.startswith("lm_head") else w * 2)


def test_r14_a_tied_pair_whose_first_name_is_refused() -> None:
    """Held: ``lm_head`` alone lands right, but the unmapped embedding's load writes its place: left out."""
    model = TiedRefusedFirst()
    _check(model, model.spec())


class NthFloatLoad(QKVStack):
    """Loading float ``k`` for the ``nth`` time (counted per name, the initial load included) also writes
    ``k[at]`` into q's place."""

    def __init__(self, nth: int) -> None:
        super().__init__()
        self.nth = nth
        self.count: dict[str, int] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            qkv = self.layers[i].qkv.data
            row = {"q": 0, "k": H, "v": 2 * H}[leaf]
            qkv[row : row + H].copy_(w)
            if w.is_floating_point():
                self.count[name] = self.count.get(name, 0) + 1
                if leaf == "k" and self.count[name] == self.nth:
                    qkv[self.at] = w[self.at]


@pytest.mark.parametrize("nth", [2, 3])
def test_r14_a_stray_on_the_nth_float_load_of_a_name(nth: int) -> None:
    """Held: the build's edge and finite loads are a name's 2nd and 3rd float loads (the initial load is the 1st): a
    stray on either is seen and ``k`` (with its victim q) is left out in every layer. (Not compared with a whole
    reload: this loader is not a function of its input, and the harness's reload is the Nth load in one model and
    not in the other; a stray on the 2nd load only when it is finite is the back-to-back hole above's cousin.)"""
    model = NthFloatLoad(nth)
    spec = model.spec()
    model.load_weights(list(_weights(spec, 1).items()))
    before = _state(model)
    pm = build_map(model, spec, model.load_weights)
    assert _same(before, _state(model)) == []
    assert all(n in pm.unmapped for n in spec if ".k." in n or ".q." in n), sorted(pm.runs)


class OddShapes(torch.nn.Module):
    """Per layer a 0-d bf16 parameter, an fp16 one, an fp32 one that requires grad, and an empty one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
        for layer in self.layers:
            layer.s = torch.nn.Parameter(torch.zeros((), dtype=torch.bfloat16), requires_grad=False)
            layer.h = _p(5, 3, dtype=torch.float16)
            layer.f = torch.nn.Parameter(torch.zeros(7), requires_grad=True)
            layer.e = _p(0, 4)

    def spec(self) -> Spec:
        out: Spec = {}
        for i in range(3):
            out[f"model.layers.{i}.s"] = ("BF16", ())
            out[f"model.layers.{i}.h"] = ("F16", (5, 3))
            out[f"model.layers.{i}.f"] = ("F32", (7,))
            out[f"model.layers.{i}.e"] = ("BF16", (0, 4))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            i, leaf = _leaf(name)
            getattr(self.layers[i], leaf).data.copy_(w)


def test_r14_odd_shapes_and_dtypes_build_and_stay_exact() -> None:
    """Held: a 0-d parameter, fp16 (whose background is bf16 bit patterns read as fp16: all of magnitude 0.3-2.3,
    a tell for a loader that reads what a parameter held), fp32 with gradients, and an empty tensor."""
    model = OddShapes()
    _check(model, model.spec())
