"""Faults with real processes on 127.0.0.1: nothing is lost and nothing wrong is served (docs/RELIABILITY.md).

Each test prints a ``RELIABILITY`` line with its figures (run with ``-s`` to see them).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from deltasync import (
    FencedObject,
    IntegrityError,
    LocalStore,
    ObjectNotFound,
    RefusalReason,
    StoreError,
    Trust,
    UpdateRefused,
    VersionGapError,
    list_versions,
    read_manifest,
    read_weights,
)
from deltasync.agent import Agent
from deltasync.client import CoordinatorClient, RetryPolicy
from deltasync.config import AgentConfig, PublisherConfig
from deltasync.layout import manifest_key
from deltasync.publisher import Publisher
from deltasync.reader import load_object
from deltasync.staging import StagedUpdate, stage_object
from deltasync.targets import InMemoryTarget
from deltasync.testing.launchers import CoordinatorProcess
from deltasync.testing.models import qwen3_shapes
from deltasync.testing.stream import UpdateStream
from tests.conftest import (
    AGENT_TOKEN,
    PUBLISHER_TOKEN,
    SMALL_QWEN3,
    TOKENS_ENV,
    agent_token,
    assert_agents_hold,
    assert_bit_equal,
    overwrite,
    remove,
)

pytestmark = pytest.mark.slow
ENV = TOKENS_ENV


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    with CoordinatorProcess(
        tmp_path / "ledger.db", store=str(tmp_path / "store"), env=ENV, args=["--max-wait-s", "5"]
    ) as proc:
        yield proc


@pytest.fixture
def light_agent() -> Iterator:
    """Makes agents on in-memory engines (the real agent, client and store; no vLLM); closes their clients."""
    clients: list[CoordinatorClient] = []

    def make(store, url: str, agent_id: str, tmp: Path) -> Agent:
        token = agent_token(agent_id)
        clients.append(CoordinatorClient(url, token=token, retry=RetryPolicy(retries=40, backoff_s=0.05, timeout_s=10)))
        config = AgentConfig(
            agent_id=agent_id, staging_dir=str(tmp / agent_id), retries=1, backoff_s=0.01, poll_wait_s=1
        )
        return Agent(store=store, coordinator=clients[-1], target=InMemoryTarget(), config=config)

    yield make
    for client in clients:
        client.close()


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the process exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def run_publisher(tmp: Path, url: str, n: int, seed: int, **pause) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.fault_scripts",
        "publish",
        str(tmp / "store"),
        url,
        str(n),
        "--seed",
        str(seed),
        "--truth",
        str(tmp / "truth"),
    ]
    if pause:
        cmd += ["--pause-at", pause["at"], "--marker", str(pause["marker"])]
    if "freeze_window_s" in pause:
        cmd += ["--freeze-window-s", str(pause["freeze_window_s"])] + (["--stop-after"] if pause["stop_after"] else [])
    (tmp / "truth").mkdir(exist_ok=True)
    return subprocess.Popen(cmd, env={**os.environ, **ENV})


# ---------------------------------------------------------------- 1. kill -9 the publisher


@pytest.mark.parametrize("point", ["between-shards", "before-manifest"])
def test_publisher_killed_mid_version(tmp_path: Path, coordinator: CoordinatorProcess, point: str, light_agent) -> None:
    at = "v00000003/shard-00001" if point == "between-shards" else "v00000003/manifest.json"
    marker = tmp_path / "paused"
    proc = run_publisher(tmp_path, coordinator.url, 6, seed=0, at=at, marker=marker)
    wait_for(marker, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    store = LocalStore(tmp_path / "store")
    partial = [k for k in store.list() if k.startswith("v00000003/")]
    assert partial and manifest_key(3, "delta") not in partial  # a half-written version is in the store...
    assert [x.version for x in list_versions(store)] == [0, 1, 2]  # ...and invisible to readers
    agent = light_agent(store, coordinator.url, "a0", tmp_path)
    assert agent.sync().to_version == 2
    with pytest.raises(ObjectNotFound):
        read_weights(store, 3)
    left_behind = {k: store.get(k) for k in partial}
    # a restarted publisher (new weights: its snapshot is gone) waits for the dead one's lease to lapse, then
    # continues above every key in the store: v3's leftovers are never written over, v4 is an anchor
    t0 = time.monotonic()
    again = run_publisher(tmp_path, coordinator.url, 2, seed=1)
    assert again.wait(120) == 0
    recovery_s = time.monotonic() - t0
    listing = {x.version: x for x in list_versions(store)}
    assert sorted(listing) == [0, 1, 2, 4, 5] and listing[4].anchor and not listing[4].delta
    assert {k: store.get(k) for k in partial} == left_behind  # create-only: the crash's files untouched
    for v in (4, 5):
        assert_bit_equal(read_weights(store, v), torch.load(tmp_path / "truth" / f"v{v}.pt"))
    assert agent.sync().to_version == 5
    assert_bit_equal(agent.target.weights, torch.load(tmp_path / "truth" / "v5.pt"))
    print(
        f"\nRELIABILITY publisher kill -9 {point}: versions lost 0, partial version visible: no, "
        f"restart to v5 registered {recovery_s:.1f} s (incl. interpreter start and the lease's 3 s TTL)"
    )


@pytest.mark.parametrize("then", ["resumed", "killed-after-its-late-write"])
def test_a_frozen_publisher_past_its_lease_never_commits_a_version_readers_take(
    tmp_path: Path, coordinator: CoordinatorProcess, then: str
) -> None:
    """SIGSTOP a publisher between its last lease refresh and its manifest write, past the lease TTL, while a
    second publisher takes the run; then resume it (it writes its manifest late). Resumed, it withdraws what
    registration refused; killed right after the late write, its leftover names an epoch the second publisher
    fenced: key-only readers refuse it, `deltasync ls` marks it, and gc deletes it."""
    marker = tmp_path / "paused"
    first = run_publisher(
        tmp_path,
        coordinator.url,
        6,
        seed=0,
        at="v00000003/manifest.json",
        marker=marker,
        freeze_window_s=2.0,
        stop_after=then != "resumed",
    )
    wait_for(marker, first)
    os.kill(first.pid, signal.SIGSTOP)  # every thread: no lease renewal, no write
    try:
        time.sleep(4)  # past the 3 s lease TTL
        second = run_publisher(tmp_path, coordinator.url, 2, seed=1)
        assert second.wait(120) == 0  # takes the run (epoch 2), starts above v3's shards: anchor v4, delta v5
    finally:
        os.kill(first.pid, signal.SIGCONT)
    store = LocalStore(tmp_path / "store")
    if then == "resumed":
        assert first.wait(60) != 0  # registration refused it: fenced
    else:
        wait_for(Path(f"{marker}.written"), first)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    late = manifest_key(3, "delta")
    run_id = httpx.get(f"{coordinator.url}/healthz").json()["run_id"]
    pinned = Trust(run_id=run_id)
    if then == "resumed":
        assert not store.exists(late)  # withdrawn by the fenced publisher itself
    else:
        assert store.exists(late) and read_manifest(store, 3).lease_epoch == 1
        with pytest.raises(FencedObject, match=r"epoch 1, but epoch 2 took run .* registered v2: a fenced"):
            read_weights(store, 3, trust=pinned)
        ls = subprocess.run(
            [sys.executable, "-m", "deltasync.cli", "ls", str(tmp_path / "store")], capture_output=True, text=True
        )
        assert ls.returncode == 0 and "FENCED: epoch 1" in ls.stdout and "readers refuse them" in ls.stderr, ls
    for v in (4, 5):  # the run goes on through the second publisher, exactly
        assert_bit_equal(read_weights(store, v, trust=pinned), torch.load(tmp_path / "truth" / f"v{v}.pt"))
    with CoordinatorClient(coordinator.url, token=PUBLISHER_TOKEN) as client:
        report = client.collect_garbage()
    assert "v00000003/" in report.leftovers  # the fenced (or crashed) publisher's v3, never registered
    assert not [k for k in store.list() if k.startswith("v00000003/")]
    assert [x.version for x in list_versions(store)] == [0, 1, 2, 4, 5] or report.deleted
    print(f"\nRELIABILITY frozen publisher {then}: late write readable: no, gc deleted {report.leftovers}")


# ---------------------------------------------------------------- 3. kill -9 and restart the coordinator


def test_coordinator_killed_mid_run(tmp_path: Path, coordinator: CoordinatorProcess, light_agent) -> None:
    store = LocalStore(tmp_path / "store")
    stream = UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=3)
    agents = [light_agent(store, coordinator.url, f"a{i}", tmp_path) for i in range(3)]
    stop = threading.Event()
    threads = [threading.Thread(target=a.run, args=(stop,)) for a in agents]
    client = CoordinatorClient(
        coordinator.url, token=PUBLISHER_TOKEN, retry=RetryPolicy(retries=60, backoff_s=0.05, timeout_s=10)
    )
    truth = {}
    for t in threads:
        t.start()
    outage_s = 3.0
    with Publisher(store, client, PublisherConfig(anchor_every=15)) as pub:
        for step in range(40):
            if step == 15:  # the coordinator dies; it comes back after an outage, whatever the publisher does
                coordinator.kill()
                threading.Timer(outage_s, coordinator.start).start()
            weights = stream.step()
            truth[pub.publish(weights, step)] = weights
    deadline = time.monotonic() + 60
    while any(a.target.version != 39 for a in agents) and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(30)
    ledger = client.wait_for_versions(None, wait_s=0)
    client.close()
    deltas = [v.version for v in ledger if v.kind == "delta"]
    assert deltas == list(range(1, 40)) and len(ledger) == len({(v.version, v.kind) for v in ledger})
    assert_agents_hold(agents, 39, truth[39])
    print(
        f"\nRELIABILITY coordinator kill -9 for {outage_s:.0f} s: versions lost 0, duplicated 0; "
        f"3 agents at v39 bit-exact"
    )


# ---------------------------------------------------------------- 4. store faults


@pytest.fixture
def published(tmp_path: Path, coordinator: CoordinatorProcess, light_agent):
    store = LocalStore(tmp_path / "store")
    stream = UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=4)
    client = CoordinatorClient(coordinator.url, token=PUBLISHER_TOKEN)
    pub = Publisher(store, client, PublisherConfig(anchor_every=None, anchor_bytes_fraction=None))
    truth = {pub.publish(stream.bf16(), 0): stream.bf16()}
    pub.flush()
    agent = light_agent(store, coordinator.url, "a0", tmp_path)
    agent.sync()

    def step() -> int:
        weights = stream.step()
        v = pub.publish(weights, len(truth))
        pub.flush()
        truth[v] = weights
        return v

    yield store, agent, step, truth, client
    pub.close()
    client.close()


FAULTS = {
    "truncated": lambda b: b[: len(b) // 2],
    "flipped byte": lambda b: b[:100] + bytes([b[100] ^ 0x01]) + b[101:],
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_corrupt_shards_are_never_applied(published, fault: str) -> None:
    store, agent, step, truth, _ = published
    v = step()
    key = f"v{v:08d}/shard-00000.safetensors"
    good = store.get(key)
    overwrite(store, key, FAULTS[fault](good))
    with pytest.raises(IntegrityError, match=r"(size is|sha256 is) "):
        agent.sync()
    assert agent.target.version == v - 1  # nothing applied
    overwrite(store, key, good)
    assert agent.sync().to_version == v
    assert_bit_equal(agent.target.weights, truth[v])


def test_a_missing_shard_then_found(published) -> None:
    store, agent, step, truth, _ = published
    v = step()
    key = f"v{v:08d}/shard-00000.safetensors"
    good = store.get(key)
    remove(store, key)
    with pytest.raises(ObjectNotFound, match="no object"):
        agent.sync()
    assert agent.target.version == v - 1
    overwrite(store, key, good)
    assert agent.sync().to_version == v


def test_a_manifest_with_a_wrong_size(published) -> None:
    store, agent, step, truth, _ = published
    v = step()
    key = manifest_key(v, "delta")
    good = store.get(key)
    m = read_manifest(store, v)
    lying = dataclasses.replace(m, shards=(dataclasses.replace(m.shards[0], bytes=m.shards[0].bytes + 1),))
    overwrite(store, key, lying.to_json())
    with pytest.raises(IntegrityError, match="the coordinator registered"):  # the manifest itself is checked
        agent.sync()
    assert agent.target.version == v - 1
    overwrite(store, key, good)
    assert agent.sync().to_version == v


def test_duplicate_out_of_order_and_replayed_versions(published, tmp_path: Path) -> None:
    from deltasync.errors import CoordinatorError
    from deltasync.schemas import VersionCreate

    store, agent, step, truth, client = published
    v1, v2 = step(), step()
    m1 = read_manifest(store, v1)
    assert client.register_version(VersionCreate.for_manifest(m1))[1] is False  # a duplicate is idempotent
    with pytest.raises(CoordinatorError) as exc:  # out of order: a new delta below the latest
        client.register_version(
            VersionCreate.for_manifest(dataclasses.replace(m1, version=v1, base_version=v1 - 1, shards=()))
        )
    assert exc.value.status_code == 409
    agent.sync()
    assert agent.target.version == v2
    # a replayed delta straight at the engine is refused before anything is written
    replay = _staged(store, v1, tmp_path / "replay")
    with pytest.raises(VersionGapError, match=f"this engine holds v{v2}"):
        agent.target.apply(StagedUpdate(objects=(replay,)))
    assert agent.target.version == v2 and agent.target.state().healthy
    assert_bit_equal(agent.target.weights, truth[v2])


def test_a_delta_for_another_model(published, tmp_path: Path) -> None:
    store, agent, step, truth, _ = published
    other = LocalStore(tmp_path / "other")
    with Publisher(other) as pub:  # another model: other names and shapes
        stream = UpdateStream.from_shapes({"model.norm.weight": (7,), "w": (3, 3)}, seed=0, lr=1e-2)
        pub.publish(stream.bf16(), 0)
        pub.publish(stream.step(), 1)
    before = agent.target.version
    with pytest.raises(UpdateRefused, match="is for another model") as exc:
        agent.target.apply(StagedUpdate(objects=(_staged(other, 1, tmp_path / "foreign"),)))
    assert exc.value.reason is RefusalReason.MODEL
    assert agent.target.version == before and agent.target.state().healthy  # refused before any write
    assert_bit_equal(agent.target.weights, truth[before])


def _staged(store: LocalStore, version: int, directory: Path):
    m = read_manifest(store, version)
    deltas = load_object(store, m, base=read_weights(store, version - 1))
    return stage_object(directory, m, store.get(manifest_key(version, "delta")), deltas)


def test_a_full_disk(tmp_path: Path, coordinator: CoordinatorProcess, light_agent) -> None:
    class SmallDisk(LocalStore):
        """A size-limited store: writes past ``limit`` bytes fail as a full disk does."""

        limit = 400_000

        def put(self, key, data):
            used = sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file()) if self.root.exists() else 0
            if used + len(data) > self.limit:
                raise StoreError(f"{self.uri}: could not write {key!r} ([Errno 28] No space left on device)")
            super().put(key, data)

    store = SmallDisk(tmp_path / "store")
    stream = UpdateStream.from_shapes(qwen3_shapes(SMALL_QWEN3), seed=5)
    client = CoordinatorClient(coordinator.url, token=PUBLISHER_TOKEN)
    agent = light_agent(store, coordinator.url, "a0", tmp_path)
    pub = Publisher(store, client, PublisherConfig(anchor_every=None, anchor_bytes_fraction=None, encoding="raw"))
    with pytest.raises(StoreError, match="No space left on device"):
        for step in range(100):
            pub.publish(stream.step(), step)
            pub.flush()
    committed = [x.version for x in list_versions(store)]
    agent.sync()
    assert agent.target.version == committed[-1]  # the agent serves the last whole version, nothing more
    with pytest.raises(StoreError):
        pub.close()
    store.limit = 10**9  # space freed: a new publisher continues with an anchor, above every key written
    weights = stream.step()
    with Publisher(store, client) as again:
        v = again.publish(weights, 999)
    assert v > committed[-1] and list_versions(store)[-1].anchor
    assert agent.sync().to_version == v
    client.close()
    assert_bit_equal(agent.target.weights, weights)
    print(
        f"\nRELIABILITY full disk: publisher failed clearly after v{committed[-1]}, nothing partial visible, "
        "recovered with an anchor"
    )


# ---------------------------------------------------------------- 5. hostile input


def test_oversized_headers_bodies_traversal_and_tokens(tmp_path: Path, coordinator: CoordinatorProcess) -> None:
    url = coordinator.url
    with httpx.Client(base_url=url, timeout=10) as http:
        big_header = {"X-Junk": "x" * 100_000}
        try:
            status = http.get("/healthz", headers=big_header).status_code
        except httpx.HTTPError:
            status = "connection closed"
        assert status == 431
        assert (
            http.post(
                "/v1/versions",
                content=b"{" + b" " * 2_000_000,
                headers={"Authorization": f"Bearer {PUBLISHER_TOKEN}", "Content-Type": "application/json"},
            ).status_code
            == 413
        )
        assert http.get("/v1/versions/..%2F..%2Fetc").status_code in (404, 422)
        assert http.post("/v1/versions", json={}).status_code == 401
        assert (
            http.post(
                "/v1/agents/x/heartbeat",
                json={"applied_version": 1, "state": "idle"},
                headers={"Authorization": "Bearer wrong"},
            ).status_code
            == 403
        )
        assert http.post("/v1/gc", headers={"Authorization": f"Bearer {AGENT_TOKEN}"}).status_code == 403
        assert http.get("/v1/agents").status_code == 401  # reads need a token too
    log = coordinator.log_path.read_text()
    assert PUBLISHER_TOKEN not in log and AGENT_TOKEN not in log and "Bearer" not in log


def test_atheris_fuzzes_the_delta_reader(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is not installed")
    script = tmp_path / "fuzz.py"
    script.write_text(
        "import sys, atheris\n"
        "with atheris.instrument_imports():\n"
        "    from deltasync import decode_shard, FormatError\n"
        "def one(data):\n"
        "    try:\n"
        "        decode_shard(data, name='fuzz', base={})\n"
        "    except FormatError:\n"
        "        pass\n"
        "    except ValueError as exc:\n"
        "        if 'pass base=' not in str(exc):\n"
        "            raise\n"
        "atheris.Setup(sys.argv, one)\n"
        "atheris.Fuzz()\n"
    )
    # 5,000 inputs in CI (about 35 s on 2 cores); a longer campaign: DELTASYNC_FUZZ_RUNS=200000
    runs = int(os.environ.get("DELTASYNC_FUZZ_RUNS", "5000"))
    proc = subprocess.run(
        [sys.executable, str(script), f"-runs={runs}", "-max_len=2048", f"-artifact_prefix={tmp_path}/"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Done {runs} runs" in proc.stderr
    print(f"\nRELIABILITY atheris: {runs} inputs into decode_shard, only FormatError raised")
