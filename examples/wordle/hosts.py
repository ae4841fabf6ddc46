"""Separate hosts on one Linux machine: each in its own network, PID, IPC and mount namespaces, joined by veth links.

A disaggregated deployment (trainer, store, coordinator, vLLM, environment on different machines) must not lean on
anything the machines would not share: a path, a loopback address, a file the other side happens to see. This
module makes such hosts on one machine (root, ``ip``, ``unshare`` and ``nsenter``; Linux only), so the demo and the
tests run that deployment for real:

* **network**: each host is a network namespace with its own loopback and one interface, ``eth0``, with address
  ``10.77.0.<10 + i>/24``, linked by a veth pair to a bridge in a namespace of its own (the switch). A host reaches
  another only through these addresses; its ``127.0.0.1`` is its own.
* **processes**: each host has its own PID namespace and ``/proc``: it sees only its own processes, which run as
  the host's own unprivileged user (``UID_BASE + i``), with no capabilities and no way to gain one: root inside a
  host could undo its mounts, enter another host's network or change the machine's kernel settings. Files the
  operator puts in a host's directory are given to that user (:meth:`Host.own`).
* **files**: each host has a directory under ``base`` that only it sees. A host's processes live in its mount
  namespace (held by one small process per host), where ``base`` is an empty file system holding only the host's
  own directory at its usual path, and ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are its own (``tmp``, ``var-tmp``
  and ``shm`` in its directory). Everything else (the Python, the code, the virtualenv) is the machine's, as
  software installed on every host would be; where the code or the virtualenv lies under ``/tmp`` or ``/var/tmp``
  (a fresh clone there), it stays visible at its path in every host.
* **shared memory**: each host has its own IPC namespace: System V shared memory, semaphores and message queues,
  and POSIX message queues, made on one host are not there on another.
* **environment**: a host's processes get only what they are given (``env=``) and a few variables of the
  machine's that say how software runs here (:data:`BASE_ENV`: ``PATH``, the locale, Python's own), never the
  launcher's whole environment, where another host's credentials may be. :func:`from_machine` picks more of the
  machine's variables by name, for the hosts that need them (vLLM's settings where vLLM runs).

Everything is torn down on exit, even after a failure: processes, namespaces, links. ``base`` stays, with each
host's logs.

    with Hosts(["store", "trainer"], base=Path("/var/tmp/run")) as hosts:
        server = hosts["store"].popen(["python", "-m", "http.server", "--bind", hosts["store"].address, "8000"])
        hosts["trainer"].run(["curl", f"http://{hosts['store'].address}:8000/"])
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BASE_ENV", "SUBNET", "UID_BASE", "Host", "Hosts", "HostsUnavailable", "from_machine", "unavailable"]

SUBNET = "10.77.0"
"""The hosts' /24: host ``i`` is ``SUBNET.(10 + i)``."""
UID_BASE = 47000
"""Host ``i``'s processes run as user and group ``UID_BASE + i``, unprivileged."""

_TOOLS = ("ip", "unshare", "nsenter", "mount")

BASE_ENV = (
    "PATH",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "VIRTUAL_ENV",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONHASHSEED",
    "PYTHONIOENCODING",
    "PYTHONUNBUFFERED",
    "PYTHONUTF8",
)
"""The machine's variables every process of every host gets, where the machine has them: how software runs here,
never a credential. Everything else a process gets is given to it (``env=``), or picked by :func:`from_machine`."""

_PRIVATE = {Path("/tmp"): "tmp", Path("/var/tmp"): "var-tmp"}
"""The machine's directories each host has its own of (at the path, from the directory of this name in its own)."""


def from_machine(*names: str) -> dict[str, str]:
    """The machine's variables named ``names`` (``NAME``, or ``PREFIX*`` for every name that starts so), for the
    hosts that need them: a host gets none of the machine's variables but :data:`BASE_ENV` otherwise."""
    exact = {n for n in names if not n.endswith("*")}
    prefixes = tuple(n[:-1] for n in names if n.endswith("*"))
    return {k: v for k, v in os.environ.items() if k in exact or (prefixes and k.startswith(prefixes))}


def _environment(given: Mapping[str, str]) -> dict[str, str]:
    """What a host's process runs with: :data:`BASE_ENV` from the machine, then ``given``."""
    out = {k: os.environ[k] for k in BASE_ENV if k in os.environ}
    for name, value in given.items():
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is None:
            raise ValueError(
                f"environment variable name {name!r}: expected ASCII letters, digits and _, no digit first"
            )
        if "\0" in value:
            raise ValueError(f"environment variable {name}: its value holds a NUL byte")
        out[name] = value
    return out


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


def _refuse_links(host: Host, hidden: Path, path: Path) -> None:
    """HostsUnavailable if a directory on the way to ``path`` in the host's own ``hidden`` (``/tmp``, ``/var/tmp``:
    a directory in the host's directory) is a link or not a directory."""
    rel = path.relative_to(hidden)
    path = host.root / _PRIVATE[hidden]
    for part in rel.parts:
        path = path / part
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise HostsUnavailable(
                f"host {host.name}: {path} is {'a link' if path.is_symlink() else 'not a directory'}, where its own "
                f"{hidden / rel} is to be made (left by an earlier run?); remove it, or give "
                "the hosts another base"
            )


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
    uid: int = 0
    """The unprivileged user (and group) every process of this host runs as."""
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def _enter(self) -> list[str]:
        if self.holder is None or self.holder.poll() is not None:
            raise HostsUnavailable(f"host {self.name} is not running (its namespace holder exited)")
        # the host's init (PID 1 inside): its mount, network, IPC and PID namespaces; nsenter forks into the last
        return ["nsenter", "-t", str(self.init_pid), "-m", "-n", "-i", "-p", "--"]

    def command(self, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None) -> list[str]:
        """``argv`` as a command line that runs inside this host (its namespaces, ``cwd`` default: its directory),
        with :data:`BASE_ENV`, ``HOME`` (default: its directory) and ``env`` as its whole environment."""
        pairs = [f"{k}={v}" for k, v in _environment({"HOME": str(self.root), **(env or {})}).items()]
        where = str(cwd or self.root)
        # the host's own unprivileged user, no capabilities and no way to gain any: root inside a host could
        # undo its mounts, enter another host's network or change the machine's kernel settings
        drop = [f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--bounding-set=-all"]
        drop += ["--inh-caps=-all", "--no-new-privs"]
        # `env -i`: the launcher's environment (nsenter's and setpriv's) ends here, only `pairs` go in
        return [*self._enter(), "setpriv", *drop, "env", "-i", "-C", where, *pairs, *argv]

    def own(self, *paths: Path) -> None:
        """Give ``paths`` (files or directory trees the operator put in this host's directory) to the host's
        user. Links are not followed."""
        for path in paths:
            os.chown(path, self.uid, self.uid, follow_symlinks=False)
            if path.is_dir() and not path.is_symlink():
                for sub in path.rglob("*"):
                    os.chown(sub, self.uid, self.uid, follow_symlinks=False)

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
            env: its environment, besides :data:`BASE_ENV` and ``HOME`` (the host's directory unless given here):
                nothing else of the launcher's environment is passed (see :func:`from_machine`).
            cwd: the working directory, a path this host sees (default: its directory).
            log: a file name in this host's directory for stdout and stderr (default: inherited).
        """
        if log is not None:
            if "/" in log or log in ("", ".", ".."):
                raise ValueError(f"log {log!r} must be a file name in the host's directory")
            fd = os.open(self.root / log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
            out = os.fdopen(fd, "ab")
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
        """Run a command inside this host to completion (its environment as :meth:`popen`'s); its output is
        returned, not checked."""
        return subprocess.run(self.command(argv, env), capture_output=True, text=True, timeout=timeout, check=False)

    def _inside(self) -> list[int]:
        """This host's live processes but its init (their machine PIDs; zombies left out)."""
        try:
            ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        except OSError:
            return []
        pids = []
        for proc in Path("/proc").glob("[0-9]*"):
            pid = int(proc.name)
            if pid == self.init_pid:
                continue
            try:
                if (
                    os.readlink(proc / "ns/pid") == ns
                    and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
                ):
                    pids.append(pid)
            except OSError:
                continue
        return pids

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop this host: SIGTERM to every process in it (those started here and any they left behind), up to
        ``grace_s`` for them to exit, then SIGKILL to the holder, whose end ends the host's init and, with it,
        whatever is left in the host."""
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        if self.init_pid:
            for pid in self._inside():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self._inside() and time.monotonic() < deadline:
                time.sleep(0.05)
        for proc in [*self.processes, *([self.holder] if self.holder else [])]:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Hosts:
    """Hosts joined by one switch, made on ``__enter__`` and torn down on ``__exit__`` (see the module).

    Args:
        names: the hosts, in address order (``SUBNET.10`` first).
        base: where each host's directory goes (``base/NAME``), created if missing. Not under ``/tmp`` or
            ``/dev/shm``: each host gets one of its own, which would hide it (under ``/var/tmp``, each host's own
            ``/var/tmp`` holds the path to its directory).
        software: directories every host must see at their paths (default: the working directory; the running
            Python and its virtualenv always are). The rest of the machine is seen anyway; only these, where they
            lie under /tmp, /var/tmp or in a directory other users cannot enter (/root), need it.

    Raises:
        HostsUnavailable: the machine cannot make hosts (:func:`unavailable`), or a setup command failed.
        ValueError: a bad name or ``base``.
    """

    def __init__(self, names: Sequence[str], *, base: Path, software: Sequence[Path] | None = None) -> None:
        base = Path(base).resolve()
        if isinstance(names, str):
            raise ValueError(f"host names must be a list of names, got the string {names!r}")
        for private in (Path("/tmp"), Path("/dev/shm")):
            if base == private or private in base.parents:
                raise ValueError(f"hosts' base {base} must not be under {private}: each host has its own")
        if len(base.parents) < 2:
            raise ValueError(f"hosts' base {base} must be a directory of its own (e.g. /var/tmp/hosts), not {base}")
        if len(set(names)) != len(names) or not 0 < len(names) <= 200:
            raise ValueError(f"host names must be 1 to 200 distinct names, got {list(names)}")
        for name in names:
            if not name.isidentifier() or len(name) > 32:
                raise ValueError(f"host name {name!r} must be an identifier (letters, digits, _) of 32 at most")
        python = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent]
        given = software if software is not None else [Path.cwd()]
        wanted = sorted({Path(p).resolve() for p in [*given, *python]})
        for path in wanted:
            if path == base or base in path.parents:
                raise ValueError(f"hosts' base {base} holds {path}, which every host must see: choose another base")
        closed = [d for d in [*reversed(base.parents), base] if d.exists() and not d.stat().st_mode & stat.S_IXOTH]
        if closed:
            raise ValueError(f"hosts' base {base} lies in {closed[0]}, which other users cannot enter: choose another")
        self.base = base
        # what a host sees otherwise than the machine: its own /tmp and /var/tmp, and an empty directory for every
        # directory on the software's path that other users cannot enter (/root, where pyenv puts Python); the
        # software is bound back at its path inside (a virtualenv inside the working directory comes with it)
        self.covers: dict[Path, list[Path]] = {p: [] for p in _PRIVATE if p.is_dir() and not p.is_symlink()}
        for path in wanted:
            cover = next((d for d in [*reversed(path.parents), path] if d in self.covers), None)
            if cover is None:
                cover = next(
                    (d for d in [*reversed(path.parents)][1:] + [path] if not d.stat().st_mode & stat.S_IXOTH), None
                )
            if cover is not None:
                self.covers.setdefault(cover, []).append(path)
        for cover, paths in self.covers.items():
            self.covers[cover] = [p for p in paths if not any(q in p.parents for q in paths)]
        self.run_id = secrets.token_hex(3)
        self.switch = f"dsh-{self.run_id}--switch"  # never a host's: host names have no "-"
        self.hosts = {
            name: Host(name, f"{SUBNET}.{10 + i}", base / name, f"dsh-{self.run_id}-{name}", uid=UID_BASE + i)
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
        """Start the process whose namespaces are the host's: ``base`` holds only the host's directory; ``/tmp``,
        ``/var/tmp``, ``/dev/shm`` and the IPC objects are the host's own."""
        if host.root.is_symlink() or (host.root.exists() and not host.root.is_dir()):
            raise HostsUnavailable(f"host {host.name}: {host.root} is not a directory")
        host.root.mkdir(parents=True, exist_ok=True)
        for sub in (*_PRIVATE.values(), "shm"):
            if (host.root / sub).is_symlink():  # left by an earlier run's host: never followed
                (host.root / sub).unlink()
            (host.root / sub).mkdir(exist_ok=True)
        os.chown(host.root, host.uid, host.uid, follow_symlinks=False)
        os.chown(host.root / "shm", host.uid, host.uid, follow_symlinks=False)
        for sub in _PRIVATE.values():
            os.chmod(host.root / sub, 0o1777, follow_symlinks=False)
        # the directories made again inside the host's own /tmp or /var/tmp (the paths to the software and to
        # base): a link an earlier run's host left on such a path would take a mount elsewhere
        for hidden in _PRIVATE:
            for path in [*self.covers.get(hidden, []), self.base]:
                if hidden in path.parents:
                    _refuse_links(host, hidden, path)
        own, base = shlex.quote(str(host.root)), shlex.quote(str(self.base))
        keep, cover, back, release = [], [], [], []
        for k, (hidden, paths) in enumerate(self.covers.items()):
            saved, where = f"/mnt/c{k}", shlex.quote(str(hidden))
            if paths:  # the machine's directory, kept aside while it is covered
                keep += [f"mkdir {saved}", f"mount --bind {where} {saved}"]
                release.append(f"umount {saved}")
            if hidden in _PRIVATE:  # the host's own, from its directory (kept aside at /mnt/own meanwhile)
                cover.append(f"mount --bind /mnt/own/{_PRIVATE[hidden]} {where}")
            else:
                cover.append(f"mount -t tmpfs -o mode=0755 tmpfs {where}")
            for path in paths:  # the software, at its path again
                inside = shlex.quote(str(path))
                rel = shlex.quote(str(path.relative_to(hidden))) if path != hidden else "."
                back += [f"mkdir -p {inside}", f"mount --bind {saved}/{rel} {inside}"]
        setup = " && ".join(
            [
                "cd /",  # never hold a directory the host is not to see
                "umask 022",  # what it makes on the way to the software and to its directory, its user may enter
                "mount -t tmpfs tmpfs /mnt",  # a private place for what is hidden below and still needed
                "mkdir /mnt/own",
                f"mount --bind {own} /mnt/own",
                *keep,
                *cover,
                *back,
                # after the covers: a base under /var/tmp is made again in the host's own /var/tmp
                f"mkdir -p {base}",
                f"mount -t tmpfs -o mode=0755 tmpfs {base}",  # every host's directory hidden
                f"mkdir -p {own}",
                f"mount --move /mnt/own {own}",  # and this host's back at its path
                *release,
                "umount /mnt",
                f"mount --bind {own}/shm /dev/shm",
                # POSIX message queues are the IPC namespace's; the machine's file system of them is not shown
                "if grep -q ' /dev/mqueue ' /proc/self/mounts; then mount -t mqueue mqueue /dev/mqueue; fi",
                "if [ -d /run/netns ]; then mount -t tmpfs -o mode=0755 tmpfs /run/netns; fi",  # no handles shown
                "echo ready",
                "exec sleep infinity",
            ]
        )
        host.holder = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--propagation", "private", "--ipc"]
            + ["--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", setup],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=_environment({}),  # the host's init is the host's: none of the launcher's environment
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
