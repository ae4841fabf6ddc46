"""GPU check of the engine's update path with deltasync's own code (run by hand; asserts nothing but its own
bit-exactness and the proof's verdicts): the patch map's build, an engine's first sync from a ``raw`` anchor, and
steady ``packed`` deltas at ~2.5% changed elements, each part next to its memory floor measured in the same process
(the GPU counterpart of ``benchmarks/bench_map.py`` and ``benchmarks/bench_apply.py``).

The GPU machines this runs on have torch but no vLLM (and nothing can be installed there but carried wheels:
zstandard), so the engine's own methods (``deltasync.vllm.proof``, which imports vLLM) cannot run there. This
script calls what they call, in their order, on a stand-in of vLLM's model (:class:`FusedLM`: Qwen3's or Llama's
parameters fused as vLLM fuses them at TP=1, q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, loaded
by the same rule as vLLM's ``stacked_params_mapping``):

* **map build**: :func:`deltasync.vllm.patch_map.build_map` over the stand-in's ``load_weights``; floor: one clone
  of the model, a parameter at a time;
* **first sync** (an anchor): ``read`` (:func:`~deltasync.format.decode_shard` of the shard's bytes), ``plan``
  (:meth:`PatchMap.plan`: the values copied to the device), ``prove`` (the staged values against the published
  checksums), ``pause`` (the writes), ``audit`` (:meth:`PatchMap.check_written`); floor: one host-to-device copy
  of the model's bytes from pinned memory;
* **steady deltas**: ``read`` (the decode against the live values, read from the device at the changed elements
  through :meth:`PatchMap.gather`), ``plan``, ``prove`` (:class:`~deltasync.sketch.ChangeProof` over every
  tensor), ``pause`` and ``audit``; floors: ``index_copy_`` of the changed elements on the device (what the pause
  must do) and one host-to-device copy of their indices and values (what the plan must move).

Every step checks the live parameters bit for bit against the trainer's weights, and each delta's proof is also
run once more with one value forged (it must fail). ``--device cpu --quick`` runs tiny shapes anywhere (CI runs it
so that it cannot rot). Ends with one JSON line.

    python benchmarks/gpu/bench_engine.py [--device cuda] [--cases 0.6B 70B-2 70B-4] [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # deltasync from this checkout

from deltasync._cpus import format_cpu_list, parallel_map, work_cpus  # noqa: E402
from deltasync._kernels import warm  # noqa: E402
from deltasync.format import TensorDelta, decode_shard, encode_shard, tensor_checksum  # noqa: E402
from deltasync.sketch import ChangeProof, parse_sketch, tensor_sketch  # noqa: E402
from deltasync.vllm.patch_map import PatchMap, Runs, Scatter, build_map  # noqa: E402
from deltasync.vllm.served import ServedValues  # noqa: E402

QWEN3_0_6B = {"vocab": 151936, "hidden": 1024, "inter": 3072, "layers": 28, "heads": 16, "kv": 8, "head_dim": 128}
LLAMA3_70B = {"vocab": 32000, "hidden": 8192, "inter": 28672, "heads": 64, "kv": 8, "head_dim": 128}
CASES: dict[str, dict[str, Any]] = {
    "0.6B": {**QWEN3_0_6B, "qk_norm": True, "tied": True},
    "8B-2": {**QWEN3_0_6B, "hidden": 4096, "inter": 12288, "heads": 32, "layers": 2, "qk_norm": True},
    "70B-2": {**LLAMA3_70B, "layers": 2},  # vocabulary cut to 32000 as in benchmarks/bench_map.py
    "70B-4": {**LLAMA3_70B, "layers": 4},
    "1.7B": {**QWEN3_0_6B, "hidden": 2048, "inter": 6144, "qk_norm": True, "tied": True},
}
QUICK: dict[str, Any] = {
    "vocab": 512, "hidden": 128, "inter": 256, "layers": 3, "heads": 2, "kv": 1, "head_dim": 64, "qk_norm": True
}  # fmt: skip

_STACKED = (  # vLLM's stacked_params_mapping for Qwen3 and Llama: (fused parameter, checkpoint part, shard)
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def checkpoint_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes (a tied ``lm_head`` left out, as checkpoints do)."""
    h, inter, hd = c["hidden"], c["inter"], c["head_dim"]
    q, kv = c["heads"] * hd, c["kv"] * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab"], h)}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if c.get("qk_norm"):
            out |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    out["model.norm.weight"] = (h,)
    if not c.get("tied"):
        out["lm_head.weight"] = (c["vocab"], h)
    return out


class FusedLM(torch.nn.Module):
    """A stand-in of vLLM's Qwen3 / Llama model at TP=1: its parameter names, its fused ``qkv_proj`` and
    ``gate_up_proj`` (q, k, v and gate, up stacked by rows), a tied ``lm_head`` sharing the embedding, random bf16
    weights, and ``load_weights`` with vLLM's rule: a stacked part is copied into its rows of the fused parameter
    (shapes checked, as vLLM's ``weight_loader`` asserts), anything else into the parameter of its own name."""

    def __init__(self, c: dict[str, Any], device: torch.device, seed: int = 0) -> None:
        super().__init__()
        h, inter, hd = c["hidden"], c["inter"], c["head_dim"]
        q, kv = c["heads"] * hd, c["kv"] * hd
        self.rows: dict[str | int, tuple[int, int]] = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        self.rows |= {0: (0, inter), 1: (inter, inter)}
        gen = torch.Generator(device=device).manual_seed(seed)

        def leaf(*shape: int) -> torch.nn.Module:
            m = torch.nn.Module()
            w = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
            m.weight = torch.nn.Parameter(w, requires_grad=False)
            return m

        model = torch.nn.Module()
        model.embed_tokens = leaf(c["vocab"], h)
        layers = torch.nn.ModuleList()
        for _ in range(c["layers"]):
            layer = torch.nn.Module()
            attn, mlp = torch.nn.Module(), torch.nn.Module()
            attn.qkv_proj, attn.o_proj = leaf(q + 2 * kv, h), leaf(h, q)
            if c.get("qk_norm"):
                attn.q_norm, attn.k_norm = leaf(hd), leaf(hd)
            mlp.gate_up_proj, mlp.down_proj = leaf(2 * inter, h), leaf(h, inter)
            layer.self_attn, layer.mlp = attn, mlp
            layer.input_layernorm, layer.post_attention_layernorm = leaf(h), leaf(h)
            layers.append(layer)
        model.layers = layers
        model.norm = leaf(h)
        self.model = model
        if c.get("tied"):
            self.lm_head = torch.nn.Module()
            self.lm_head.weight = model.embed_tokens.weight  # one parameter under two names, as vLLM ties them
        else:
            self.lm_head = leaf(c["vocab"], h)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())  # looked up at each call, as vLLM does
        loaded: set[str] = set()
        with torch.no_grad():
            for name, w in weights:
                for fused, part, shard in _STACKED:
                    if part in name:
                        target = name.replace(part, fused)
                        start, rows = self.rows[shard]
                        dst = params[target].data.narrow(0, start, rows)
                        break
                else:
                    target, dst = name, params[name].data
                if tuple(dst.shape) != tuple(w.shape):
                    raise ValueError(f"{name}: loaded {tuple(w.shape)} into {tuple(dst.shape)}")
                dst.copy_(w)
                loaded.add(target)
        return loaded


def layout_map(model: FusedLM, shapes: dict[str, tuple[int, ...]]) -> PatchMap:
    """The map :func:`build_map` should find, written down from the stand-in's layout: the fallback that keeps the
    rest of a run going (and says so) where the build fails on a device."""
    params = dict(model.named_parameters(remove_duplicate=False))
    runs = {}
    for name, shape in shapes.items():
        param, row = name, 0
        for fused, part, shard in _STACKED:
            if part in name:
                param, row = name.replace(part, fused), model.rows[shard][0]
                break
        cols, numel = (shape[1] if len(shape) > 1 else 1), torch.Size(shape).numel()
        runs[name] = [Runs(param, torch.tensor([0]), torch.tensor([row * cols]), torch.tensor([numel]))]
    return PatchMap(runs, {}, params, 0.0)


@contextlib.contextmanager
def timed(device: torch.device, into: dict[str, Any], key: str) -> Iterator[None]:
    """Seconds of the block into ``into[key]``, the device's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    into[key] = time.perf_counter() - t0


def pinned_bytes(n: int, device: torch.device) -> torch.Tensor:
    """``n`` bytes of page-locked host memory for copies to ``device`` (pageable where pinning fails)."""
    try:
        return torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    except RuntimeError:
        return torch.empty(n, dtype=torch.uint8)


def served_weights(pm: PatchMap, shapes: dict[str, tuple[int, ...]], device: torch.device) -> dict[str, torch.Tensor]:
    """What the engine serves, in checkpoint names, read through the map (which reads to the host), on ``device``
    (the trainer's copy)."""
    out = {}
    for name, shape in shapes.items():
        flat = pm.read_whole(name)
        assert flat is not None, name
        out[name] = flat.reshape(shape).to(device)
    return out


def trainer_step(weights: dict[str, torch.Tensor], fraction: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The next version: ~``fraction`` of the elements moved by one or two units in the last place, up or down
    (what a small learning rate does to bf16 weights), on the device."""
    out = {}
    for name, t in weights.items():
        bits = t.view(torch.int16)
        flip = torch.rand(t.shape, generator=gen, device=t.device) < fraction
        step = torch.randint(-2, 3, t.shape, generator=gen, device=t.device, dtype=torch.int16)
        step = torch.where(step == 0, torch.ones_like(step), step)
        magnitude = (bits & 0x7FFF) + step  # the sign kept; finite and nonzero (never NaN, which is refused)
        moved = (bits & -0x8000) | magnitude.clamp(1, 0x7F7F)
        out[name] = torch.where(flip, moved, bits).view(torch.bfloat16)
    return out


def publish_delta(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], version: int
) -> tuple[bytes, dict[str, str], int, dict[str, torch.Tensor]]:
    """What the publisher writes for ``old -> new``: one ``packed`` shard, the published sketches, the changed
    elements, and the new weights on the host. The diff runs on the device (a trainer's weights live there); the
    encoding on the host."""
    deltas, sketches, nnz, hosts = [], {}, 0, {}
    for name, t in new.items():
        idx = torch.nonzero(old[name].reshape(-1).view(torch.int16) != t.reshape(-1).view(torch.int16)).squeeze(1)
        host = hosts[name] = t.cpu()
        sketches[name] = tensor_sketch(host)
        if idx.numel() == 0:
            continue
        nnz += idx.numel()
        deltas.append(
            TensorDelta(
                ckpt_name=name,
                shape=tuple(t.shape),
                dtype=t.dtype,
                indices=idx.cpu(),
                values=t.reshape(-1)[idx].cpu(),
                base_values=old[name].reshape(-1)[idx].cpu(),
                checksum=tensor_checksum(host),
            )
        )
    blob = encode_shard(deltas, kind="delta", encoding="packed", target_version=version, base_version=version - 1)
    return blob, sketches, nnz, hosts


def exact(pm: PatchMap, weights: dict[str, torch.Tensor]) -> bool:
    """Whether every checkpoint tensor reads back from the live parameters bit for bit as ``weights`` (compared on
    the host, where :meth:`PatchMap.read_whole` reads)."""
    for name, t in weights.items():
        flat = pm.read_whole(name)
        if flat is None or not torch.equal(flat.view(torch.int16), t.reshape(-1).cpu().view(torch.int16)):
            return False
    return True


def prove(
    decoded: dict[str, TensorDelta],
    served: ServedValues,
    pm: PatchMap,
    served_sketch: dict[str, str],
    published: dict[str, str],
    forge: str | None = None,
    reread: list[str] | None = None,
) -> bool:
    """The engine's proof before the pause (:func:`deltasync.vllm.proof.prove_update` for sparse changes to tensors held whole): the
    old values the decoder read at the changed elements (or read again through the map), every tensor's change
    added to one :class:`ChangeProof`, on the decoder's threads. ``forge``: a tensor whose first new value is
    flipped in the proof's copy (the proof must then fail)."""
    proof = ChangeProof()
    for name in decoded:
        proof.expect(name, parse_sketch(served_sketch[name]), parse_sketch(published[name]))

    def add(name: str) -> None:
        d = decoded[name]
        assert d.indices is not None
        parts = served.served.get(name)
        same = parts is not None and len(parts) == 1 and parts[0][0].data_ptr() == d.indices.data_ptr()
        if same and parts is not None:
            old = parts[0][1]
        else:
            old = pm.gather(name, d.indices)
            if reread is not None:
                reread.append(name)
        new = d.values.reshape(-1).to(old.dtype)
        if name == forge:
            new = new.clone()
            new.view(torch.int16)[0] ^= 1
        proof.add(name, new, old, d.indices, increasing=True)

    names = list(decoded)
    parallel_map(add, names, sum(decoded[n].nnz for n in names), cost=lambda n: decoded[n].nnz)
    return proof.holds()


def run_case(
    name: str, c: dict[str, Any], device: torch.device, steps: int, fraction: float, out: dict[str, Any]
) -> None:
    """Fills ``out`` as it goes (what was measured stands if a later step fails)."""
    shapes = checkpoint_shapes(c)
    spec = {n: ("BF16", s) for n, s in shapes.items()}
    model = FusedLM(c, device)
    params = dict(model.named_parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in params.values())
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    out |= {"case": name, "device": str(device), "elements": numel, "model_gb": model_bytes / 1e9}

    try:
        profile = cProfile.Profile() if os.environ.get("DELTASYNC_BENCH_PROFILE") == "1" else None
        with timed(device, out, "map_s"):
            if profile is not None:
                profile.enable()
            pm = build_map(model, spec, model.load_weights)
            if profile is not None:
                profile.disable()
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)
            if os.environ.get("DELTASYNC_BENCH_PROFILE_CALLERS"):
                pstats.Stats(profile).print_callers(os.environ["DELTASYNC_BENCH_PROFILE_CALLERS"])
        out["map_layers"], out["unmapped"] = dict(getattr(pm, "layers", {})), sorted(pm.unmapped)
    except Exception as exc:  # noqa: BLE001 - a finding: said, and the rest measured through the written-down map
        traceback.print_exc()
        out["map_error"], out["map_s"], out["map_layers"] = f"{type(exc).__name__}: {exc}", float("nan"), {}
        pm = layout_map(model, shapes)
    with timed(device, out, "floor_clone_s"):
        for p in params.values():
            p.data.clone()
    print(f"{name}: map {out['map_s']:.2f} s ({out['map_layers']}), whole-model clone {out['floor_clone_s']:.3f} s")
    if steps < 0:  # the map alone
        return

    weights = served_weights(pm, shapes, device)  # the trainer's copy
    sketches = {n: tensor_sketch(t.cpu()) for n, t in weights.items()}

    # first sync: an engine holding other weights (here: zeros) takes an anchor of the current version
    host = {n: t.cpu() for n, t in weights.items()}
    anchor = encode_shard(
        [
            TensorDelta(ckpt_name=n, shape=tuple(t.shape), dtype=t.dtype, indices=None, values=t, checksum=c_)
            for n, t in host.items()
            for c_ in [tensor_checksum(t)]
        ],
        kind="anchor",
        encoding="raw",
        target_version=0,
    )
    checksums = {n: tensor_checksum(t) for n, t in host.items()}
    for p in params.values():
        p.data.zero_()
    buf = bytearray(anchor)  # a staged file's bytes, read once (the engine maps the file)
    del anchor
    first: dict[str, Any] = {}
    with timed(device, first, "read_s"):
        _, dense = decode_shard(buf, name="anchor")
    with timed(device, first, "plan_s"):
        ops = pm.plan(dense.values())
    with timed(device, first, "prove_s"):
        ok = all(tensor_checksum(d.values.reshape(-1)) == checksums[n] for n, d in dense.items())
    with timed(device, first, "pause_s"):
        pm.write(ops, threads=False)
    with timed(device, first, "audit_s"):
        bad = pm.check_written(ops)
    first["proof_holds"], first["audit_ok"], first["bit_exact"] = ok, not bad, exact(pm, weights)
    pinned = pinned_bytes(model_bytes, device)
    target = torch.empty(model_bytes, dtype=torch.uint8, device=device)
    with timed(device, first, "floor_h2d_s"):
        target.copy_(pinned, non_blocking=True)
    del pinned, target, buf, dense, ops
    out["first_sync"] = first
    print(
        f"{name}: first sync read {first['read_s']:.3f} plan {first['plan_s']:.3f} prove {first['prove_s']:.3f} "
        f"pause {first['pause_s']:.3f} audit {first['audit_s']:.3f} s (H2D floor {first['floor_h2d_s']:.3f} s); "
        f"exact {first['bit_exact']}"
    )

    def live(name: str, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return pm.gather(name, indices)  # the engine's _served_values, in place

    gen = torch.Generator(device=device).manual_seed(1)
    steady: list[dict[str, Any]] = []
    out["steps"] = steady
    for version in range(1, steps + 1):
        new = trainer_step(weights, fraction, gen)
        blob, published, nnz, new_host = publish_delta(weights, new, version)
        buf = bytearray(blob)
        del blob
        step: dict[str, Any] = {"version": version, "changed": nnz, "shard_mb": len(buf) / 1e6}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        served = ServedValues(live)
        with timed(device, step, "read_s"):
            _, decoded = decode_shard(buf, name=f"v{version}", base=served)
        with timed(device, step, "plan_s"):
            ops = pm.plan(decoded.values())
        reread: list[str] = []
        with timed(device, step, "prove_s"):
            holds = prove(decoded, served, pm, sketches, published, reread=reread)
        step["prove_reread"] = len(reread)
        with timed(device, step, "read_host_base_s"):  # the same decode against a host copy: no device reads
            decode_shard(buf, name=f"v{version}", base=host)
        forged = next(iter(decoded))
        step["forgery_caught"] = not prove(decoded, served, pm, sketches, published, forge=forged)
        step["before_pause_s"] = step["read_s"] + step["plan_s"] + step["prove_s"]
        with timed(device, step, "pause_s"):
            pm.write(ops, threads=False)
        with timed(device, step, "audit_s"):
            bad = pm.check_written(ops)
        if device.type == "cuda":
            step["engine_extra_peak_mb"] = (torch.cuda.max_memory_allocated(device) - before) / 1e6
        step["decoded_mb"] = sum(d.values.numel() * (8 + d.values.element_size()) for d in decoded.values()) / 1e6
        step["proof_holds"], step["audit_ok"], step["bit_exact"] = holds, not bad, exact(pm, new)
        step["ns_per_changed"] = step["before_pause_s"] / max(nnz, 1) * 1e9
        # floors: the pause's scatter of the changed elements alone, and one copy of their indices and values in
        with timed(device, step, "floor_scatter_s"):
            for o in ops:
                if isinstance(o, Scatter):
                    pm.param(o.param).data.view(-1).index_copy_(0, o.index, o.values)
        staged = pinned_bytes(nnz * 10, device)
        on_device = torch.empty(nnz * 10, dtype=torch.uint8, device=device)
        with timed(device, step, "floor_h2d_s"):
            on_device.copy_(staged, non_blocking=True)
        del staged, on_device, ops, decoded, served, buf
        steady.append(step)
        weights, sketches, host = new, published, new_host
        print(
            f"{name}: v{version} {nnz / 1e6:.1f}M changed ({nnz / numel:.2%}): read {step['read_s'] * 1e3:.0f} "
            f"plan {step['plan_s'] * 1e3:.0f} prove {step['prove_s'] * 1e3:.0f} (re-read {step['prove_reread']}) ms = "
            f"before the pause "
            f"{step['before_pause_s'] * 1e3:.0f} ms ({step['ns_per_changed']:.1f} ns/changed; read against a host copy "
            f"{step['read_host_base_s'] * 1e3:.0f} ms); pause "
            f"{step['pause_s'] * 1e3:.1f} ms (scatter floor {step['floor_scatter_s'] * 1e3:.1f}), audit "
            f"{step['audit_s'] * 1e3:.1f} ms, H2D floor {step['floor_h2d_s'] * 1e3:.1f} ms; peak +"
            f"{step.get('engine_extra_peak_mb', float('nan')):.0f} MB (decoded {step['decoded_mb']:.0f} MB); "
            f"exact {step['bit_exact']}, proof {step['proof_holds']}, forgery caught {step['forgery_caught']}",
            flush=True,
        )
    out["steps"] = steady


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", nargs="+", default=["0.6B", "70B-2", "70B-4"], choices=sorted(CASES))
    parser.add_argument("--steps", type=int, default=3, help="steady deltas per case (-1: the map build alone)")
    parser.add_argument("--fraction", type=float, default=0.025)
    parser.add_argument("--quick", action="store_true", help="tiny shapes only (the CI run of the CPU fallback)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cases = {"tiny": QUICK} if args.quick else {n: CASES[n] for n in args.cases}
    kernels = warm()  # compiled (or loaded from numba's cache) as the engine does at its start
    print(
        f"torch {torch.__version__}, device {device}, host cpus {format_cpu_list(work_cpus())}, compiled loops "
        f"{kernels}",
        flush=True,
    )
    results = []
    for name, config in cases.items():
        result: dict[str, Any] = {"case": name}
        results.append(result)
        try:
            run_case(name, config, device, args.steps, args.fraction, result)
        except Exception as exc:  # noqa: BLE001 - one device run: the other cases still report
            traceback.print_exc()
            result["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(result), flush=True)  # each case as it ends (a run cut short keeps the others)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({"torch": torch.__version__, "cpus": os.cpu_count(), "results": results}))
    return results


if __name__ == "__main__":
    main()
