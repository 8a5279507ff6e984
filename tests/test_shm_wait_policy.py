"""The shared-memory wait policy when a yield cannot reach the peers (transport/shm_wait.py).

Launchers (torchrun, distcomm-run, distcomm-bench) start each rank in a session of its own. With the
kernel's autogroups on, each session is a scheduling group, and a ``sched_yield`` only lets the
other tasks *of the yielder's group* run: a waiter yielding for its peer keeps the CPU the peer
needs. So a waiter whose peers are in other sessions (or other cpu cgroups) does not yield: it goes
from its spin (or, with more ranks than CPUs, from its first look) straight to sleep, and the last
poster rings it.

* ``yield_reaches``: a process of this session is reachable, one that started a session of its own
  is not (when autogroups are on; the test reads the kernel's switch and expects what it says).
* ``WaitPolicy``: those defaults, and values the user set kept.
* A world of 4 ranks, each in its own session (what a launcher gives): the policy the transport
  took, and every kind of wait getting its answer through sleeping (the latency path's all_reduce
  and barrier, the general path, a large all_reduce, slot reuse, p2p), results checked.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from distcomm.transport.shm_wait import WaitPolicy, yield_reaches
from distcomm.tuning import Tuning
from harness import run_world


def _autogroups() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() not in ("", "0")
    except OSError:
        return False


@pytest.fixture
def sleepers():
    """(a child in this session, a child in a session of its own); both killed afterwards."""
    code = "import time; time.sleep(60)"
    same = subprocess.Popen([sys.executable, "-c", code])
    apart = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        yield same.pid, apart.pid
    finally:
        for child in (same, apart):
            child.kill()
            child.wait()


def test_yield_reaches_this_sessions_processes_only(sleepers):
    same, apart = sleepers
    assert yield_reaches([]) is True
    assert yield_reaches([os.getpid()]) is True  # itself: nobody to reach
    assert yield_reaches([same]) is True
    assert yield_reaches([apart]) is (not _autogroups())
    assert yield_reaches([same, apart]) is (not _autogroups())


def test_yield_reaches_no_process_that_is_gone():
    child = subprocess.Popen(["true"])
    child.wait()
    assert yield_reaches([child.pid]) is False


def test_policy_sleeps_without_yielding_when_yields_cannot_reach(sleepers):
    same, apart = sleepers
    cpus = len(os.sched_getaffinity(0))
    many, few = cpus + 2, 1  # local ranks: oversubscribed, or one CPU each
    reach = WaitPolicy(many, Tuning.from_env({}), [same])
    assert reach.yields_reach_peers and (reach.spin_s, reach.yield_s, reach.shared_yield_s) == (0.0, 50e-6, 200e-6)
    if not _autogroups():
        pytest.skip("autogroups are off: every process of this cgroup is reachable")
    apart_many = WaitPolicy(many, Tuning.from_env({}), [apart])
    assert not apart_many.yields_reach_peers
    assert (apart_many.spin_s, apart_many.yield_s, apart_many.shared_yield_s) == (0.0, 0.0, 0.0)
    apart_few = WaitPolicy(few, Tuning.from_env({}), [apart])
    assert (apart_few.spin_s, apart_few.yield_s, apart_few.shared_yield_s) == (20e-6, 0.0, 0.0)  # spin, then sleep
    user = WaitPolicy(many, Tuning.from_env({"DISTCOMM_SHM_YIELD_US": "30", "DISTCOMM_SHM_SHARED_YIELD_US": "40"}),
                      [apart])
    assert (user.yield_s, user.shared_yield_s) == pytest.approx((30e-6, 40e-6))


def sessions_body(rank, world, calls):
    os.setsid()  # what torchrun, distcomm-run and distcomm-bench do to each rank
    import numpy as np

    import distcomm as dist
    from distcomm import world as dist_world

    dist.init_process_group(None)
    pg = dist_world.default_pg
    policy = pg.transport.policy
    expect = 1.0 * world * (world + 1) / 2
    x = np.zeros(2, np.float32)
    for i in range(calls):  # the latency path: 3 of 4 ranks wait for the last poster's ring
        x[:] = rank + 1 + i
        dist.all_reduce(x)
        assert x.tolist() == [expect + world * i] * 2, (i, x)
        if i % 50 == 0:
            dist.barrier()
    works = [dist.all_reduce(np.full(3, rank + 1.0), async_op=True) for _ in range(6)]  # the general path
    for w in works:
        w.wait()
    big = np.full(300_000, rank + 1.0, np.float32)  # more than a slot: several rounds, slots reused
    dist.all_reduce(big)
    assert float(big.min()) == float(big.max()) == expect
    token = np.full(4, rank, np.int64)  # p2p through the rings: a token around the ring of ranks
    if rank == 0:
        dist.send(token, 1)
        dist.recv(token, world - 1)
    else:
        dist.recv(token, rank - 1)
        token += 1
        dist.send(token, (rank + 1) % world)
    if rank == 0:
        assert token.tolist() == [world - 1] * 4
    dist.barrier()
    dist.destroy_process_group()
    return policy.yields_reach_peers, policy.yield_s, policy.shared_yield_s


@pytest.mark.slow
def test_a_world_of_separate_sessions_sleeps_instead_of_yielding():
    world = 4
    results = run_world(sessions_body, world, args=(600,), timeout=120)
    if _autogroups():
        assert results == [(False, 0.0, 0.0)] * world
    else:
        assert all(reach for reach, _, _ in results)
