from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from deltasync import DeltaManifest, FormatError, ShardEntry, TensorEntry, UnsupportedFormatVersion, model_fingerprint

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "manifest.schema.json").read_text())
C0, C1 = "xxh3_128:" + "0" * 32, "xxh3_128:" + "1" * 32
S0, S1 = "wsum4:" + "0" * 64, "wsum4:" + "0123456789abcdef" * 4
SHA = "a" * 64


def _manifest() -> DeltaManifest:
    return DeltaManifest(
        kind="delta",
        version=5,
        base_version=4,
        encoding="packed",
        shards=(
            ShardEntry(file="shard-00000.safetensors", bytes=10, sha256=SHA),
            ShardEntry(file="shard-00001.safetensors", bytes=20, sha256=SHA),
        ),
        tensors={
            "a": TensorEntry(
                shape=(2, 3), dtype="BF16", nnz=2, shards=(0, 1), checksums=((0, 3, C0), (3, 6, C1)), sketch=S1
            ),
            "b": TensorEntry(shape=(4,), dtype="F32", nnz=0, shards=(), checksums=((0, 4, C0),), sketch=S0),
        },
    )


def test_round_trip_and_schema() -> None:
    m = _manifest()
    data = m.to_json()
    jsonschema.validate(json.loads(data), SCHEMA)
    back = DeltaManifest.from_json(data, name="m")
    assert back == m
    assert back.to_json() == data
    assert (m.total_bytes, m.nnz, m.numel) == (30, 2, 10)
    assert m.model_fingerprint == DeltaManifest.from_json(data, name="m").model_fingerprint
    assert m.model_fingerprint.startswith("sha256:")


def _broken(path: list, value: object) -> bytes:
    obj = json.loads(_manifest().to_json())
    target = obj
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(obj).encode()


CASES = [
    (["kind"], "diff", "m: kind must be one of ['delta', 'anchor'], found 'diff'"),
    (["encoding"], "lz4", "m: encoding must be one of ['raw', 'packed'], found 'lz4'"),
    # one version cap everywhere (the store's v{N:08d}), not three
    (["version"], -1, "m: version must be an int in [0, 99999999], found -1"),
    (["version"], 10**8, "m: version must be an int in [0, 99999999], found 100000000"),
    (["run_id"], "../x", "m: run_id must be null or a run identity like 'run-2f1c...', found '../x'"),
    (["model_id"], "", "m: model_id must be null or a string of 1 to 256 characters, found ''"),
    (["model_fingerprint"], "md5:1", "m: model_fingerprint must be 'sha256:' and 64 hex digits, found 'md5:1'"),
    (["base_version"], 5, "m: base_version must be an int in [0, 4], found 5"),
    (["format_version"], "x", "m: format_version must be 'major.minor', found 'x'"),
    (["shards"], {}, "m: shards must be a list, found dict"),
    (["shards", 0, "file"], "../x", "m: shards[0].file must match shard-NNNNN.safetensors, found '../x'"),
    (["shards", 0, "sha256"], "AB", "m: shards[0].sha256 must be 64 lowercase hex digits, found 'AB'"),
    (
        ["shards", 0, "bytes"],
        "10",
        "m: shards[0].bytes must be an int in [0, 9223372036854775807], found '10'",
    ),
    (["shards", 1, "file"], "shard-00000.safetensors", "m: shards must name each file once"),
    (
        ["shards", 0, "extra"],
        1,
        "m: shards[0] must have exactly the keys ['bytes', 'file', 'sha256'], found ['bytes', 'extra', 'file', 'sha256']",
    ),
    (["tensors"], [], "m: tensors must be an object, found list"),
    (
        ["tensors", "a", "dtype"],
        "I8",
        "m: tensors['a'].dtype must be one of ['BF16', 'F16', 'F32'], found 'I8'",
    ),
    (
        ["tensors", "a", "shape"],
        [2, -3],
        "m: tensors['a'].shape must be a list of at most 16 non-negative ints, found [2, -3]",
    ),
    (["tensors", "a", "nnz"], 7, "m: tensors['a'].nnz must be an int in [0, 6], found 7"),
    (
        ["tensors", "a", "shards"],
        [1, 0],
        "m: tensors['a'].shards must be sorted unique indices below 2, found [1, 0]",
    ),
    (
        ["tensors", "a", "shards"],
        [],
        "m: tensors['a'].shards must be non-empty exactly when nnz > 0 (nnz=2, shards=[])",
    ),
    (
        ["tensors", "a", "checksums"],
        [],
        "m: tensors['a'].checksums must be a non-empty list of [start, stop, digest], found []",
    ),
    (
        ["tensors", "a", "checksums", 1, 0],
        4,
        "m: tensors['a'].checksums[1] must be [3, stop >= 3, 'xxh3_128:<32 hex>'], found [4, 6, 'xxh3_128:11111111111111111111111111111111']",
    ),
    (["tensors", "a", "checksums", 1, 1], 5, "m: tensors['a'].checksums must cover [0, 6), they end at 5"),
    (
        ["tensors", "b", "checksums", 0, 2],
        "sha1:00",
        "m: tensors['b'].checksums[0] must be [0, stop >= 0, 'xxh3_128:<32 hex>'], found [0, 4, 'sha1:00']",
    ),
    (
        ["tensors", "b", "nnz"],
        KeyError,
        "m: tensors['b'] must have exactly the keys ['checksums', 'dtype', 'nnz', 'shape', 'shards', 'sketch'], found ['checksums', 'dtype', 'shape', 'shards', 'sketch']",
    ),
    # format 1.2: every tensor's linear sketch (deltasync.sketch), canonical text only
    (
        ["tensors", "a", "sketch"],
        "wsum4:00",
        "m: tensors['a'].sketch must be 'wsum4:' and 64 lowercase hex digits, found 'wsum4:00'",
    ),
    (
        ["tensors", "a", "sketch"],
        S1.upper(),
        f"m: tensors['a'].sketch must be 'wsum4:' and 64 lowercase hex digits, found {S1.upper()!r}",
    ),
    (
        ["tensors", "b", "sketch"],
        None,
        "m: tensors['b'].sketch must be 'wsum4:' and 64 lowercase hex digits, found None",
    ),
    (
        ["tensors", "b", "sketch"],
        KeyError,
        "m: tensors['b'] must have exactly the keys ['checksums', 'dtype', 'nnz', 'shape', 'shards', 'sketch'], found ['checksums', 'dtype', 'nnz', 'shape', 'shards']",
    ),
]


@pytest.mark.parametrize(("path", "value", "message"), CASES, ids=[m.split(" must")[0] for _, _, m in CASES])
def test_exact_messages(path: list, value: object, message: str) -> None:
    with pytest.raises(FormatError) as exc:
        DeltaManifest.from_json(_broken(path, value), name="m")
    assert str(exc.value) == message


def test_document_level_errors() -> None:
    with pytest.raises(FormatError, match=r"^m: manifest is not valid JSON \(Expecting value"):
        DeltaManifest.from_json(b"nope", name="m")
    with pytest.raises(FormatError, match=r"^m: manifest is 16777217 bytes, more than the cap of 16777216$"):
        DeltaManifest.from_json(b" " * (16 * 1024 * 1024 + 1), name="m")
    with pytest.raises(FormatError, match=r"^m: manifest must be a JSON object, found list$"):
        DeltaManifest.from_json(b"[]", name="m")
    with pytest.raises(FormatError, match=r"^m: base_version must be null for an anchor, found 4$"):
        DeltaManifest.from_json(_broken(["kind"], "anchor"), name="m")
    with pytest.raises(UnsupportedFormatVersion, match=r"^m: format_version 2.1 is not supported"):
        DeltaManifest.from_json(_broken(["format_version"], "2.1"), name="m")
    delta0 = json.loads(_broken(["version"], 0))
    with pytest.raises(FormatError, match=r"^m: version of a delta must be > 0, found 0$"):
        DeltaManifest.from_json(json.dumps(delta0), name="m")


def test_the_fingerprint_must_match_the_tensors() -> None:
    """Another model's objects: every object names its model; a manifest whose declared fingerprint is not
    the one its tensors give is corrupt (or edited), and refused."""
    m = _manifest()
    assert m.model_fingerprint == model_fingerprint({"a": ("BF16", (2, 3)), "b": ("F32", (4,))})
    other = model_fingerprint({"a": ("BF16", (2, 4)), "b": ("F32", (4,))})
    assert other != m.model_fingerprint
    with pytest.raises(FormatError, match=r"model_fingerprint is sha256:.* but the tensors listed give sha256:"):
        DeltaManifest.from_json(_broken(["model_fingerprint"], other), name="m")


def test_model_and_run_ids_round_trip() -> None:
    m = dataclasses.replace(_manifest(), model_id="Qwen/Qwen3-0.6B", run_id="run-" + "ab" * 16)
    back = DeltaManifest.from_json(m.to_json(), name="m")
    assert (back.model_id, back.run_id) == ("Qwen/Qwen3-0.6B", "run-" + "ab" * 16)
    jsonschema.validate(json.loads(m.to_json()), SCHEMA)


def test_format_1_0_manifests_still_read_and_newer_minors_may_add_keys() -> None:
    old = json.loads(_manifest().to_json())
    for key in ("model_fingerprint", "model_id", "run_id", "lease_epoch", "adapter"):
        del old[key]
    for t in old["tensors"].values():
        del t["sketch"]
    old["format_version"] = "1.0"
    jsonschema.validate(old, SCHEMA)
    m = DeltaManifest.from_json(json.dumps(old), name="m")
    assert m.format_version == "1.0" and m.run_id is None and "model_fingerprint" not in m.to_json().decode()
    assert DeltaManifest.from_json(m.to_json(), name="m") == m
    newer = json.loads(_manifest().to_json()) | {"format_version": "1.7", "something_new": [1, 2]}
    newer["tensors"]["a"]["something_new"] = 1  # at every level
    newer["shards"][0]["something_new"] = 1
    back = DeltaManifest.from_json(json.dumps(newer), name="m")  # a newer minor: unknown keys ignored
    assert (back.version, back.tensors["a"].sketch, back.shards[0].bytes) == (5, S1, 10)
    with pytest.raises(FormatError, match=r"must have exactly the keys"):  # our own minor: no stray keys
        DeltaManifest.from_json(json.dumps(json.loads(_manifest().to_json()) | {"something_new": 1}), name="m")


def test_sketches_round_trip_and_old_manifests_have_none() -> None:
    """Format 1.2 writes every tensor's sketch; a 1.1 manifest has none (``None``) and stays byte-exact."""
    m = _manifest()
    data = m.to_json()
    assert b'"sketch": "' + S1.encode() + b'"' in data
    back = DeltaManifest.from_json(data, name="m")
    assert {n: e.sketch for n, e in back.tensors.items()} == {"a": S1, "b": S0}
    old = json.loads(data) | {"format_version": "1.1"}
    del old["lease_epoch"], old["adapter"]
    for t in old["tensors"].values():
        del t["sketch"]
    jsonschema.validate(old, SCHEMA)
    m11 = DeltaManifest.from_json(json.dumps(old), name="m")
    assert m11.format_version == "1.1" and {e.sketch for e in m11.tensors.values()} == {None}
    assert b"sketch" not in m11.to_json() and DeltaManifest.from_json(m11.to_json(), name="m") == m11
    assert m11.model_fingerprint == m.model_fingerprint  # the sketch is not part of the model's identity
    with pytest.raises(jsonschema.ValidationError):  # 1.2 requires it
        jsonschema.validate(json.loads(data) | {"tensors": old["tensors"]}, SCHEMA)
    stray = {k: v for k, v in json.loads(data).items() if k not in ("lease_epoch", "adapter")} | {
        "format_version": "1.1"
    }  # no sketch
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(stray, SCHEMA)
    with pytest.raises(
        FormatError, match=r"^m: tensors\['a'\] must have exactly the keys \['checksums', 'dtype', 'nnz', "
    ):
        DeltaManifest.from_json(json.dumps(stray), name="m")


def test_a_manifest_without_sketches_is_never_written_as_1_2() -> None:
    """A 1.2 manifest whose entries lack the sketch serializes to something every reader refuses, so
    ObjectWriter.commit (which parses before writing) can never commit it."""
    m = _manifest()
    bare = dataclasses.replace(m, tensors={n: dataclasses.replace(e, sketch=None) for n, e in m.tensors.items()})
    with pytest.raises(FormatError, match=r"^m: tensors\['a'\]\.sketch must be 'wsum4:' .* found None$"):
        DeltaManifest.from_json(bare.to_json(), name="m")
