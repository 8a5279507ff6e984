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


def _p2p_late_sender(rank, world_size):
    """rank 0: an irecv whose wait(timeout) runs out (rank 1 sends late), then an irecv's future
    with a collective issued after it that the sender makes before it sends."""
    import distcomm as dist

    dist.init_process_group(timeout=timedelta(seconds=20))
    got = np.zeros(1, dtype=np.float32)
    if rank == 1:
        time.sleep(1.5)  # late: rank 0's wait(timeout) runs out first
        dist.send(np.full(1, 5, dtype=np.float32), dst=0)
        dist.all_reduce(np.ones(1, dtype=np.float32))  # rank 0 issues it after its irecv's get_future
        dist.send(np.full(1, 7, dtype=np.float32), dst=0)
        dist.barrier()
        dist.destroy_process_group()
        return None
    work = dist.irecv(got, src=1)
    try:  # before, this wait returned once the message came, within the group's timeout
        work.wait(timeout=timedelta(seconds=0.3))
        message = None
    except dist.DistTimeoutError as exc:
        message = str(exc)
    work.wait()  # the receive went on
    first = float(got[0])
    future = dist.irecv(got, src=1).get_future()
    total = np.ones(1, dtype=np.float32)
    dist.all_reduce(total)  # not queued behind the receive: the sender makes it before sending
    future.wait()
    dist.barrier()
    dist.destroy_process_group()
    return {"message": message, "first": first, "total": float(total[0]), "second": float(got[0])}


@pytest.mark.slow  # waits out timeouts and late peers: seconds
def test_a_receives_wait_with_a_timeout_gives_up_and_its_future_does_not_hold_up_the_group():
    res = run_world(_p2p_late_sender, 2, timeout=60)[0]
    assert res["message"] is not None and res["message"].startswith("irecv")
    assert "Timed out in Work.wait after 0.3 s; " in res["message"] and res["message"].endswith(GOES_ON)
    assert res["first"] == 5.0 and res["total"] == 2.0 and res["second"] == 7.0
