"""Unit tests of the shared-memory engine's parts, in one process (no world needed).

Rings (wrap-around, partial pushes, discards, record headers), segments (mode 0600, unnamed or
unpredictably named, let go of on close, garbage collection or any death, the launcher's cleanup
hook), doorbells and futex waits, the waiting policy's deadline and health checks, peer health
through pidfds, host ids, and single-copy reads. Multi-process behaviour is in the other test_shm_* files.
"""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from distcomm.transport import hostid, shm_direct, shm_segment
from distcomm.transport.base import KIND_COLLECTIVE, MessageKey, TransportError
from distcomm.transport.shm_ring import MODE_DIRECT, MODE_INLINE, RECORD, Ring, decode, encode
from distcomm.transport.shm_segment import Segment
from distcomm.transport.shm_wait import Bell, PeerHealth, WaitPolicy, futex_wait, wait_until
from distcomm.tuning import Tuning


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """Segments of this test in a private directory (so leftovers are visible and harmless)."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("DISTCOMM_SHM_DIR", str(d))
    return d


# -- rings ----------------------------------------------------------------------------------------
def _ring(capacity: int) -> tuple[Ring, Ring, np.ndarray]:
    block = np.zeros(Ring.block_bytes(capacity), np.uint8)
    return Ring(block), Ring(block), block


def test_ring_round_trip_with_wrap_around():
    prod, cons, _ = _ring(4096)
    rng = np.random.default_rng(0)
    sent, got = [], []
    for size in [100, 4000, 3000, 1, 4096, 2500, 0, 777]:
        data = rng.integers(0, 256, size, dtype=np.uint8)
        sent.append(data)
        pushed = 0
        while pushed < size:
            pushed += prod.push(data[pushed:])
            out = np.empty(cons.readable(), np.uint8)
            cons.pull(out)
            got.append(out)
    assert np.array_equal(np.concatenate(sent), np.concatenate(got))


def test_ring_full_and_partial_push():
    prod, cons, _ = _ring(4096)
    assert prod.push(np.ones(5000, np.uint8)) == 4096
    assert prod.writable() == 0
    assert prod.push(np.ones(10, np.uint8)) == 0
    out = np.empty(1000, np.uint8)
    assert cons.pull(out) == 1000
    assert prod.writable() == 1000
    assert cons.pull(None, 96) == 96  # discard
    assert cons.readable() == 4096 - 1096


def test_ring_counters_are_shared_through_memory():
    prod, cons, block = _ring(4096)
    prod.push(np.arange(10, dtype=np.uint8))
    late = Ring(block)  # a consumer attached later sees what was published
    assert late.readable() == 10


def test_record_round_trip():
    key = MessageKey(7, KIND_COLLECTIVE, 123456789)
    for mode in (MODE_INLINE, MODE_DIRECT):
        rec = decode(encode(mode, key, 0x1234, 1 << 40, 0xDEADBEEF))
        assert (rec.mode, rec.group, rec.kind, rec.seq, rec.signature, rec.nbytes, rec.address) == (
            mode, 7, KIND_COLLECTIVE, 123456789, 0x1234, 1 << 40, 0xDEADBEEF)
    assert encode(MODE_INLINE, MessageKey(0, 1, -5), 0, 0).nbytes == RECORD
    assert decode(encode(MODE_INLINE, MessageKey(0, 1, -5), 0, 0)).seq == -5


# -- segments -------------------------------------------------------------------------------------
def test_segment_is_private_and_never_named(shm_dir):
    a = Segment.create(8192)
    try:
        assert os.listdir(shm_dir) == []  # nothing to leave behind, even now
        assert stat.S_IMODE(os.stat(a.path).st_mode) == 0o600
        assert a.name.startswith(f"distcomm@{os.getpid()}.")
        code = ("import sys; from distcomm.transport.shm_segment import Segment; "
                "s = Segment.open(sys.argv[1]); s.buf[:4] = [1, 2, 3, 4]; s.close()")
        subprocess.run([sys.executable, "-c", code, a.name], check=True, timeout=60,
                       env={**os.environ, "DISTCOMM_SHM_DIR": str(shm_dir)})
        assert list(a.buf[:4]) == [1, 2, 3, 4]  # another process wrote the same memory
        a.unlink()
        with pytest.raises(FileNotFoundError):
            Segment.open(a.name)  # once let go of, nobody can open it
        a.buf[4] = 5  # and the mapping lives on
    finally:
        a.close()


def test_named_segment_is_private_and_unpredictable(shm_dir):
    a, b = Segment.create(8192, anonymous=False), Segment.create(8192, anonymous=False)
    try:
        for seg in (a, b):
            st = os.stat(seg.path)
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert seg.name.startswith("distcomm-") and len(seg.name) >= len("distcomm-") + 32
        assert a.name != b.name
        peer = Segment.open(a.name)
        peer.buf[:4] = [1, 2, 3, 4]
        assert list(a.buf[:4]) == [1, 2, 3, 4]  # the same memory
        peer.close()
        assert os.path.exists(a.path)  # only the creator unlinks
    finally:
        a.close()
        b.close()
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("anonymous", [True, False])
def test_segment_open_refuses_foreign_modes(shm_dir, anonymous):
    seg = Segment.create(4096, anonymous=anonymous)
    try:
        os.chmod(seg.path, 0o644)
        with pytest.raises(PermissionError, match="not a private segment"):
            Segment.open(seg.name)
        with pytest.raises(ValueError):
            Segment.open("../etc/passwd")
    finally:
        seg.close()


def test_segment_open_refuses_another_file_at_the_same_descriptor(shm_dir):
    seg = Segment.create(4096)
    try:
        pid, fd, inode = seg.name.removeprefix("distcomm@").split(".")
        with pytest.raises(FileNotFoundError, match="no longer holds"):
            Segment.open(f"distcomm@{pid}.{fd}.{int(inode) + 1}")  # a recycled descriptor
    finally:
        seg.close()


def test_segment_let_go_of_by_unlink_close_and_gc(shm_dir):
    for anonymous in (True, False):
        seg = Segment.create(4096, anonymous=anonymous)
        seg.unlink()
        assert not os.path.exists(seg.path) and os.listdir(shm_dir) == []
        seg.buf[0] = 1  # still mapped
        seg.close()
        seg = Segment.create(4096, anonymous=anonymous)
        path = seg.path
        del seg
        gc.collect()
        assert not os.path.exists(path) and os.listdir(shm_dir) == []


def test_named_segment_unlinked_at_interpreter_exit(shm_dir):
    code = ("from distcomm.transport.shm_segment import Segment; "
            "s = Segment.create(4096, anonymous=False); print(s.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "DISTCOMM_SHM_DIR": str(shm_dir)})
    assert out.stdout.strip().startswith("distcomm-")
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("death", ["SIGKILL", "SIGTERM", "os._exit"])
def test_nothing_left_by_a_process_that_dies_holding_a_segment(shm_dir, death):
    """Deaths that run no finalizer (torch's test harness SIGTERMs the ranks left when one fails;
    multiprocessing's forked children end in os._exit) leave nothing in the directory."""
    end = "os._exit(0)" if death == "os._exit" else f"os.kill(os.getpid(), signal.{death})"
    code = ("import os, signal; from distcomm.transport.shm_segment import Segment; "
            f"s = Segment.create(1 << 20); assert os.listdir({str(shm_dir)!r}) == []; {end}")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DISTCOMM_SHM_DIR": str(shm_dir)})
    assert proc.returncode in (0, -9, -15), proc.stderr
    assert os.listdir(shm_dir) == []


def test_cleanup_hook_removes_a_runs_segments(shm_dir, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/42")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    seg = Segment.create(4096, anonymous=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "other")
    other = Segment.create(4096, anonymous=False)
    assert seg.name.startswith("distcomm-job_42-3-")
    shm_segment.cleanup("job/42", 2)  # another attempt: untouched
    assert len(os.listdir(shm_dir)) == 2
    shm_segment.cleanup("job/42", 3)
    assert os.listdir(shm_dir) == [other.name]
    seg.close()
    other.close()


# -- waiting --------------------------------------------------------------------------------------
def _bell() -> tuple[Bell, np.ndarray]:
    mem = np.zeros(64, np.uint8)
    words = memoryview(mem).cast("I")
    return Bell(words, 0, mem.ctypes.data), mem


def test_futex_wait_returns_when_value_differs_or_times_out():
    bell, _ = _bell()
    t = time.monotonic()
    futex_wait(bell.address, 1, 5.0)  # value is 0, not 1: returns at once
    futex_wait(bell.address, 0, 0.01)  # times out
    assert time.monotonic() - t < 2.0


def test_bell_wakes_a_sleeper():
    bell, _ = _bell()
    flag = []
    woke = threading.Event()

    def sleeper():
        policy = WaitPolicy(1)
        wait_until(lambda: bool(flag), time.monotonic() + 10, bell, policy, lambda: None,
                   lambda: TransportError("timeout", reason="timeout"))
        woke.set()

    t = threading.Thread(target=sleeper)
    t.start()
    time.sleep(0.05)  # well past spinning and yielding: asleep in the kernel
    flag.append(1)
    bell.ring()
    assert woke.wait(5)
    t.join()


def test_wait_until_arms_only_a_waiter_about_to_sleep():
    """``arm`` (publishing what we wait for, so the completer rings us) runs once, just before the
    first sleep: a wait that ends while spinning or yielding leaves the flags alone."""
    bell, _ = _bell()
    policy = WaitPolicy(1)
    armed = []

    def timeout():
        return TransportError("timeout", reason="timeout")

    wait_until(lambda: True, None, bell, policy, lambda: None, timeout, arm=lambda: armed.append(1))
    polls = []
    wait_until(lambda: polls.append(1) or len(polls) > 3, None, bell, policy, lambda: None, timeout,
               arm=lambda: armed.append(1))
    assert armed == []
    state = {"armed_at": None, "polls": 0}

    def ready():
        state["polls"] += 1
        return state["armed_at"] is not None and state["polls"] > state["armed_at"]

    def arm():
        armed.append(1)
        state["armed_at"] = state["polls"]

    wait_until(ready, time.monotonic() + 5, bell, policy, lambda: None, timeout, arm=arm)
    assert armed == [1]  # once, and ready() was checked again after it


def test_wait_until_after_a_poll_does_not_spin_again():
    """``polled``: the caller (GroupShm's exchange) has just spun for the policy's spin time, so the
    wait goes on to its yield phase and then to sleep without a second spin."""
    bell, _ = _bell()
    policy = WaitPolicy(1)
    policy.spin_s, policy.yield_s = 30.0, 0.0  # a spin that would outlast the test's patience
    armed = []

    def timeout():
        return TransportError("timeout", reason="timeout")

    start = time.monotonic()
    wait_until(lambda: bool(armed), time.monotonic() + 20, bell, policy, lambda: None, timeout,
               arm=lambda: armed.append(1), polled=True)
    assert armed == [1]  # it reached the sleep phase (arm runs just before the first sleep)
    assert time.monotonic() - start < 10.0  # and did not spin for spin_s first


def test_wait_until_deadline_and_health_check():
    bell, _ = _bell()
    policy = WaitPolicy(1)
    with pytest.raises(TransportError, match="late"):
        wait_until(lambda: False, time.monotonic() + 0.05, bell, policy, lambda: None,
                   lambda: TransportError("late", reason="timeout"))
    calls = []

    def check():
        calls.append(1)
        if len(calls) >= 2:
            raise TransportError("peer died", reason="lost")

    t = time.monotonic()
    with pytest.raises(TransportError, match="peer died"):
        wait_until(lambda: False, None, bell, policy, check, lambda: None)
    assert time.monotonic() - t < 2.0


def test_peer_health_sees_exit_including_zombies():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        health = PeerHealth({5: child.pid})
        assert health.dead([5]) == []
        child.kill()
        deadline = time.monotonic() + 5
        while not health.dead([5]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert health.dead([5]) == [5]  # not yet reaped: a zombie counts as dead
        health.close()
    finally:
        child.wait()


# -- host ids and single-copy reads -------------------------------------------------------------
def test_host_id_is_stable_and_overridable(monkeypatch):
    assert hostid.host_id() == hostid.host_id()
    monkeypatch.setenv("DISTCOMM_HOST_ID", "node-a")
    assert hostid.host_id() == "node-a"
    assert "ranks [0, 2]" in hostid.describe(["a", "b", "a"])


def test_direct_read_of_own_memory_and_probe():
    src = np.arange(1000, dtype=np.int64)
    out = np.zeros_like(src)
    if not shm_direct.probe(os.getpid(), src.ctypes.data, 0):
        pytest.skip("process_vm_readv is not allowed here")
    shm_direct.read(os.getpid(), src.ctypes.data, out)
    assert np.array_equal(src, out)
    assert not shm_direct.probe(os.getpid(), src.ctypes.data + 8, 0)  # the word there is 1, not 0
    with pytest.raises(shm_direct.DirectReadError) as info:
        shm_direct.read(os.getpid(), 8, out)  # an unmapped address
    assert info.value.reason == "error" and "Bad address" in str(info.value)
    assert isinstance(info.value, RuntimeError)  # a DistError (TransportError), never a bare OSError


def test_direct_read_of_a_process_that_is_gone_is_a_lost_peer():
    import subprocess

    src = np.arange(8, dtype=np.int64)
    if not shm_direct.probe(os.getpid(), src.ctypes.data, 0):
        pytest.skip("process_vm_readv is not allowed here")
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid names nobody (until reused, which a reader cannot tell either)
    with pytest.raises(shm_direct.DirectReadError) as info:
        shm_direct.read(child.pid, src.ctypes.data, np.zeros(8, np.int64))
    assert info.value.reason == "lost" and info.value.pid == child.pid
    assert f"pid {child.pid}" in str(info.value) and "exited" in str(info.value)


# -- group rounds: who gets woken ------------------------------------------------------------------
class _Members:
    """``p`` members' GroupShm views of one group, in this process, over plain memory: member q's
    ``wait_for`` runs ``during_wait[q]`` (the test's moves while q is waiting) instead of waiting."""

    def __init__(self, p: int, nslots: int = 4):
        from distcomm.transport import shm_group

        slot = 4096
        _, total = shm_group.layout(p, slot, nslots)
        members = self

        class Seg:
            def __init__(self):
                self.buf = np.zeros(total, np.uint8)

        class Transport:
            crash_news = memoryview(np.zeros(1, np.uint64))  # nobody crashes here
            tuning = Tuning(shm_native=False)  # these pin the Python steps (test_shm_native.py: the C ones)

            def __init__(self, q):
                self.q = q

            def check_members(self, ranks):
                raise AssertionError("crash_news is 0: never called")

            def bell_of(self, g):
                return members.bells[g]

            def wait_for(self, ready, deadline, peers, on_timeout, arm=None, polled=False, also=None):
                if arm is not None:
                    arm()  # the waiter is past its spin and yield phases: asleep, it needs a ring
                members.waits.append(self.q)
                members.during_wait.pop(self.q)()
                assert ready()

        class Ch:
            def __init__(self, r):
                self.rank, self.ranks, self.size = r, list(range(p)), p
                self.key, self.signature, self.deadline = MessageKey(7, KIND_COLLECTIVE, 1), 99, None

        segs = [Seg() for _ in range(p)]
        for s in segs:
            shm_group.init_segment(s.buf, 7, p, slot, nslots)
        self.bell_mem = np.zeros(2 * p, np.uint32)
        words = memoryview(self.bell_mem).cast("B").cast("I")
        self.bells = [Bell(words, 2 * q, self.bell_mem.ctypes.data + 8 * q) for q in range(p)]
        self.ctx = [shm_group.GroupShm(Transport(q), 7, list(range(p)), q, segs, slot, nslots) for q in range(p)]
        self.ch = [Ch(q) for q in range(p)]
        self.waits: list[int] = []
        self.during_wait: dict = {}
        self.bell_mem[:] = 0  # setup rang everyone's bell

    def rung(self) -> list[int]:
        """Members whose bell moved since the last call."""
        out = [q for q in range(len(self.bells)) if self.bells[q].value()]
        self.bell_mem[::2] = 0
        return out

    def post(self, q: int, k: int) -> None:
        self.ctx[q].post(k, self.ch[q], 8)


def test_only_the_last_poster_rings_a_member_waiting_for_all():
    m = _Members(3)

    def meanwhile():
        m.post(1, 1)
        assert m.rung() == []  # rank 2 has not posted: waking rank 0 would be for nothing
        m.post(2, 1)
        assert m.rung() == [0]

    m.post(0, 1)
    m.during_wait[0] = meanwhile
    m.ctx[0].wait_posted(1, m.ch[0], 8)
    assert m.waits == [0] and m.during_wait == {}
    m.post(1, 2)
    assert m.rung() == []  # nobody waits any more


def test_a_member_waiting_for_one_root_is_rung_by_the_root_alone():
    m = _Members(3)

    def meanwhile():
        m.post(2, 1)
        assert m.rung() == []
        m.post(0, 1)
        assert m.rung() == [1]

    m.during_wait[1] = meanwhile
    m.ctx[1].wait_posted(1, m.ch[1], 8, [0])
    assert m.waits == [1]


def test_slot_reuse_waits_for_every_reader_and_the_last_one_rings():
    m = _Members(3, nslots=2)
    for k in (1, 2):
        for q in range(3):
            m.post(q, k)
    m.ctx[1].consume(2)
    m.ctx[2].consume(1)
    m.ctx[0].acquire(3, m.ch[0])  # round 3 reuses round 1's slot: both peers are done with it
    assert m.waits == []
    m.rung()

    def meanwhile():
        m.ctx[2].consume(1)
        assert m.rung() == []
        m.ctx[2].consume(2)
        assert m.rung() == [0]

    m.during_wait[0] = meanwhile
    m.ctx[0].acquire(4, m.ch[0])  # round 2's slot: rank 2 has not read it yet
    assert m.waits == [0]
    m.ctx[0].acquire(4, m.ch[0])
    m.ctx[0].acquire(3, m.ch[0])
    assert m.waits == [0]  # known done: no second wait


def test_a_mismatched_header_is_still_noticed():
    from distcomm.signatures import signature

    m = _Members(2)
    m.ch[0].signature = signature("all_reduce", 9, 0)  # float32, SUM
    m.post(0, 1)
    m.ch[1].signature = signature("all_reduce", 9, 4)  # float32, MAX
    m.post(1, 1)
    with pytest.raises(TransportError, match=r"^in all_reduce #1 this rank passed op=MAX but rank 0 passed op=SUM; "
                                             r"every rank of the group must pass the same reduce op$"):
        m.ctx[1].wait_posted(1, m.ch[1], 8)


def test_slot_memoryviews_alias_the_slots_of_their_round():
    m = _Members(2, nslots=2)
    ctx = m.ctx[0]
    for k in (1, 2, 3):
        ctx.words(1, k)[0] = 1000 + k
        ctx.raw(1, k)[8:10] = b"\x07\x09"
    assert int(ctx.data(1, 1)[:8].view(np.int64)[0]) == 1003  # round 3 reuses round 1's slot
    assert int(ctx.data(1, 2)[:8].view(np.int64)[0]) == 1002
    assert bytes(m.ctx[1].data(1, 3)[8:10]) == b"\x07\x09"  # the owner sees the same memory
    assert ctx.words(0, 1)[0] == 0  # another member's slot is untouched


def test_slot_settings_are_checked_with_the_limits_in_the_message():
    from distcomm.transport import shm_group

    assert shm_group.slot_config(Tuning(shm_slot_bytes=8192, shm_slots=shm_group.MAX_NSLOTS)) == (
        8192, shm_group.MAX_NSLOTS)
    # more slots than the header history can cover would let a peer overwrite a deferred check's entry
    for bad in (Tuning(shm_slots=1), Tuning(shm_slots=shm_group.MAX_NSLOTS + 1), Tuning(shm_slot_bytes=4000)):
        with pytest.raises(ValueError, match=f"from 2 to {shm_group.MAX_NSLOTS} slots"):
            shm_group.slot_config(bad)
