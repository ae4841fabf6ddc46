"""The sidecar agent keeps a real vLLM server bit-exact: real coordinator, server and sidecar processes."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import PUBLISHER_TOKEN
from tests.integration.helpers import ServerStack, server_stack, sidecar_command

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
LAYERS = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerStack]:
    with server_stack(tmp_path_factory.mktemp("server"), tiny_model_dir) as s:
        yield s


def test_a_late_sidecar_catches_up_from_the_anchor_then_follows(stack: ServerStack) -> None:
    pub = stack.publisher
    for _ in range(4):
        pub.step(anchor=pub.version + 1 == 3)
    stack.start_sidecar()  # late: the server serves its startup weights ('default'), v0..v4 are published
    stack.wait_applied(4)
    stack.assert_served(4)
    for _ in range(4):
        pub.step()
        time.sleep(0.3)
    stack.wait_applied(8)
    stack.assert_served(8)
    completion = httpx.post(
        stack.server.url + "/v1/completions",
        timeout=60,
        json={"model": stack.server.model, "prompt": "Guess the five letter word:", "max_tokens": 8, "temperature": 0},
    )
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] is not None


def test_a_sidecar_killed_mid_stream_resumes_at_the_engines_real_version(stack: ServerStack) -> None:
    pub = stack.publisher
    for _ in range(3):
        pub.step()
    time.sleep(0.5)  # the sidecar is fetching or applying
    stack.kill_sidecar()
    served = stack.server.admin_json("GET", "/weight_info")["weight_version"]
    for _ in range(2):
        pub.step(anchor=pub.version + 1 == 12)
    stack.start_sidecar()
    stack.wait_applied(pub.version)
    stack.assert_served(pub.version)
    assert int(served) in range(8, pub.version + 1)
    paused = stack.server.admin_json("GET", "/is_paused")
    assert paused.get("is_paused") is False


# ---------------------------------------------------------------------------------------------------- the boundary
# A caller who reaches vLLM's port and holds no engine credential (a rollout worker, an environment
# running model-written code) tries every way in. Each is refused, and the engine keeps serving exactly what it
# served, under the same label, bit for bit.

ATTACKS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/init_weight_transfer_engine", {"init_info": {"agent_id": "evil", "staging_root": "/tmp"}}),
    ("POST", "/init_weight_transfer_engine", {"init_info": {"agent_id": "sidecar-0", "allow_rollback": True}}),
    ("POST", "/start_weight_update", {}),
    ("POST", "/update_weights", {"update_info": {"objects": [], "allow_rollback": True}}),
    ("POST", "/finish_weight_update", {}),
    ("POST", "/update_weight_version", {"new_version": "999"}),
    ("POST", "/collective_rpc", {"method": "reset_weights"}),
    ("POST", "/collective_rpc", {"method": "reload_weights"}),
    ("POST", "/collective_rpc", {"method": "deltasync_status"}),
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("POST", "/abort_requests", {}),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/sleep", None),
    ("POST", "/wake_up", None),
    ("POST", "/scale_elastic_ep", {"new_data_parallel_size": 2}),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
    ("POST", "/start_profile", None),
    ("GET", "/server_info", None),
]


def _served(stack: ServerStack) -> tuple[str, bool, list[dict[str, Any]]]:
    with stack.server.admin() as admin:
        label = admin.get("/weight_info").json()["weight_version"]
        paused = admin.get("/is_paused").json()["is_paused"]
        ranks = admin.post("/collective_rpc", json={"method": "deltasync_status"}).json()["results"]
    keys = ("version", "healthy", "high_water", "run_id", "agent", "allow_rollback", "mode", "drift", "history")
    return label, paused, [{k: r.get(k) for k in keys} for r in ranks]  # not "proofs": the sidecar proves every 2 s


def test_without_the_engine_credential_no_request_changes_the_engine(stack: ServerStack) -> None:
    pub = stack.publisher
    stack.wait_applied(pub.version)
    before = _served(stack)
    url = stack.server.url
    for method, path, body in ATTACKS:
        bare = httpx.request(method, url + path, json=body, timeout=30)
        assert bare.status_code == 401, (method, path, bare.status_code, bare.text)
        assert bare.json()["error"] == (
            f"deltasync: {method} {path} is not an inference route: it needs the engine credential "
            "(X-DeltaSync-Engine-Token); only the engine's deltasync agent may change this engine"
        )
        wrong = httpx.request(
            method, url + path, json=body, timeout=30, headers={"X-DeltaSync-Engine-Token": "not-the-credential!"}
        )
        assert wrong.status_code == 403 and "is wrong" in wrong.json()["error"], (method, path, wrong.text)
    # every other administrative route of the pinned vLLM, enumerated from its own app: test_engine_guard.py
    log = (stack.tmp / "vllm.log").read_text()
    assert 'deltasync guard: refused POST "/collective_rpc" from 127.0.0.1:' in log
    # inference works as vLLM configures it
    completion = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": stack.server.model, "prompt": "Guess:", "max_tokens": 4, "temperature": 0},
    )
    assert completion.status_code == 200
    assert _served(stack) == before
    stack.assert_served(pub.version)
    pub.step()  # the rightful agent still drives the engine
    stack.wait_applied(pub.version)
    stack.assert_served(pub.version)


def test_a_second_agent_is_refused_before_it_changes_anything(stack: ServerStack) -> None:
    pub = stack.publisher
    stack.wait_applied(pub.version)
    before = _served(stack)
    cmd = sidecar_command(stack.server.url, stack.coordinator.url, stack.store.root, stack.tmp / "staging-2")
    other = [*cmd[1:], "--apply-mode", "patches", "--allow-rollback"]  # another policy, too
    other[other.index("sidecar-0")] = "sidecar-1"
    procs = [stack.spawn(*other, agent_id="sidecar-1")]
    # the same id, copy-pasted into a second process: refused while the running agent's session is alive
    same = sidecar_command(stack.server.url, stack.coordinator.url, stack.store.root, stack.tmp / "staging-3")
    same = [*same[1:], "--apply-mode", "patches", "--allow-rollback"]
    procs.append(stack.spawn(*same, agent_id="sidecar-0"))
    expected = (
        "this engine is driven by agent 'sidecar-0'; refusing to touch it",
        "agent 'sidecar-0' drives this engine from another process, heard from",
    )
    deadline = time.monotonic() + 180
    while not all(e in stack.log.read_text() for e in expected):  # they start, are refused, and back off
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), stack.log.read_text()[-5000:]
        time.sleep(0.5)
    for proc in procs:
        proc.terminate()
        proc.wait(30)
    assert _served(stack) == before  # mode, rollback policy, owner: unchanged
    pub.step()  # the rightful agent is never locked out (its staging root is unchanged)
    stack.wait_applied(pub.version)
    stack.assert_served(pub.version)


def test_an_update_message_carries_no_policy(stack: ServerStack) -> None:
    """Even with the credential, ``allow_rollback`` in an update message is refused: the policy is the claim's."""
    before = _served(stack)
    with stack.sidecar_frozen():  # its recovery of a session it did not start would re-claim and clear the outcome
        with stack.server.admin() as admin:  # a 500 drops vLLM's keep-alive connection: one client per call
            assert admin.post("/start_weight_update", json={}).status_code == 200
        with stack.server.admin() as admin:
            r = admin.post("/update_weights", json={"update_info": {"objects": [], "allow_rollback": True}})
        [rank] = stack.server.admin_json("POST", "/collective_rpc", {"method": "deltasync_status"})["results"]
        if rank["session_active"]:
            with stack.server.admin() as admin:
                admin.post("/finish_weight_update", json={})
    assert r.status_code >= 400 and rank["outcome"]["refused"] == "malformed"
    assert "update_info has unknown fields ['allow_rollback']: an update carries only its objects" in str(
        rank["outcome"]["message"]
    )
    assert _served(stack)[:2] == before[:2]
    stack.assert_served(stack.publisher.version)


def test_drift_drops_the_label_and_an_anchor_restores_the_engine(stack: ServerStack) -> None:
    """A path outside deltasync (vLLM's own ``reload_weights``, called here with the credential) changes the served
    weights under a registered label: the sidecar's whole-state proof (every 2 s here) catches it, unlabels and
    pauses the engine, says so to the coordinator, and restores it through an anchor, bit-exact."""
    pub = stack.publisher
    stack.kill_sidecar()  # the same agent, restarted with a 2 s audit: it takes over its engine after the ttl
    stack.start_sidecar("--audit-interval-s", "2")
    pub.step()
    stack.wait_applied(pub.version, timeout_s=300)
    plan = {"method": "deltasync_prove", "kwargs": {"windows": [], "extras": False}}
    [rank] = stack.server.admin_json("POST", "/collective_rpc", plan)["results"]
    assert rank["kernel_blocks"].get("model.layers.0.self_attn.qkv_proj") == 4, rank  # read back a block at a time
    # vLLM's own reload_weights (a path outside deltasync) with q_proj alone changed: on the CPU build only the
    # repacked copy in the qkv kernel changes (the parameter is empty), which the proof reads back through the kernel
    evil = stack.tmp / "evil"
    evil.mkdir()
    for f in Path(stack.server.model).iterdir():
        if f.suffix == ".json" or f.name.startswith("tokenizer"):
            shutil.copy(f, evil / f.name)
    name = "model.layers.0.self_attn.q_proj.weight"
    save_file({name: (pub.truth[pub.version][name].float() * -3).to(torch.bfloat16)}, str(evil / "model.safetensors"))
    with stack.server.admin() as admin:
        r = admin.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(evil)}})
        assert r.status_code == 200, r.text
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = httpx.get(
            stack.coordinator.url + "/metrics", timeout=30, headers={"Authorization": f"Bearer {PUBLISHER_TOKEN}"}
        ).text
        seen.update(r for r in stack.client.health()["reasons"] if "drift" in r)
        if re.search(r"^deltasync_engine_drifts_total 1\.0$", metrics, re.M):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(stack.log.read_text()[-3000:])
    assert any("agent sidecar-0: drift:" in r and "published checksums" in r for r in seen), seen
    stack.wait_served(pub.version)
    stack.assert_served(pub.version)  # restored, bit-exact
    assert "drift:" in stack.log.read_text()
    deadline = time.monotonic() + 60
    while any("drift" in r for r in stack.client.health()["reasons"]):  # re-proven whole: the alert goes
        assert time.monotonic() < deadline, stack.client.health()
        time.sleep(0.2)
