"""Separate hosts on one Linux machine: each in its own network and mount namespaces, joined by veth links.

A disaggregated deployment (trainer, store, coordinator, vLLM, environment on different machines) must not lean on
anything the machines would not share: a path, a loopback address, a file the other side happens to see. This
module makes such hosts on one machine (root, ``ip``, ``unshare`` and ``nsenter``; Linux only), so the demo and the
tests run that deployment for real:

* **network**: each host is a network namespace with its own loopback and one interface, ``eth0``, with address
  ``10.77.0.<10 + i>/24``, linked by a veth pair to a bridge in a namespace of its own (the switch). A host reaches
  another only through these addresses; its ``127.0.0.1`` is its own.
* **processes**: each host has its own PID namespace and ``/proc``: it sees only its own processes.
* **files**: each host has a directory under ``base`` that only it sees. A host's processes live in its mount
  namespace (held by one small process per host), where ``base`` is an empty file system holding only the host's
  own directory at its usual path, and ``/tmp`` and ``/dev/shm`` are its own. Everything else (the Python, the code,
  the virtualenv) is the machine's, as software installed on every host would be; where the code or the
  virtualenv lies under ``/tmp`` (a fresh clone there), it stays visible at its path in every host.

Everything is torn down on exit, even after a failure: processes, namespaces, links. ``base`` stays, with each
host's logs.

    with Hosts(["store", "trainer"], base=Path("/var/tmp/run")) as hosts:
        server = hosts["store"].popen(["python", "-m", "http.server", "--bind", hosts["store"].address, "8000"])
        hosts["trainer"].run(["curl", f"http://{hosts['store'].address}:8000/"])
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SUBNET", "Host", "Hosts", "HostsUnavailable", "unavailable"]

SUBNET = "10.77.0"
"""The hosts' /24: host ``i`` is ``SUBNET.(10 + i)``."""

_TOOLS = ("ip", "unshare", "nsenter", "mount")


class HostsUnavailable(RuntimeError):
    """This machine cannot make separate hosts (not Linux, not root, or a tool is missing)."""


def unavailable() -> str | None:
    """Why this machine cannot make hosts (``None``: it can)."""
    if not Path("/proc/self/ns/net").exists():
        return "separate hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "separate hosts need root (network and mount namespaces)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"separate hosts need {', '.join(missing)} (Debian: iproute2, util-linux, mount)"
    return None


def _sh(*argv: str) -> None:
    """Run a setup command; a failure names it and what it said."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise HostsUnavailable(f"{shlex.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


@dataclass
class Host:
    """One host: its name, address, private directory and the processes started in it."""

    name: str
    address: str
    root: Path
    """This host's directory: the only directory under the hosts' ``base`` its processes can see."""
    netns: str
    holder: subprocess.Popen[bytes] | None = None
    init_pid: int = 0
    """The host's first process (PID 1 in its PID namespace), as this machine numbers it."""
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def _enter(self) -> list[str]:
        if self.holder is None or self.holder.poll() is not None:
            raise HostsUnavailable(f"host {self.name} is not running (its namespace holder exited)")
        # the host's init (PID 1 inside): its mount, network and PID namespaces; nsenter forks into the last
        return ["nsenter", "-t", str(self.init_pid), "-m", "-n", "-p", "--"]

    def command(self, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None) -> list[str]:
        """``argv`` as a command line that runs inside this host (its namespaces, ``cwd`` default: its directory)."""
        pairs = [f"{k}={v}" for k, v in (env or {}).items()]
        where = str(cwd or self.root)
        return [*self._enter(), "env", "-C", where, *pairs, *argv]

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        log: str | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start a process inside this host (its own process group; stopped when the hosts are torn down).

        Args:
            argv: the command.
            env: extra environment (the machine's environment is inherited, as a login on an identical host).
            cwd: the working directory, a path this host sees (default: its directory).
            log: a file name in this host's directory for stdout and stderr (default: inherited).
        """
        if log is not None:
            out = open(self.root / log, "ab")  # noqa: SIM115 - the process owns it; closed below
            kwargs.setdefault("stdout", out)
            kwargs.setdefault("stderr", subprocess.STDOUT)
        try:
            proc = subprocess.Popen(self.command(argv, env, cwd), start_new_session=True, **kwargs)
        finally:
            if log is not None:
                out.close()
        self.processes.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside this host to completion; its output is returned, not checked."""
        return subprocess.run(self.command(argv, env), capture_output=True, text=True, timeout=timeout, check=False)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every process started in this host (SIGTERM to its group, then SIGKILL), then the holder (SIGKILL:
        it waits for the host's init, which ignores SIGTERM; the init's end ends whatever is left in the host)."""
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in [*self.processes, *([self.holder] if self.holder else [])]:
            if proc is not self.holder:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                    continue
                except subprocess.TimeoutExpired:
                    pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Hosts:
    """Hosts joined by one switch, made on ``__enter__`` and torn down on ``__exit__`` (see the module).

    Args:
        names: the hosts, in address order (``SUBNET.10`` first).
        base: where each host's directory goes (``base/NAME``), created if missing. Not under ``/tmp``: each host
            gets a ``/tmp`` of its own, which would hide it.
        software: directories every host sees as the machine's (default: the working directory and the running
            Python's prefix); only those under ``/tmp`` need it, the rest of the machine is seen anyway.

    Raises:
        HostsUnavailable: the machine cannot make hosts (:func:`unavailable`), or a setup command failed.
        ValueError: a bad name or ``base``.
    """

    def __init__(self, names: Sequence[str], *, base: Path, software: Sequence[Path] | None = None) -> None:
        base = Path(base).resolve()
        if base == Path("/tmp") or Path("/tmp") in base.parents or Path("/dev/shm") in base.parents:
            raise ValueError(f"hosts' base {base} must not be under /tmp or /dev/shm: each host has its own of those")
        if len(set(names)) != len(names) or not 0 < len(names) <= 200:
            raise ValueError(f"host names must be 1 to 200 distinct names, got {list(names)}")
        for name in names:
            if not name.isidentifier():
                raise ValueError(f"host name {name!r} must be an identifier (letters, digits, _)")
        self.base = base
        wanted = [Path(p).resolve() for p in (software if software is not None else [Path.cwd(), Path(sys.prefix)])]
        under_tmp = sorted({p for p in wanted if Path("/tmp") in p.parents})
        # the outermost ones (a virtualenv inside the working directory comes with it)
        self.software = [p for p in under_tmp if not any(q in p.parents for q in under_tmp)]
        self.run_id = secrets.token_hex(3)
        self.switch = f"dsh-{self.run_id}-switch"
        self.hosts = {
            name: Host(name, f"{SUBNET}.{10 + i}", base / name, f"dsh-{self.run_id}-{name}")
            for i, name in enumerate(names)
        }
        self._made: list[str] = []

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts.values())

    def __enter__(self) -> Hosts:
        why = unavailable()
        if why is not None:
            raise HostsUnavailable(why)
        try:
            self._make()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _make(self) -> None:
        _sh("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts.values()):
            _sh("ip", "netns", "add", host.netns)
            self._made.append(host.netns)
            _sh("ip", "-n", host.netns, "link", "set", "lo", "up")
            port = f"p{i}"
            # the pair is made in the switch's namespace (no name in the machine's own), then one end moves
            _sh(
                "ip",
                "-n",
                self.switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host.netns,
            )
            _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _sh("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
            self._hold(host)

    def _hold(self, host: Host) -> None:
        """Start the process whose mount namespace is the host's: ``base`` holds only the host's directory, and
        ``/tmp`` and ``/dev/shm`` are the host's own."""
        for sub in ("tmp", "shm"):
            (host.root / sub).mkdir(parents=True, exist_ok=True)
        (host.root / "tmp").chmod(0o1777)
        own, base = shlex.quote(str(host.root)), shlex.quote(str(self.base))
        software = []  # the machine's code under /tmp, at its path again in the host's own /tmp
        for path in self.software:
            inside = shlex.quote(str(path))
            software += [
                f"mkdir -p {inside}",
                f"mount --bind /mnt/tmp0/{shlex.quote(str(path.relative_to('/tmp')))} {inside}",
            ]
        setup = " && ".join(
            [
                "cd /",  # never hold a directory the host is not to see
                "mount -t tmpfs tmpfs /mnt",  # a private place for what is hidden below and still needed
                "mkdir /mnt/own /mnt/tmp0",
                f"mount --bind {own} /mnt/own",
                "mount --bind /tmp /mnt/tmp0",
                f"mount -t tmpfs -o mode=0755 tmpfs {base}",  # every host's directory hidden
                f"mkdir -p {own}",
                f"mount --move /mnt/own {own}",  # and this host's back at its path
                f"mount --bind {own}/tmp /tmp",
                *software,
                "umount /mnt/tmp0",
                "umount /mnt",
                f"mount --bind {own}/shm /dev/shm",
                "echo ready",
                "exec sleep infinity",
            ]
        )
        # its own PID namespace too, with its own /proc: a host sees only its processes (as root on a shared /proc
        # it could read another host's environment, or its files through /proc/PID/root)
        host.holder = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--propagation", "private"]
            + ["--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", setup],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert host.holder.stdout is not None and host.holder.stderr is not None
        line = host.holder.stdout.readline()
        if line.strip() != b"ready":
            host.holder.wait(10)
            err = host.holder.stderr.read().decode(errors="replace")
        host.holder.stdout.close()
        host.holder.stderr.close()
        if line.strip() != b"ready":
            raise HostsUnavailable(f"host {host.name}: its mount namespace could not be set up: {err.strip()}")
        children = Path(f"/proc/{host.holder.pid}/task/{host.holder.pid}/children").read_text().split()
        if len(children) != 1:
            raise HostsUnavailable(f"host {host.name}: its init process was not found ({children})")
        host.init_pid = int(children[0])

    def teardown(self) -> None:
        """Stop every process and delete every namespace this instance made (links go with them). Idempotent."""
        for host in self.hosts.values():
            host.stop()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._made.clear()
