"""Failures on the shared-memory engine: dead and closed peers, timeouts, mismatches, hosts, cleanup.

* A killed rank makes the ranks waiting on it (in a collective or a receive) fail with
  PeerLostError naming it, although their timeout is 30 minutes: liveness is checked while waiting
  (so the test needs no timing assertion: a late detection would be a timeout, not this error).
* A rank that destroys its process group is reported as closed to the ranks still waiting on it.
* A group timeout names the rank that did not arrive; a size or dtype mismatch names the peer.
* "shm" refuses ranks on different hosts with a message naming the alternatives.
* Segments: none left in the segment directory after setup, after destroy, after an exception and
  after exiting without destroy (each test gets its own directory under /dev/shm).

Tiers: the fast tier (``pytest -m "not slow"``) keeps the segment cleanup of a rank that exits
without destroying its group and the default engine across two hosts (the only test of the hybrid
transport); the rest is slow. (test_api_errors' killed-peer world, which is fast, kills a rank of
the default engine, shared memory on one host.)
"""

from __future__ import annotations

import os

import pytest

from harness import run_world


def dead_peer_body(rank, world):
    import signal

    import numpy as np

    import distcomm as dist

    dist.init_process_group("shm")
    dist.barrier()
    victim = world - 1
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if rank == 0:
            dist.recv(np.zeros(4), src=victim)
        else:
            dist.all_reduce(np.ones(1000))
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.slow
def test_dead_peer_fails_fast_naming_it():
    world = 3
    results = run_world(dead_peer_body, world, expect_failure=[world - 1], timeout=90)
    for rank in range(world - 1):
        kind, message = results[rank]
        assert kind == "PeerLostError", (rank, kind, message)
        assert f"rank {world - 1} exited" in message, message


def closed_peer_body(rank, world):
    import numpy as np

    import distcomm as dist

    dist.init_process_group("shm")
    dist.barrier()
    if rank == 1:
        dist.destroy_process_group()
        return "closed"
    try:
        dist.all_reduce(np.ones(10))
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    return "no error"


@pytest.mark.slow
def test_closed_peer_is_reported():
    kind, message = run_world(closed_peer_body, 2, timeout=60)[0]
    assert kind == "PeerLostError" and "rank 1 closed its transport" in message, message


def timeout_and_mismatch_body(rank, world):
    from datetime import timedelta

    import numpy as np

    import distcomm as dist

    dist.init_process_group("shm")
    out = {}
    quick = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    if rank == 0:
        for name, call in [("collective", lambda: dist.all_reduce(np.ones(3), group=quick)),
                           ("recv", lambda: dist.recv(np.ones(3), src=1, group=quick))]:
            try:
                call()
            except RuntimeError as exc:
                out[name] = (type(exc).__name__, str(exc))
    dist.barrier()
    for name, x in [("size", np.ones(4 + rank, np.float32)), ("dtype", np.ones(4, [np.float32, np.int32][rank]))]:
        g = dist.new_group([0, 1])
        try:
            dist.all_reduce(x, group=g)
        except RuntimeError as exc:
            out[name] = (type(exc).__name__, str(exc))
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_timeout_and_mismatch_name_the_peer():
    results = run_world(timeout_and_mismatch_body, 2, timeout=90)
    for name in ("collective", "recv"):
        kind, message = results[0][name]
        assert kind == "DistTimeoutError" and "rank 1" in message, message
    for rank in range(2):
        for name in ("size", "dtype"):
            kind, message = results[rank][name]
            assert kind == "CollectiveMismatchError" and f"rank {1 - rank}" in message, (rank, message)


def hosts_body(rank, world):
    import distcomm as dist

    os.environ["DISTCOMM_HOST_ID"] = f"node{rank % 2}"
    try:
        dist.init_process_group("shm")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_shm_refuses_ranks_on_different_hosts():
    for message in run_world(hosts_body, 2, timeout=60):
        assert "needs every rank on one host" in message and "'gloo'" in message, message


def cleanup_body(rank, world, how):
    import numpy as np

    import distcomm as dist

    dist.init_process_group("shm")
    x = np.ones(50_000)
    dist.all_reduce(x)
    g = dist.new_group(list(range(world)))
    dist.broadcast(x, src=0, group=g)
    dist.barrier()
    seen = os.listdir(os.environ["DISTCOMM_SHM_DIR"])
    dist.barrier()
    if how == "exception":
        raise RuntimeError("boom")
    if how == "destroy":
        dist.destroy_process_group()
    return seen  # "exit": leave without destroying anything


@pytest.mark.parametrize("how", [pytest.param("destroy", marks=pytest.mark.slow),
                                 pytest.param("exception", marks=pytest.mark.slow), "exit"])
def test_no_segment_left_behind(seg_dir, how):
    world = 3
    results = run_world(cleanup_body, world, args=(how,), env={"DISTCOMM_SHM_DIR": seg_dir},
                        expect_failure=range(world) if how == "exception" else (), timeout=90)
    if how != "exception":
        assert results == [[]] * world  # already unlinked once set up: nothing to leak even on SIGKILL


def default_engine_two_hosts_body(rank, world):
    import numpy as np

    import distcomm as dist

    os.environ["DISTCOMM_HOST_ID"] = f"node{rank // 2}"
    dist.init_process_group()
    x = np.full(1000, rank, np.float64)
    dist.all_reduce(x)
    big = np.arange(70_001, dtype=np.float32) * (rank + 1)  # past 256 KiB: hierarchical
    dist.all_reduce(big)
    assert (big == np.arange(70_001, dtype=np.float32) * 10).all()
    even = np.arange(70_000, dtype=np.float64) * (rank + 1)  # splits evenly between a host's ranks:
    dist.all_reduce(even, op=dist.ReduceOp.AVG)  # its phases inside a host on the shm collectives
    assert (even == np.arange(70_000, dtype=np.float64) * 2.5).all()
    collectives = type(dist.group.WORLD.collectives).__name__, type(dist.group.WORLD.collectives.host).__name__
    local = dist.new_group([0, 1])
    y = np.full(10, rank, np.int64)
    if rank < 2:
        dist.all_reduce(y, group=local)
    b = np.zeros(5)
    if rank == 0:
        dist.send(np.arange(5.0), dst=3)
    if rank == 3:
        dist.recv(b, src=0)
    dist.barrier()
    senders = []
    if rank == 0:  # any-source receives with senders on this host (1) and on the other (2, 3)
        for _ in range(3):
            c = np.zeros(2, np.int32)
            src = dist.recv(c)
            assert (c == src).all()
            senders.append(src)
    else:
        dist.send(np.full(2, rank, np.int32), dst=0)
    dist.barrier()
    transport = type(dist.group.WORLD.transport).__name__
    dist.destroy_process_group()
    return x[0], int(y[0]), b.tolist(), transport, sorted(senders), collectives


# slow tier: the real multi-host tests (test_multihost_netns.py) run the same shape across namespaces
@pytest.mark.slow
def test_default_engine_across_hosts_uses_tcp_between_them():
    pytest.importorskip("distcomm.transport.tcp")
    results = run_world(default_engine_two_hosts_body, 4, timeout=120)
    assert [r[0] for r in results] == [6.0] * 4
    assert [r[1] for r in results] == [1, 1, 2, 3]
    assert results[3][2] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert {r[3] for r in results} == {"HybridTransport"}
    assert results[0][4] == [1, 2, 3]
    assert {r[5] for r in results} == {("HierarchicalCollectives", "ShmCollectives")}  # 2 hosts x 2 ranks


def _mapped_shm_segments() -> int:
    """How many shared-memory mappings this process has in the segment directory (named or not)."""
    from distcomm.transport.shm_segment import shm_dir

    where = os.path.realpath(shm_dir()) + "/"
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if where in line)


def group_churn_body(rank, world):
    """Create, use and destroy many subgroups: each one's shared memory is let go at its destroy,
    not only when the whole world is destroyed."""
    import numpy as np

    import distcomm as dist

    dist.init_process_group("gloo")
    x = np.ones(4, np.float32)
    dist.all_reduce(x)
    baseline = _mapped_shm_segments()
    peak = baseline
    for i in range(12):
        g = dist.new_group(list(range(world)))
        y = np.full(1000, float(i), np.float32)
        dist.all_reduce(y, group=g)
        assert y[0] == i * world
        peak = max(peak, _mapped_shm_segments())
        dist.destroy_process_group(g)
        dist.barrier()  # every member has released the group before the next one is made
    after = _mapped_shm_segments()
    dist.destroy_process_group()
    # each live group maps one segment per member; 12 groups kept alive would be 12 * world more
    assert peak > baseline, (baseline, peak)  # a group's memory really was mapped while in use
    assert after == baseline, f"{after - baseline} group mappings left after destroying every group"
    return "ok"


@pytest.mark.slow
def test_destroying_a_group_frees_its_shared_memory():
    assert run_world(group_churn_body, 3, timeout=120) == ["ok"] * 3
