"""The generic algorithms' large-message paths over the real TCP transport: the "receives posted"
tokens (a rank that starts late gets no large message unexpected, i.e. copied twice) and the
per-thread scratch (reused between calls, given up after a failed call).

Two ranks are two threads with their own TcpTransport on 127.0.0.1 (test_transport_tcp.local_world),
so a test can look at a rank's transport while the other rank is inside the call. No timing
assertions: "late" is a rank that has not called yet, checked by state, not by the clock.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from test_transport_tcp import local_world

from distcomm import reduction as R
from distcomm._algorithms import _blocks, select
from distcomm.dtypes import from_name
from distcomm.errors import DistTimeoutError
from distcomm.transport.base import KIND_COLLECTIVE, Channel, MessageKey
from distcomm.types import RedOpType

MiB = 1 << 20
SUM = R.reducer(RedOpType.SUM, from_name("float32"))


def channel(transport, rank: int, seq: int = 1, timeout: float = 30.0) -> Channel:
    return Channel(transport, ranks=[0, 1], rank=rank, key=MessageKey(group=0, kind=KIND_COLLECTIVE, seq=seq),
                   op="all_reduce", deadline=time.monotonic() + timeout)


def rank_input(rank: int, count: int) -> np.ndarray:
    x = np.full(count, rank + 1, np.float32)
    x[rank::7] = -3
    return x


def run_in_thread(fn) -> tuple[threading.Thread, list]:
    box: list = []

    def body():
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            box.append(("error", exc))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, box


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, nbytes", [
    (select.choose("allreduce", 0, 2, algo="halving_doubling"), 4 * MiB),
], ids=["halving_doubling"])
def test_late_rank_gets_no_large_message_unexpected(algorithm, nbytes):
    # (not the pipelined ring: its start token cost more CPU than the copies it saved)
    count = nbytes // 4
    with local_world(2) as (t0, t1):
        early, early_box = run_in_thread(lambda: algorithm(channel(t1, 1), b := rank_input(1, count), SUM) or b)
        # Rank 0 has not called: what rank 1 sends now arrives unexpected, read by rank 0's
        # transport in the background. Rank 1's first message is small (its token or count);
        # once it is here, give any large message that would follow time to show up too.
        deadline = time.monotonic() + 20
        while not t0.matcher.has_unexpected() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert t0.matcher.has_unexpected(), "rank 1 sent nothing before rank 0 called"
        time.sleep(0.3)
        sizes = sorted(m.nbytes for m in t0.matcher.unexpected())
        assert all(n <= 8 for n in sizes), f"rank 1 sent data before rank 0 was ready: {sizes}"

        mine = rank_input(0, count)
        algorithm(channel(t0, 0), mine, SUM)
        early.join(30)
        assert early_box and early_box[0][0] == "ok", early_box
        expected = rank_input(0, count) + rank_input(1, count)
        assert mine.tobytes() == expected.tobytes()
        assert early_box[0][1].tobytes() == expected.tobytes()


def _allgather(ch, rank, count):
    out = np.zeros(2 * count, np.float32)
    out[rank * count:(rank + 1) * count] = rank_input(rank, count)
    select.choose("allgather", 0, 2, algo="ring")(ch, out, count)
    return out


def _reduce_scatter(ch, rank, count):
    out = np.zeros(count, np.float32)
    select.choose("reduce_scatter", 0, 2, algo="ring")(ch, rank_input(rank, 2 * count), out, [count, count], SUM)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("call, want", [
    (_allgather, lambda rank, count: np.concatenate([rank_input(0, count), rank_input(1, count)])),
    (_reduce_scatter, lambda rank, count: (rank_input(0, 2 * count) + rank_input(1, 2 * count))[rank * count:(rank + 1) * count]),
], ids=["allgather_ring", "reduce_scatter_ring"])
@pytest.mark.parametrize("late", [0, 1])
def test_late_rank_gets_no_large_message_unexpected_other_ops(call, want, late):
    count = MiB // 4  # 1 MiB per rank's message: above ready_exchange_bytes
    early_rank = 1 - late
    with local_world(2) as transports:
        early, box = run_in_thread(lambda: call(channel(transports[early_rank], early_rank), early_rank, count))
        late_t = transports[late]
        deadline = time.monotonic() + 5  # its token comes first
        while not late_t.matcher.has_unexpected() and early.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.3)  # a large message that would follow has time to arrive
        sizes = sorted(m.nbytes for m in late_t.matcher.unexpected())
        assert all(n <= 8 for n in sizes), f"rank {early_rank} sent data before rank {late} was ready: {sizes}"
        mine = call(channel(late_t, late), late, count)
        early.join(30)
        assert box and box[0][0] == "ok", box
        assert mine.tobytes() == want(late, count).tobytes()
        assert box[0][1].tobytes() == want(early_rank, count).tobytes()


def _scratch_checks():
    n = _blocks.SCRATCH_FRESH_BELOW  # elements: 4-8x the smallest size that is kept
    a = _blocks.scratch(n, np.float32)
    b = _blocks.scratch(n // 2, np.float64)
    assert a.dtype == np.float32 and a.size == n and b.dtype == np.float64 and b.size == n // 2
    assert np.shares_memory(a, b)  # the same kept memory, handed out again
    bigger = _blocks.scratch(4 * n, np.float32)  # outgrows it: new memory, kept from now on
    assert not np.shares_memory(a, bigger)
    assert np.shares_memory(bigger, _blocks.scratch(n, np.int8))
    small = _blocks.SCRATCH_FRESH_BELOW - 1  # bytes: fresh memory, the kept one left alone
    assert not np.shares_memory(bigger, _blocks.scratch(small, np.int8))
    huge = _blocks.SCRATCH_KEEP_BYTES // 4 + 1
    assert not np.shares_memory(_blocks.scratch(huge, np.float32), _blocks.scratch(n, np.int8))
    return bigger


def test_scratch_is_kept_per_thread_and_shared_between_dtypes():
    # each in a new thread: this one's kept scratch may be any size after other tests
    first, box1 = run_in_thread(_scratch_checks)
    first.join(10)
    assert box1 and box1[0][0] == "ok", box1
    second, box2 = run_in_thread(lambda: _blocks.scratch(4 * _blocks.SCRATCH_FRESH_BELOW, np.float32))
    second.join(10)
    assert box2[0][0] == "ok" and not np.shares_memory(box2[0][1], box1[0][1])  # another thread: its own
    # (the first thread is gone but its array is alive here, so the memory cannot be reused)


def test_consecutive_calls_reuse_scratch_and_stay_correct():
    # Different algorithms, sizes and dtypes back to back on the same two threads: each call's
    # scratch is the previous one's memory, and every result is still exact.
    plan = [("halving_doubling", 1 << 19, np.float32), ("recursive_doubling", 1000, np.float64),
            ("ring", 3 << 18, np.int32), ("ring_pipelined", 1 << 20, np.float32), ("halving_doubling", 77, np.int64)]
    with local_world(2) as (t0, t1):
        def rank_calls(rank, transport):
            out = []
            for seq, (algo, count, dtype) in enumerate(plan):
                x = rank_input(rank, count).astype(dtype)
                fn = select.choose("allreduce", 0, 2, algo=algo)
                fn(channel(transport, rank, seq=seq + 1), x, R.reducer(RedOpType.SUM, from_name(np.dtype(dtype).name)))
                out.append(x)
            return out

        other, box = run_in_thread(lambda: rank_calls(1, t1))
        got0 = rank_calls(0, t0)
        other.join(60)
        assert box and box[0][0] == "ok", box
        for (algo, count, dtype), g0, g1 in zip(plan, got0, box[0][1]):
            want = (rank_input(0, count).astype(dtype) + rank_input(1, count).astype(dtype))
            assert g0.tobytes() == want.tobytes(), algo
            assert g1.tobytes() == want.tobytes(), algo


def test_failed_call_gives_up_its_scratch():
    # Rank 1 never calls: rank 0's call times out with its receives into scratch still posted.
    # The next scratch of this thread must be other memory, which a late message cannot reach.
    count = MiB // 4
    with local_world(2) as (t0, _t1):
        before = _blocks.scratch(count, np.float32)  # the kept memory the call will use
        fn = select.choose("allreduce", 0, 2, algo="halving_doubling")
        with pytest.raises(DistTimeoutError):
            fn(channel(t0, 0, timeout=0.3), rank_input(0, count), SUM)
        assert not np.shares_memory(before, _blocks.scratch(count, np.float32))
