"""An object collective with an object one rank cannot pickle: that rank raises its pickling error,
every other rank a DistBackendError naming it, and the group stays in step.

torch's gloo is no oracle here: its pickling rank raises and the others wait for payloads that never
come. distcomm's rank sends a size that says "unpicklable" in the sizes' exchange, so every rank
skips the payloads (before, the receivers of a broadcast_object_list read the source's next call as
the payload: a mismatch naming the wrong call, and a group broken for good).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import pytest

from harness import run_world

WORLD = 3
BAD = 1  # the rank whose object cannot be pickled


def _calls(dist, rank: int, world: int) -> dict:
    def obj():
        return threading.Lock() if rank == BAD else {"rank": rank}

    return {
        "broadcast_object_list": lambda: dist.broadcast_object_list([obj(), 1], src=BAD),
        "all_gather_object": lambda: dist.all_gather_object([None] * world, obj()),
        "gather_object": lambda: dist.gather_object(obj(), [None] * world if rank == 0 else None, dst=0),
        "scatter_object_list": lambda: dist.scatter_object_list(
            [None], [obj() for _ in range(world)] if rank == BAD else None, src=BAD),
    }


def _run(rank, world, engine, name):
    import distcomm as dist

    dist.init_process_group(engine, timeout=timedelta(seconds=30))
    try:
        _calls(dist, rank, world)[name]()
        outcome = "returned"
    except TypeError as exc:  # pickle's own error for a lock, on the rank that tried
        outcome = f"TypeError: {'pickle' in str(exc)}"
    except dist.DistBackendError as exc:
        outcome = f"DistBackendError: {f'rank {BAD} could not pickle' in str(exc)}"
    x = np.ones(2)
    dist.all_reduce(x)  # the ranks are still in step
    good = [None] * world
    dist.all_gather_object(good, rank)  # and the object collectives still work
    dist.destroy_process_group()
    return outcome, x.tolist(), good


@pytest.mark.parametrize("engine", ["gloo", "tcp"])
@pytest.mark.parametrize("name", list(_calls(None, 0, WORLD)))
def test_an_unpicklable_object_fails_every_rank_and_keeps_the_group(name, engine):
    results = run_world(_run, WORLD, args=(engine, name), timeout=60)
    for rank, (outcome, total, good) in enumerate(results):
        want = "TypeError: True" if rank == BAD else "DistBackendError: True"
        assert outcome == want, (rank, outcome)
        assert total == [float(WORLD)] * 2 and good == list(range(WORLD)), (rank, total, good)
