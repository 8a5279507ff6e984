"""A rank that arrives at a collective after its peers timed out on it fails too; it does not complete it.

The peers' call timed out (a DistTimeoutError each); rank 2 comes late to the same call. On the
shared-memory engine the peers had already posted their data, so before, rank 2 read it and
returned success: the ranks disagreed on whether the call happened (a barrier passed by one rank
that the others abandoned). Now a rank whose call fails mid-collective takes back the post of the
round it did not finish and marks the group given up: the late rank fails with PeerFailedError
naming the rank, as torch's gloo fails it ("Connection closed by peer"), and the group's later
calls fail at once. The late rank waits on the peer, finds it gave up at its next health check,
and is told what the peers were doing (their failures).
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest

from harness import run_world

TIMEOUT_S = 3  # the peers' timeout; the late rank comes 2 s after it
LATE_S = TIMEOUT_S + 2

# calls in which every rank waits for every other (a rooted call's root may complete without its
# peers: a broadcast's root only writes)
OPS = {
    "all_reduce 8 B": lambda dist, rank, world: dist.all_reduce(np.ones(2, dtype=np.float32)),
    "barrier": lambda dist, rank, world: dist.barrier(),
    "all_to_all_single 12 B": lambda dist, rank, world: dist.all_to_all_single(
        np.zeros(world, dtype=np.float32), np.ones(world, dtype=np.float32)),
    "all_gather 8 B": lambda dist, rank, world: dist.all_gather_into_tensor(
        np.zeros(2 * world, dtype=np.float32), np.ones(2, dtype=np.float32)),
    "all_reduce 8 MiB": lambda dist, rank, world: dist.all_reduce(np.ones(1 << 21, dtype=np.float32)),
}


def _late(rank, world, name):
    import distcomm as dist
    from distcomm.errors import DistTimeoutError, PeerFailedError

    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    call = OPS[name]
    call(dist, rank, world)  # every rank once: the group's shared memory is set up
    late = rank == world - 1
    if late:
        time.sleep(LATE_S)
    outcome = "completed"
    try:
        call(dist, rank, world)
    except PeerFailedError as exc:
        assert "gave up on this group" in str(exc), exc
        if late:  # what the peers reported comes along
            assert "were doing" in str(exc) and "failed: " in str(exc), exc
        outcome = "peer failed"
    except DistTimeoutError:
        outcome = "timed out"
    # the group is unusable on every rank now: its next call fails at once
    started = time.monotonic()
    with pytest.raises(dist.DistError):
        dist.all_reduce(np.ones(1, dtype=np.float32))
    assert time.monotonic() - started < TIMEOUT_S  # not waited out: the failure is known
    if not late:
        time.sleep(LATE_S)  # the late rank still reads this rank's header
    dist.destroy_process_group()
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPS))
def test_a_late_rank_fails_the_call_its_peers_timed_out_on(name):
    world = 3
    outcomes = run_world(_late, world, args=(name,), timeout=60)
    # the first peer to time out gives up; the other may find that before its own timeout
    assert "timed out" in outcomes[:-1] and set(outcomes[:-1]) <= {"timed out", "peer failed"}, outcomes
    assert outcomes[-1] == "peer failed", outcomes
