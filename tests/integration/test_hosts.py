"""Separate hosts on one machine (examples/wordle/hosts.py): what a host can reach, see and leave behind."""

from __future__ import annotations

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
    """Found by the adversary: a host's processes ran as root with every capability. One wrote the machine's
    core_pattern (the kernel then ran its program as root in the machine's namespaces), one unmounted the base to
    reach another host's files, one entered an earlier host's network through /run/netns, one took another
    host's address. Each host's processes now run as its own unprivileged user without capabilities."""
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
    """Found by the adversary: teardown waited on nsenter, which dies on SIGTERM at once, then killed the host:
    a process that needs a moment to flush never got it. Now every process in the host gets ``grace_s``."""
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
