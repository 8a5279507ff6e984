"""Waiting on shared memory: spin briefly, then yield, then sleep on a futex; notice dead peers.

Why three phases: on this kind of machine (2 vCPUs that behave like ~1.25 cores) a rank that spins
steals the time of the rank it waits for. So a waiter spins only for a few microseconds (the answer
is often already on its way: a flag round trip costs under a microsecond), then gives its CPU away
with sched_yield for a little longer, then sleeps in the kernel on its *doorbell*. When more ranks
share the host than there are CPUs, the spin phase is skipped and the yield phase shortened.

Doorbells. Every rank has one 32-bit counter (and a count of its sleeping threads) in its world
segment. Whoever changes something another rank may wait for (a flag, a ring's head or tail) bumps
that rank's bell and, only if a thread of it is asleep, calls FUTEX_WAKE: a writer pays a
system call only when it has to. A sleeper calls FUTEX_WAIT(bell, value it read before its last
check), so a bump between its check and its sleep makes the kernel return at once; sleeps are also
capped (``slice_s``), which bounds the cost of any wake-up lost to store reordering and gives the
waiter a regular moment to check its peers' health. Group rounds (shm_group.py) go further: a
waiter about to sleep publishes what it waits for, and only the post or consume that completes it
rings the bell (p ranks waiting on each other: one ring each, from the last poster; no bumps
before that).

Peer health. Each rank keeps a pidfd per peer (a file descriptor that becomes readable when the
process exits, zombie or not, and never refers to a recycled pid). While sleeping, a waiter checks
its peers every ``check_s`` (0.1 s): a dead peer is reported within a fraction of a second.

Without futex (an architecture whose syscall number we do not know), sleeping degrades to short
time.sleep() calls with the same cap.
"""

from __future__ import annotations

import ctypes
import os
import platform
import select
import threading
import time
from typing import Callable

from ..tuning import DEFAULT, Tuning

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}.get(
    platform.machine().lower()
)
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
    _syscall = None

HAVE_FUTEX = _syscall is not None and _SYS_FUTEX is not None

try:
    _getcpu = _libc.sched_getcpu
    _getcpu.restype = ctypes.c_int
    _getcpu.argtypes = []
except (NameError, AttributeError):  # pragma: no cover
    _getcpu = None


_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (a locked instruction: taking an uncontended lock).

    Needed where a rank stores a flag and then reads another's (store, fence, load on both
    sides): without it each could read the other's old value, and a wake-up be lost.
    """
    _fence_lock.acquire()
    _fence_lock.release()


def current_cpu() -> int:
    """The CPU this thread runs on (-1 if unknown): a waiter whose peer last ran on the same CPU
    does not spin, since the peer cannot make progress until the waiter lets go of that CPU."""
    return _getcpu() if _getcpu is not None else -1


def futex_wait(address: int, expected: int, timeout: float) -> None:
    """Sleep while the u32 at ``address`` equals ``expected``, at most ``timeout`` seconds."""
    if not HAVE_FUTEX:
        time.sleep(min(timeout, 0.001))
        return
    ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)


def futex_wake(address: int) -> None:
    if HAVE_FUTEX:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


class Bell:
    """One rank's doorbell, seen from any process that maps its world segment.

    ``words`` is a u32 memoryview of the segment; ``index`` the bell, ``index + 1`` its sleepers.
    """

    __slots__ = ("words", "index", "address", "_sleepers", "_lock")

    def __init__(self, words: memoryview, index: int, address: int):
        self.words = words
        self.index = index
        self.address = address
        self._sleepers = 0  # only meaningful for this process's own bell
        self._lock = threading.Lock()

    def ring(self) -> None:
        """Bump the bell and wake its sleepers (a system call only if one is asleep)."""
        w, i = self.words, self.index
        w[i] = (w[i] + 1) & 0xFFFFFFFF
        if w[i + 1]:
            futex_wake(self.address)

    def bump(self) -> None:
        """Bump the bell without waking: a sleeper about to sleep returns at once, one already
        asleep keeps sleeping (for news it does not wait for; see GroupShm.consume)."""
        w, i = self.words, self.index
        w[i] = (w[i] + 1) & 0xFFFFFFFF

    def value(self) -> int:
        return self.words[self.index]

    def sleeping(self) -> bool:
        return self.words[self.index + 1] != 0

    def sleep(self, seen: int, timeout: float) -> None:
        """Sleep until rung (the bell moved from ``seen``) or ``timeout``; marks us a sleeper."""
        with self._lock:
            self._sleepers += 1
            self.words[self.index + 1] = self._sleepers
        try:
            futex_wait(self.address, seen, timeout)
        finally:
            with self._lock:
                self._sleepers -= 1
                self.words[self.index + 1] = self._sleepers


class WaitPolicy:
    """How long to spin and to yield before sleeping; see the module docstring."""

    def __init__(self, local_ranks: int, tuning: Tuning = DEFAULT):
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover
            cpus = os.cpu_count() or 1
        self.oversubscribed = local_ranks > cpus
        self.spin_s = _or(tuning.shm_spin_s, 0.0 if self.oversubscribed else 20e-6)
        self.yield_s = _or(tuning.shm_yield_s, 50e-6 if self.oversubscribed else 100e-6)
        self.shared_yield_s = _or(tuning.shm_shared_yield_s, 200e-6)  # when sharing a CPU
        self.slice_s = 0.05  # longest single sleep
        self.check_s = 0.1  # peer health check period while sleeping


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def wait_until(
    ready: Callable[[], bool],
    deadline: float | None,
    bell: Bell,
    policy: WaitPolicy,
    check: Callable[[], None],
    on_timeout: Callable[[], BaseException | None],
    spin: bool = True,
    arm: Callable[[], None] | None = None,
    polled: bool = False,
) -> None:
    """Return once ``ready()``; past ``deadline`` raise ``on_timeout()`` (or return if it gives
    None: the wait was satisfied after all). ``check()`` deals with dead peers (raises, or settles
    what was waited for); it runs every ``policy.check_s`` while sleeping and before a timeout.
    ``spin=False`` skips the spin phase (the awaited peer shares our CPU). ``arm()`` runs once,
    before the first sleep: it publishes what we wait for, so that whoever completes it rings our
    bell (it must store its flag and fence; ``ready()`` is checked again after it). A waiter that
    is still spinning or yielding needs no ring, and its peers then need not check for it.
    ``polled``: the caller has just spun for the policy's spin time itself (GroupShm's poll before
    its wait): the spin phase is not repeated, the yield phase and the rest are unchanged."""
    if ready():
        return
    now = time.perf_counter
    start = now()
    spin_s = 0.0 if polled else policy.spin_s
    if spin and spin_s:
        end = start + spin_s
        while now() < end:
            if ready():
                return
    end = start + (spin_s + policy.yield_s if spin else policy.shared_yield_s)
    yield_ = os.sched_yield
    while now() < end:
        yield_()
        if ready():
            return
    if arm is not None:
        arm()
    next_check = time.monotonic() + policy.check_s
    while True:
        seen = bell.value()
        if ready():
            return
        mono = time.monotonic()
        if mono >= next_check:
            check()
            next_check = mono + policy.check_s
        if deadline is not None and mono >= deadline:
            check()
            if ready():
                return
            exc = on_timeout()
            if exc is None:
                return
            raise exc
        limit = policy.slice_s if deadline is None else min(policy.slice_s, max(0.0, deadline - mono))
        bell.sleep(seen, min(limit, max(1e-4, next_check - mono)))


class PeerHealth:
    """Which peers have exited: a pidfd per peer (or /proc polling where pidfds are unavailable)."""

    def __init__(self, pids: dict[int, int]):
        self._pids = dict(pids)
        self._fds: dict[int, int] = {}
        for rank, pid in pids.items():
            try:
                self._fds[rank] = os.pidfd_open(pid)
            except (AttributeError, OSError):
                pass
        self._dead: set[int] = set()
        for rank, pid in pids.items():  # a peer that was gone before we opened its pidfd
            if rank not in self._fds and not process_alive(pid):
                self._dead.add(rank)

    def dead(self, ranks) -> list[int]:
        """The ranks among ``ranks`` whose process has exited."""
        fds = [self._fds[r] for r in ranks if r in self._fds and r not in self._dead]
        if fds:
            readable, _, _ = select.select(fds, [], [], 0)
            if readable:
                gone = set(readable)
                self._dead.update(r for r, fd in self._fds.items() if fd in gone)
        for r in ranks:
            if r not in self._fds and r in self._pids and r not in self._dead and not process_alive(self._pids[r]):
                self._dead.add(r)
        return [r for r in ranks if r in self._dead]

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is neither a zombie nor dead (its /proc stat state)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False
