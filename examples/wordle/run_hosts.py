"""The Wordle demo across five hosts that share nothing but a network: what `make demo-hosts` runs.

    sudo python -m examples.wordle.run_hosts [--out demo-out/hosts] [--steps 80]

The hosts are made on this machine (:mod:`examples.wordle.hosts`: network, PID, IPC and mount namespaces joined by
veth links; root needed), each with its own address, loopback, processes, shared memory, ``/tmp``, ``/var/tmp`` and
directory, and run what five machines would:

=============  ===========  ==========================================================================================
host           address      runs
=============  ===========  ==========================================================================================
store          10.77.0.10   an S3 API server (moto, checking every request's signature and IAM policy) holding the
                            run's bucket: only the trainer's key writes it
coordinator    10.77.0.11   ``deltasync coordinator`` over TLS (a CA made for the run), SQLite ledger
trainer        10.77.0.12   the GRPO trainer and its Publisher: writes ``s3://``, registers over https
inference      10.77.0.13   vLLM with the deltasync backend (inference routes open to the network, its engine
                            credential in a 0600 file on this host only) and its sidecar agent, reading ``s3://``
env            10.77.0.14   the Wordle environment (on its loopback) and the rollout workers, which reach vLLM's
                            inference routes over the network and hand groups to the trainer (TLS, bearer token)
=============  ===========  ==========================================================================================

Every command is printed as the host's shell line (the README's recipe for real machines is these lines). The
launcher is the operator: it copies the base model to the hosts that load it, the CA certificate to the clients,
each host's store key to that host (:data:`STORE_GRANTS`: the environment host gets none), and at the end reads the
trainer's checksums and runs the final check on the inference host, where the engine credential is. Each host's
processes get only their own variables (its credentials, and the few of the machine's it needs: :data:`MACHINE_ENV`),
never the launcher's whole environment. While the demo runs it samples, in every host, the open files of every
process (none may lie in another host's directory) and the TCP connections (every peer is the host's own loopback or
a host address), and counts the bytes each host sent and received on its link. Everything is torn down on exit,
even after a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from deltasync.testing.launchers import VllmServerProcess
from deltasync.testing.output_dir import fresh_output_dir
from deltasync.testing.s3_iam import read_credentials
from deltasync.testing.tls import make_ca

from .hosts import SUBNET, Host, Hosts, HostsUnavailable, from_machine, unavailable
from .run_demo import _quantile, add_run_arguments, build_model, warm_start

__all__ = ["HOSTS", "MACHINE_ENV", "STORE_GRANTS", "Deployment", "main"]

HOSTS = ("store", "coordinator", "trainer", "inference", "env")
PORTS = {"store": 9000, "coordinator": 8600, "inference": 8000, "env": 8700, "rollouts": 8800}
BUCKET = "wordle-run"
AGENT_ID = "vllm-0"
STORE_GRANTS = {"trainer": "write", "coordinator": "read,delete", "inference": "read"}
"""Who holds a key to the store, and what it may do on the run's bucket (and nothing else): the trainer publishes,
the coordinator lists and reads it (and deletes, for its retention, when asked), the agent on the inference host
reads. The environment host, where model-written code runs, holds none."""
_NUMERIC = ("OMP_*", "KMP_*", "MKL_*", "OPENBLAS_*", "NVPL_*")
MACHINE_ENV = {
    "trainer": _NUMERIC,
    "inference": (*_NUMERIC, "VLLM_*", "LD_PRELOAD", "LD_LIBRARY_PATH"),
    "env": _NUMERIC,
}
"""The machine's variables a host's processes get besides the hosts' base (:data:`examples.wordle.hosts.BASE_ENV`),
as :func:`examples.wordle.hosts.from_machine` names them: how numeric code runs on this machine where torch
computes, and vLLM's settings where vLLM runs."""
_NEVER = ("VLLM_SERVER_DEV_MODE",)
"""Never passed on, whatever the machine has: vLLM's development routes change the engine with no credential."""

_WAIT = """
import ssl, sys, time, httpx
url, ca, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
verify = ssl.create_default_context(cafile=ca) if ca else True
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    try:
        if httpx.get(url, timeout=2, verify=verify).status_code < 500:
            sys.exit(0)
    except httpx.TransportError:
        pass
    time.sleep(0.3)
sys.exit(f"{url} did not answer within {timeout} s")
"""


class Deployment:
    """The five hosts' processes, started in order, followed, checked and reported.

    Args:
        hosts: the hosts (:data:`HOSTS`), made.
        out: where the report goes (the machine's, not a host's).
        model: the warm-started base model (copied to the hosts that load it).
        args: the demo's arguments.
    """

    def __init__(self, hosts: Hosts, out: Path, model: Path, args: argparse.Namespace) -> None:
        self.hosts, self.out, self.model, self.args = hosts, out, model, args
        self.py = sys.executable
        self.repo = Path(__file__).resolve().parents[2]
        self.addr = {h.name: h.address for h in hosts}
        self.procs: dict[str, tuple[Host, subprocess.Popen[Any]]] = {}
        self.recipe: list[str] = []
        publisher_token, secret = secrets.token_hex(16), secrets.token_hex(16)
        self.coordinator_env = {"DELTASYNC_PUBLISHER_TOKEN": publisher_token, "DELTASYNC_AGENT_SECRET": secret}
        self.rollout_token = secrets.token_hex(16)
        self.env_token = secrets.token_hex(16)  # the environment's, held by it and by the rollout workers beside it
        self.store_uri = f"s3://{BUCKET}/run"
        self.s3_endpoint = {
            "AWS_ENDPOINT_URL_S3": f"http://{self.addr['store']}:{PORTS['store']}",
            "AWS_REGION": "us-east-1",
        }
        self.store_keys: dict[str, dict[str, str]] = {}
        """Each store user's key (:data:`STORE_GRANTS`), as the store host made it."""
        self.coordinator_url = f"https://{self.addr['coordinator']}:{PORTS['coordinator']}"
        self.vllm_url = f"http://{self.addr['inference']}:{PORTS['inference']}"
        self.rollouts_url = f"https://{self.addr['env']}:{PORTS['rollouts']}"
        self.samples: list[dict[str, Any]] = []
        self.violations: list[str] = []
        self.peers: Counter[str] = Counter()

    # ---------------------------------------------------------------- running things in hosts

    def _base_env(self) -> dict[str, str]:
        # the code is the machine's (software installed on every host); the vLLM and HF caches are each host's own
        return {"PYTHONPATH": str(self.repo), "HOME": "/tmp/home", "PYTHONUNBUFFERED": "1"}

    def machine_env(self, host: Host) -> dict[str, str]:
        """The machine's variables ``host``'s processes get (:data:`MACHINE_ENV`)."""
        env = from_machine(*MACHINE_ENV.get(host.name, ()))
        return {k: v for k, v in env.items() if k not in _NEVER}

    def store_env(self, user: str) -> dict[str, str]:
        """What a process needs to reach the store as ``user`` (:data:`STORE_GRANTS`): the endpoint and its key."""
        return {**self.s3_endpoint, **self.store_keys[user]}

    def environment(self, host: Host, env: dict[str, str] | None = None) -> dict[str, str]:
        """The whole environment of a process on ``host`` (the hosts' base aside): ``env`` and what every process
        and this host's get. Nothing of the launcher's own environment but :meth:`machine_env`."""
        return {**self.machine_env(host), **self._base_env(), **(env or {})}

    def _show(self, host: Host, argv: list[str], env: dict[str, str]) -> None:
        secret = ("TOKEN", "SECRET", "KEY")  # AWS_ACCESS_KEY_ID is shown: an identifier, not a secret
        common = {**self._base_env(), **self.machine_env(host)}
        shown = {k: ("..." if k.rsplit("_", 1)[-1] in secret else v) for k, v in env.items() if k not in common}
        pairs = " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items())
        line = f"{host.name}$ {pairs + ' ' if pairs else ''}{shlex.join(argv).replace(self.py, 'python')}"
        self.recipe.append(line)
        print(f"[hosts] {line}", flush=True)

    def start(self, name: str, host: Host, argv: list[str], env: dict[str, str] | None = None) -> None:
        env = self.environment(host, env)
        self._show(host, argv, env)
        self.procs[name] = (host, host.popen(argv, env=env, log=f"{name}.log"))

    def run(self, host: Host, argv: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> str:
        env = self.environment(host, env)
        self._show(host, argv, env)
        done = host.run(argv, env=env, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{host.name}: {shlex.join(argv)} exited with {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout

    def wait_http(self, host: Host, url: str, name: str, *, ca: str = "", timeout_s: float = 120) -> None:
        """Wait, from ``host``, until ``url`` answers (the process ``name`` must stay up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            proc = self.procs[name][1]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.procs[name][0].root / name}.log")
            done = host.run([self.py, "-c", _WAIT, url, ca, "5"], env=self._base_env(), timeout=30)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not answer {url} within {timeout_s} s; see its log in {host.root}")

    # ---------------------------------------------------------------- the deployment

    def provision(self) -> None:
        """What an operator copies onto each machine: the base model where it is loaded, a tokenizer on the
        environment host, the CA's certificate on the clients, each server's certificate and key on its host,
        the engine credential on the inference host; each given to the host's user."""
        h = self.hosts
        for name in ("trainer", "inference"):
            shutil.copytree(self.model, h[name].root / "model")
            h[name].own(h[name].root / "model")
        shutil.copytree(self.model, h["env"].root / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors"))
        h["env"].own(h["env"].root / "tokenizer")
        ca, leaves = make_ca(self.out / "tls", {"coordinator": (self.addr["coordinator"],), "env": (self.addr["env"],)})
        for name, (cert, key) in leaves.items():  # each server's certificate and key on its host only
            shutil.copy(cert, h[name].root / "server.pem")
            shutil.copy(key, h[name].root / "server.key")
            os.chmod(h[name].root / "server.key", 0o600)
            h[name].own(h[name].root / "server.pem", h[name].root / "server.key")
            key.unlink()
        for name in ("trainer", "inference"):
            shutil.copy(ca, h[name].root / "ca.pem")
        token = h["inference"].root / "engine.token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        h["inference"].own(token)

    def start_store(self) -> None:
        """The S3 API on the store host (:mod:`deltasync.testing.s3_iam`: moto, checking every request's signature and
        IAM policy) with the run's bucket and a key for each of :data:`STORE_GRANTS`, which the operator takes from
        the store host (each is handed to its own host only)."""
        store = self.hosts["store"]
        argv = [self.py, "-m", "deltasync.testing.s3_iam", "--host", self.addr["store"], "--port", str(PORTS["store"])]
        argv += ["--bucket", BUCKET, "--credentials", "store-keys"]
        for user, access in STORE_GRANTS.items():
            argv += ["--grant", f"{user}={access}"]
        self.start("s3", store, argv, {"AWS_REGION": self.s3_endpoint["AWS_REGION"]})
        self.wait_http(store, self.s3_endpoint["AWS_ENDPOINT_URL_S3"], "s3")
        for user in STORE_GRANTS:
            self.store_keys[user] = read_credentials(store.root / "store-keys" / f"{user}.env")

    def start_all(self) -> None:
        h, a, py = self.hosts, self.addr, self.py
        self.start_store()

        coord = h["coordinator"]
        self.start(
            "coordinator",
            coord,
            [py, "-m", "deltasync.cli", "coordinator", "--db", "ledger.db", "--store", self.store_uri]
            + ["--host", a["coordinator"], "--port", str(PORTS["coordinator"])]
            + ["--ssl-certfile", "server.pem", "--ssl-keyfile", "server.key"],
            {**self.coordinator_env, **self.store_env("coordinator")},
        )
        agent_token = self.run(
            coord, [py, "-m", "deltasync.cli", "token", "--agent-id", AGENT_ID], self.coordinator_env
        ).strip()
        self.wait_http(
            h["trainer"], self.coordinator_url + "/healthz", "coordinator", ca=str(h["trainer"].root / "ca.pem")
        )

        inference = h["inference"]
        engine = {"DELTASYNC_ENGINE_TOKEN_FILE": str(inference.root / "engine.token")}
        server = VllmServerProcess(
            inference.root / "model", log=inference.root / "vllm.log", args=["--enable-scale-out"]
        )
        argv = server.command()
        argv[argv.index("--host") + 1] = "0.0.0.0"  # the inference routes are open to the rollout workers
        argv[argv.index("--port") + 1] = str(PORTS["inference"])
        argv[argv.index("--model") + 1] = "model"
        self.start("vllm", inference, argv, {**server.environment(), **engine})

        env = h["env"]
        self.start(
            "env",
            env,
            [py, "-m", "examples.wordle.env_server", "--host", "127.0.0.1", "--port", str(PORTS["env"])],
            {"WORDLE_ENV_TOKEN": self.env_token},
        )
        print("[hosts] waiting for vLLM (about a minute on 2 cores)", flush=True)
        self.wait_http(env, self.vllm_url + "/health", "vllm", timeout_s=600)

        local_vllm = f"http://127.0.0.1:{PORTS['inference']}"  # the agent reaches its engine on its own loopback
        self.start(
            "agent",
            inference,
            [py, "-m", "deltasync.cli", "agent", "--vllm-url", local_vllm, "--coordinator", self.coordinator_url]
            + ["--ca-bundle", "ca.pem", "--store", self.store_uri, "--agent-id", AGENT_ID]
            + ["--staging-dir", "staging", "--poll-wait-s", "5", "--backoff-s", "0.2"],
            {"DELTASYNC_AGENT_TOKEN": agent_token, **engine, **self.store_env("inference")},
        )
        self.start(
            "rollouts",
            env,
            [py, "-m", "examples.wordle.rollout_server", "--tokenizer", "tokenizer", "--vllm-url", self.vllm_url]
            + ["--env-url", f"http://127.0.0.1:{PORTS['env']}", "--host", a["env"], "--port", str(PORTS["rollouts"])]
            + ["--max-staleness", str(self.args.max_staleness), "--seed", str(self.args.seed)]
            + ["--positions", str(max(64, 2 * self.args.steps))]
            + ["--ssl-certfile", "server.pem", "--ssl-keyfile", "server.key"],
            {"WORDLE_ROLLOUT_TOKEN": self.rollout_token, "WORDLE_ENV_TOKEN": self.env_token},
        )
        self.wait_http(env, f"http://127.0.0.1:{PORTS['env']}/healthz", "env")
        self.wait_http(h["trainer"], self.rollouts_url + "/healthz", "rollouts", ca=str(h["trainer"].root / "ca.pem"))
        trainer = h["trainer"]
        self.start(
            "trainer",
            trainer,
            [py, "-m", "examples.wordle.train", "--model", "model", "--rollouts-url", self.rollouts_url]
            + ["--coordinator", self.coordinator_url, "--ca-bundle", "ca.pem", "--store", self.store_uri]
            + ["--served-from", "coordinator", "--agent-id", AGENT_ID, "--skip-final-check", "--out", "run"]
            + ["--steps", str(self.args.steps), "--warmup-steps", "0", "--learning-rate", str(self.args.learning_rate)]
            + ["--max-staleness", str(self.args.max_staleness), "--seed", str(self.args.seed)],
            {
                "DELTASYNC_PUBLISHER_TOKEN": self.coordinator_env["DELTASYNC_PUBLISHER_TOKEN"],
                **self.store_env("trainer"),
            }
            | {"WORDLE_ROLLOUT_TOKEN": self.rollout_token},
        )

    # ---------------------------------------------------------------- watching

    def _host_of_pids(self) -> dict[int, Host]:
        """Every process on the machine that lives in one of the hosts (by its network namespace)."""
        by_ns: dict[str, Host] = {}
        for host in self.hosts:
            assert host.holder is not None
            by_ns[os.readlink(f"/proc/{host.holder.pid}/ns/net")] = host
        out = {}
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                host = by_ns.get(os.readlink(proc / "ns/net"))
            except OSError:
                continue
            if host is not None:
                out[int(proc.name)] = host
        return out

    def sample(self) -> None:
        """One sample: CPU seconds per host, open files checked, TCP peers recorded and checked."""
        tick = os.sysconf("SC_CLK_TCK")
        cpu: Counter[str] = Counter()
        base = self.hosts.base
        for pid, host in self._host_of_pids().items():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu[host.name] += (int(fields[11]) + int(fields[12])) / tick
                fds = list(Path(f"/proc/{pid}/fd").iterdir())
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith(str(base) + "/") and not target.startswith(str(host.root) + "/"):
                    self.violations.append(f"{host.name} pid {pid} opened {target}")
        for host in self.hosts:
            done = subprocess.run(
                ["ip", "netns", "exec", host.netns, "ss", "-tnH", "state", "established"],
                capture_output=True,
                text=True,
                check=False,
            )
            for line in done.stdout.splitlines():
                parts = line.split()
                if len(parts) < 4:
                    continue
                local, peer = parts[-2].rsplit(":", 1)[0], parts[-1].rsplit(":", 1)[0]
                local_port = parts[-2].rsplit(":", 1)[1]
                for address in (local, peer):
                    bare = address.strip("[]").removeprefix("::ffff:")
                    if not (bare in ("127.0.0.1", "::1") or bare.startswith(SUBNET + ".")):
                        self.violations.append(f"{host.name}: a connection through {address} ({line.strip()})")
                if peer.startswith(SUBNET + "."):
                    server = {v: k for k, v in PORTS.items()}.get(int(local_port))
                    if server is None:  # this side is the client
                        self.peers[f"{host.name} -> {self._name_of(peer)}"] += 1
        self.samples.append({"t": time.time(), "cpu": dict(cpu)})

    def _name_of(self, address: str) -> str:
        return next((n for n, a in self.addr.items() if a == address.removeprefix("::ffff:")), address)

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes each host sent and received on its link (the switch's port counters)."""
        done = subprocess.run(
            ["ip", "-n", self.hosts.switch, "-s", "-j", "link", "show"], capture_output=True, text=True, check=True
        )
        names = list(self.addr)
        out = {}
        for link in json.loads(done.stdout):
            if link["ifname"].startswith("p") and link["ifname"][1:].isdigit():
                stats = link["stats64"]
                # the switch's port receives what its host sends
                out[names[int(link["ifname"][1:])]] = {"sent": stats["rx"]["bytes"], "received": stats["tx"]["bytes"]}
        return out

    def follow(self) -> list[dict[str, Any]]:
        """Progress lines while the trainer runs; a sample every ~2 s; any other process exiting is a failure."""
        metrics = self.hosts["trainer"].root / "run" / "metrics.jsonl"
        rows: list[dict[str, Any]] = []
        offset, last_sample = 0, 0.0
        trainer = self.procs["trainer"][1]
        while True:
            done = trainer.poll() is not None
            for name, (host, proc) in self.procs.items():
                if name != "trainer" and proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {host.root / name}.log")
            if time.monotonic() - last_sample > 2:
                self.sample()
                last_sample = time.monotonic()
            if metrics.exists():
                with open(metrics) as f:
                    f.seek(offset)
                    for line in f:
                        r = json.loads(line)
                        rows.append(r)
                        print(
                            f"[hosts] step {r['step']:3d}: reward {r['reward']:.3f}, rollouts from "
                            f"v{min(g[0] for g in r['groups'])} (trainer at v{r['policy_version']}), dropped so far "
                            f"{r['dropped_total']}, published v{r['version']}",
                            flush=True,
                        )
                    offset = f.tell()
            if done:
                if trainer.returncode != 0:
                    log = (self.hosts["trainer"].root / "trainer.log").read_text()[-3000:]
                    raise RuntimeError(f"the trainer exited with {trainer.returncode}:\n{log}")
                return rows
            time.sleep(0.5)

    def probe_engine_boundary(self) -> dict[str, Any]:
        """From the environment host (where model-written code would run): try to change the engine through vLLM's
        port, and to read its credential. Every administrative request must be refused, and the file not seen."""
        env = self.hosts["env"]
        token_file = self.hosts["inference"].root / "engine.token"
        script = f"""
import json, httpx
out = {{}}
for method, path, body in [("POST", "/pause", None), ("POST", "/collective_rpc", {{"method": "deltasync_effective"}}),
                           ("POST", "/update_weights", {{}}), ("GET", "/weight_info", None),
                           ("POST", "/update_weight_version", {{"version": "999"}})]:
    r = httpx.request(method, {self.vllm_url!r} + path, json=body, timeout=30,
                      headers={{"X-DeltaSync-Engine-Token": "guess-" + "x" * 40}} if path == "/pause" else {{}})
    out[method + " " + path] = r.status_code
try:
    open({str(token_file)!r}).read()
    out["read engine.token"] = "read"
except OSError as exc:
    out["read engine.token"] = type(exc).__name__
import os
leaks = 0
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        leaks += b"DELTASYNC_ENGINE_TOKEN" in open(f"/proc/{{pid}}/environ", "rb").read()
    except OSError:
        pass
out["processes showing an engine credential"] = leaks
print(json.dumps(out))
"""
        done = env.run([self.py, "-c", script], env=self._base_env(), timeout=120)
        if done.returncode:
            raise RuntimeError(f"the engine-boundary probe failed: {done.stderr[-2000:]}")
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))

    def final_check(self, final: dict[str, Any]) -> dict[str, Any]:
        """On the inference host, with the engine credential that never leaves it: what vLLM computes with, against
        the trainer's checksums (copied over by the operator, as a file)."""
        inference = self.hosts["inference"]
        shutil.copy(self.hosts["trainer"].root / "run" / "final.json", inference.root / "trainer-final.json")
        argv = [self.py, "-m", "examples.wordle.check_served", "--vllm-url", f"http://127.0.0.1:{PORTS['inference']}"]
        argv += ["--out", "served.json", "--expect", "trainer-final.json"]
        env = {**self._base_env(), "DELTASYNC_ENGINE_TOKEN_FILE": str(inference.root / "engine.token")}
        self._show(inference, argv, env)
        inference.run(argv, env=env, timeout=300)
        return dict(json.loads((inference.root / "served.json").read_text()))


def _cpu_cores(samples: list[dict[str, Any]], start: float, end: float) -> dict[str, float]:
    inside = [s for s in samples if start <= s["t"] <= end] or samples
    first, last = inside[0], inside[-1]
    wall = max(last["t"] - first["t"], 1e-9)
    return {n: (last["cpu"].get(n, 0.0) - first["cpu"].get(n, 0.0)) / wall for n in last["cpu"]}


def report(
    deployment: Deployment, rows: list[dict[str, Any]], final: dict[str, Any], served: dict[str, Any]
) -> dict[str, Any]:
    quarter = max(1, len(rows) // 4)
    latency = list(final["publish_to_served_s"].values())
    drops = [b["dropped_total"] - a["dropped_total"] for a, b in zip([{"dropped_total": 0}, *rows], rows, strict=False)]
    summary = {
        "steps": len(rows),
        "wall_s": final["rl_ended_at"] - final["rl_started_at"],
        "cpu_cores_per_host": _cpu_cores(deployment.samples, final["rl_started_at"], final["rl_ended_at"]),
        "link_bytes": deployment.link_bytes(),
        "connections": dict(sorted(deployment.peers.items())),
        "publish_to_served_ms_median": _quantile(latency, 0.5) * 1e3,
        "publish_to_served_ms_p90": _quantile(latency, 0.9) * 1e3,
        "staleness_histogram": final["staleness_histogram"],
        "dropped_groups": final["dropped_groups"],
        "dropped_per_step": sum(drops) / max(1, len(rows)),
        "episodes": final["episodes"],
        "reward_first_quarter": sum(r["reward"] for r in rows[:quarter]) / quarter,
        "reward_last_quarter": sum(r["reward"] for r in rows[-quarter:]) / quarter,
        "violations": deployment.violations,
        "trainer_version": final["version"],
        "served_weight_version": served["weight_version"],
        "tensors_checked": served.get("tensors_checked", 0),
        "bit_exact": bool(served.get("bit_exact")),
    }
    print("\n[hosts] five hosts, one network:")
    for name, cores in sorted(summary["cpu_cores_per_host"].items()):
        link = summary["link_bytes"].get(name, {})
        print(
            f"  {name:12s} {deployment.addr[name]:12s} CPU {cores:5.2f} cores"
            f"   sent {link.get('sent', 0) / 1e6:8.2f} MB   received {link.get('received', 0) / 1e6:8.2f} MB"
        )
    print("  connections seen (client -> server): " + ", ".join(summary["connections"]))
    print(
        f"  publish -> served across hosts: median {summary['publish_to_served_ms_median']:.0f} ms, "
        f"p90 {summary['publish_to_served_ms_p90']:.0f} ms"
    )
    print(
        f"  staleness at consumption {summary['staleness_histogram']}; dropped {summary['dropped_groups']} groups "
        f"({summary['dropped_per_step']:.2f} per step); {summary['episodes']} episodes generated"
    )
    print(
        f"  reward: first quarter {summary['reward_first_quarter']:.3f}, "
        f"last quarter {summary['reward_last_quarter']:.3f}"
    )
    print(f"  isolation: {len(summary['violations'])} violations (files of another host, connections off the links)")
    print(
        f"final: trainer v{summary['trainer_version']} / vLLM weight_version {summary['served_weight_version']}: "
        f"{'BIT-EXACT' if summary['bit_exact'] else 'MISMATCH'} over {summary['tensors_checked']} tensors"
    )
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build and warm-start the model, make the hosts, run the deployment, check, report, tear down."""
    out = args.out.absolute()  # made fresh by main()
    print(f"[hosts] building the tiny Qwen3 and its Wordle tokenizer in {out / 'model'}", flush=True)
    model = build_model(out / "model")
    if args.warmup_steps > 0:
        warm_start(model, args.warmup_steps, args.seed)
    base = args.base.absolute() / f"run-{os.getpid()}"
    t0 = time.monotonic()
    with Hosts(HOSTS, base=base) as hosts:
        print(f"[hosts] made {', '.join(f'{h.name} {h.address}' for h in hosts)}; their directories under {base}")
        deployment = Deployment(hosts, out, model, args)
        try:
            deployment.provision()
            deployment.start_all()
            rows = deployment.follow()
            final = json.loads((hosts["trainer"].root / "run" / "final.json").read_text())
            served = deployment.final_check(final)
            boundary = deployment.probe_engine_boundary()
            deployment.sample()
            summary = report(deployment, rows, final, served)
            summary["engine_boundary_from_env_host"] = boundary
            print(f"  from the environment host, vLLM's administrative routes answered: {boundary}")
            summary["namespaces"] = [hosts.switch, *(h.netns for h in hosts)]
            summary["base"] = str(base)
        finally:
            (out / "recipe.txt").write_text("\n".join(deployment.recipe) + "\n")
            for host in hosts:  # the hosts' logs outlive them
                for log in host.root.glob("*.log"):
                    (out / "logs" / host.name).mkdir(parents=True, exist_ok=True)
                    shutil.copy(log, out / "logs" / host.name / log.name)
    summary["after_setup_s"] = time.monotonic() - t0
    result = {
        "summary": summary,
        "steps": rows,
        "final": {k: v for k, v in final.items() if k != "effective_checksums"},
    }
    (out / "report.json").write_text(json.dumps(result, indent=1))
    print(f"[hosts] torn down; {summary['after_setup_s']:.0f} s after set-up; logs and recipe in {out}")
    shutil.rmtree(base, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo-out/hosts"))
    parser.add_argument("--base", type=Path, default=Path("/var/tmp/deltasync-hosts"), help="the hosts' directories")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.lora_rank:  # its rollout workers run on the environment host, which names no adapter yet
        parser.error("--lora-rank runs on one machine for now: python -m examples.wordle.run_demo --lora-rank R")
    if args.moe:  # its final check starts a fresh engine on the inference host
        parser.error("--moe runs on one machine for now: python -m examples.wordle.run_demo --moe")
    try:
        args.out = fresh_output_dir(args.out)
    except ValueError as exc:
        parser.error(str(exc))
    why = unavailable()
    if why is not None:
        print(f"[hosts] cannot run: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        result = run(args)
    except (HostsUnavailable, KeyboardInterrupt) as exc:
        print(f"[hosts] stopped: {exc!r}; every host was torn down", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 2
    summary = result["summary"]
    return 0 if summary["bit_exact"] and not summary["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())
