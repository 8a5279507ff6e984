"""``async_op=True`` on the torch backend "distcomm" returns without waiting for the peers, as gloo's.

A program may issue an asynchronous collective, then a send or a collective on another group that
its peers need first, and only then wait: the asynchronous call must not wait for its peers before
it returns, or such a program deadlocks. Each case runs on backend "gloo" (the oracle) and on
"distcomm", at world size 2.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from harness import run_world  # noqa: E402

TIMEOUT = timedelta(seconds=20)  # the group's: a call that waits for its peers first fails at this


def _async_then_p2p(rank, dist):
    """rank 0: async broadcast from 1, then a send rank 1 must receive before it broadcasts."""
    x, y = torch.full((4,), float(rank)), torch.full((4,), 5.0 + rank)
    if rank == 0:
        work = dist.broadcast(x, src=1, async_op=True)
        dist.send(y, dst=1)
        work.wait()
    else:
        dist.recv(y, src=0)
        dist.broadcast(x, src=1)
    return x.tolist(), y.tolist()


def _async_then_other_group(rank, dist):
    """rank 0: async all_reduce on g1, then a synchronous one on g2; rank 1 calls g2 first."""
    g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
    a, b = torch.full((4,), float(rank)), torch.full((4,), 10.0 * rank)
    if rank == 0:
        work = dist.all_reduce(a, group=g1, async_op=True)
        dist.all_reduce(b, group=g2)
        work.wait()
    else:
        dist.all_reduce(b, group=g2)
        dist.all_reduce(a, group=g1)
    return a.tolist(), b.tolist()


def _async_returns_before_the_peer_arrives(rank, dist):
    """rank 1 arrives 2 s late: rank 0's async call returns at once, its wait() takes the time."""
    x = torch.full((1,), float(rank + 1))
    if rank == 0:
        started = time.monotonic()
        work = dist.all_reduce(x, async_op=True)
        returned = time.monotonic() - started
        done_early = work.is_completed()
        work.wait()
        return x.tolist(), returned < 1.0, done_early
    time.sleep(2)
    dist.all_reduce(x)
    return x.tolist(), True, False


def _async_barrier_and_rooted(rank, dist):
    """Small rooted calls and a barrier, issued async in a row and waited in reverse (the latency
    paths take only synchronous calls), then synchronously: the same results."""
    outs = []
    for asynchronous in (True, False):
        x = torch.full((3,), float(rank + 1))
        y = torch.full((3,), float(rank + 1))
        works = [dist.broadcast(x, src=1, async_op=asynchronous), dist.reduce(y, dst=0, async_op=asynchronous),
                 dist.barrier(async_op=asynchronous)]
        for work in reversed(works if asynchronous else []):
            work.wait()
        outs.append((x.tolist(), y.tolist() if rank == 0 else None))
    return outs


def _recv_future_then_collective(rank, dist):
    """rank 0: an irecv's future, then an all_reduce rank 1 makes before it sends: the future must
    not hold the group's collectives back."""
    got, x = torch.zeros(2), torch.full((2,), float(rank + 1))
    if rank == 0:
        future = dist.irecv(got, src=1).get_future()
        dist.all_reduce(x)
        future.wait()
    else:
        dist.all_reduce(x)
        dist.send(torch.full((2,), 7.0), dst=0)
    return x.tolist(), got.tolist() if rank == 0 else None


CASES = {
    "async then p2p": (_async_then_p2p, [([1.0] * 4, [5.0] * 4)] * 2),
    "async then another group": (_async_then_other_group, [([1.0] * 4, [10.0] * 4)] * 2),
    "async returns before the peer arrives": (_async_returns_before_the_peer_arrives,
                                              [([3.0], True, False), ([3.0], True, False)]),
    "async rooted calls and barrier": (_async_barrier_and_rooted,
                                       [[([2.0] * 3, [3.0] * 3)] * 2, [([2.0] * 3, None)] * 2]),
}
# gloo's send/recv Work has no future ("Work::getFuture not implemented"): distcomm's only
FUTURE_CASES = {
    "a receive's future then a collective": (_recv_future_then_collective,
                                             [([3.0] * 2, [7.0] * 2), ([3.0] * 2, None)]),
}


def _case(rank, world, backend, name):
    import torch.distributed as dist

    import distcomm.torch_backend  # noqa: F401 - registers "distcomm"

    dist.init_process_group(backend, rank=rank, world_size=world, timeout=TIMEOUT)
    dist.barrier()
    result = {**CASES, **FUTURE_CASES}[name][0](rank, dist)
    dist.barrier()
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("backend", ["gloo", "distcomm"])
@pytest.mark.parametrize("name", list(CASES))
def test_an_async_call_does_not_wait_for_its_peers(backend, name):
    # a deadlock fails at the group's timeout (20 s) inside the world's deadline
    assert run_world(_case, 2, args=(backend, name), timeout=60) == CASES[name][1]


@pytest.mark.parametrize("name", list(FUTURE_CASES))
def test_a_receives_future_does_not_hold_the_groups_collectives_back(name):
    assert run_world(_case, 2, args=("distcomm", name), timeout=60) == FUTURE_CASES[name][1]


def _wait_timeout(rank, world):
    import torch.distributed as dist

    import distcomm.torch_backend  # noqa: F401
    from distcomm.errors import DistTimeoutError

    dist.init_process_group("distcomm", rank=rank, world_size=world, timeout=TIMEOUT)
    dist.barrier()
    x = torch.ones(1 << 10)
    waited = None
    if rank == 0:
        work = dist.all_reduce(x, async_op=True)
        started = time.monotonic()
        with pytest.raises(DistTimeoutError, match="all_reduce"):
            work.wait(timeout=timedelta(seconds=1))
        waited = round(time.monotonic() - started)
        work.wait()  # the call went on: it completes once rank 1 arrives
        got = torch.zeros(1)
        receive = dist.irecv(got, src=1)
        with pytest.raises(DistTimeoutError, match="recv"):  # gloo closes the pair here
            receive.wait(timeout=timedelta(seconds=0.5))
        receive.wait()
        assert got.item() == 4.0
    else:
        time.sleep(3)
        dist.all_reduce(x)
        time.sleep(1)
        dist.send(torch.full((1,), 4.0), dst=0)
    dist.barrier()
    dist.destroy_process_group()
    return waited, x[0].item()


@pytest.mark.slow  # waits out timeouts and late peers: seconds
def test_wait_with_a_timeout_raises_after_it_and_the_call_still_completes():
    assert run_world(_wait_timeout, 2, timeout=60) == [(1, 2.0), (None, 2.0)]
