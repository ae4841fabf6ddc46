"""Helpers for the integration tests: expected effective weights of Qwen3, and publishing a stream."""

from __future__ import annotations

import torch

from deltasync import LocalStore, compute_delta, tensor_checksum, write_anchor, write_delta
from deltasync.client import CoordinatorClient
from deltasync.manifest import DeltaManifest
from deltasync.protocol import VersionCreate
from deltasync.testing import UpdateStream


def qwen3_effective(w: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """What vLLM's Qwen3 at TP=1 holds, by module/parameter name, for checkpoint weights ``w``."""
    out = {"model.embed_tokens.weight": w["model.embed_tokens.weight"], "model.norm.weight": w["model.norm.weight"]}
    out["lm_head"] = out["lm_head.weight"] = w["model.embed_tokens.weight"]  # tied
    for i in range(num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj"] = torch.cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[p + "self_attn.o_proj"] = w[p + "self_attn.o_proj.weight"]
        out[p + "mlp.gate_up_proj"] = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        out[p + "mlp.down_proj"] = w[p + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            out[p + norm + ".weight"] = w[p + norm + ".weight"]
    return out


def effective_checksums(w: dict[str, torch.Tensor], num_layers: int) -> dict[str, str]:
    return {k: tensor_checksum(v) for k, v in qwen3_effective(w, num_layers).items()}


class StreamPublisher:
    """Publishes a realistic update stream to a store and registers it (the test stand-in for a trainer)."""

    def __init__(
        self,
        store: LocalStore,
        client: CoordinatorClient,
        weights: dict[str, torch.Tensor],
        *,
        lr: float = 1e-6,
        encoding: str = "packed",
        seed: int = 0,
    ) -> None:
        self.store, self.client, self.encoding = store, client, encoding
        self.stream = UpdateStream(weights, lr=lr, seed=seed)
        self.snapshot = {k: v.clone() for k, v in weights.items()}
        self.truth: dict[int, dict[str, torch.Tensor]] = {0: {k: v.clone() for k, v in weights.items()}}
        self.base: DeltaManifest = write_anchor(store, weights, version=0, encoding=encoding)
        self._register(self.base)
        self.version = 0

    def _register(self, manifest: DeltaManifest) -> None:
        self.client.register_version(VersionCreate.for_manifest(manifest))

    def step(self, *, anchor: bool = False) -> int:
        curr = self.stream.step()
        self.version += 1
        changes = compute_delta(self.snapshot, curr, update_prev=True)
        self.base = write_delta(
            self.store, changes, state=curr, version=self.version, base=self.base, encoding=self.encoding
        )  # type: ignore[arg-type]
        self._register(self.base)
        if anchor:
            self._register(write_anchor(self.store, curr, version=self.version, encoding=self.encoding))  # type: ignore[arg-type]
        self.truth[self.version] = curr
        return self.version
