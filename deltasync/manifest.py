"""The manifest of one published object (a delta or an anchor): its shards and tensors, as JSON.

A manifest is written last, after every shard: its presence is the commit marker of a version. It names
the model it belongs to (a fingerprint over every tensor's name, dtype and shape, plus an optional model id)
and the run that published it, so a receiver can refuse another model's or another run's object before
reading a shard.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import FormatError, UnsupportedFormatVersion
from .sketch import SKETCH_PREFIX, parse_sketch
from .vocab import (
    CHECKPOINT_NAME,
    DTYPES,
    ENCODINGS,
    FORMAT_VERSION,
    KINDS,
    MAX_INT,
    MAX_TENSOR_NUMEL,
    MAX_VERSION,
    Encoding,
    Kind,
)

__all__ = [
    "MAX_MANIFEST_BYTES",
    "AdapterEntry",
    "DeltaManifest",
    "ModelSpec",
    "ShardEntry",
    "TensorEntry",
    "content_fingerprint",
    "describe_spec_difference",
    "model_fingerprint",
]

MAX_MANIFEST_BYTES = 16 * 1024 * 1024
"""Readers refuse larger manifests (about 100k tensors fit in 16 MiB), checked before reading."""

ModelSpec = Mapping[str, tuple[str, tuple[int, ...]]]
"""A model as deltasync sees it: checkpoint name -> (safetensors dtype name, full shape)."""

_SHARD_FILE = re.compile(r"shard-\d{5}\.safetensors")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHECKSUM = re.compile(r"xxh3_128:[0-9a-f]{32}")
_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MODEL_ID_MAX = 256
_KEYS_1_0 = {"format_version", "kind", "version", "base_version", "encoding", "shards", "tensors"}
_KEYS_1_1 = _KEYS_1_0 | {"model_fingerprint", "model_id", "run_id"}
_KEYS_1_3 = _KEYS_1_1 | {"lease_epoch"}
_KEYS_1_4 = _KEYS_1_3 | {"adapter"}
_ADAPTER_KEYS_1_4 = {"peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "base_fingerprint"}
_ADAPTER_KEYS_1_5 = _ADAPTER_KEYS_1_4 | {"base_content"}
_TARGET_MODULE = re.compile(r"[A-Za-z0-9_.]{1,128}")
_MAX_ADAPTER_RANK = 65536
_TENSOR_KEYS_1_0 = {"shape", "dtype", "nnz", "shards", "checksums"}
_TENSOR_KEYS_1_2 = _TENSOR_KEYS_1_0 | {"sketch"}


def model_fingerprint(spec: ModelSpec) -> str:
    """``sha256:`` over the sorted names, dtypes and shapes, one JSON line ``[name, dtype, shape]`` each (an
    unambiguous encoding, whatever the characters of a name): equal for every version of one model."""
    h = hashlib.sha256()
    for name in sorted(spec):
        dtype, shape = spec[name]
        h.update(json.dumps([name, dtype, list(shape)], separators=(",", ":")).encode() + b"\n")
    return "sha256:" + h.hexdigest()


def content_fingerprint(spec: ModelSpec, read: Callable[[str], memoryview]) -> str:
    """``sha256:`` over a model's weights: for each tensor of ``spec`` in name order, one JSON line ``[name, dtype,
    shape, nbytes]`` (as :func:`model_fingerprint` writes it, with the byte count) and then its ``nbytes`` raw bytes
    (``read(name)``: little-endian, C order, as safetensors stores them). Each tensor's bytes are framed by their
    count, so two models' digests are equal only when they hold the same tensors bit for bit."""
    h = hashlib.sha256()
    for name in sorted(spec):
        dtype, shape = spec[name]
        data = read(name).cast("B")
        h.update(json.dumps([name, dtype, list(shape), data.nbytes], separators=(",", ":")).encode() + b"\n")
        h.update(data)
    return "sha256:" + h.hexdigest()


def describe_spec_difference(expected: ModelSpec, found: ModelSpec, limit: int = 3) -> str:
    """A short human account of how two model specs differ (for refusal messages)."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    changed = sorted(
        n
        for n in set(expected) & set(found)
        if tuple(expected[n][1]) != tuple(found[n][1]) or expected[n][0] != found[n][0]
    )
    parts = []
    if changed:
        n = changed[0]
        parts.append(
            f"{len(changed)} tensors differ, e.g. {n!r} is {expected[n][0]} {list(expected[n][1])} here and "
            f"{found[n][0]} {list(found[n][1])} in the object"
        )
    if missing:
        parts.append(f"{len(missing)} tensors missing from the object, e.g. {missing[:limit]}")
    if extra:
        parts.append(f"{len(extra)} tensors unknown here, e.g. {extra[:limit]}")
    return "; ".join(parts) or "the specs are equal"


ChecksumPart = tuple[int, int, str]
"""``(start, stop, digest)``: the checksum of flat elements ``[start, stop)`` of a tensor."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardEntry:
    """One shard file of a published object."""

    file: str
    """File name, relative to the manifest's directory: ``shard-{i:05d}.safetensors``."""
    bytes: int
    """Exact size of the file."""
    sha256: str
    """Hex sha256 of the file."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorEntry:
    """One tensor of the model at the manifest's version."""

    shape: tuple[int, ...]
    """Full shape."""
    dtype: str
    """safetensors dtype name."""
    nnz: int
    """Elements this object stores for the tensor: changed ones in a delta (0 if unchanged),
    ``numel`` in an anchor."""
    shards: tuple[int, ...]
    """Indices into ``DeltaManifest.shards`` of the shards holding entries; empty if unchanged."""
    checksums: tuple[ChecksumPart, ...]
    """Checksums of the whole tensor at this version, part by part: contiguous, covering
    ``[0, numel)``. One part unless the tensor was published in spans (FSDP ranks)."""
    sketch: str | None = None
    """The ``wsum4`` sketch of the whole tensor at this version (:mod:`deltasync.sketch`): the sum of any
    partition's sketches, so a rank can prove whichever elements it holds. ``None`` only in manifests written
    before format 1.2."""

    @property
    def numel(self) -> int:
        """Number of elements of the full tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterEntry:
    """What a LoRA adapter's object is (since 1.4): its tensors are the adapter's own (PEFT names, as in
    ``adapter_model.safetensors``), for the base model :attr:`base_fingerprint` names. Two objects are versions of
    one adapter when these are equal; the engine refuses another base or another adapter before the first write."""

    r: int
    """The rank."""
    lora_alpha: float
    """The scaling numerator (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA)."""
    target_modules: tuple[str, ...]
    """The adapted modules' names (sorted), as in PEFT's ``target_modules``."""
    use_rslora: bool = False
    """rsLoRA scaling."""
    base_fingerprint: str
    """:func:`model_fingerprint` of the base model the adapter applies to (its checkpoint names, dtypes, shapes)."""
    peft_type: str = "LORA"
    """PEFT's adapter type; only ``LORA`` is published."""
    adapter_name: str | None = field(default=None, compare=False)
    """The adapter's name in the trainer's PEFT model (which of its adapters is published; ``None``: the active
    one). The publisher's own knowledge: never published, and no part of the adapter's identity."""
    base_content: str | None = field(default=None, compare=False)
    """:func:`content_fingerprint` of the base model's weights the adapter was trained on (since 1.5; ``None``:
    the publisher could not read them whole, e.g. an FSDP-sharded base, or an object written before 1.5). An engine
    that knows its own base's digest refuses an adapter whose digest differs: another base of the same shapes. No
    part of the adapter's identity (equality), which the engine's served directory cannot say."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "peft_type": self.peft_type,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
            "base_fingerprint": self.base_fingerprint,
        }

    def describe_difference(self, other: AdapterEntry) -> str:
        """How two adapters differ, field by field (for refusal messages); ``""`` when they are one adapter."""
        mine, theirs = self.to_dict(), other.to_dict()  # base_content is compared on its own, against the engine's
        return "; ".join(f"{k} {theirs[k]!r} here, {mine[k]!r} in the object" for k in mine if mine[k] != theirs[k])


@dataclass(frozen=True, kw_only=True)  # no slots: spec and model_fingerprint are cached per manifest
class DeltaManifest:
    """Index of one published object: a delta ``base_version -> version`` or an anchor."""

    kind: Kind
    """``delta`` or ``anchor``."""
    version: int
    """The version this object produces."""
    base_version: int | None
    """The version a delta applies to; ``None`` for an anchor."""
    encoding: Encoding
    """Encoding of every shard."""
    shards: tuple[ShardEntry, ...]
    """Shard files, in order."""
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    """Every tensor of the model at ``version``, changed or not, by checkpoint name."""
    model_id: str | None = None
    """An optional name of the model lineage (e.g. ``Qwen/Qwen3-0.6B``), checked when both sides set one."""
    run_id: str | None = None
    """The run that published the object: the coordinator ledger's identity, or the store's own run record
    without a coordinator (``None`` in objects written before 1.3 without a coordinator)."""
    lease_epoch: int | None = None
    """The epoch of the publisher lease its writer held (since 1.3; ``None`` without a coordinator). A reader
    refuses an object whose epoch a later publisher of the run fenced (see :mod:`deltasync.runrecord`)."""
    adapter: AdapterEntry | None = None
    """The LoRA adapter the tensors are (since 1.4); ``None``: a model's own weights."""
    format_version: str = FORMAT_VERSION
    """``major.minor`` of the format."""
    squash: bool = field(default=False, compare=False)
    """Where the object lies, not what it is (never in the JSON): ``True`` for a delta read from, or written to, a
    squash's keys (``v{version}/squash-{base_version}/``, see :func:`deltasync.layout.prefix_of`). A squash's bytes
    are a delta's; the signature and the ledger's digest vouch for them wherever they lie."""

    @property
    def total_bytes(self) -> int:
        """Bytes of all shard files."""
        return sum(s.bytes for s in self.shards)

    @property
    def nnz(self) -> int:
        """Stored elements over all tensors."""
        return sum(t.nnz for t in self.tensors.values())

    @property
    def numel(self) -> int:
        """Elements of the whole model."""
        return sum(t.numel for t in self.tensors.values())

    @functools.cached_property
    def spec(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The model this object belongs to: name -> (dtype, shape)."""
        return {n: (t.dtype, t.shape) for n, t in self.tensors.items()}

    @functools.cached_property
    def model_fingerprint(self) -> str:
        """:func:`model_fingerprint` of :attr:`spec`: equal for two versions of one model."""
        return model_fingerprint(self.spec)

    def to_json(self) -> bytes:
        """Deterministic JSON (sorted keys, one line per shard and per tensor), as in ``manifest.json``."""

        def dump(x: object) -> str:
            return json.dumps(x, sort_keys=True, separators=(", ", ": "))

        shards = ",\n".join(f"  {dump({'file': s.file, 'bytes': s.bytes, 'sha256': s.sha256})}" for s in self.shards)
        with_sketch = self.format_version not in ("1.0", "1.1")

        def tensor(t: TensorEntry) -> dict[str, Any]:
            out: dict[str, Any] = {
                "shape": list(t.shape),
                "dtype": t.dtype,
                "nnz": t.nnz,
                "shards": list(t.shards),
                "checksums": [list(p) for p in t.checksums],
            }
            if with_sketch:
                out["sketch"] = t.sketch  # None is refused by readers: every 1.2 writer sets it
            return out

        tensors = ",\n".join(f"  {dump(n)}: {dump(tensor(t))}" for n, t in sorted(self.tensors.items()))
        head: dict[str, Any] = {
            "format_version": self.format_version,
            "kind": self.kind,
            "version": self.version,
            "base_version": self.base_version,
            "encoding": self.encoding,
        }
        if self.format_version != "1.0":
            head.update(model_fingerprint=self.model_fingerprint, model_id=self.model_id, run_id=self.run_id)
        if self.format_version not in ("1.0", "1.1", "1.2"):
            head.update(lease_epoch=self.lease_epoch)
        if self.format_version not in ("1.0", "1.1", "1.2", "1.3"):
            head.update(adapter=None if self.adapter is None else self._adapter_dict())
        elif self.adapter is not None:
            raise ValueError(f"an adapter's manifest needs format 1.4 or later, not {self.format_version}")
        lines = [f" {dump(k)}: {dump(v)}," for k, v in sorted(head.items())]
        body = "\n".join(
            [
                "{",
                *lines,
                f' "shards": [\n{shards}\n ],' if shards else ' "shards": [],',
                f' "tensors": {{\n{tensors}\n }}' if tensors else ' "tensors": {}',
                "}",
            ]
        )
        return (body + "\n").encode()

    def _adapter_dict(self) -> dict[str, Any]:
        assert self.adapter is not None
        out = self.adapter.to_dict()
        if self.format_version != "1.4":
            out["base_content"] = self.adapter.base_content
        elif self.adapter.base_content is not None:
            raise ValueError(f"an adapter's base_content needs format 1.5 or later, not {self.format_version}")
        return out

    @classmethod
    def from_json(cls, data: bytes | str, *, name: str) -> DeltaManifest:
        """Parse and validate a manifest.

        Args:
            data: the JSON document.
            name: how to name the document in errors (a store key or path).

        Raises:
            FormatError: the manifest is too large, not JSON, or breaks a rule of docs/FORMAT.md
                (the message names the field).
            UnsupportedFormatVersion: the major format version is unknown.
        """
        raw_bytes = data.encode() if isinstance(data, str) else bytes(data)
        if len(raw_bytes) > MAX_MANIFEST_BYTES:
            raise FormatError(f"{name}: manifest is {len(raw_bytes)} bytes, more than the cap of {MAX_MANIFEST_BYTES}")
        try:
            obj = json.loads(raw_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise FormatError(f"{name}: manifest is not valid JSON ({exc})") from None
        return _parse_manifest(obj, name)


class _Check:
    """Field validation that names the document and the field in every error."""

    def __init__(self, name: str) -> None:
        self.name = name

    def fail(self, where: str, what: str) -> FormatError:
        return FormatError(f"{self.name}: {where} {what}")

    def keys(self, where: str, obj: object, keys: set[str], *, extra_ok: bool = False) -> dict[str, Any]:
        if not isinstance(obj, dict):
            raise self.fail(where, f"must be a JSON object, found {type(obj).__name__}")
        if not keys <= set(obj) or (set(obj) != keys and not extra_ok):
            raise self.fail(where, f"must have exactly the keys {sorted(keys)}, found {sorted(obj)}")
        return obj

    def int_in(self, where: str, x: object, lo: int, hi: int) -> int:
        if type(x) is not int or not lo <= x <= hi:
            raise self.fail(where, f"must be an int in [{lo}, {hi}], found {x!r}")
        return x


def _parse_manifest(obj: object, name: str) -> DeltaManifest:
    c = _Check(name)
    fmt = obj.get("format_version") if isinstance(obj, dict) else None
    if not isinstance(fmt, str) or not re.fullmatch(r"\d{1,6}\.\d{1,6}", fmt):
        c.keys("manifest", obj, _KEYS_1_0, extra_ok=True)  # a clear error for non-objects and missing keys
        raise c.fail("format_version", f"must be 'major.minor', found {fmt!r}")
    major, minor = (int(x) for x in fmt.split("."))
    ours_major, ours_minor = (int(x) for x in FORMAT_VERSION.split("."))
    if major != ours_major:
        raise UnsupportedFormatVersion(
            f"{name}: format_version {fmt} is not supported; this reader knows {ours_major}.x (upgrade deltasync)"
        )
    # a newer minor version may only add keys (at any level): accept and ignore them
    newer = minor > ours_minor
    keys = _KEYS_1_0 if minor == 0 else _KEYS_1_1 if minor < 3 else _KEYS_1_3 if minor == 3 else _KEYS_1_4
    top = c.keys("manifest", obj, keys, extra_ok=newer)
    kind, encoding = top["kind"], top["encoding"]
    if kind not in KINDS:
        raise c.fail("kind", f"must be one of {list(KINDS)}, found {kind!r}")
    if encoding not in ENCODINGS:
        raise c.fail("encoding", f"must be one of {list(ENCODINGS)}, found {encoding!r}")
    version = c.int_in("version", top["version"], 0, MAX_VERSION)
    base = top["base_version"]
    if kind == "anchor" and base is not None:
        raise c.fail("base_version", f"must be null for an anchor, found {base!r}")
    if kind == "delta":
        if version == 0:
            raise c.fail("version", "of a delta must be > 0, found 0")
        base = c.int_in("base_version", base, 0, version - 1)
    if not isinstance(top["shards"], list):
        raise c.fail("shards", f"must be a list, found {type(top['shards']).__name__}")
    shards = []
    for i, s in enumerate(top["shards"]):
        s = c.keys(f"shards[{i}]", s, {"file", "bytes", "sha256"}, extra_ok=newer)
        if not isinstance(s["file"], str) or not _SHARD_FILE.fullmatch(s["file"]):
            raise c.fail(f"shards[{i}].file", f"must match shard-NNNNN.safetensors, found {s['file']!r}")
        if not isinstance(s["sha256"], str) or not _SHA256.fullmatch(s["sha256"]):
            raise c.fail(f"shards[{i}].sha256", f"must be 64 lowercase hex digits, found {s['sha256']!r}")
        shards.append(
            ShardEntry(file=s["file"], bytes=c.int_in(f"shards[{i}].bytes", s["bytes"], 0, MAX_INT), sha256=s["sha256"])
        )
    if len({s.file for s in shards}) != len(shards):
        raise c.fail("shards", "must name each file once")
    if not isinstance(top["tensors"], dict):
        raise c.fail("tensors", f"must be an object, found {type(top['tensors']).__name__}")
    for t in top["tensors"]:
        if not CHECKPOINT_NAME.fullmatch(t):
            raise c.fail("tensors", f"name {t[:80]!r} must have 1 to 1024 characters, no ':' and no control characters")
    tensor_keys = _TENSOR_KEYS_1_0 if minor < 2 else _TENSOR_KEYS_1_2
    tensors = {t: _parse_tensor(c, t, raw, kind, len(shards), tensor_keys, newer) for t, raw in top["tensors"].items()}
    model_id = run_id = None
    if minor >= 1:
        model_id, run_id = top["model_id"], top["run_id"]
        if model_id is not None and (not isinstance(model_id, str) or not 0 < len(model_id) <= _MODEL_ID_MAX):
            raise c.fail("model_id", f"must be null or a string of 1 to {_MODEL_ID_MAX} characters, found {model_id!r}")
        if run_id is not None and (not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id)):
            raise c.fail("run_id", f"must be null or a run identity like 'run-2f1c...', found {run_id!r}")
    lease_epoch = None
    if minor >= 3 and top["lease_epoch"] is not None:
        lease_epoch = c.int_in("lease_epoch", top["lease_epoch"], 1, MAX_INT)
    adapter = None
    if minor >= 4 and top["adapter"] is not None:
        adapter = _parse_adapter(c, top["adapter"], _ADAPTER_KEYS_1_4 if minor == 4 else _ADAPTER_KEYS_1_5, newer)
    manifest = DeltaManifest(
        kind=kind,
        version=version,
        base_version=base,
        encoding=encoding,
        shards=tuple(shards),
        tensors=tensors,
        model_id=model_id,
        run_id=run_id,
        lease_epoch=lease_epoch,
        adapter=adapter,
        format_version=fmt,
    )
    if minor >= 1:
        declared = top["model_fingerprint"]
        if not isinstance(declared, str) or not _FINGERPRINT.fullmatch(declared):
            raise c.fail("model_fingerprint", f"must be 'sha256:' and 64 hex digits, found {declared!r}")
        if declared != manifest.model_fingerprint:
            raise c.fail(
                "model_fingerprint",
                f"is {declared} but the tensors listed give {manifest.model_fingerprint}; the manifest is corrupt",
            )
    return manifest


def _parse_adapter(c: _Check, raw: object, keys: set[str], newer: bool) -> AdapterEntry:
    a = c.keys("adapter", raw, keys, extra_ok=newer)
    if a["peft_type"] != "LORA":
        raise c.fail("adapter.peft_type", f"must be 'LORA', found {a['peft_type']!r}")
    r = c.int_in("adapter.r", a["r"], 1, _MAX_ADAPTER_RANK)
    alpha = a["lora_alpha"]
    try:
        finite = type(alpha) in (int, float) and math.isfinite(float(alpha)) and alpha > 0
    except OverflowError:  # an int beyond any float
        finite = False
    if not finite:
        raise c.fail("adapter.lora_alpha", f"must be a finite number > 0, found {str(alpha)[:40]!r}")
    targets = a["target_modules"]
    if (
        not isinstance(targets, list)
        or not 0 < len(targets) <= 1024
        or not all(isinstance(t, str) and _TARGET_MODULE.fullmatch(t) for t in targets)
        or targets != sorted(set(targets))
    ):
        raise c.fail("adapter.target_modules", f"must be a sorted list of unique module names, found {targets!r}")
    if type(a["use_rslora"]) is not bool:
        raise c.fail("adapter.use_rslora", f"must be true or false, found {a['use_rslora']!r}")
    base = a["base_fingerprint"]
    if not isinstance(base, str) or not _FINGERPRINT.fullmatch(base):
        raise c.fail("adapter.base_fingerprint", f"must be 'sha256:' and 64 hex digits, found {base!r}")
    content = a.get("base_content")  # since 1.5
    if content is not None and (not isinstance(content, str) or not _FINGERPRINT.fullmatch(content)):
        raise c.fail("adapter.base_content", f"must be null or 'sha256:' and 64 hex digits, found {content!r}")
    return AdapterEntry(
        r=r,
        lora_alpha=alpha,
        target_modules=tuple(targets),
        use_rslora=a["use_rslora"],
        base_fingerprint=base,
        base_content=content,
    )


def _parse_tensor(c: _Check, t: str, raw: object, kind: str, n_shards: int, keys: set[str], newer: bool) -> TensorEntry:
    where = f"tensors[{t!r}]"
    e = c.keys(where, raw, keys, extra_ok=newer)
    shape = e["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > 16
        or not all(type(d) is int and 0 <= d <= MAX_TENSOR_NUMEL for d in shape)
    ):
        raise c.fail(f"{where}.shape", f"must be a list of at most 16 non-negative ints, found {shape!r}")
    numel = math.prod(shape)
    if numel > MAX_TENSOR_NUMEL:
        raise c.fail(f"{where}.shape", f"has {numel} elements, more than the cap of {MAX_TENSOR_NUMEL}")
    if not isinstance(e["dtype"], str) or e["dtype"] not in DTYPES:
        raise c.fail(f"{where}.dtype", f"must be one of {sorted(DTYPES)}, found {e['dtype']!r}")
    nnz = c.int_in(f"{where}.nnz", e["nnz"], numel if kind == "anchor" else 0, numel)
    idx = e["shards"]
    if (
        not isinstance(idx, list)
        or not all(type(i) is int and 0 <= i < n_shards for i in idx)
        or idx != sorted(set(idx))
    ):
        raise c.fail(f"{where}.shards", f"must be sorted unique indices below {n_shards}, found {idx!r}")
    if bool(idx) != (nnz > 0 or (kind == "anchor" and numel == 0)):
        raise c.fail(f"{where}.shards", f"must be non-empty exactly when nnz > 0 (nnz={nnz}, shards={idx})")
    parts = e["checksums"]
    if not isinstance(parts, list) or not parts:
        raise c.fail(f"{where}.checksums", f"must be a non-empty list of [start, stop, digest], found {parts!r}")
    pos = 0
    for k, p in enumerate(parts):
        if (
            not isinstance(p, list)
            or len(p) != 3
            or type(p[0]) is not int
            or type(p[1]) is not int
            or not isinstance(p[2], str)
            or not _CHECKSUM.fullmatch(p[2])
            or p[0] != pos
            or p[1] < p[0]
        ):
            raise c.fail(f"{where}.checksums[{k}]", f"must be [{pos}, stop >= {pos}, 'xxh3_128:<32 hex>'], found {p!r}")
        pos = p[1]
    if pos != numel:
        raise c.fail(f"{where}.checksums", f"must cover [0, {numel}), they end at {pos}")
    sketch = None
    if "sketch" in keys:  # since 1.2
        sketch = e["sketch"]
        try:
            parse_sketch(sketch)
        except ValueError:
            raise c.fail(
                f"{where}.sketch", f"must be {SKETCH_PREFIX!r} and 64 lowercase hex digits, found {sketch!r}"
            ) from None
    return TensorEntry(
        shape=tuple(shape),
        dtype=e["dtype"],
        nnz=nnz,
        shards=tuple(idx),
        checksums=tuple((p[0], p[1], p[2]) for p in parts),
        sketch=sketch,
    )
