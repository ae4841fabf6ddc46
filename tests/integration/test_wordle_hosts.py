"""The Wordle demo across five hosts that share nothing but a network (`make demo-hosts`, shortened): store (S3),
coordinator (TLS), trainer, inference (vLLM + agent) and environment (env server + rollout workers), each in its own
network and mount namespaces. Every cross-host connection went between host addresses, no process opened a file of
another host, the bound held, the end is bit-exact, and nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples.wordle.hosts import unavailable

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]

BASE = Path("/var/tmp/deltasync-hosts-test")


def test_shortened_demo_across_five_hosts(tmp_path: Path) -> None:
    out = tmp_path / "hosts"
    cmd = [sys.executable, "-m", "examples.wordle.run_hosts", "--out", str(out), "--base", str(BASE)]
    cmd += ["--steps", "6", "--warmup-steps", "20"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "BIT-EXACT" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    summary, steps, final = report["summary"], report["steps"], report["final"]
    # bit-exact across hosts: the trainer's checksums (written on its host) equal what vLLM computes with (read on
    # the inference host, with the engine credential that never left it), at the trainer's last version
    assert summary["bit_exact"] and summary["served_weight_version"] == str(summary["trainer_version"]) == "6"
    assert summary["tensors_checked"] > 0
    # no process opened a file in another host's directory; every TCP peer was a host's own loopback or a host
    # address on the links
    assert summary["violations"] == []
    # the environment host (where model-written code runs) reaches vLLM's inference routes, but every
    # administrative request it makes is refused (no credential, or a guessed one), and it cannot see the credential
    boundary = summary["engine_boundary_from_env_host"]
    assert boundary.pop("read engine.token") == "FileNotFoundError"
    assert boundary.pop("processes showing an engine credential") == 0  # its own /proc shows only its processes
    assert boundary and all(status in (401, 403) for status in boundary.values()), boundary
    # the traffic went where the deployment says, over the links: rollout workers to vLLM's inference routes, the
    # trainer to the rollout service and the coordinator, the agent to the coordinator; store traffic both ways
    connections = set(summary["connections"])
    assert {"env -> inference", "trainer -> env", "trainer -> coordinator", "inference -> coordinator"} <= connections
    links = summary["link_bytes"]
    assert set(links) == {"store", "coordinator", "trainer", "inference", "env"}
    assert links["store"]["received"] > 100_000 and links["store"]["sent"] > 100_000  # deltas in, deltas out
    assert all(v["sent"] > 0 and v["received"] > 0 for v in links.values())
    # the bound held; production sized to consumption
    assert all(0 <= s <= 2 for r in steps for s in r["staleness"]), [r["staleness"] for r in steps]
    assert sum(summary["staleness_histogram"].values()) == 2 * len(steps) == 12
    assert final["episodes"] > 0
    # the recipe printed is the commands each host ran
    recipe = (out / "recipe.txt").read_text()
    for line in ("store$", "coordinator$", "inference$", "env$", "trainer$", "--ssl-certfile", "s3://"):
        assert line in recipe
    assert summary["after_setup_s"] < 900
    # everything torn down: namespaces, processes, the hosts' directories
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [ns for ns in summary["namespaces"] if ns in names]
    leftovers = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if summary["base"].encode() in cmdline.read_bytes():
                leftovers.append(cmdline.parent.name)
        except OSError:
            continue
    assert not leftovers and not Path(summary["base"]).exists()
