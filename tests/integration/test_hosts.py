"""Separate hosts on one machine (examples/wordle/hosts.py): what a host can reach, see and leave behind."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.wordle.hosts import Hosts, HostsUnavailable, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

_SERVE = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = sys.argv[2].encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer((sys.argv[1], 8000), H).serve_forever()
"""

_GET = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(f"http://{sys.argv[1]}:8000/", timeout=3).read().decode())
except OSError as exc:
    print(f"unreachable: {exc}")
"""


@pytest.fixture
def base() -> Path:
    path = Path("/var/tmp") / f"deltasync-test-hosts-{time.time_ns()}"
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _wait_served(host: object, address: str) -> str:
    for _ in range(100):
        out = host.run([sys.executable, "-c", _GET, address]).stdout.strip()  # type: ignore[attr-defined]
        if not out.startswith("unreachable"):
            return str(out)
        time.sleep(0.1)
    return str(out)


def test_hosts_reach_each_other_only_over_their_links_and_see_only_their_own_files(base: Path) -> None:
    before = _namespaces()
    with Hosts(["store", "trainer", "engine"], base=base) as hosts:
        store, trainer, engine = hosts["store"], hosts["trainer"], hosts["engine"]
        assert (store.address, trainer.address, engine.address) == ("10.77.0.10", "10.77.0.11", "10.77.0.12")
        # the network: a server on the store's link address is reached from the other hosts
        store.popen([sys.executable, "-c", _SERVE, store.address, "from-store"], log="server.log")
        assert _wait_served(trainer, store.address) == "from-store"
        assert _wait_served(engine, store.address) == "from-store"
        # a host's loopback is its own: a server on the engine's 127.0.0.1 is not the trainer's 127.0.0.1
        engine.popen([sys.executable, "-c", _SERVE, "127.0.0.1", "engine-loopback"], log="loopback.log")
        assert _wait_served(engine, "127.0.0.1") == "engine-loopback"
        assert trainer.run([sys.executable, "-c", _GET, "127.0.0.1"]).stdout.startswith("unreachable")
        # and the machine's own network is not there at all
        routes = trainer.run(["ip", "-4", "addr"]).stdout
        assert "10.77.0.11/24" in routes and routes.count("inet ") == 2, routes  # lo and eth0 only
        # the files: each host sees its own directory under base, and no other host's
        (store.root / "secret").write_text("the store's")
        look = f"import os; print(sorted(os.listdir({str(base)!r})), os.path.exists({str(store.root / 'secret')!r}))"
        assert trainer.run([sys.executable, "-c", look]).stdout.split("]")[0] == "['trainer'"
        assert "False" in trainer.run([sys.executable, "-c", look]).stdout
        assert "True" in store.run([sys.executable, "-c", look]).stdout
        # /tmp is the host's own: a file a host writes there is in its directory, not in the machine's /tmp
        marker = f"deltasync-hosts-{time.time_ns()}"
        assert trainer.run(["sh", "-c", f"echo x > /tmp/{marker} && ls /tmp/{marker}"]).returncode == 0
        assert (trainer.root / "tmp" / marker).exists() and not Path("/tmp", marker).exists()
        assert engine.run(["ls", f"/tmp/{marker}"]).returncode != 0
        # a process started in a host runs in its directory, and its log is there
        assert trainer.run(["pwd"]).stdout.strip() == str(trainer.root)
        assert (store.root / "server.log").exists()
        made = _namespaces() - before
        assert len(made) == 4, made  # three hosts and the switch
    # torn down: namespaces and processes gone, the hosts' directories kept (logs)
    assert _namespaces() == before
    assert all(p.poll() is not None for h in hosts for p in [*h.processes, h.holder] if p is not None)
    assert (base / "store" / "secret").read_text() == "the store's"


def test_a_failure_inside_the_block_still_tears_everything_down(base: Path) -> None:
    before = _namespaces()
    with pytest.raises(RuntimeError, match="boom"), Hosts(["a", "b"], base=base) as hosts:
        hosts["a"].popen(["sleep", "600"])
        raise RuntimeError("boom")
    assert _namespaces() == before
    assert all(p.poll() is not None for h in hosts for p in h.processes)


def test_bad_arguments_are_refused_before_anything_is_made(tmp_path: Path, base: Path) -> None:
    before = _namespaces()
    with pytest.raises(ValueError, match="must not be under /tmp"):
        Hosts(["a"], base=tmp_path)
    with pytest.raises(ValueError, match="distinct names"):
        Hosts(["a", "a"], base=base)
    with pytest.raises(ValueError, match="must be an identifier"):
        Hosts(["a b"], base=base)
    assert _namespaces() == before
    assert issubclass(HostsUnavailable, RuntimeError)


def test_software_under_tmp_stays_visible_in_every_host(base: Path, tmp_path: Path) -> None:
    """A fresh clone under /tmp (its code and virtualenv) is seen at its path by every host, whose /tmp is
    otherwise its own: the machine's other /tmp files are not."""
    code = tmp_path / "clone"
    (code / ".venv").mkdir(parents=True)
    (code / "tool.py").write_text("print('the machine code')\n")
    (tmp_path / "other").write_text("not the host's")
    with Hosts(["a"], base=base, software=[code, code / ".venv", Path.cwd(), Path(sys.prefix)]) as hosts:
        assert code.resolve() in hosts.covers[Path("/tmp")]  # and its virtualenv comes with it
        assert (code / ".venv").resolve() not in hosts.covers[Path("/tmp")]
        out = hosts["a"].run([sys.executable, str(code / "tool.py")])
        assert out.stdout.strip() == "the machine code", out.stderr
        assert hosts["a"].run(["cat", str(tmp_path / "other")]).returncode != 0


_PS = """
import json, os
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
seen = {}
for pid in pids:
    try:
        seen[pid] = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()[:80]
    except OSError:
        pass
print(json.dumps(seen))
"""


def test_a_host_sees_only_its_own_processes(base: Path) -> None:
    """Each host has its own PID namespace and /proc: no host can list another's processes, read their
    environment (where credentials live) or reach their files through /proc/PID/root."""
    import json

    with Hosts(["inference", "env"], base=base) as hosts:
        inference, env = hosts["inference"], hosts["env"]
        secret = "DELTASYNC_ENGINE_TOKEN=do-not-leak-" + "x" * 20
        server = inference.popen([sys.executable, "-c", "import time; time.sleep(60)"], env=dict([secret.split("=")]))
        time.sleep(0.5)
        seen = json.loads(env.run([sys.executable, "-c", _PS]).stdout)
        assert not any("time.sleep(60)" in cmd for cmd in seen.values()), seen
        assert len(seen) <= 4, seen  # its init, the probe itself (and nsenter's fork parent)
        mine = json.loads(inference.run([sys.executable, "-c", _PS]).stdout)
        assert any("time.sleep(60)" in cmd for cmd in mine.values())
        # the machine's PID of the sleeper means nothing in the other host
        probe = f"import sys; print(open('/proc/{server.pid}/environ','rb').read())"
        out = env.run([sys.executable, "-c", probe])
        assert "do-not-leak" not in out.stdout + out.stderr


def _sh(host: object, cmd: str) -> tuple[int, str]:
    done = host.run(["sh", "-c", cmd])  # type: ignore[attr-defined]
    return int(done.returncode), str(done.stdout + done.stderr)


def test_a_host_is_no_root_of_the_machine(base: Path) -> None:
    """Each host's processes run as its own unprivileged user without capabilities: as root with every
    capability, a host could write the machine's core_pattern (the kernel then runs its program as root in the
    machine's namespaces), unmount the base to reach another host's files, enter an earlier host's network
    through /run/netns, or take another host's address."""
    with Hosts(["a", "b"], base=base) as hosts:
        a, b = hosts["a"], hosts["b"]
        assert _sh(b, "id -u")[1].strip() == str(b.uid) and b.uid != a.uid and b.uid != 0
        assert _sh(b, "grep CapEff /proc/self/status")[1].split()[-1] == "0000000000000000"
        # the machine's kernel settings (the same value written back: a hole would change nothing)
        assert _sh(b, 'v=$(cat /proc/sys/kernel/core_pattern); printf %s "$v" > /proc/sys/kernel/core_pattern')[0]
        (a.root / "secret").write_text("A")
        code, out = _sh(b, f"umount -l {base} ; cat {base}/a/secret ; echo pwned > {base}/a/planted")
        assert "A" not in out.split() and not (a.root / "planted").exists(), out
        assert _sh(b, f"ls /run/netns; nsenter --net=/run/netns/{a.netns} true")[0] != 0
        assert _sh(b, f"ip addr add {a.address}/24 dev eth0")[0] != 0
        assert _sh(b, "mkdir -p /tmp/cg && mount -t cgroup2 none /tmp/cg")[0] != 0
        # its own directory is its user's to write; the machine's software is readable, not writable
        assert _sh(b, "echo mine > own.txt && cat own.txt")[1].strip() == "mine"
        assert _sh(b, f"touch {Path(sys.executable).resolve().parent}/planted")[0] != 0


_GRACEFUL = """
import signal, sys, time
def bye(*_):
    time.sleep(1.0)
    open("flushed", "w").write("done")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
time.sleep(60)
"""


def test_processes_get_their_grace_at_teardown(base: Path) -> None:
    """Every process in a host gets ``grace_s`` at teardown to flush: waiting on nsenter (which dies on
    SIGTERM at once) and then killing the host would give it none."""
    with Hosts(["a"], base=base) as hosts:
        a = hosts["a"]
        proc = a.popen([sys.executable, "-c", _GRACEFUL], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        with proc.stdout:
            assert proc.stdout.readline().strip() == b"ready"
    assert (a.root / "flushed").read_text() == "done"


@pytest.mark.parametrize(
    ("names", "where", "match"),
    [
        ("ab", "base", "list of names"),
        (["a"], "/dev/shm", "/dev/shm"),
        (["a"], "/", "directory of its own"),
        (["a"], "/var", "directory of its own"),
        (["a"], "holds-software", "which every host must see"),
        (["x" * 40], "base", "32 at most"),
    ],
)
def test_bad_names_and_bases_are_value_errors(base: Path, names: object, where: str, match: str) -> None:
    path = base if where in ("base", "holds-software") else Path(where)
    software = [base / "code"] if where == "holds-software" else None  # a base that would hide the code
    with pytest.raises(ValueError, match=match):
        Hosts(names, base=path, software=software)  # type: ignore[arg-type]


def test_a_host_named_switch_is_an_ordinary_host(base: Path) -> None:
    with Hosts(["switch", "b"], base=base) as hosts:
        assert hosts["switch"].run(["true"]).returncode == 0


_SHM = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes, libc.shmget.restype = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
libc.shmat.argtypes, libc.shmat.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p
libc.shmctl.argtypes, libc.shmctl.restype = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p], ctypes.c_int
IPC_CREAT, IPC_RMID, SHM_RDONLY = 0o1000, 0, 0o10000
key, what = int(sys.argv[1]), sys.argv[2]
if what == "make":  # a segment anyone may read, holding a secret
    shmid = libc.shmget(key, 4096, IPC_CREAT | 0o666)
    assert shmid >= 0, ctypes.get_errno()
    data = sys.argv[3].encode()
    ctypes.memmove(libc.shmat(shmid, None, 0), data, len(data))
    print("made")
else:
    shmid = libc.shmget(key, 0, 0)
    if shmid < 0:
        print(f"no segment (errno {ctypes.get_errno()})")
    elif what == "remove":
        print("removed" if libc.shmctl(shmid, IPC_RMID, None) == 0 else "not removed")
    else:
        print(ctypes.string_at(libc.shmat(shmid, None, SHM_RDONLY), 64).split(b"\\0")[0].decode())
"""


def test_shared_memory_made_on_one_host_is_not_on_another(base: Path) -> None:
    """A System V shared memory segment the trainer host makes (open to everyone, as a process may leave one) is
    not found by its key from the environment host, where model-written code runs: each host has its own IPC
    namespace. The machine's own ``ipcs`` does not show it either."""
    key, secret = 0x5EC0000 + secrets.randbelow(1 << 20), f"trainer-only-{secrets.token_hex(8)}"
    with Hosts(["trainer", "env"], base=base) as hosts:
        trainer, env = hosts["trainer"], hosts["env"]
        try:
            assert trainer.run([sys.executable, "-c", _SHM, str(key), "make", secret]).stdout.strip() == "made"
            assert trainer.run([sys.executable, "-c", _SHM, str(key), "read"]).stdout.strip() == secret
            seen = env.run([sys.executable, "-c", _SHM, str(key), "read"])
            assert seen.stdout.strip() == "no segment (errno 2)", seen.stdout + seen.stderr
            assert f"{key:#010x}" not in env.run(["ipcs", "-m"]).stdout
            assert f"{key:#010x}" not in subprocess.run(["ipcs", "-m"], capture_output=True, text=True).stdout
        finally:  # the segment outlives its process: never leave one on the machine
            trainer.run([sys.executable, "-c", _SHM, str(key), "remove"])
            subprocess.run([sys.executable, "-c", _SHM, str(key), "remove"], capture_output=True, check=False)


def test_var_tmp_is_each_hosts_own(base: Path) -> None:
    """A file the environment host leaves in /var/tmp is not in the trainer's /var/tmp, nor in the machine's: it
    lies in the environment host's own directory (``var-tmp``). Nor does a host see the machine's /var/tmp."""
    marker = f"deltasync-left-{time.time_ns()}"
    machine = Path("/var/tmp") / f"deltasync-machine-{time.time_ns()}"
    machine.write_text("the machine's")
    try:
        with Hosts(["trainer", "env"], base=base) as hosts:
            trainer, env = hosts["trainer"], hosts["env"]
            assert _sh(env, f"echo from-env > /var/tmp/{marker} && cat /var/tmp/{marker}")[1].strip() == "from-env"
            code, out = _sh(trainer, f"cat /var/tmp/{marker}")
            assert code != 0 and "from-env" not in out, out
            assert not Path("/var/tmp", marker).exists()
            assert (env.root / "var-tmp" / marker).read_text() == "from-env\n"
            assert _sh(trainer, f"cat {machine}")[0] != 0
            # the hosts' directories, under /var/tmp, are still at their paths inside
            assert _sh(trainer, "pwd && touch mine")[1].strip() == str(trainer.root)
            assert (trainer.root / "mine").exists()
    finally:
        machine.unlink()
        Path("/var/tmp", marker).unlink(missing_ok=True)


_ENVIRON = """
import json
print(json.dumps(dict(v.split("=", 1) for v in open("/proc/self/environ").read().split("\\0") if v)))
"""

_LAUNCHER_SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "launcher-aws-secret-" + "s" * 20,  # the operator's own cloud key
    "DELTASYNC_AGENT_SECRET": "coordinator-secret-" + "c" * 20,  # the coordinator's
    "DELTASYNC_ENGINE_TOKEN": "inference-engine-" + "e" * 20,  # the inference host's
    "HF_TOKEN": "hf_launcher" + "h" * 20,
}


def test_a_host_gets_only_its_own_environment(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's environment holds credentials (the operator's, other hosts'): a process on the environment
    host reads its own /proc/self/environ and finds none of them, only the hosts' base, its own variables and the
    machine's settings the deployment names for it (``MACHINE_ENV``). vLLM's settings reach the inference host
    only, and never its development mode."""
    import argparse

    from examples.wordle.hosts import BASE_ENV
    from examples.wordle.run_hosts import HOSTS, MACHINE_ENV, Deployment

    for name, value in _LAUNCHER_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("VLLM_LOGGING_PREFIX", "[vllm]")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with Hosts(HOSTS, base=base) as hosts:
        inference, env = hosts["inference"], hosts["env"]
        bare = json.loads(env.run([sys.executable, "-c", _ENVIRON]).stdout)
        assert set(bare) <= {*BASE_ENV, "HOME"}, sorted(bare)
        deployment = Deployment(hosts, base / "out", base / "model", argparse.Namespace())
        seen = json.loads(deployment.run(env, [sys.executable, "-c", _ENVIRON], {"WORDLE_ROLLOUT_TOKEN": "own"}))
        assert not {k: v for k, v in seen.items() if v in _LAUNCHER_SECRETS.values()}, sorted(seen)
        assert seen["WORDLE_ROLLOUT_TOKEN"] == "own" and seen["OMP_NUM_THREADS"] == "2"
        assert not [k for k in seen if k.startswith("VLLM_")]
        own = {"HOME", "PYTHONPATH", "PYTHONUNBUFFERED", "WORDLE_ROLLOUT_TOKEN"}
        assert set(seen) <= {*BASE_ENV, *own, *deployment.machine_env(env)}, sorted(seen)
        assert set(deployment.machine_env(env)) == {"OMP_NUM_THREADS"} | {
            k for k in os.environ if k.startswith(tuple(p.rstrip("*") for p in MACHINE_ENV["env"]))
        }
        served = json.loads(deployment.run(inference, [sys.executable, "-c", _ENVIRON]))
        assert served["VLLM_LOGGING_PREFIX"] == "[vllm]" and "VLLM_SERVER_DEV_MODE" not in served
        assert not {k: v for k, v in served.items() if v in _LAUNCHER_SECRETS.values()}, sorted(served)


_ANONYMOUS = """
import json, sys, urllib.request
import boto3, botocore.exceptions
url, bucket, trainer_key_id = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
def call(name, method, path, body=None):
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data=body, method=method), timeout=10) as r:
            out[name] = [r.status, r.read().decode(errors="replace")[:300]]
    except urllib.error.HTTPError as exc:
        out[name] = [exc.code, exc.read().decode(errors="replace")[:300]]
call("PUT", "PUT", f"/{bucket}/run/planted", b"stop the trainer")
call("LIST", "GET", f"/{bucket}?list-type=2")
call("GET", "GET", f"/{bucket}/run/published")
call("reset-auth", "POST", "/moto-api/reset-auth", b"inf")
# signed, with the keys anyone can guess (what the store accepted before it checked), and with the trainer's key
# id (the recipe shows it) and a guessed secret
for who, key_id in [("guessed", "testing"), ("trainer's id", trainer_key_id)]:
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                      aws_access_key_id=key_id, aws_secret_access_key="testing")
    for name, call_ in [("PUT", lambda: s3.put_object(Bucket=bucket, Key="run/planted", Body=b"x")),
                        ("LIST", lambda: s3.list_objects_v2(Bucket=bucket))]:
        try:
            call_()
            out[f"{who} {name}"] = [200, "accepted"]
        except botocore.exceptions.ClientError as exc:
            out[f"{who} {name}"] = [exc.response["ResponseMetadata"]["HTTPStatusCode"], exc.response["Error"]["Code"]]
print(json.dumps(out))
"""

_STORE = """
import json, sys
from deltasync.errors import StoreError
from deltasync.store import open_store
store, out = open_store(sys.argv[1]), {}
for what in sys.argv[2:]:
    try:
        if what == "put":
            store.put("published", b"the trainer's")
        out[what] = "ok" if what == "put" else store.list() if what == "list" else store.get("published").decode()
    except StoreError as exc:
        out[what] = f"refused: {exc}"
print(json.dumps(out))
"""


def test_the_store_is_written_only_with_the_trainers_key(base: Path) -> None:
    """From the environment host, which holds no store key, the demo's S3 server refuses an anonymous PUT, LIST
    and GET of the run's bucket, a PUT and a LIST signed with guessable keys or with the trainer's key id (shown in
    the recipe) and a guessed secret, and moto's switch that turns the checks off; nothing lands. The trainer's key writes; the inference host's (the agent's) and the coordinator's read and
    cannot write."""
    import argparse

    from examples.wordle.run_hosts import BUCKET, HOSTS, STORE_GRANTS, Deployment

    with Hosts(HOSTS, base=base) as hosts:
        deployment = Deployment(hosts, base / "out", base / "model", argparse.Namespace())
        deployment.start_store()
        assert set(deployment.store_keys) == set(STORE_GRANTS) and "env" not in STORE_GRANTS
        url, uri = deployment.s3_endpoint["AWS_ENDPOINT_URL_S3"], deployment.store_uri

        def store(host: str, *what: str, user: str | None = None) -> dict[str, object]:
            argv = [sys.executable, "-c", _STORE, uri, *what]
            return dict(json.loads(deployment.run(hosts[host], argv, deployment.store_env(user or host))))

        assert store("trainer", "put", "list") == {"put": "ok", "list": ["published"]}
        key_id = deployment.store_keys["trainer"]["AWS_ACCESS_KEY_ID"]
        attack = json.loads(deployment.run(hosts["env"], [sys.executable, "-c", _ANONYMOUS, url, BUCKET, key_id]))
        for name in ("PUT", "LIST", "GET", "reset-auth"):
            status, body = attack[name]
            assert status == 403 and "<Code>AccessDenied</Code>" in body, (name, attack[name])
        assert "refuses anonymous and presigned requests" in attack["PUT"][1]
        assert "administrative API" in attack["reset-auth"][1]
        assert attack["guessed PUT"] == attack["guessed LIST"] == [403, "InvalidAccessKeyId"]
        assert attack["trainer's id PUT"] == attack["trainer's id LIST"] == [403, "SignatureDoesNotMatch"]
        # nothing landed; the agent's and the coordinator's keys read, and are refused a write
        for host in ("inference", "coordinator"):
            seen = store(host, "list", "get", "put")
            assert seen["list"] == ["published"] and seen["get"] == "the trainer's", seen
            assert str(seen["put"]).startswith("refused: ") and "privileges" in str(seen["put"]), seen


def test_software_in_a_closed_directory_under_var_tmp_stays_visible(base: Path) -> None:
    """A checkout in a directory only root may enter (0700), under /var/tmp, which each host has its own of: the
    checkout is seen at its path by every host; the rest of that directory and of the machine's /var/tmp is not."""
    closed = Path("/var/tmp") / f"deltasync-closed-{time.time_ns()}"
    code = closed / "clone"
    try:
        code.mkdir(parents=True)
        closed.chmod(0o700)
        code.chmod(0o755)
        (code / "tool.py").write_text("print('the machine code')\n")
        (code / "tool.py").chmod(0o644)
        (closed / "other").write_text("not the host's")
        with Hosts(["a"], base=base, software=[code, Path.cwd(), Path(sys.prefix)]) as hosts:
            assert code in hosts.covers[Path("/var/tmp")]
            out = hosts["a"].run([sys.executable, str(code / "tool.py")])
            assert out.stdout.strip() == "the machine code", out.stderr
            assert hosts["a"].run(["cat", str(closed / "other")]).returncode != 0
    finally:
        subprocess.run(["rm", "-rf", str(closed)], check=False)


def test_a_link_left_in_a_hosts_var_tmp_is_refused(base: Path) -> None:
    """Each host's /var/tmp is a directory of its own that its user writes; a link an earlier run's host left
    there, on the path where the hosts' base is made again inside, would take that mount elsewhere: refused."""
    (base / "a" / "var-tmp").mkdir(parents=True)
    (base / "a" / "var-tmp" / base.relative_to("/var/tmp").parts[0]).symlink_to("/etc")
    with pytest.raises(HostsUnavailable, match=r"is a link, where its own /var/tmp/.* is to be made"):
        with Hosts(["a"], base=base):
            pass
