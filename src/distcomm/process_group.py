"""ProcessGroup: a set of global ranks, its sequence numbers, its engine, and its order of work.

Operations on one group complete in issue order (torch's guarantee). A synchronous call made while
nothing is queued runs inline in the caller's thread: no thread hand-off on the latency path. An
``async_op=True`` call is queued for the group's one worker thread (started on first use), which
makes progress while the caller computes; a synchronous call made behind queued work waits its turn.
One thread per group, never one per operation: two groups can then never deadlock each other the
way a single shared worker could (rank 0 runs group A's op while rank 1 runs group B's).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable, Sequence

from .backends import collectives as generic_collectives
from .transport.base import KIND_COLLECTIVE, Channel, MessageKey, Transport
from .work import Work

# Operation codes carried in message signatures, so ranks running different collectives at the
# same sequence number see a mismatch instead of exchanging each other's bytes.
OPCODES = {
    name: i + 1
    for i, name in enumerate(
        [
            "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather",
            "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
            "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
            "gather_object", "scatter_object_list", "object_sizes", "send", "recv",
        ]
    )
}


def signature(op: str, dtype_code: int = 0, reduce_code: int = 0) -> int:
    return (OPCODES[op] << 16) | ((dtype_code & 0xFF) << 8) | (reduce_code & 0xFF)


def _profiling():
    """torch when it is loaded and a profiler is on (so calls should be recorded), else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.autograd.profiler._is_profiler_enabled:
            return None
    except AttributeError:
        pass
    return torch


def _profiler_scope(name: str):
    """A torch.profiler record_function scope when torch is loaded and a profiler is on."""
    torch = _profiling()
    return nullcontext() if torch is None else torch.profiler.record_function(name)


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


class ProcessGroup:
    """A group of processes: its global ranks, this process's rank in it, its engine.

    ``rank``/``size`` are group-relative; ``ranks[i]`` is the global rank of group rank i. A
    process that is not a member has no ProcessGroup object: it holds GroupMember.NON_GROUP_MEMBER.
    """

    def __init__(
        self,
        group_id: int,
        name: str,
        ranks: Sequence[int],
        global_rank: int,
        transport: Transport,
        backend_name: str,
        timeout: timedelta,
        engine: Any,
        store: Any = None,
    ):
        self.group_id = group_id
        self.group_name = name
        self.ranks = list(ranks)
        self._rank_of = {g: i for i, g in enumerate(self.ranks)}
        self.global_rank = global_rank
        self._rank = self._rank_of[global_rank]
        self.transport = transport
        self.backend_name = backend_name
        self.timeout = timeout
        self.engine = engine
        self.store = store
        # The engine's collectives: an engine may replace any of backends/collectives.py's
        # functions (shared memory reduces straight from peers' buffers); the rest are generic.
        self.ops = getattr(transport, "collectives", None) or generic_collectives
        self.seq = 0
        self.executor = OrderedExecutor(name)
        # ``small_all_reduce(tensor, op) -> bool`` and ``small_barrier() -> bool``: the engine's
        # latency paths for small synchronous all_reduces and for barriers (backends/shm_latency.py).
        # Each does the whole call and returns True, or returns False having done nothing. Found
        # once the engine has them (see _install_latency_paths).
        self.small_all_reduce = self._first_small_all_reduce
        self.small_barrier = self._first_small_barrier

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    @timeout.setter
    def timeout(self, value: timedelta) -> None:
        self._timeout = value
        self._timeout_s = value.total_seconds()  # read by every call: converted once

    # torch's ProcessGroup exposes these as methods
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.ranks)

    def name(self) -> str:
        return self.backend_name

    def group_rank(self, global_rank: int) -> int:
        return self._rank_of.get(global_rank, -1)

    def __repr__(self) -> str:
        return f"<distcomm.ProcessGroup {self.group_name!r} ranks={self.ranks} backend={self.backend_name}>"

    # -- running operations -------------------------------------------------------------------
    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def channel(self, op: str, seq: int, sig: int, timeout: timedelta | None = None) -> Channel:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        return Channel(
            self.transport,
            self.ranks,
            self._rank,
            MessageKey(self.group_id, KIND_COLLECTIVE, seq),
            op,
            sig,
            time.monotonic() + seconds,
        )

    def collective(
        self,
        op: str,
        body: Callable[[Channel], Any],
        async_op: bool,
        sig: int | None = None,
        result: Any = None,
        timeout: timedelta | None = None,
    ) -> Work | None:
        """Run ``body(channel)`` as this group's next collective, inline or queued.

        The sequence number is taken now, in issue order, so every member numbers the same call
        alike whether it runs inline or later on the worker thread.
        """
        seq = self.next_seq()
        sig = signature(op) if sig is None else sig

        def run() -> None:
            if _profiling() is None:
                body(self.channel(op, seq, sig, timeout))
                return
            with _profiler_scope(f"distcomm:{op}"):
                body(self.channel(op, seq, sig, timeout))

        return self.executor.run(op, run, async_op, result)

    def _first_small_all_reduce(self, tensor, op) -> bool:
        return self._install_latency_paths() and self.small_all_reduce(tensor, op)

    def _first_small_barrier(self) -> bool:
        return self._install_latency_paths() and self.small_barrier()

    def _install_latency_paths(self) -> bool:
        """Ask the engine for its latency paths: it has none (generic collectives, a group of one,
        a member on another host, an algorithm forced), not yet (the group's shared memory is set
        up by its first collective), or some, which from then on take the calls (True)."""
        make = getattr(self.ops, "latency_paths", None)
        paths = False if make is None else make(self)
        if paths is None:
            return False
        if not paths:
            self.small_all_reduce = self.small_barrier = _no_latency_path
            return False
        self.small_all_reduce, self.small_barrier = paths.all_reduce, paths.barrier
        return True

    def close(self) -> None:
        self.executor.close()


def _no_latency_path(*args) -> bool:
    return False
