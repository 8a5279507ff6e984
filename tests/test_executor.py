"""OrderedExecutor's claim: one operation of a group at a time, whichever threads issue them.

The latency paths claim a group with ``enter_inline`` / ``leave_inline`` (a non-blocking acquire
and a release); the worker thread waits for the same claim before it takes a queued task. These
tests drive it from several threads at once and check that no two operations ever overlap, that
queued work keeps its issue order, and that an inline call never jumps ahead of queued work.
"""

from __future__ import annotations

import threading

import pytest

from distcomm.executor import OrderedExecutor

DEADLINE = 30.0  # seconds for any thread of a test to finish: a hang fails the test, never the suite


class Overlap:
    """A body that notes whether another body was running when it started."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active = 0
        self.overlaps = 0
        self.runs = 0

    def body(self, log=None, item=None):
        with self.lock:
            self.active += 1
            if self.active > 1:
                self.overlaps += 1
        # give another thread the chance to run into this one (a switch interval's worth)
        for _ in range(200):
            pass
        with self.lock:
            self.active -= 1
            self.runs += 1
            if log is not None:
                log.append(item)


def _join_all(threads):
    for t in threads:
        t.join(DEADLINE)
    assert not any(t.is_alive() for t in threads), "a thread hung on the executor"


def test_threads_mixing_inline_claims_sync_and_async_calls_never_overlap():
    ex = OrderedExecutor("g")
    seen = Overlap()
    per_thread: dict[int, list] = {i: [] for i in range(4)}
    errors = []

    def play(i):
        try:
            works = []
            for k in range(300):
                kind = (i + k) % 3
                if kind == 0:  # what a latency path does
                    if ex.enter_inline():
                        try:
                            seen.body()
                        finally:
                            ex.leave_inline()
                elif kind == 1:
                    ex.run("sync", seen.body, async_op=False)
                else:
                    works.append(ex.run("async", lambda k=k: seen.body(per_thread[i], k), async_op=True))
            for w in works:
                w.wait(timeout=DEADLINE)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=play, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    _join_all(threads)
    ex.close()
    assert not errors, errors
    assert seen.overlaps == 0, f"{seen.overlaps} operations started while another was running"
    assert seen.runs >= 4 * 200  # every sync and async call ran (inline claims may decline)
    for i, log in per_thread.items():  # a thread's async calls ran in the order it issued them
        assert log == sorted(log) and len(log) == 100, (i, log)


def test_a_claim_held_by_one_thread_declines_every_other_until_released():
    ex = OrderedExecutor("g")
    assert ex.idle() and ex.enter_inline()
    assert not ex.idle()
    results = []
    t = threading.Thread(target=lambda: results.append(ex.enter_inline()), daemon=True)
    t.start()
    _join_all([t])
    assert results == [False]
    assert not ex.enter_inline()  # not reentrant either: the holder's own thread is declined too
    ex.leave_inline()
    assert ex.idle() and ex.enter_inline()
    ex.leave_inline()
    ex.close()


def test_queued_work_waits_for_an_inline_call_and_inline_calls_wait_for_queued_work():
    ex = OrderedExecutor("g")
    order = []
    assert ex.enter_inline()  # an inline call is running (a latency path's round)
    work = ex.run("async", lambda: order.append("queued"), async_op=True)
    # the worker must not start the queued task while the inline call holds the group
    assert not work.is_completed() and order == []
    assert not ex.enter_inline() and not ex.idle()
    order.append("inline")
    ex.leave_inline()
    work.wait(timeout=DEADLINE)
    assert order == ["inline", "queued"]

    gate = threading.Event()
    first = ex.run("async", lambda: (gate.wait(DEADLINE), order.append("slow")), async_op=True)
    # the worker holds the group now or soon; either way no inline claim succeeds before it ran
    assert not ex.enter_inline()
    gate.set()
    first.wait(timeout=DEADLINE)
    ex.run("sync", lambda: order.append("after"), async_op=False)
    assert order == ["inline", "queued", "slow", "after"]
    ex.close()


def test_a_closed_executor_declines_inline_claims_and_refuses_queued_work():
    ex = OrderedExecutor("g")
    ex.close()
    assert not ex.enter_inline()
    with pytest.raises(RuntimeError, match="destroyed"):
        ex.run("x", lambda: None, async_op=False)
