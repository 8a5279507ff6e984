"""OrderedExecutor: a process group's order of work.

Operations on one group complete in issue order (torch's guarantee). A synchronous call made while
nothing is queued runs inline in the caller's thread: no thread hand-off on the latency path. An
``async_op=True`` call is queued for the group's one worker thread (started on first use), which
makes progress while the caller computes; a synchronous call made behind queued work waits its turn.
One thread per group, never one per operation: two groups can then never deadlock each other the
way a single shared worker could (rank 0 runs group A's op while rank 1 runs group B's).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

from .errors import describe_op
from .work import Work


class _Task:
    __slots__ = ("run", "work")

    def __init__(self, run: Callable[[], Any], work: Work):
        self.run = run
        self.work = work


class OrderedExecutor:
    """Runs a group's operations one at a time in issue order; see the module docstring.

    Who runs the group's current operation holds ``_running``, a lock taken without waiting by an
    inline call (``enter_inline``) and waited for by the worker thread before it takes a task: two
    threads of one process never both run an operation of one group. The claim of an inline call is
    then one non-blocking acquire and its release one release (both single C calls, atomic under
    the GIL), where a condition-guarded flag costs a lock round trip on each side.
    """

    def __init__(self, name: str, rank: int | None = None):
        self.name = name
        self.rank = rank  # this process's rank in the group, when known: named by a Work's timeout
        self._queue: collections.deque[_Task] = collections.deque()
        self._running = threading.Lock()
        # Guards the queue, the worker's start and ``closed``; only the worker waits on it.
        self._cv = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        # Set by close(), under _cv; an inline claim reads it without (its claim is the lock).
        self.closed = False
        # The release of an inline call's claim: the lock's own method, no Python frame. The worker
        # needs no wake-up: it waits on the lock itself.
        self.leave_inline = self._running.release

    def enter_inline(self) -> bool:
        """Claim the group for a synchronous call the caller runs itself: True when nothing is
        running or queued and the group is open (then ``leave_inline()`` must follow), else False."""
        queue = self._queue
        if queue or self.closed or not self._running.acquire(False):
            return False
        if queue:  # queued between the test and the claim: the queued task was issued first
            self._running.release()
            return False
        return True

    def inline_gate(self) -> tuple:
        """(queue, lock): what ``enter_inline`` reads, for a claim made in C (the whole calls of
        _calls.h, which repeat its steps: nothing queued, not closed, the lock taken without
        waiting, still nothing queued). The queue is only read there; ``leave_inline`` releases."""
        return self._queue, self._running

    def idle(self) -> bool:
        """Nothing running or queued: a snapshot, for callers choosing between running a call
        inline and queueing it (torch's C++ callers issue every call async; see torch_backend)."""
        return not (self._queue or self._running.locked())

    def describe(self, op: str, seq: int | None = None) -> str:
        """``op`` as a Work's errors name it: "all_reduce #7 on rank 1 of group '0'" (the sequence
        number and rank where known)."""
        return f"{describe_op(op, seq, self.rank)} of group {self.name!r}"

    def run(self, op: str, fn: Callable[[], Any], async_op: bool, result: Any = None,
            seq: int | None = None) -> Work | None:
        """Run ``fn``, operation ``op`` (number ``seq`` of the group), inline when it may (see the
        module docstring), else queued: its Work when ``async_op``, else None once it is done."""
        if not async_op and self.enter_inline():
            try:
                fn()
            finally:
                self._running.release()
            return None
        work = Work(op, result, self.describe(op, seq))
        with self._cv:
            if self.closed:
                raise RuntimeError(f"{op}: the process group {self.name!r} has been destroyed")
            self._queue.append(_Task(fn, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"distcomm-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        if async_op:
            return work
        work.wait()
        return None

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    if self.closed:
                        return
                    self._cv.wait()
            # The claim first, then the task: a task stays queued (so inline calls decline) until
            # its turn. Only this thread removes tasks, so the queue is still not empty here.
            self._running.acquire()
            with self._cv:
                task = self._queue.popleft()
            exc = None
            try:
                task.run()
            except BaseException as e:  # noqa: BLE001 - delivered through the Work
                exc = e
            finally:
                self._running.release()
            task.work._finish(exc)

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
