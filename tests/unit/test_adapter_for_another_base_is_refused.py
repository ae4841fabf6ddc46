"""An adapter trained on another base of the same names and shapes is refused where both sides know the base's
weights: the manifest's ``adapter.base_content`` (format 1.5) is the digest of the trainer's base weights, the
engine computes the same digest of the checkpoint it serves, and the one apply rule refuses an adapter whose
digest differs before anything is written. An adapter without the digest (a 1.4 object, a sharded base) and an
engine that cannot tell (no checkpoint: a dummy load) keep the names-and-shapes check alone."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import AdapterEntry, DeltaManifest, Publisher, UpdateRefused, read_weights
from deltasync.apply import Step, TensorsReceiver, admit, apply_update
from deltasync.errors import FormatError, RefusalReason
from deltasync.lora import adapter_entry
from deltasync.manifest import model_fingerprint
from deltasync.reader import load_object, read_manifest
from deltasync.store import LocalStore
from deltasync.targets.base import combine_ranks
from deltasync.testing.models import build_tiny_model, peft_model, write_config_only_model
from deltasync.vllm.shadow import Shadow

pytest.importorskip("peft")

GOLDEN = Path(__file__).parents[1] / "data" / "golden"


def _documented_digest(model_dir: Path) -> str:
    """``base_content`` as docs/FORMAT.md defines it, read straight from a one-file safetensors checkpoint: per
    tensor in name order, ``["name","BF16",[d0,d1],nbytes]`` and a newline, then its raw bytes."""
    buf = (model_dir / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8 : 8 + n])
    header.pop("__metadata__", None)
    data = buf[8 + n :]
    h = hashlib.sha256()
    for name in sorted(header):
        info = header[name]
        start, stop = info["data_offsets"]
        h.update(json.dumps([name, info["dtype"], info["shape"], stop - start], separators=(",", ":")).encode())
        h.update(b"\n" + data[start:stop])
    return "sha256:" + h.hexdigest()


def _peft(model_dir: Path, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft_model(model_dir, seed=5, rank=4, **kw)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two bases of one architecture (same names, dtypes and shapes), other random weights."""
    root = tmp_path_factory.mktemp("bases")
    return build_tiny_model(root / "served", seed=0), build_tiny_model(root / "other", seed=1)


@pytest.fixture(scope="module")
def published(bases: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, LocalStore]:
    """One anchor of one adapter configuration trained on each base, each in a store of its own."""
    stores = {}
    for key, base in zip(("served", "other"), bases, strict=True):
        model = _peft(base)
        stores[key] = LocalStore(tmp_path_factory.mktemp(f"{key}-adapter"))
        with Publisher(stores[key], adapter=adapter_entry(model)) as pub:
            pub.publish(model)
    return stores


def _engine_status(base: Path, content: str | None) -> dict[str, Any]:
    """What a fresh lora-mode engine serving ``base`` reports (``deltasync_status``), its base's weights read."""
    fingerprint = model_fingerprint(Shadow(str(base)).spec())
    return {
        "healthy": True,
        "version": None,
        "adapter": {"dir": "/served", "base_fingerprint": fingerprint, "base_content": content, "served": None},
    }


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_publisher_and_the_engine_compute_the_documented_digest(arch: str, tmp_path: Path) -> None:
    """The trainer's PEFT model (its base loaded in bf16 or float32) and the engine's checkpoint give the digest
    docs/FORMAT.md defines, tied embeddings (qwen3) or an own lm_head (llama); no checkpoint: unknown."""
    base = build_tiny_model(tmp_path / arch, seed=3, arch=arch)
    want = _documented_digest(base)
    assert adapter_entry(_peft(base)).base_content == want
    assert adapter_entry(_peft(base, dtype=torch.float32)).base_content == want
    assert Shadow(str(base)).content() == want
    assert Shadow(str(write_config_only_model(tmp_path / "dummy"))).content() is None


def test_an_adapter_for_another_base_of_the_same_shapes_is_refused_before_any_write(
    bases: tuple[Path, Path], published: dict[str, LocalStore]
) -> None:
    """An engine serving one base, as its agent sees it: the adapter trained on the other base has the same
    manifest entry but for its base's digest, and is refused before the first write; the served base's is applied."""
    served, _ = bases
    content = _documented_digest(served)
    holding = combine_ranks([_engine_status(served, content)], label=None).holding()
    other = read_manifest(published["other"], 0, "anchor")
    mine = read_manifest(published["served"], 0, "anchor")
    assert other.adapter == mine.adapter and other.adapter is not None
    receiver = TensorsReceiver()
    where = "store/v00000000/anchor"
    step = Step.of(other, load_object(published["other"], other), where)
    with pytest.raises(UpdateRefused) as exc:
        apply_update([step], receiver, holding)
    assert exc.value.reason is RefusalReason.MODEL
    assert mine.adapter is not None and other.adapter.base_content != mine.adapter.base_content == content
    assert str(exc.value) == (
        f"{where}: anchor v0 is an adapter for another base model of the same shapes (base weights "
        f"{other.adapter.base_content[:19]}..., this engine serves base weights {content[:19]}...): publish the "
        "adapter from a trainer whose base is the checkpoint this engine serves, or serve the adapter's own base"
    )
    assert receiver.tensors is None
    after = apply_update([Step.of(mine, load_object(published["served"], mine), where)], receiver, holding)
    assert after is not None and after.version == 0 and after.adapter_base_content == content
    assert receiver.tensors is not None and receiver.tensors.keys() == read_weights(published["served"], 0).keys()


def test_without_a_digest_on_either_side_names_and_shapes_decide_as_before(
    bases: tuple[Path, Path], published: dict[str, LocalStore]
) -> None:
    """A 1.4 object (no base_content) and an engine that cannot read its base (a dummy load) admit the other base's
    adapter on names and shapes alone: the digest refuses only where both sides know it."""
    served, _ = bases
    other = read_manifest(published["other"], 0, "anchor")
    assert other.adapter is not None
    old = dataclasses.replace(
        other, format_version="1.4", adapter=dataclasses.replace(other.adapter, base_content=None)
    )
    old = DeltaManifest.from_json(old.to_json(), name="1.4")
    assert old.format_version == "1.4" and old.adapter is not None and old.adapter.base_content is None
    knows = combine_ranks([_engine_status(served, _documented_digest(served))], label=None).holding()
    admit(old, knows, where="1.4 object")
    dummy = combine_ranks([_engine_status(served, None)], label=None).holding()
    assert dummy.adapter_base_content is None
    admit(other, dummy, where="dummy engine")


def _adapter_doc(content: Any, fmt: str = "1.5") -> bytes:
    doc = json.loads((GOLDEN / "manifest-adapter.json").read_bytes())
    doc["format_version"] = fmt
    if content is KeyError:
        del doc["adapter"]["base_content"]
    else:
        doc["adapter"]["base_content"] = content
    return json.dumps(doc).encode()


@pytest.mark.parametrize("content", [None, "sha256:" + "0123456789abcdef" * 4])
def test_base_content_round_trips(content: str | None) -> None:
    m = DeltaManifest.from_json(_adapter_doc(content), name="m")
    assert m.adapter is not None and m.adapter.base_content == content
    again = DeltaManifest.from_json(m.to_json(), name="again")
    assert again.adapter is not None and again.adapter.base_content == content and again.to_json() == m.to_json()


@pytest.mark.parametrize(
    "content",
    ["sha256:" + "AB" * 32, "sha256:" + "a" * 63, "a" * 64, "sha1:" + "a" * 40, "", 7, ["sha256:" + "a" * 64]],
    ids=["upper", "short", "no-prefix", "other-hash", "empty", "int", "list"],
)
def test_a_malformed_base_content_is_a_format_error_naming_it(content: Any) -> None:
    with pytest.raises(FormatError) as exc:
        DeltaManifest.from_json(_adapter_doc(content), name="hostile")
    assert str(exc.value) == (
        f"hostile: adapter.base_content must be null or 'sha256:' and 64 hex digits, found {content!r}"
    )


def test_base_content_is_required_in_1_5_and_refused_in_1_4() -> None:
    with pytest.raises(FormatError, match=r"hostile: adapter must have exactly the keys \[.*'base_content'"):
        DeltaManifest.from_json(_adapter_doc(KeyError), name="hostile")
    with pytest.raises(FormatError, match="hostile: adapter must have exactly the keys"):
        DeltaManifest.from_json(_adapter_doc(None, fmt="1.4"), name="hostile")
    m = DeltaManifest.from_json(_adapter_doc("sha256:" + "a" * 64), name="m")
    with pytest.raises(ValueError, match="base_content needs format 1.5 or later, not 1.4"):
        dataclasses.replace(m, format_version="1.4").to_json()
    entry = AdapterEntry(r=2, lora_alpha=16, target_modules=("q_proj",), base_fingerprint="sha256:" + "ab" * 32)
    assert entry == dataclasses.replace(entry, base_content="sha256:" + "a" * 64)  # no part of the identity


def test_the_schema_refuses_a_malformed_base_content() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).parents[2] / "docs" / "manifest.schema.json").read_bytes())
    validator = jsonschema.Draft202012Validator(schema)
    assert not list(validator.iter_errors(json.loads(_adapter_doc(None))))
    assert not list(validator.iter_errors(json.loads(_adapter_doc("sha256:" + "a" * 64))))
    for bad in ("sha256:" + "AB" * 32, "a" * 64, "", 7):
        assert list(validator.iter_errors(json.loads(_adapter_doc(bad)))), bad
