"""Work.wait(timeout) that times out names the operation (sequence number, rank and group where the
Work knows them) and says that the operation goes on and what to do; Work.is_success() before
completion is torch's: True while no error has happened (torch 2.13's gloo Work and its Python
Work subclass both return True there)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import numpy as np
import pytest

from distcomm.errors import DistTimeoutError
from distcomm.executor import OrderedExecutor
from harness import run_world

GOES_ON = ("the operation itself goes on (it completes when every rank has joined it, or fails at its group's "
           "timeout): call wait() again to keep waiting, or poll is_completed()")


def test_a_queued_works_timeout_names_its_seq_rank_and_group():
    ex = OrderedExecutor("7", rank=1)
    release = threading.Event()
    try:
        work = ex.run("all_reduce", lambda: release.wait(30), True, result=["t"], seq=12)
        with pytest.raises(DistTimeoutError) as info:
            work.wait(timeout=timedelta(milliseconds=50))
        assert str(info.value) == f"all_reduce #12 on rank 1 of group '7': Timed out in Work.wait after 0.05 s; {GOES_ON}"
        assert not work.is_completed() and work.is_success() and work.exception() is None
        release.set()
        assert work.wait(timeout=30) and work.result() == ["t"] and work.is_success()
    finally:
        release.set()
        ex.close()


def test_without_seq_or_rank_the_group_is_still_named():
    ex = OrderedExecutor("trainers")
    release = threading.Event()
    try:
        work = ex.run("broadcast", lambda: release.wait(30), True)
        with pytest.raises(DistTimeoutError, match=r"^broadcast of group 'trainers': Timed out in Work.wait after 0.02 s; "):
            work.wait(timeout=0.02)
    finally:
        release.set()
        ex.close()


def _late_peer(rank, world_size):
    import distcomm as dist

    dist.init_process_group(timeout=timedelta(seconds=30))
    x = np.full(4, rank + 1, dtype=np.float32)
    if rank == 1:
        time.sleep(2.0)  # late: rank 0's wait(timeout) runs out first
        dist.all_reduce(x)
        return None
    work = dist.all_reduce(x, async_op=True)
    pending_success = work.is_success()
    try:
        work.wait(timeout=timedelta(seconds=0.5))
        message = None
    except dist.DistTimeoutError as exc:
        message = str(exc)
    completed_early = work.is_completed()
    work.wait()  # the operation went on, and completes once rank 1 joins
    return {"pending_success": pending_success, "message": message, "completed_early": completed_early,
            "value": float(x[0]), "success": work.is_success()}


def test_through_the_api_the_operation_goes_on_after_a_timed_out_wait():
    res = run_world(_late_peer, 2, timeout=60)[0]
    assert res["pending_success"] is True
    assert not res["completed_early"]
    assert res["message"] is not None and res["message"].startswith("all_reduce")
    assert " of group '0': Timed out in Work.wait after 0.5 s; " in res["message"]
    assert res["message"].endswith(GOES_ON)
    assert res["value"] == 3.0 and res["success"] is True
