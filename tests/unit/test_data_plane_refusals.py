"""The data plane serves only what a publisher registered, and loses nothing: staged files are never written
through a planted link or outside the staging directory; a malformed or swapped staged file never serves; the
engine's version is never relabelled; two runs signed by one key are never mixed; one planted anchor does not
break the registered chain; tensor names cannot forge a fingerprint collision; a deeply nested signature or
directory is refused or skipped; the agent outlives an answer it cannot parse; a failed fetch leaves nothing
staged. Each test plants what a store writer or a network client can, then checks the refusal is clear or the
attack harmless."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from deltasync import (
    ForeignObject,
    FormatError,
    LocalStore,
    ObjectWriter,
    SignatureError,
    SigningKey,
    Trust,
    compute_delta,
    encode_shard,
    read_weights,
    write_anchor,
    write_delta,
)
from deltasync.errors import ApplyError, IntegrityError, RefusalReason, UpdateRefused
from deltasync.layout import manifest_key, signature_key
from deltasync.reader import load_object, read_manifest
from deltasync.staging import StagedUpdate, stage_object
from deltasync.targets import EngineClaim, InMemoryTarget
from tests.conftest import assert_bit_equal
from tests.support.world import World, world


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(32, 32, generator=g).to(torch.bfloat16), "b": torch.randn(32, generator=g).bfloat16()}


@pytest.fixture
def w(tmp_path: Path, weights: dict[str, torch.Tensor]):
    with world(tmp_path, weights, lr=1e-3) as w:
        yield w


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_symlinks_planted_in_the_staging_directory_are_never_written_through(w: World) -> None:
    """The agent never follows a link planted at a staging name (``staging/v0000000N``,
    ``.manifest.json.tmp``): following it would overwrite the store's committed shard or any file the planter
    chose."""
    agent = w.agent("agent-0", target=InMemoryTarget(staged_files=True))  # staged as for a vLLM engine
    agent.sync()
    w.publisher.step()
    w.publisher.step()
    staging, store_files = agent.staging, _files(w.store.root)
    victim = w.tmp / "victim.txt"
    victim.write_text("precious\n")
    for name in ("v00000001", "v00000002", "v00000001-", "v00000002-"):  # every name a guess could reach
        os.symlink(w.store.root / "v00000001", staging / name)
    (staging / "cache").mkdir(exist_ok=True)
    for v in (1, 2):
        sha = read_manifest(w.store, v).shards[0].sha256
        os.symlink(victim, staging / "cache" / sha)  # a planted "cached shard"
        os.symlink(victim, staging / "cache" / f"{sha}.tmp")
    result = agent.sync()
    assert (result.to_version, agent.target.label) == (2, "2")
    assert_bit_equal(agent.target.weights, w.publisher.truth[2])
    assert _files(w.store.root) == store_files  # nothing in the store changed
    assert victim.read_text() == "precious\n"


def test_a_staging_directory_replaced_by_a_link_is_refused_clearly(w: World) -> None:
    agent = w.agent("agent-0", target=InMemoryTarget(staged_files=True))
    agent.sync()
    w.publisher.step()
    shutil.rmtree(agent.staging)
    os.symlink(w.store.root, agent.staging)
    with pytest.raises(Exception, match="is a symlink or not a directory; deltasync never writes through links"):
        agent.sync()
    assert _files(w.store.root)  # the store is untouched and the engine still serves v0
    assert agent.target.label == "0"


def test_a_removed_staging_directory_is_recreated(w: World) -> None:
    """A removed staging directory is recreated: later syncs go on."""
    agent = w.agent("agent-0", target=InMemoryTarget(staged_files=True))
    agent.sync()
    for expected in (1, 2):
        w.publisher.step()
        shutil.rmtree(agent.staging)
        assert agent.sync().to_version == expected


def test_an_update_message_cannot_name_files_outside_the_staging_directory(tmp_path: Path, weights) -> None:
    """An update message naming a self-consistent forged delta anywhere on disk (here through a symlinked
    directory) is refused: the engine never serves weights no publisher registered under label '1'."""
    store = LocalStore(tmp_path / "store")
    m0 = write_anchor(ObjectWriter(store=store, run_id="run-a"), weights, version=0)
    target = InMemoryTarget()
    target.init(EngineClaim(agent_id="agent-0", staging_root=str(tmp_path / "staging")))
    target.apply(
        StagedUpdate(objects=(stage_object(tmp_path / "staging" / "v0", m0, m0.to_json(), load_object(store, m0)),))
    )
    evil = {k: torch.full_like(v, 42.0) for k, v in weights.items()}
    fake = LocalStore(tmp_path / "elsewhere")
    write_delta(
        ObjectWriter(store=fake, encoding="raw", run_id="run-a"),
        compute_delta(weights, evil),
        state=evil,
        version=1,
        base=m0,
    )
    os.symlink(tmp_path / "elsewhere" / "v00000001", tmp_path / "staging" / "link")

    def message(directory: Path) -> StagedUpdate:
        info = {
            "objects": [
                {
                    "kind": "delta",
                    "version": 1,
                    "base_version": 0,
                    "manifest_path": str(directory / "manifest.json"),
                    "shard_paths": [str(directory / "shard-00000.safetensors")],
                }
            ]
        }
        return StagedUpdate.from_update_info(info)

    for directory in (tmp_path / "elsewhere" / "v00000001", tmp_path / "staging" / "link"):
        with pytest.raises(UpdateRefused, match="is not inside the staging directory") as exc:
            target.apply(message(directory))
        assert exc.value.reason is RefusalReason.MALFORMED
    unnamed = InMemoryTarget()  # a receiver no agent initialised takes no files at all
    with pytest.raises(UpdateRefused, match="this receiver has no staging directory"):
        unnamed.apply(message(tmp_path / "elsewhere" / "v00000001"))
    assert (target.version, target.label, target.state().healthy) == (0, "0", True)
    assert_bit_equal(target.weights, weights)


def test_a_malformed_staged_file_is_a_refusal_not_an_engine_failure(tmp_path: Path, weights) -> None:
    """A malformed staged file is a refusal (MALFORMED) on every target, as on the vLLM engine, never an
    ApplyError that marks the engine unhealthy."""
    store = LocalStore(tmp_path / "store")
    m0 = write_anchor(store, weights, version=0)
    target = InMemoryTarget()
    target.init(EngineClaim(agent_id="agent-0", staging_root=str(tmp_path / "staging")))
    target.apply(
        StagedUpdate(objects=(stage_object(tmp_path / "staging" / "v0", m0, m0.to_json(), load_object(store, m0)),))
    )
    bad = tmp_path / "staging" / "bad.json"
    bad.write_text("{not json")
    info = {
        "objects": [{"kind": "delta", "version": 1, "base_version": 0, "manifest_path": str(bad), "shard_paths": []}]
    }
    with pytest.raises(UpdateRefused) as exc:
        target.apply(StagedUpdate.from_update_info(info))
    assert exc.value.reason is RefusalReason.MALFORMED and not isinstance(exc.value, ApplyError)
    assert target.state().healthy and target.label == "0"


def test_init_never_relabels_a_version_the_engine_knows(w: World) -> None:
    """``init`` with ``base_version=0`` on an engine serving v1 never relabels it '0' nor resets its high water."""
    w.publisher.step()
    agent = w.agent("agent-0")
    agent.sync()
    agent.target.init(EngineClaim(agent_id=agent.config.agent_id, base_version=0))
    st = agent.target.state()
    assert (st.version, st.label, st.high_water) == (1, "1", 1)


def test_a_staged_shard_swapped_after_verification_never_serves(tmp_path: Path, weights) -> None:
    """A raw shard replaced in the staging directory after the agent checked it: the receiver's checksums after
    writing catch it, and the engine is unlabelled (never serves the old label) until an anchor restores it."""
    store = LocalStore(tmp_path / "store")
    m0 = write_anchor(store, weights, version=0)
    new = {k: v.clone() for k, v in weights.items()}
    new["b"][:3] += 1
    m1 = write_delta(store, compute_delta(weights, new), state=new, version=1, base=m0)
    root = tmp_path / "staging"
    target = InMemoryTarget()
    target.init(EngineClaim(agent_id="agent-0", staging_root=str(root)))
    target.apply(StagedUpdate(objects=(stage_object(root / "v0", m0, m0.to_json(), load_object(store, m0)),)))
    d1 = load_object(store, m1, base=weights)
    obj = stage_object(root / "v1", m1, m1.to_json(), d1)
    evil = [dataclasses.replace(d, values=torch.full_like(d.values, 7.0), base_values=None) for d in d1]
    Path(obj.shard_paths[0]).write_bytes(
        encode_shard(evil, kind="delta", encoding="raw", target_version=1, base_version=0)
    )
    files_only = StagedUpdate.from_update_info(StagedUpdate(objects=(obj,)).to_update_info())
    with pytest.raises(ApplyError, match="the engine needs an anchor"):
        target.apply(files_only)
    assert not target.state().healthy and target.label == "unhealthy" and target.version is None
    with pytest.raises(UpdateRefused) as exc:
        target.apply(StagedUpdate(objects=(stage_object(root / "v1b", m1, m1.to_json(), d1),)))
    assert exc.value.reason is RefusalReason.UNHEALTHY
    target.init(EngineClaim(agent_id="agent-0", allow_rollback=True))  # the operator's policy, at the claim
    target.apply(StagedUpdate(objects=(stage_object(root / "v0b", m0, m0.to_json(), load_object(store, m0)),)))
    assert target.state().healthy and target.label == "0"


def test_two_runs_signed_by_one_key_are_never_mixed(tmp_path: Path) -> None:
    """Two runs sharing a publisher key: with run B's signed delta v1 swapped into run A's store,
    ``read_weights(trust=key)`` never returns run A's untouched tensors with run B's touched ones."""
    key = SigningKey.generate()
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    wa, wb = (
        ObjectWriter(store=a, signing_key=key, run_id="run-aaaa"),
        ObjectWriter(store=b, signing_key=key, run_id="run-bbbb", encoding="raw"),
    )
    g = torch.Generator().manual_seed(1)
    sa = {"x": torch.randn(8, 16, generator=g).bfloat16(), "y": torch.randn(16, generator=g).bfloat16()}
    sb = {k: torch.randn(v.shape, generator=g).bfloat16() for k, v in sa.items()}
    ma, mb = write_anchor(wa, sa, version=0), write_anchor(wb, sb, version=0)
    a1 = {k: v.clone() for k, v in sa.items()}
    a1["x"].view(-1)[0] += 1
    write_delta(wa, compute_delta(sa, a1), state=a1, version=1, base=ma)
    b1 = {k: v.clone() for k, v in sb.items()}
    b1["y"] += 1
    write_delta(wb, compute_delta(sb, b1), state=b1, version=1, base=mb)
    shutil.rmtree(a.root / "v00000001")
    shutil.copytree(b.root / "v00000001", a.root / "v00000001")
    with pytest.raises(FormatError, match=r"the chain to v1 mixes objects of runs \['run-aaaa', 'run-bbbb'\]"):
        read_weights(a, 1)  # consistency alone
    # with the key: these writers recorded no run.json, so a key-only reader must pin the run
    with pytest.raises(ForeignObject, match="has no run record"):
        read_weights(a, 1, trust=Trust(verify_key=key.verify_key))
    with pytest.raises(ForeignObject, match="belongs to run run-bbbb, this reader is pinned to run run-aaaa"):
        read_weights(a, 1, trust=Trust(verify_key=key.verify_key, run_id="run-aaaa"))


def test_one_planted_anchor_does_not_break_the_registered_delta_chain(w: World) -> None:
    """An unregistered ``v2/anchor/manifest.json`` (``{}``) fails no trusted read of v2, and a restarted agent
    syncs through the registered deltas without downloading a full anchor."""
    agent = w.agent("agent-0")
    w.publisher.step()
    w.publisher.step()
    agent.sync()
    w.store.put("v00000002/anchor/manifest.json", b"{}")
    trust = Trust(ledger=w.publisher.client.registered_digest)
    assert_bit_equal(read_weights(w.store, 2, trust=trust), w.publisher.truth[2])
    w.publisher.step()
    restarted = w.agent("agent-0", target=agent.target)
    result = restarted.sync()
    assert (result.route, result.to_version) == ("deltas", 3)
    assert_bit_equal(agent.target.weights, w.publisher.truth[3])


def test_tensor_names_cannot_forge_a_fingerprint_collision(tmp_path: Path) -> None:
    """Names holding NUL and newline could make another model's fingerprint equal to the served one's, and the
    engine admit the foreign anchor: names with control characters or ':' are refused everywhere."""
    evil = "a\0BF16\0[2]\nb"
    with pytest.raises(ValueError, match="no ':' and no control characters"):
        write_anchor(LocalStore(tmp_path / "s"), {evil: torch.ones(3, dtype=torch.bfloat16)}, version=0)
    store = LocalStore(tmp_path / "t")
    m = write_anchor(store, {"a": torch.ones(2, dtype=torch.bfloat16)}, version=0)
    doc = json.loads(store.get(manifest_key(0, "anchor")))
    doc["tensors"][evil] = doc["tensors"].pop("a")
    with pytest.raises(FormatError, match="no ':' and no control characters"):
        type(m).from_json(json.dumps(doc).encode(), name="hostile")


def test_a_deeply_nested_signature_is_a_signature_error(tmp_path: Path, weights) -> None:
    """A ``manifest.sig`` of lists nested deep is a SignatureError, never a RecursionError out of a reader (a
    signature is also capped at 4 KiB, read or not)."""
    key = SigningKey.generate()
    store = LocalStore(tmp_path / "store")
    write_anchor(ObjectWriter(store=store, signing_key=key), weights, version=0)
    depth = 2000  # 4000 bytes: under the cap, past json's recursion limit
    path = store.root / signature_key(0, "anchor")
    path.unlink()
    path.write_bytes(b"[" * depth + b"]" * depth)
    with pytest.raises(SignatureError):
        read_manifest(store, 0, "anchor", trust=Trust(verify_key=key.verify_key))


def test_a_directory_nested_past_the_store_depth_is_skipped(tmp_path: Path, caplog) -> None:
    """A 2000-deep directory in the store is skipped with a warning: listing is iterative and stops at
    ``MAX_DEPTH`` (no deltasync key is deeper than 3), so ``list`` never raises RecursionError (nor GC a 500)."""
    store = LocalStore(tmp_path / "store")
    store.put("v00000000/anchor/manifest.json", b"{}")
    fd = os.open(store.root, os.O_RDONLY)
    for _ in range(2000):  # relative mkdir/openat: the path grows past PATH_MAX
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    os.close(fd)
    try:
        assert store.list() == ["v00000000/anchor/manifest.json"]
        assert "is deeper than 16 levels; not listed" in caplog.text
    finally:  # remove it top-down, lifting the rest one level each time: pytest's recursive clean-up would fail
        top = store.root / "d"
        while (top / "d").exists():
            os.rename(top / "d", store.root / "rest")
            top.rmdir()
            os.rename(store.root / "rest", top)
        top.rmdir()


def test_agent_run_outlives_a_coordinator_answer_it_cannot_parse(w: World, monkeypatch) -> None:
    """A heartbeat answer failing validation never escapes ``Agent.run`` to kill the agent thread."""
    agent = w.agent("agent-0", poll_wait_s=0.05)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise ValueError("1 validation error for AgentPublic")

    monkeypatch.setattr(agent.coordinator, "heartbeat", broken)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    w.publisher.step()
    deadline = 200
    while agent.target.version != 1 and deadline:
        stop.wait(0.05)
        deadline -= 1
    stop.set()
    thread.join(10)
    assert agent.target.version == 1 and calls  # it kept syncing although every heartbeat failed


def test_a_fetch_that_fails_after_linking_leaves_nothing_staged(w: World) -> None:
    """An agent that stages for an engine that decodes links a local store's shards unread before it fetches the
    others; a shard that cannot be linked (here: not its manifest's size) is fetched and refused, and the
    directories made for the update are gone: nothing of a refused update stays in the staging directory."""

    class Decoding(InMemoryTarget):  # says, as a vLLM engine in place does, that it decodes what it is given
        def state(self):  # type: ignore[no-untyped-def]
            return dataclasses.replace(super().state(), decodes=True)

    agent = w.agent("agent-0", target=Decoding(staged_files=True))
    assert agent.sync().to_version == 0
    v = w.publisher.step()
    shard = w.store.root / f"v{v:08d}" / read_manifest(w.store, v).shards[0].file
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])  # (this target decodes no packed delta: no recovery asserted)
    with pytest.raises(IntegrityError, match="size is"):
        agent.sync()
    assert sorted(p.name for p in agent.staging.iterdir() if p.name != "cache") == []
