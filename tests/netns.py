"""Several "hosts" on one machine for multi-host tests: Linux namespaces joined by a bridge.

Each host is a process (the *holder*, a shell that waits on its stdin) in its own network, UTS and
mount namespaces: its own interfaces and addresses, its own hostname (``dchost<k>``) and its own
/dev/shm (a small tmpfs mounted in its mount namespace only). Processes started with
``Host.popen`` join those three namespaces (``nsenter``), so to distcomm they run on another
machine: ``transport/hostid.py`` reads a different hostname, /dev/shm device and mount namespace.
The pid namespace and the file system stay shared, so the test can see the hosts' processes and
read their /dev/shm (``/proc/<holder>/root/dev/shm``) from outside.

The hosts are wired like a rack: a *router* namespace holds one bridge per subnet (``br0``,
``br1``, ...), and each host has one veth per subnet (``eth0`` in 10.77.0.0/24, ``eth1`` in
10.78.0.0/24, ...) whose other end is in the router, on that bridge. Host ``k`` is ``.<k+1>`` in
every subnet. Nothing is created in this machine's own namespaces (the veths are made directly in
theirs), so parallel tests and other jobs on the machine are not disturbed.

Cleanup needs no bookkeeping: namespaces made by ``unshare`` (not ``ip netns add``) are not pinned
by a bind mount, so they go, with their veths, bridges and tmpfs, when their last process exits.
``Network.close`` SIGKILLs every process in each host, then closes the holders' stdin. If the test
process itself dies, the holders' stdin closes with it and they exit too, and what ``Host.popen``
started dies with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time

SUBNETS = ("10.77.0", "10.78.0", "10.79.0")
SHM_SIZE = "256m"


def unavailable() -> str | None:
    """Why namespaced hosts cannot be made here (a skip reason), or None."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "needs Linux namespaces"
    if os.geteuid() != 0:
        return "needs root (network, UTS and mount namespaces, veth pairs, tmpfs mounts)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2 / util-linux)"
    try:
        probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--", "ip", "link", "add", "dcprobe",
                                "type", "bridge"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make namespaces here: {exc}"
    if probe.returncode != 0:
        return f"cannot make namespaces or bridges here: {probe.stderr.strip()}"
    return None


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def _holder(argv_prefix: list[str], script: str) -> subprocess.Popen:
    """A shell in new namespaces that runs ``script``, says "ready", then waits on its stdin."""
    p = subprocess.Popen(argv_prefix + ["--", "sh", "-c", script + "; echo ready; read _"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise RuntimeError(f"namespace holder failed: {line}{p.stderr.read()}")
    return p


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


class Host:
    """One namespaced host: ``hostname``, ``address(subnet)`` of its ``eth<subnet>``."""

    def __init__(self, index: int, holder: subprocess.Popen):
        self.index = index
        self.hostname = f"dchost{index}"
        self.holder = holder
        self.pid = holder.pid
        self._net = _ns_inode(self.pid, "net")

    def address(self, subnet: int = 0) -> str:
        return f"{SUBNETS[subnet]}.{self.index + 1}"

    def nsenter(self) -> list[str]:
        return ["nsenter", f"--target={self.pid}", "--net", "--uts", "--mount", "--"]

    def popen(self, argv: list[str], preexec_fn=None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this host (nsenter execs it: the Popen's pid is the program's). It is
        SIGKILLed if the test process dies (PR_SET_PDEATHSIG), so a killed test leaves no job
        running in the namespaces."""

        def setup():
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if preexec_fn is not None:
                preexec_fn()

        return subprocess.Popen(self.nsenter() + argv, preexec_fn=setup, **kwargs)

    def run(self, argv: list[str]) -> str:
        done = subprocess.run(self.nsenter() + argv, capture_output=True, text=True, timeout=20)
        if done.returncode != 0:
            raise RuntimeError(f"on {self.hostname}: {' '.join(argv)} failed: {done.stderr.strip()}")
        return done.stdout

    def processes(self) -> list[int]:
        """Pids of every process on this host but its holder (by network namespace)."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.pid and _ns_inode(int(entry), "net") == self._net:
                pids.append(int(entry))
        return pids

    def shm_entries(self) -> list[str]:
        """What is in this host's own /dev/shm."""
        return sorted(os.listdir(f"/proc/{self.pid}/root/dev/shm"))

    def kill_all(self) -> None:
        """SIGKILL every process on this host but its holder: the host loses power."""
        for _ in range(50):
            pids = self.processes()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)


class Network:
    """``n`` hosts with ``subnets`` interfaces each, one bridge per subnet. Use as a context manager."""

    def __init__(self, n: int, subnets: int = 1):
        self.hosts: list[Host] = []
        self.router: subprocess.Popen | None = None
        try:
            self._build(n, subnets)
        except BaseException:
            self.close()
            raise

    def _build(self, n: int, subnets: int) -> None:
        self.router = _holder(["unshare", "--net"], "ip link set lo up")
        rp = self.router.pid
        for s in range(subnets):
            _run(["nsenter", f"--target={rp}", "--net", "ip", "link", "add", f"br{s}", "type", "bridge"])
            _run(["nsenter", f"--target={rp}", "--net", "ip", "link", "set", f"br{s}", "up"])
        for k in range(n):
            holder = _holder(["unshare", "--net", "--uts", "--mount", "--propagation", "private"],
                             f"hostname dchost{k} && mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm"
                             " && ip link set lo up")
            host = Host(k, holder)
            self.hosts.append(host)
            for s in range(subnets):
                _run(["ip", "link", "add", "name", f"eth{s}", "netns", str(host.pid), "type", "veth",
                      "peer", "name", f"h{k}s{s}", "netns", str(rp)])
                _run(["nsenter", f"--target={rp}", "--net", "ip", "link", "set", f"h{k}s{s}", "master", f"br{s}"])
                _run(["nsenter", f"--target={rp}", "--net", "ip", "link", "set", f"h{k}s{s}", "up"])
                host.run(["ip", "addr", "add", f"{host.address(s)}/24", "dev", f"eth{s}"])
                host.run(["ip", "link", "set", f"eth{s}", "up"])

    def close(self) -> None:
        for host in self.hosts:
            host.kill_all()
        for p in [h.holder for h in self.hosts] + ([self.router] if self.router else []):
            try:
                p.stdin.close()
            except OSError:
                pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            for stream in (p.stdout, p.stderr):
                stream.close()

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
