"""The end of init_process_group: rank 0, whose process hosts the store under env://, returns only
once every other rank has made its last store call of init (``rollcall.finish``), so a quick rank 0
(send, print, exit) cannot take the store away from a rank still in init; and a rank that never
finishes holds it back only a bounded time."""

from __future__ import annotations

import threading
import time

from distcomm._api import rollcall
from distcomm.store import HashStore


def test_rank_zero_returns_only_after_every_other_rank_finished():
    store, order = HashStore(), []

    def rank_zero():
        rollcall.finish(store, 0, 3, wait=30)
        order.append("rank 0 returned")

    zero = threading.Thread(target=rank_zero)
    zero.start()
    for rank in (1, 2):
        time.sleep(0.2)  # a rank descheduled in its init
        assert zero.is_alive() and "rank 0 returned" not in order
        order.append(f"rank {rank} finished")
        rollcall.finish(store, rank, 3)
    zero.join(10)
    assert order == ["rank 1 finished", "rank 2 finished", "rank 0 returned"]


def test_a_rank_that_never_finishes_holds_rank_zero_back_a_bounded_time():
    store = HashStore()
    rollcall.finish(store, 1, 3)  # rank 2 never comes (it failed; its own error says why)
    started = time.monotonic()
    rollcall.finish(store, 0, 3, wait=0.3)
    assert time.monotonic() - started < 5


def test_the_other_ranks_and_a_world_of_one_do_not_wait():
    store = HashStore()
    started = time.monotonic()
    rollcall.finish(store, 2, 3, wait=30)
    rollcall.finish(store, 0, 1, wait=30)
    assert time.monotonic() - started < 5
