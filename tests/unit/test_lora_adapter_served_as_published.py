"""LoRA mode without vLLM: the adapter served is the adapter published.

A hostile format 1.4 or 1.5 adapter manifest is a FormatError naming the field (an integer alpha beyond any float
included); an adapter object whose tensors are not the adapter its manifest names is refused; an adapter PEFT
can publish but vLLM cannot load (``lora_bias``, ``trainable_token_indices``, embedding targets, DoRA) never
reaches a LoRA receiver; the served directory holds the published version as PEFT loads it, its files replaced
by rename, never written in place, and no link planted in it (at a served name or the temporary one) is
followed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import AdapterEntry, DeltaManifest, Publisher, ShardEntry, TensorEntry, UpdateRefused, read_weights
from deltasync.apply import Holding, admit
from deltasync.errors import FormatError, RefusalReason
from deltasync.lora import adapter_config_json, adapter_entry, adapter_state
from deltasync.manifest import model_fingerprint
from deltasync.store import LocalStore
from deltasync.vllm.lora_slots import ADAPTER_FILE, CONFIG_FILE, read_adapter_config, write_adapter

GOLDEN = Path(__file__).parents[1] / "data" / "golden"
BASE = "sha256:" + "1" * 64
TARGETS = ["q_proj", "v_proj"]


# --------------------------------------------------------------------------------- promise 4: format 1.4 and 1.5 fields


def _golden_adapter_doc() -> dict[str, Any]:
    return json.loads((GOLDEN / "manifest-adapter.json").read_bytes())


def _with_adapter(adapter: Any, fmt: str = "1.5") -> bytes:
    doc = _golden_adapter_doc()
    doc["adapter"] = adapter
    doc["format_version"] = fmt
    return json.dumps(doc).encode()  # NaN and Infinity as Python's json writes them (and reads them back)


def _field(**change: Any) -> dict[str, Any]:
    return {**_golden_adapter_doc()["adapter"], **change}


HOSTILE_FIELDS = [
    ("r-bool", _field(r=True), "adapter.r"),
    ("r-float", _field(r=8.0), "adapter.r"),
    ("r-string", _field(r="8"), "adapter.r"),
    ("r-zero", _field(r=0), "adapter.r"),
    ("r-negative", _field(r=-8), "adapter.r"),
    ("r-huge", _field(r=65537), "adapter.r"),
    ("r-2**70", _field(r=2**70), "adapter.r"),
    ("r-null", _field(r=None), "adapter.r"),
    ("alpha-nan", _field(lora_alpha=math.nan), "adapter.lora_alpha"),
    ("alpha-inf", _field(lora_alpha=math.inf), "adapter.lora_alpha"),
    ("alpha-minus-inf", _field(lora_alpha=-math.inf), "adapter.lora_alpha"),
    ("alpha-bool", _field(lora_alpha=True), "adapter.lora_alpha"),
    ("alpha-zero", _field(lora_alpha=0), "adapter.lora_alpha"),
    ("alpha-negative", _field(lora_alpha=-16), "adapter.lora_alpha"),
    ("alpha-string", _field(lora_alpha="16"), "adapter.lora_alpha"),
    ("alpha-null", _field(lora_alpha=None), "adapter.lora_alpha"),
    ("alpha-list", _field(lora_alpha=[16]), "adapter.lora_alpha"),
    ("targets-unsorted", _field(target_modules=["v_proj", "q_proj"]), "adapter.target_modules"),
    ("targets-duplicate", _field(target_modules=["q_proj", "q_proj"]), "adapter.target_modules"),
    ("targets-empty", _field(target_modules=[]), "adapter.target_modules"),
    ("targets-string", _field(target_modules="q_proj"), "adapter.target_modules"),
    ("targets-regex", _field(target_modules=[".*proj"]), "adapter.target_modules"),
    ("targets-path", _field(target_modules=["../../etc/passwd"]), "adapter.target_modules"),
    ("targets-slash", _field(target_modules=["a/b"]), "adapter.target_modules"),
    ("targets-empty-name", _field(target_modules=[""]), "adapter.target_modules"),
    ("targets-newline", _field(target_modules=["q_proj\n"]), "adapter.target_modules"),
    ("targets-int", _field(target_modules=[1]), "adapter.target_modules"),
    ("targets-null-item", _field(target_modules=[None]), "adapter.target_modules"),
    ("targets-long-name", _field(target_modules=["x" * 129]), "adapter.target_modules"),
    ("targets-too-many", _field(target_modules=sorted(f"m{i:05d}" for i in range(1025))), "adapter.target_modules"),
    ("rslora-int", _field(use_rslora=0), "adapter.use_rslora"),
    ("rslora-one", _field(use_rslora=1), "adapter.use_rslora"),
    ("rslora-string", _field(use_rslora="false"), "adapter.use_rslora"),
    ("rslora-null", _field(use_rslora=None), "adapter.use_rslora"),
    ("base-upper", _field(base_fingerprint="sha256:" + "AB" * 32), "adapter.base_fingerprint"),
    ("base-short", _field(base_fingerprint="sha256:" + "a" * 63), "adapter.base_fingerprint"),
    ("base-no-prefix", _field(base_fingerprint="a" * 64), "adapter.base_fingerprint"),
    ("base-null", _field(base_fingerprint=None), "adapter.base_fingerprint"),
    ("peft-lower", _field(peft_type="lora"), "adapter.peft_type"),
    ("peft-loha", _field(peft_type="LOHA"), "adapter.peft_type"),
    ("peft-null", _field(peft_type=None), "adapter.peft_type"),
    ("missing-key", {k: v for k, v in _field().items() if k != "use_rslora"}, "adapter"),
    ("extra-key", _field(lora_dropout=0.0), "adapter"),
    ("list", [], "adapter"),
    ("string", "LORA", "adapter"),
    ("number", 1, "adapter"),
    ("true", True, "adapter"),
    ("empty-object", {}, "adapter"),
]


@pytest.mark.parametrize(("adapter", "field"), [c[1:] for c in HOSTILE_FIELDS], ids=[c[0] for c in HOSTILE_FIELDS])
def test_a_hostile_adapter_field_is_refused_by_a_format_error_naming_it(adapter: Any, field: str) -> None:
    with pytest.raises(FormatError, match=field.replace(".", r"\.")):
        DeltaManifest.from_json(_with_adapter(adapter), name="hostile")


def test_a_newer_minor_still_refuses_a_hostile_known_adapter_field() -> None:
    """1.6 may add keys (ignored), never relax the known ones."""
    ok = DeltaManifest.from_json(_with_adapter(_field(lora_dropout=0.0), fmt="1.6"), name="newer")
    assert ok.adapter is not None and ok.adapter.r == 2
    with pytest.raises(FormatError, match=r"adapter\.r"):
        DeltaManifest.from_json(_with_adapter(_field(r=True), fmt="1.6"), name="newer")


def test_a_huge_integer_alpha_is_a_format_error_not_an_overflow() -> None:
    with pytest.raises(FormatError, match=r"adapter\.lora_alpha"):
        DeltaManifest.from_json(_with_adapter(_field(lora_alpha=10**400)), name="huge alpha")


def test_the_schema_refuses_what_the_reader_refuses() -> None:
    """docs/manifest.schema.json and the reader agree on the adapter (JSON values only: NaN is not JSON)."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).parents[2] / "docs" / "manifest.schema.json").read_bytes())
    validator = jsonschema.Draft202012Validator(schema)
    assert not list(validator.iter_errors(_golden_adapter_doc()))
    # beyond JSON Schema: NaN and infinities are not JSON; "integer" admits 8.0 (draft 2020-12); no keyword says
    # "sorted"; Python's re (which jsonschema uses) lets `$` match before a final newline, ECMA-262's does not
    beyond = ("alpha-nan", "alpha-inf", "alpha-minus-inf", "r-float", "targets-unsorted", "targets-newline")
    lenient = []
    for case, adapter, _ in HOSTILE_FIELDS:
        if case in beyond:
            continue
        if not list(validator.iter_errors(json.loads(_with_adapter(adapter)))):
            lenient.append(case)
    assert not lenient, f"the schema accepts adapters the reader refuses: {lenient}"


def test_an_adapter_key_in_a_1_3_manifest_is_refused_and_1_3_stays_readable() -> None:
    old = (GOLDEN / "1.3" / "manifest-delta.json").read_bytes()
    m = DeltaManifest.from_json(old, name="1.3")
    assert m.adapter is None and m.format_version == "1.3"
    assert m.to_json() == old
    for value in (None, _field()):
        doc = json.loads(old)
        doc["adapter"] = value
        with pytest.raises(FormatError, match="keys"):
            DeltaManifest.from_json(json.dumps(doc), name="1.3 with adapter")
    entry = AdapterEntry(r=2, lora_alpha=4, target_modules=("q_proj",), base_fingerprint=BASE)
    with pytest.raises(ValueError, match="1.4"):
        dataclasses.replace(m, adapter=entry).to_json()


def test_an_adapter_round_trips_exactly() -> None:
    for alpha in (16, 16.0, 0.5, 1e-300, 1e300):
        m = DeltaManifest.from_json(_with_adapter(_field(lora_alpha=alpha, use_rslora=True)), name="rt")
        again = DeltaManifest.from_json(m.to_json(), name="rt again")
        assert again.adapter == m.adapter and type(again.adapter.lora_alpha) is type(alpha)  # type: ignore[union-attr]


# ---------------------------------------------------- promise 2: an adapter object is the adapter its manifest names

ENTRY = AdapterEntry(r=8, lora_alpha=16, target_modules=tuple(TARGETS), base_fingerprint=BASE)
HIDDEN = 32
P = "base_model.model.model.layers.0.self_attn"


def _adapter_tensors(rank: int = 8, modules: tuple[str, ...] = ("q_proj", "v_proj")) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for m in modules:
        out[f"{P}.{m}.lora_A.weight"] = (rank, HIDDEN)
        out[f"{P}.{m}.lora_B.weight"] = (HIDDEN, rank)
    return out


def _adapter_manifest(shapes: dict[str, tuple[int, ...]], entry: AdapterEntry = ENTRY) -> bytes:
    """A well-formed 1.4 anchor listing ``shapes`` (its manifest only: admission reads nothing else)."""
    tensors = {
        n: TensorEntry(
            shape=s,
            dtype="BF16",
            nnz=math.prod(s),
            shards=(0,),
            checksums=((0, math.prod(s), "xxh3_128:" + "0" * 32),),
            sketch="wsum4:" + "0" * 64,
        )
        for n, s in shapes.items()
    }
    shard = ShardEntry(file="shard-00000.safetensors", bytes=1, sha256="0" * 64)
    m = DeltaManifest(
        kind="anchor", version=0, base_version=None, encoding="raw", shards=(shard,), tensors=tensors, adapter=entry
    )
    return m.to_json()


def _refused_before_any_write(data: bytes, holding: Holding) -> BaseException | None:
    """The refusal a receiver gives this object by its manifest (the reader's FormatError or admit's
    UpdateRefused), ``None`` if it would be admitted."""
    try:
        manifest = DeltaManifest.from_json(data, name="hostile adapter")
        admit(manifest, holding, where="adversary")
    except (FormatError, UpdateRefused) as exc:
        return exc
    return None


FRESH = Holding(adapter_base=BASE)  # a lora engine before its first anchor: the anchor defines the adapter's tensors
SERVED = Holding(adapter_base=BASE, adapter=ENTRY)  # the directory's adapter_config.json names this adapter

# Admission checks that an adapter object's tensors are the adapter its manifest names (apply._not_the_adapter), not
# only the manifest's adapter entry: the first anchor, or the first after a restart, defines the served spec.


def _with(**extra: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    return {**_adapter_tensors(), **{k.replace("__", "."): v for k, v in extra.items()}}


TENSOR_CASES = [
    pytest.param(_adapter_tensors(), True, id="control-the-adapter-itself"),
    pytest.param(
        _with(**{f"{P}.q_proj.base_layer.weight": (HIDDEN, HIDDEN)}),
        False,
        id="base-weight-smuggled",
    ),
    pytest.param(
        _with(**{"base_model.model.model.norm.weight": (HIDDEN,)}),
        False,
        id="norm-weight-smuggled",
    ),
    pytest.param(
        _with(**{f"{P}.q_proj.lora_B.bias": (HIDDEN,)}),
        False,
        id="lora-bias",
    ),
    pytest.param(
        _adapter_tensors(rank=16),
        False,
        id="rank-16-shapes-declared-r-8",
    ),
    pytest.param(
        {**_adapter_tensors(), f"{P}.v_proj.lora_B.weight": (HIDDEN, 4)},
        False,
        id="a-and-b-ranks-disagree",
    ),
    pytest.param(
        _adapter_tensors(modules=("q_proj", "v_proj", "o_proj")),
        False,
        id="module-not-in-target-modules",
    ),
    pytest.param(
        {k: v for k, v in _adapter_tensors().items() if not k.endswith("v_proj.lora_B.weight")},
        False,
        id="lora-a-without-b",
    ),
]


@pytest.mark.parametrize(("shapes", "admitted"), TENSOR_CASES)
@pytest.mark.parametrize("holding", [FRESH, SERVED], ids=["fresh-engine", "adapter-dir-configured"])
def test_an_adapter_object_whose_tensors_are_not_that_adapter_is_refused(
    shapes: dict[str, tuple[int, ...]], admitted: bool, holding: Holding
) -> None:
    refusal = _refused_before_any_write(_adapter_manifest(shapes), holding)
    if admitted:
        assert refusal is None, refusal
    else:
        assert refusal is not None, "admitted: vLLM would be asked to load tensors that are not this adapter"
        if isinstance(refusal, UpdateRefused):
            assert refusal.reason in (RefusalReason.MALFORMED, RefusalReason.MODEL, RefusalReason.UNSUPPORTED)


def test_a_full_weights_anchor_named_like_an_adapter_is_refused_both_ways() -> None:
    """A model's own weights (``adapter`` null) whose tensors carry adapter names: never an adapter's object for a
    lora receiver; and an adapter object is never a model's own weights for a full-weights receiver."""
    shapes = _adapter_tensors()
    plain = DeltaManifest.from_json(_adapter_manifest(shapes), name="x")
    plain = dataclasses.replace(plain, adapter=None)
    with pytest.raises(UpdateRefused, match="model's own weights") as exc:
        admit(plain, FRESH, where="adversary")
    assert exc.value.reason is RefusalReason.MODEL
    adapter = DeltaManifest.from_json(_adapter_manifest(shapes), name="y")
    spec = {n: ("BF16", s) for n, s in shapes.items()}  # even a full-weights engine whose spec is exactly these names
    for holding in (Holding(), Holding(spec=spec, version=0)):
        with pytest.raises(UpdateRefused, match="LoRA adapter's") as exc:
            admit(adapter, holding, where="adversary")
        assert exc.value.reason is RefusalReason.MODEL


def test_a_catch_up_across_an_anchor_of_another_adapter_is_refused() -> None:
    """[delta of the served adapter, anchor of another adapter on the same base, delta after it]: admitted object
    by object as the engine does (each against what the objects before it leave), the anchor is refused."""
    shapes = _adapter_tensors()
    spec = {n: ("BF16", s) for n, s in shapes.items()}
    first = DeltaManifest.from_json(_adapter_manifest(shapes), name="a")
    delta = dataclasses.replace(first, kind="delta", version=4, base_version=3)
    other = dataclasses.replace(first, version=5, adapter=dataclasses.replace(ENTRY, lora_alpha=32))
    holding = Holding(adapter_base=BASE, adapter=ENTRY, spec=spec, version=3, high_water=3)
    admit(delta, holding, where="catch-up", target=6)
    holding = holding.after(delta)
    with pytest.raises(UpdateRefused, match="lora_alpha 16 here, 32 in the object") as exc:
        admit(other, holding, where="catch-up", target=6)
    assert exc.value.reason is RefusalReason.MODEL


def test_an_adapter_above_its_declared_base_is_refused_whatever_the_holding() -> None:
    """Another base (a fingerprint differing in one hex digit), a base the engine cannot tell, and the served
    adapter's own entry on another base: refused MODEL."""
    data = _adapter_manifest(_adapter_tensors())
    m = DeltaManifest.from_json(data, name="m")
    for base in ("sha256:" + "1" * 63 + "2", "unknown"):
        for adapter in (None, ENTRY):
            with pytest.raises(UpdateRefused, match="another base model") as exc:
                admit(m, Holding(adapter_base=base, adapter=adapter), where="adversary")
            assert exc.value.reason is RefusalReason.MODEL


# --------------------------------------------------- the publisher's side: PEFT adapters vLLM cannot load as LoRA


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deltasync.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("adv-lora") / "tiny", seed=0)


def _peft(tiny: Path, seed: int = 0, **config: Any) -> Any:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)
        lora = peft.LoraConfig(
            **{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False, **config}
        )
        return peft.get_peft_model(base, lora)


# PEFT's lora_bias and trainable_token_indices (and embedding targets) add tensors (lora_B.bias,
# trainable_tokens_delta) that vLLM's loader raises on when a request names the adapter: lora.adapter_entry refuses
# them at the source and apply._not_the_adapter at every receiver.


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"lora_bias": True}, id="lora-bias"),
        pytest.param({"trainable_token_indices": [1, 2, 3]}, id="trainable-tokens"),
        pytest.param({"target_modules": [*TARGETS, "embed_tokens"]}, id="embedding-target"),
        pytest.param({"use_dora": True}, id="dora-control"),
    ],
)
def test_an_adapter_vllm_cannot_load_never_reaches_a_lora_receiver(
    tiny: Path, tmp_path: Path, config: dict[str, Any]
) -> None:
    """Refused by adapter_entry or the publisher, or else by the admission rule of a lora receiver of that base."""
    model = _peft(tiny, **config)
    try:
        entry = adapter_entry(model)
        store = LocalStore(tmp_path / "s")
        with Publisher(store, adapter=entry) as pub, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT warns about lora_B.bias shapes as it collects the state
            pub.publish(model)
    except ValueError:
        return  # refused at the source
    refusal = _refused_before_any_write(pub.published[0].to_json(), Holding(adapter_base=entry.base_fingerprint))
    assert refusal is not None, (
        f"admitted: {sorted(n for n in pub.published[0].tensors if not n.endswith(('lora_A.weight', 'lora_B.weight')))[:3]}"
    )


def test_a_nan_in_an_adapter_delta_is_refused_by_the_reader(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store writer publishes NaN in an adapter's delta (the publisher refuses NaN; here it is forced past it):
    every reader refuses the object, naming the tensor."""
    import deltasync.format

    model = _peft(tiny)
    store = LocalStore(tmp_path / "s")
    with Publisher(store, adapter=adapter_entry(model)) as pub:
        pub.publish(model)
        name = sorted(n for n, _ in model.named_parameters() if "lora_B" in n)[0]
        with torch.no_grad():
            model.get_parameter(name).view(-1)[3] = math.nan
        with monkeypatch.context() as m:
            m.setattr(deltasync.format, "has_nan", lambda values: False)
            pub.publish(model)
            pub.flush()
    assert [x.kind for x in pub.published] == ["anchor", "delta"]
    with pytest.raises(FormatError, match="NaN"):
        read_weights(store, 1)


def test_the_served_directory_holds_the_published_version_as_peft_loads_it(tiny: Path, tmp_path: Path) -> None:
    """Promise 1 without vLLM: what the engine writes to adapter_dir (the version read from the store) loads in
    PEFT as the trainer's adapter cast to bf16, bit for bit, with the trainer's configuration."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = _peft(tiny, use_rslora=True, lora_alpha=12.5)
    entry = adapter_entry(model)
    store = LocalStore(tmp_path / "s")
    with Publisher(store, adapter=entry) as pub:
        pub.publish(model)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.add_(torch.full_like(p, 1e-2))
        version = pub.publish(model)
        pub.flush()
    served = tmp_path / "served"
    write_adapter(str(served), read_weights(store, version), pub.published[-1].adapter)  # type: ignore[arg-type]
    want = {k: v.to(torch.bfloat16) for k, v in adapter_state(model).items()}
    from safetensors.torch import load_file

    got = load_file(served / ADAPTER_FILE)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)), k
    config = json.loads((served / CONFIG_FILE).read_text())
    trainer = model.peft_config["default"]
    assert config["r"] == trainer.r and config["lora_alpha"] == trainer.lora_alpha
    assert config["use_rslora"] is True and sorted(config["target_modules"]) == sorted(trainer.target_modules)
    assert config == adapter_config_json(entry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)
        loaded = peft.PeftModel.from_pretrained(base, str(served))
    assert loaded.peft_config["default"].use_rslora and loaded.peft_config["default"].lora_alpha == 12.5
    assert read_adapter_config(str(served), entry.base_fingerprint) == entry


# ------------------------------------------------------------- promise 3: the served files are replaced by rename


def _entry_and_tensors() -> tuple[AdapterEntry, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in _adapter_tensors().items()}
    spec = {n: ("BF16", tuple(t.shape)) for n, t in tensors.items()}
    return dataclasses.replace(ENTRY, base_fingerprint=model_fingerprint(spec)), tensors


def test_the_served_files_are_replaced_by_rename_never_written_in_place(tmp_path: Path) -> None:
    entry, tensors = _entry_and_tensors()
    served = tmp_path / "served"
    write_adapter(str(served), tensors, entry)
    inodes = {f: os.stat(served / f).st_ino for f in (ADAPTER_FILE, CONFIG_FILE)}
    with open(served / ADAPTER_FILE, "rb") as reader:  # a reader (vLLM's loader) holding the old version open
        old = (served / ADAPTER_FILE).read_bytes()
        write_adapter(str(served), {n: t + 1 for n, t in tensors.items()}, entry)
        assert reader.read() == old, "the open file changed under its reader: written in place"
    assert all(os.stat(served / f).st_ino != inodes[f] for f in inodes)
    assert sorted(os.listdir(served)) == sorted([ADAPTER_FILE, CONFIG_FILE]), "temporary files left behind"


def test_a_served_file_that_is_a_link_is_replaced_not_followed(tmp_path: Path) -> None:
    """Someone links the served tensors file to a file elsewhere: the write replaces the link, never its target."""
    entry, tensors = _entry_and_tensors()
    served = tmp_path / "served"
    served.mkdir()
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    os.symlink(victim, served / ADAPTER_FILE)
    os.symlink(victim, served / CONFIG_FILE)
    write_adapter(str(served), tensors, entry)
    assert victim.read_bytes() == b"precious"
    assert not (served / ADAPTER_FILE).is_symlink() and not (served / CONFIG_FILE).is_symlink()


# The temporary file is made by tempfile.mkstemp (O_EXCL): a predictable name opened with open(tmp, "wb") would
# follow a link planted there, overwrite the link's target and rename the link in.
def test_a_link_planted_at_the_temporary_name_is_never_followed(tmp_path: Path) -> None:
    entry, tensors = _entry_and_tensors()
    served = tmp_path / "served"
    served.mkdir()
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    for name in (ADAPTER_FILE, CONFIG_FILE):
        os.symlink(victim, served / f".{name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):  # refusing to write is fine; writing through the link is not
        write_adapter(str(served), tensors, entry)
    assert victim.read_bytes() == b"precious", "the engine wrote through a link planted in the served directory"
    assert not (served / ADAPTER_FILE).is_symlink()
