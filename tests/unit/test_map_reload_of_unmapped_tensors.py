"""What the map leaves out is reloaded after the map's writes: the engine writes the mapped tensors, then reloads
the unmapped tensors' modules. That must serve what a whole reload (every tensor, in checkpoint order) serves:
a mapped tensor whose place an unmapped tensor's load writes, or that writes into an unmapped tensor's place
(only in its company, only where it holds zeros, only as a fix-up), leaves the map too. Toy loaders, torch
only."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from deltasync.vllm.patch_map import values
from tests.unit.map_fakes import H, Spec, TwoModules, assert_exact, b_fixes_up_a, leaf, map_and_rewrite, param, weights

pytestmark = pytest.mark.usefixtures("probe_passes")  # one int32 pass, and two int16 halves


def _b_clears_a_row_of_scaled_a(layer: torch.nn.Module, i: int, part: str, w: torch.Tensor, a_done: bool) -> None:
    """``a`` is loaded scaled (``2 * a``: not mappable), ``b`` plainly; loading ``b`` clears a's first row. In
    checkpoint order ``a`` loads first, so a whole reload leaves that row zero."""
    if part == "a":
        layer.attn.a.data.copy_(w * 2)
    else:
        layer.mlp.b.data.copy_(w)
        layer.attn.a.data[0].zero_()


def _scaled_a_strays_into_b(layer: torch.nn.Module, i: int, part: str, w: torch.Tensor, a_done: bool) -> None:
    """``a`` is loaded scaled (unmapped) and also writes its raw ``a[0, 0]`` into ``b[0, 0]``; ``b`` loads after it
    in checkpoint order (a whole reload overwrites the stray, a reload of ``a``'s module after the map's writes
    does not)."""
    if part == "a":
        layer.attn.a.data.copy_(w * 2)
        layer.mlp.b.data[0, 0] = w[0, 0]
    else:
        layer.mlp.b.data.copy_(w)


def _replaced_a_strays_into_b(layer: torch.nn.Module, i: int, part: str, w: torch.Tensor, a_done: bool) -> None:
    """``a`` is loaded by replacing its data (``param.data = w.clone()``: a loader that re-lays out a weight), so
    the map refuses it at its probe; loading ``a`` also writes ``a[0, 0]`` into ``b[0, 0]``."""
    if part == "a":
        layer.attn.a.data = w.to(torch.bfloat16).clone()
        layer.mlp.b.data[0, 0] = w[0, 0]
    else:
        layer.mlp.b.data.copy_(w)


def _fills_zeros(layer: torch.nn.Module, i: int, part: str, w: torch.Tensor, a_done: bool) -> None:
    """``a`` (an fp32 parameter: unmapped by dtype) writes ``a[0, 0]`` into b's padding row where that row is zero
    (initialising what no one filled); loading ``b`` zero-fills its padding row (as vLLM's padded vocabulary).
    Checkpoint order a, b: a whole reload leaves the padding zero."""
    if part == "a":
        layer.attn.a.data.copy_(w)
        pad = layer.mlp.b.data[H]
        pad.copy_(torch.where(pad == 0, w[0, 0].to(pad.dtype), pad))
    else:
        layer.mlp.b.data[:H].copy_(w)
        layer.mlp.b.data[H].zero_()


@pytest.mark.parametrize(
    "model",
    [
        # a zero into an unmapped tensor's place is no padding zero-fill: the reload of ``a`` would undo it
        pytest.param(lambda: TwoModules(load=_b_clears_a_row_of_scaled_a), id="zero-into-unmapped-place"),
        # ``a`` is refused at its probe: it is loaded alone in the build too, and its stray shows
        pytest.param(lambda: TwoModules(load=_scaled_a_strays_into_b), id="unmapped-strays-into-mapped"),
        # a load that replaces what it is given still has its stray into the mapped places seen
        pytest.param(lambda: TwoModules(load=_replaced_a_strays_into_b), id="replacing-unmapped-strays"),
        # the mapped and unmapped tensors are loaded together too: a stray needing its victim in the same call
        pytest.param(lambda: TwoModules(a_dtype=torch.float32, load=b_fixes_up_a), id="fix-up-into-unmapped"),
        # the unmapped tensors are loaded on zeroed stand-ins too: a write only into zeros shows there
        pytest.param(lambda: TwoModules(a_dtype=torch.float32, b_rows=H + 1, load=_fills_zeros), id="fills-zeros"),
    ],
)
def test_the_reload_of_what_the_map_leaves_out_serves_a_whole_reload(model) -> None:
    assert_exact(model())


class RaisingScaleStray(torch.nn.Module):
    """Per layer: ``attn.a`` (an fp32 parameter for a BF16 tensor: unmapped by dtype) whose load also writes
    ``a[0, 0]`` into ``mlp.b[0, 0]``; ``attn.s``, per-channel scales (fp32: unmapped) the loader validates
    (``ValueError`` unless all positive, as any scale is); ``mlp.b`` plain. Checkpoint order a, s, b."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            layer.attn.a, layer.attn.s = param(H, H, dtype=torch.float32), param(H * H, dtype=torch.float32)
            layer.mlp.b = param(H, H)

    def spec(self) -> Spec:
        out: Spec = {}
        for i in range(len(self.layers)):
            out[f"model.layers.{i}.attn.a"] = ("BF16", (H, H))
            out[f"model.layers.{i}.attn.s"] = ("BF16", (H * H,))
            out[f"model.layers.{i}.mlp.b"] = ("BF16", (H, H))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            layer = self.layers[leaf(name)[0]]
            if name.endswith("attn.a"):
                layer.attn.a.data.copy_(w)
                layer.mlp.b.data[0, 0] = w[0, 0]
            elif name.endswith("attn.s"):
                if not bool((w > 0).all()):
                    raise ValueError(f"{name}: scales must be positive")
                layer.attn.s.data.copy_(w)
            else:
                layer.mlp.b.data.copy_(w)


def test_an_unmapped_load_that_raises_does_not_hide_a_stray_into_a_mapped_place() -> None:
    """The check's random values fail the scales' validation (64 scales are all positive in 1 build in 2^64), so
    the unmapped tensors' load raises; each is loaded alone, and a's stray into b's place is seen, where the
    engine's reload of the unmapped tensors (real, positive scales) goes through."""
    model = RaisingScaleStray()
    spec = model.spec()
    base, new = weights(spec, 1), weights(spec, 2)
    for n in spec:
        if n.endswith(".s"):
            base[n], new[n] = base[n].abs() + 0.5, new[n].abs() + 0.5
    pm, differ = map_and_rewrite(model, spec, new, base)
    assert differ == [], f"unmapped {sorted(pm.unmapped)}: the map differs in {differ}"


class LeftByStrict(torch.nn.Module):
    """Per layer ``attn.a`` (fp32: unmapped by dtype) and ``mlp.w`` holding rows b | c. Loading ``b`` clears a's
    first row and, for float values, also writes ``b[0, 0]`` into c's place, which ``c``, loaded after it, covers
    (harmless in a whole reload). Checkpoint order a, b, c."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(n)])
        for layer in self.layers:
            layer.attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            layer.attn.a, layer.mlp.w = param(H, H, dtype=torch.float32), param(2 * H, H)

    def spec(self) -> Spec:
        return {
            f"model.layers.{i}.{x}": ("BF16", (H, H))
            for i in range(len(self.layers))
            for x in ("attn.a", "mlp.b", "mlp.c")
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            layer = self.layers[leaf(name)[0]]
            if name.endswith("attn.a"):
                layer.attn.a.data.copy_(w)
            elif name.endswith("mlp.b"):
                layer.mlp.w.data[:H].copy_(w)
                layer.attn.a.data[0].zero_()
                if w.is_floating_point():
                    layer.mlp.w.data[H, 0] = w[0, 0]
            else:
                layer.mlp.w.data[H:].copy_(w)


def test_a_tensor_left_out_by_the_check_with_unmapped_ones_is_checked_as_unmapped_too() -> None:
    """``b`` leaves the map (its zeros in a's place), and is then reloaded after the map's writes: its stray into
    c's place would land after ``c`` was written. The check with the unmapped tensors repeats until no more leave:
    ``c`` leaves too."""
    assert_exact(LeftByStrict())


def test_a_stray_of_the_very_value_the_background_holds_is_still_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every real value and the whole background are 1.0 here: the unmapped ``a``'s stray into b's place writes
    what the background already holds there (as two random bf16 values are equal about once in 600), so only its
    load on zeroed stand-ins shows it; ``b`` leaves the map."""
    monkeypatch.setattr(values, "real_values", lambda shape, dtype, gen, edges=True: torch.ones(shape, dtype=dtype))
    pm = assert_exact(TwoModules(load=_scaled_a_strays_into_b))
    assert all(f"model.layers.{i}.b.weight" in pm.unmapped for i in range(3)), pm.unmapped
