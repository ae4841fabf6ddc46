"""GC never loses history: garbage collection attacked with symlinks, a missing newest anchor, and
an agent fetching its plan while GC runs. Nothing outside the store is touched, nothing is deleted before an
anchor is proven intact, and nothing an agent was just told to fetch disappears."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deltasync import LocalStore, ObjectNotFound, list_versions, read_weights
from deltasync.layout import manifest_key
from tests.conftest import remove
from tests.support.asgi import AGT, PUB, Coordinator, auth, weights_store

pytestmark = pytest.mark.anyio


async def test_gc_never_follows_a_symlinked_version_directory(coord: Coordinator, tmp_path: Path) -> None:
    """GC through a symlinked version directory never deletes files outside the store."""
    store = LocalStore(tmp_path / "store")
    await weights_store(coord, store, 5, anchors=(5,))
    outside = tmp_path / "precious"
    (store.root / "v00000002").rename(outside)  # v2's files now live outside the store...
    os.symlink(outside, store.root / "v00000002")  # ...and the store holds only a link to them
    before = sorted(p.name for p in outside.iterdir())
    report = (await coord.http.post("/v1/gc", headers=PUB)).json()
    assert sorted(p.name for p in outside.iterdir()) == before == ["manifest.json", "shard-00000.safetensors"]
    deleted = [(x["version"], x["kind"]) for x in report["deleted"]]
    assert deleted == [(0, "anchor"), (1, "delta"), (3, "delta"), (4, "delta"), (5, "delta")]
    assert len(report["problems"]) == 1
    assert "'v00000002' is a symlink or not a directory; deltasync never follows links" in report["problems"][0]
    assert (store.root / "v00000002").is_symlink()  # left for a person to look at, not followed


async def test_gc_never_deletes_through_a_symlinked_file(coord: Coordinator, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    await weights_store(coord, store, 5, anchors=(5,))
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"not the store's")
    shard = store.root / "v00000001" / "shard-00000.safetensors"
    shard.unlink()
    os.symlink(target, shard)
    report = (await coord.http.post("/v1/gc", headers=PUB)).json()
    assert (1, "delta") in {(x["version"], x["kind"]) for x in report["deleted"]}  # its manifest went: uncommitted
    assert target.read_bytes() == b"not the store's"  # the link's target was never touched
    assert shard.is_symlink()  # nor was the link: the store lists and deletes regular files only


async def test_gc_proves_the_kept_anchor_before_deleting_anything(coord: Coordinator, tmp_path: Path) -> None:
    """With the newest anchor's files missing, GC deletes nothing: deleting every older anchor and delta would
    leave none of the versions 0..9 that read_weights rebuilt before."""
    store = LocalStore(tmp_path / "store")
    await weights_store(coord, store, 10, anchors=(5, 10))
    for key in store.list("v00000010/anchor/"):
        remove(store, key)
    for v in range(10):
        read_weights(store, v)
    report = (await coord.http.post("/v1/gc", headers=PUB)).json()
    assert report["kept_anchor"] == 5
    assert report["problems"][0].startswith("anchor v10 cannot be proven intact (ObjectNotFound")
    assert [(x["version"], x["kind"]) for x in report["deleted"]] == [(0, "anchor")] + [
        (v, "delta") for v in range(1, 6)
    ]
    for v in range(5, 11):  # everything from the proven anchor up still rebuilds
        read_weights(store, v)
    with pytest.raises(ObjectNotFound):
        read_weights(store, 4)


async def test_gc_deletes_nothing_when_no_anchor_is_intact(coord: Coordinator, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    manifests = await weights_store(coord, store, 6, anchors=(3, 6))
    for v in (0, 3, 6):  # every anchor's shard is corrupt (same size, other bytes)
        key = f"v{v:08d}/anchor/shard-00000.safetensors"
        data = bytearray(store.get(key))
        data[-1] ^= 0xFF
        remove(store, key)
        store.put(key, bytes(data))
    before = store.list()
    report = (await coord.http.post("/v1/gc", headers=PUB)).json()
    assert report["deleted"] == [] and report["problems"][-1] == "no anchor is proven intact: nothing is deleted"
    assert store.list() == before
    assert manifests  # the fixture published what the ledger lists


async def test_gc_keeps_what_an_agent_was_just_told_to_fetch(coord: Coordinator, tmp_path: Path) -> None:
    """GC while an agent is fetching its plan never deletes that plan's anchor and deltas."""
    store = LocalStore(tmp_path / "store")
    await weights_store(coord, store, 4, anchors=(2,))
    plan = (await coord.http.get("/v1/plan", headers=AGT)).json()  # a new agent: anchor v2, deltas 3, 4
    assert [(s["version"], s["kind"]) for s in plan["steps"]] == [(2, "anchor"), (3, "delta"), (4, "delta")]
    await coord.http.post(
        "/v1/agents/agent-0/heartbeat", headers=AGT, json={"applied_version": None, "state": "fetching"}
    )
    more = await weights_store_continue(coord, store)
    report = (await coord.http.post("/v1/gc", headers=PUB)).json()
    gone = {(x["version"], x["kind"]) for x in report["deleted"]}
    assert report["kept_anchor"] == more and (2, "anchor") not in gone and (3, "delta") not in gone
    for step in plan["steps"]:  # every object of the plan is still there, so the agent's fetch succeeds
        assert store.exists(manifest_key(step["version"], step["kind"]))
    assert read_weights(store, 4) is not None
    # once the lease window passes, the plan no longer pins anything
    coord.app.state.retention.plan_lease_s = 0
    later = (await coord.http.post("/v1/gc", headers=PUB)).json()
    assert (2, "anchor") in {(x["version"], x["kind"]) for x in later["deleted"]}


async def weights_store_continue(coord: Coordinator, store: LocalStore) -> int:
    """Publish v5 and an anchor at v5 on top of what :func:`weights_store` wrote (v0..v4, anchor v2)."""
    import torch

    from deltasync import compute_delta, write_anchor, write_delta
    from deltasync.reader import read_manifest

    prev = read_weights(store, 4)
    curr = {"w": prev["w"].clone()}
    curr["w"][5] = 5
    base = read_manifest(store, 4)
    await coord.register_manifest(write_delta(store, compute_delta(prev, curr), state=curr, version=5, base=base))
    await coord.register_manifest(write_anchor(store, curr, version=5))
    assert [x.version for x in list_versions(store)][-1] == 5 and curr["w"].dtype == torch.bfloat16
    return 5


async def test_a_dry_run_proves_and_lists_but_deletes_nothing(coord: Coordinator, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    await weights_store(coord, store, 3, anchors=(3,))
    before = store.list()
    dry = (await coord.http.post("/v1/gc", params={"dry_run": True}, headers=PUB)).json()
    assert dry["kept_anchor"] == 3 and dry["deleted"] == [] and len(dry["candidates"]) == 4
    assert store.list() == before
    await coord.http.post("/v1/agents/x/heartbeat", headers=auth("x"), json={"applied_version": 1, "state": "idle"})
    dry = (await coord.http.post("/v1/gc", params={"dry_run": True}, headers=PUB)).json()
    assert [(x["version"], x["kind"]) for x in dry["candidates"]] == [(0, "anchor"), (1, "delta")]


async def test_gc_deletes_unregistered_leftovers_but_never_what_the_live_publisher_may_still_commit(
    coord: Coordinator, tmp_path: Path
) -> None:
    """Objects the ledger never registered (a crashed publisher's shards, a committed but unregistered
    version below the newest registered one) are deleted, manifest first; an unregistered version above the
    newest registered one may be the live publisher's work in progress and is kept. The fenced case, by lease
    epoch: `test_faults.py::test_a_frozen_publisher_past_its_lease_never_commits_a_version_readers_take`."""
    store = LocalStore(tmp_path / "store")
    await weights_store(coord, store, 4, anchors=(2,))
    store.put("v00000003/anchor/shard-00000.safetensors", b"a crashed publisher's anchor shard")
    store.put("v00000009/shard-00000.safetensors", b"the live publisher's next version, in progress")
    dry = (await coord.http.post("/v1/gc?dry_run=true", headers=PUB)).json()
    assert dry["leftovers"] == ["v00000003/anchor/"] and store.exists("v00000003/anchor/shard-00000.safetensors")
    report = (await coord.http.post("/v1/gc", headers=PUB)).json()
    assert report["leftovers"] == ["v00000003/anchor/"]
    assert not store.list("v00000003/anchor/")
    assert store.exists("v00000009/shard-00000.safetensors")
    assert [v.version for v in list_versions(store)] == [2, 3, 4]
