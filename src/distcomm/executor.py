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

from .work import Work


class _Task:
    __slots__ = ("run", "work")

    def __init__(self, run: Callable[[], Any], work: Work):
        self.run = run
        self.work = work


class OrderedExecutor:
    """Runs a group's operations one at a time in issue order; see the module docstring."""

    def __init__(self, name: str):
        self.name = name
        self._queue: collections.deque[_Task] = collections.deque()
        # A plain lock (not the default RLock): the inline path takes it twice per call. Only the
        # worker thread ever waits on the condition, so it is notified only once it exists.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._busy = False  # a task (queued or inline) is running
        self._thread: threading.Thread | None = None
        self._closed = False

    def enter_inline(self) -> bool:
        """Claim the group for a synchronous call the caller runs itself: True when nothing is
        running or queued and the group is open (then ``leave_inline()`` must follow), else False."""
        with self._lock:  # the lock itself, not the condition: a C-level context manager
            if self._busy or self._queue or self._closed:
                return False
            self._busy = True
            return True

    def idle(self) -> bool:
        """Nothing running or queued: a snapshot, for callers choosing between running a call
        inline and queueing it (torch's C++ callers issue every call async; see torch_backend)."""
        return not (self._busy or self._queue)

    def leave_inline(self) -> None:
        with self._lock:
            self._busy = False
            if self._thread is not None:
                self._cv.notify_all()

    def run(self, op: str, fn: Callable[[], Any], async_op: bool, result: Any = None) -> Work | None:
        if not async_op and self.enter_inline():
            try:
                fn()
            finally:
                self.leave_inline()
            return None
        work = Work(op, result)
        with self._cv:
            if self._closed:
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

    def submit_waiter(self, work: Work, wait: Callable[[], Any]) -> None:
        """Queue a task that completes ``work`` when ``wait()`` returns (futures of p2p work)."""
        with self._cv:
            self._queue.append(_Task(wait, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"distcomm-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue or (self._busy and not self._closed):
                    if self._closed and not self._queue:
                        return
                    self._cv.wait()
                task = self._queue.popleft()
                self._busy = True
            exc = None
            try:
                task.run()
            except BaseException as e:  # noqa: BLE001 - delivered through the Work
                exc = e
            with self._cv:
                self._busy = False
                self._cv.notify_all()
            task.work._finish(exc)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
