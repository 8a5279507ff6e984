"""A hang report written after the store's host has exited: rank 0 (whose process serves the
TCPStore under env://) leaves, then rank 1 times out waiting for rank 2, which is alive, sleeping.
No report can be read, and the error must say that the store is gone, not that rank 2 "may be
dead, stopped, or holding the GIL". Real processes, a 2 s timeout."""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest

from harness import run_world

TIMEOUT = 2.0


def _store_host_leaves(rank, world_size):
    import distcomm as dist

    dist.init_process_group(timeout=timedelta(seconds=TIMEOUT))
    pair = dist.new_group([1, 2])  # a group without rank 0: its exit does not end their collectives
    dist.barrier()
    if rank == 0:
        return None  # its process ends, and the store with it
    x = np.ones(4, dtype=np.float32)
    if rank == 2:
        time.sleep(TIMEOUT + 2.0)  # alive, busy outside distcomm: its watchdog would answer
        return None
    time.sleep(0.5)  # rank 0 is gone by now
    try:
        dist.all_reduce(x, group=pair)
    except dist.DistTimeoutError as exc:
        return str(exc)
    return None


@pytest.mark.slow  # waits out a timeout: seconds
def test_report_says_the_store_is_gone_not_that_the_ranks_are():
    error = run_world(_store_host_leaves, 3, timeout=60)[1]
    print(error)
    assert error is not None and "all_reduce #1 on rank 0" in error
    assert "rank 2: no report (the store is unreachable: this says nothing about rank 2)" in error
    assert "no report could be read: the store stopped answering (" in error
    assert "the process serving it (rank 0's, under env:// and tcp://) has most likely exited" in error
    assert "holding the GIL" not in error
