"""Long-lived jobs on the shared-memory engine: groups made and destroyed past the engine's
directory size, a group whose setup fails on one rank, and a group destroyed by one thread while
another is in a call on it.

* A process held at most 1024 shared-memory groups over its whole init, destroyed ones included:
  the 1025th group's first collective raised, with one group alive at a time. Now the directory
  entry of a destroyed group is reused.
* A rank that could not make its segment for a new group (out of room in /dev/shm, an unusable
  DISTCOMM_SHM_DIR) raised at once, but its peers waited for its directory entry until the
  group's timeout (30 minutes by default). Now it publishes an entry that says it gave up, and the
  peers fail at once. Here one rank points DISTCOMM_SHM_DIR at a missing directory after init; the
  group timeout is far past the world's deadline, so waiting it out fails the test.
* destroy_process_group(group) from one thread while another waited in a collective on the group
  raised AttributeError ('GroupShm' object has no attribute 'consume') in the waiter, and
  destroy_process_group() while another thread set up a group's shared memory raised TypeError:
  now both are distcomm errors that say what happened.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import numpy as np
import pytest

from harness import run_world

GROUPS = 1040  # past the directory's 1024 entries


def _many_groups(rank, world):
    import distcomm as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for i in range(GROUPS):
        g = dist.new_group([0, 1])
        t = np.full(4, float(rank + i), np.float32)
        dist.all_reduce(t, group=g)
        assert t[0] == 2 * i + 1, (i, t[0])
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    return True


@pytest.mark.slow
def test_groups_made_and_destroyed_past_the_directory_size():
    env = {"DISTCOMM_SHM_SLOT_BYTES": "4096", "DISTCOMM_SHM_SLOTS": "2"}
    assert run_world(_many_groups, 2, timeout=90, env=env) == [True, True]


def _in_call(dist, group, out, key):
    """Run an all_reduce on ``group`` in this thread; record what it raised."""
    try:
        dist.all_reduce(np.ones(8, np.float32), group=group)
        out[key] = "returned"
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        out[key] = exc


def _failures(rank, world):
    import distcomm as dist
    from distcomm.errors import DistError

    # group timeout far past the world's deadline: a rank that waits it out fails the test
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    seen = {}

    # 1. rank 1 cannot make its segment for a new group: rank 0 fails at once, and the world
    #    group is still usable
    g = dist.new_group([0, 1])
    saved = os.environ.get("DISTCOMM_SHM_DIR")
    if rank == 1:
        os.environ["DISTCOMM_SHM_DIR"] = "/nonexistent-distcomm-review"
    try:
        dist.all_reduce(np.ones(4, np.float32), group=g)
        seen["setup"] = "returned"
    except DistError as exc:
        seen["setup"] = str(exc)
    if saved is None:
        os.environ.pop("DISTCOMM_SHM_DIR", None)
    else:
        os.environ["DISTCOMM_SHM_DIR"] = saved
    dist.destroy_process_group(g)
    t = np.ones(4, np.float32)
    dist.all_reduce(t)
    assert t[0] == 2

    # 2. a group destroyed while a thread of rank 0 waits in a collective on it (rank 1 never
    #    calls it): the waiter raises a distcomm error saying so
    g = dist.new_group([0, 1])
    dist.all_reduce(np.ones(8, np.float32), group=g)  # its shared memory is set up
    out: dict = {}
    if rank == 0:
        th = threading.Thread(target=_in_call, args=(dist, g, out, "destroyed"))
        th.start()
        time.sleep(0.5)
        dist.destroy_process_group(g)
        th.join(30)
        assert not th.is_alive()
        seen["destroyed"] = out["destroyed"]
    else:
        dist.destroy_process_group(g)
    dist.barrier()

    # 3. the world destroyed while a thread of rank 0 sets up a new group's shared memory (rank 1
    #    never calls it): a distcomm error, not a TypeError
    g = dist.new_group([0, 1])
    if rank == 0:
        th = threading.Thread(target=_in_call, args=(dist, g, out, "world"))
        th.start()
        time.sleep(0.5)
        dist.destroy_process_group()
        th.join(30)
        assert not th.is_alive()
        seen["world"] = out["world"]
    else:
        dist.destroy_process_group()
    return {k: v if isinstance(v, str) else (isinstance(v, DistError), isinstance(v, RuntimeError), str(v))
            for k, v in seen.items()}


def test_failed_setup_and_destroy_during_a_call():
    r0, r1 = run_world(_failures, 2, timeout=40)
    assert "nonexistent-distcomm-review" in r1["setup"], r1
    assert "rank 1 gave up setting up the shared memory" in r0["setup"], r0
    assert "all_reduce" in r0["setup"] and "rank 0" in r0["setup"], r0
    is_dist, is_runtime, text = r0["destroyed"]
    assert is_dist and is_runtime, text
    assert "all_reduce" in text and "destroyed" in text, text
    is_dist, is_runtime, text = r0["world"]
    assert is_dist and is_runtime, text
    assert "all_reduce" in text and "closed" in text, text
