"""Multi-host for real: two or three hosts on this machine as Linux namespaces (tests/netns.py).

Each host has its own network namespace (its veth address on a bridge), UTS namespace (hostname
``dchost<k>``) and mount namespace (its own /dev/shm tmpfs), and runs one ``distcomm-run --nnodes N
--node-rank k --nproc-per-node 2`` whose workers are tests/netns_worker.py. DISTCOMM_HOST_ID is not
set: the hosts differ to transport/hostid.py because what it reads differs (hostname, /dev/shm's
device, mount namespace; the boot id is the same, it is one kernel).

* every case of tests/diff_cases.py (every collective, p2p, object collectives, groups) matches
  torch's gloo run on the same hosts, and the default engine really is shared memory inside a host
  and TCP between hosts, with the hierarchical all_reduce for the world group and its phases inside
  a host on the shared-memory collectives (the workers describe their engine through its public
  attributes; the large all_reduce cases take the hierarchy);
* a host whose processes are all SIGKILLed (a worker host, or the one with the job store) makes
  the others fail promptly, naming the lost rank and its address, and nothing is left behind: no
  process, no /dev/shm segment on any host;
* DISTCOMM_SOCKET_IFNAME=eth1 moves the TCP mesh to the hosts' second network while the job store
  stays on the first (tests/test_socket_ifname.py has the selection rule itself).

Needs root (namespaces, veths, mounts): skipped otherwise, with the reason. Marked slow.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import sys
import time

import pytest

import netns

REASON = netns.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"multi-host tests: {REASON}")]

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
WORKER = os.path.join(HERE, "netns_worker.py")
PORT = 29500  # every host has its own network namespace: no other job can hold these ports
ORACLE_PORT = 29600
DEADLINE = 90.0  # seconds for one job, start to finish; everything is killed past it


def _cases() -> list[str]:
    """Every case of diff_cases at world size 4 (about 275, a second or two per framework: starting
    the workers and importing torch is most of the test's time)."""
    import diff_cases as dc

    return [case.name for case in dc.cases(4)]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTCOMM_", "PET_", "TORCHELASTIC_"))
           and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join([SRC, HERE]), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
               PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


class Job:
    """One distcomm-run per host, output to files under ``out``."""

    def __init__(self, net: netns.Network, out, mode: str, args=(), nproc: int = 2, env=None, cpus=None):
        """``cpus[k]``: the CPUs host k's processes may run on (all by default)."""
        self.net, self.out = net, str(out)
        self.launchers = []
        self.logs = []
        n = len(net.hosts)
        for host in net.hosts:
            log = open(os.path.join(self.out, f"launcher{host.index}.log"), "w")
            self.logs.append(log.name)
            argv = [sys.executable, "-m", "distcomm.run", "--nnodes", str(n), "--node-rank", str(host.index),
                    "--nproc-per-node", str(nproc), "--master-addr", net.hosts[0].address(0),
                    "--master-port", str(PORT), "--shutdown-timeout", "5", WORKER, mode, self.out, *args]
            pin = None if cpus is None else functools.partial(os.sched_setaffinity, 0, cpus[host.index])
            self.launchers.append(host.popen(argv, env=env or _env(), stdout=log, stderr=log, cwd=self.out,
                                             preexec_fn=pin))
            log.close()

    def output(self, k: int) -> str:
        with open(self.logs[k]) as f:
            return f.read()

    def outputs(self) -> str:
        return "\n".join(f"--- launcher of {h.hostname}:\n{self.output(h.index)[-4000:]}" for h in self.net.hosts)

    def wait(self, launchers=None, deadline: float = DEADLINE) -> list[int]:
        """Exit codes of ``launchers`` (all by default); past the deadline the hosts are killed and
        the test fails with every launcher's output."""
        end = time.monotonic() + deadline
        procs = [self.launchers[k] for k in (range(len(self.launchers)) if launchers is None else launchers)]
        while any(p.poll() is None for p in procs):
            if time.monotonic() > end:
                for host in self.net.hosts:
                    host.kill_all()
                pytest.fail(f"the job did not finish within {deadline:.0f} s\n{self.outputs()}")
            time.sleep(0.05)
        return [p.returncode for p in procs]

    def describe(self, ranks) -> dict[int, dict]:
        out = {}
        for r in ranks:
            with open(os.path.join(self.out, f"describe{r}.json")) as f:
                out[r] = json.load(f)
        return out


@pytest.fixture
def hosts():
    made = []

    def make(n: int, subnets: int = 1) -> netns.Network:
        net = netns.Network(n, subnets)
        made.append(net)
        return net

    try:
        yield make
    finally:
        for net in made:
            net.close()


def assert_nothing_left(net: netns.Network, job: Job) -> None:
    for host in net.hosts:
        deadline = time.monotonic() + 10
        while host.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not host.processes(), f"processes left on {host.hostname}: {host.processes()}\n{job.outputs()}"
        assert host.shm_entries() == [], f"left in {host.hostname}'s /dev/shm: {host.shm_entries()}"


def assert_hybrid(info: dict[int, dict], hosts: list, nproc: int, subnet: int = 0) -> None:
    """Each rank runs the default engine as shared memory among its host's ranks and TCP to the
    other hosts' ranks, over ``subnet``'s addresses; the world group (spread evenly over hosts) has
    the hierarchical collectives."""
    for r, d in info.items():
        host = hosts[r // nproc]
        local = list(range(host.index * nproc, host.index * nproc + nproc))
        assert d["hostname"] == host.hostname, d
        assert (d["engine"], d["collectives"], d["host_collectives"], d["transport"], d["shm"], d["tcp"]) == (
            "HybridEngine", "HierarchicalCollectives", "ShmCollectives", "HybridTransport", "ShmTransport",
            "TcpTransport"), d
        assert d["local_ranks"] == local, f"rank {r}: shared memory with {d['local_ranks']}, expected {local}"
        for q, (mine, theirs) in d["connections"].items():
            q = int(q)
            if q in local:
                continue  # connected, but the hybrid transport sends to local peers by shared memory
            assert mine[0] == host.address(subnet) and theirs[0] == hosts[q // nproc].address(subnet), (
                f"rank {r} reaches rank {q} from {mine} to {theirs}, expected subnet {netns.SUBNETS[subnet]}")
        remote = {int(q) for q in d["connections"]} - set(local)
        assert remote == set(range(len(info))) - set(local), d["connections"]


def test_every_collective_matches_torch_across_two_hosts(hosts, tmp_path):
    from test_differential import compare
    import diff_cases as dc

    net = hosts(2)
    names = _cases()
    job = Job(net, tmp_path, "diff", [str(ORACLE_PORT), ",".join(names)])
    assert job.wait() == [0, 0], job.outputs()
    assert_hybrid(job.describe(range(4)), net.hosts, 2)
    by_name = {c.name: c for c in dc.cases(4)}
    problems = []
    for rank in range(4):
        with open(tmp_path / f"diff{rank}.pkl", "rb") as f:
            got = pickle.load(f)
        for name in names:
            problem = compare(by_name[name], 4, rank, got["torch"][name], got["distcomm"][name])
            if problem:
                problems.append(f"{name}, rank {rank}: {problem}")
    assert not problems, f"{len(problems)} differences from torch's gloo:\n" + "\n".join(problems[:20])
    assert_nothing_left(net, job)


def _watchdogs_of(launcher: int) -> set[int]:
    """The pids of the watchdog processes the launcher ``launcher`` started (its children running
    ``python -I -S -c``, as _launcher/watchdog.py starts them)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher and argv[1:4] == [b"-I", b"-S", b"-c"]:
            found.add(int(entry))
    return found


@pytest.mark.parametrize("victim", [2, 0], ids=["worker-host", "store-host"])
def test_a_killed_host_fails_the_others_promptly(hosts, tmp_path, victim):
    """3 hosts x 2 ranks all_reduce in a loop; every process of host ``victim`` is SIGKILLed (host 0
    also runs the job store). The others fail within seconds (the job's timeout is 60 s), naming
    the lost rank and its host's address, and leave nothing behind."""
    net = hosts(3)
    job = Job(net, tmp_path, "loop")
    deadline = time.monotonic() + DEADLINE
    while not all((tmp_path / f"ready{r}").exists() for r in range(6)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.launchers):
            pytest.fail(f"the workers did not all start\n{job.outputs()}")
        time.sleep(0.05)
    killed = time.monotonic()
    net.hosts[victim].kill_all()  # launcher and workers at once: the host is gone
    survivors = [k for k in range(3) if k != victim]
    # Node 0's launcher, when it survives, reports the failure, stops its workers, then waits in its
    # exit barrier for the dead host's launcher until it has missed its heartbeats (15 s by default;
    # at most coordination.EXIT_BARRIER_TIMEOUT, 30 s; torchrun's is 300 s): its workers are what
    # must go promptly. The other launchers exit.
    leaving = [k for k in survivors if k != 0]
    assert job.wait(leaving) == [1] * len(leaving), job.outputs()
    # ... and that launcher's watchdog (_launcher/watchdog.py), which lives exactly as long as it does
    lingering = {job.launchers[0].pid, *_watchdogs_of(job.launchers[0].pid)} if victim != 0 else set()
    for k in survivors:
        while set(net.hosts[k].processes()) - lingering and time.monotonic() - killed < 30:
            time.sleep(0.05)
    elapsed = time.monotonic() - killed
    assert elapsed < 15, f"the survivors took {elapsed:.1f} s after the kill\n{job.outputs()}"
    text = "".join(job.output(k) for k in survivors)
    lost = net.hosts[victim].address(0)
    ranks = (2 * victim, 2 * victim + 1)
    by_worker = "PeerLostError" in text and any(f"lost the connection to rank {r} at {lost}" in text for r in ranks)
    by_launcher = f"lost the job store at {lost}:{PORT}" in text  # node 0 gone: the launchers see it too
    assert by_worker or (victim == 0 and by_launcher), job.outputs()
    if victim != 0:
        assert "Root cause (first worker to fail)" in job.output(0), job.output(0)  # reported before the barrier
    for host in net.hosts:
        left = set(host.processes()) - lingering
        assert not left, f"processes left on {host.hostname}: {sorted(left)}\n{job.outputs()}"
        assert host.shm_entries() == [], f"left in {host.hostname}'s /dev/shm: {host.shm_entries()}"


def test_socket_ifname_moves_the_mesh_to_the_named_interface(hosts, tmp_path):
    net = hosts(2, subnets=2)
    # the job store is on eth0 (--master-addr), the workers' TCP mesh must be on eth1
    job = Job(net, tmp_path, "describe", env=_env(DISTCOMM_SOCKET_IFNAME="eth1"))
    assert job.wait() == [0, 0], job.outputs()
    assert_hybrid(job.describe(range(4)), net.hosts, 2, subnet=1)
    assert_nothing_left(net, job)
