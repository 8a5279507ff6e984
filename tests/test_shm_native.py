"""The shared-memory round steps in C (transport/_shm_round.c: GroupShm's exchange and consume, and
backends/shm/native.py's whole all_reduce round) beside their Python reference.

* On bytes, with no process: members' memory laid out as GroupShm lays it out, one ``Rounds`` per
  member. A round writes the header and counters GroupShm's Python steps write, reduces in rank
  order, reports a peer that has not posted (PENDING, nothing read or consumed), a header that is
  not ours (MISMATCH), a sleeping peer (RING_POSTED) and a peer waiting to reuse a slot
  (RING_CONSUMED), and refuses a message larger than a slot.
* Its reductions give numpy's bits, special values included (NaN, signed zeros, infinities,
  integer wrap-around).
* In real worlds: small all_reduces and barriers complete in C (counted by the module), ranks
  with it and ranks without it (DISTCOMM_SHM_NATIVE=0) meet in the same rounds at world sizes
  2, 3 and 5, and a peer that arrives late (the C call hands the wait back to Python, which
  sleeps, and the late rank's C post rings it) still gives the right sums.

test_shm_latency.py's tables (every dtype and op, world sizes 2-8, against the rank-order
reference) and test_differential.py (against torch's gloo) run through this path wherever it is
built; the mismatch and timeout tests there cover its hand-backs in real worlds.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from distcomm.backends.shm import native
from distcomm.transport import shm_group as g
from harness import run_world

needs_c = pytest.mark.skipif(g.C_UNAVAILABLE is not None, reason=str(g.C_UNAVAILABLE))
C = None if g.C_UNAVAILABLE is not None else __import__("distcomm.transport._shm_round", fromlist=["_"])


def test_the_c_round_is_built_where_it_can_be():
    """``pip install`` builds it wherever a C compiler and Python's headers exist (setup.py)."""
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers.exists():
        pytest.skip("no C compiler or no Python headers here: the Python rounds run")
    assert g.C_UNAVAILABLE is None, g.C_UNAVAILABLE


# -- on bytes ---------------------------------------------------------------------------------
SLOT_BYTES, NSLOTS = 4096, 2


class Members:
    """``size`` members' group memory in one process, laid out as GroupShm lays it out."""

    def __init__(self, size: int, budget_ns: int = 0):
        first, total = g.layout(size, SLOT_BYTES, NSLOTS)
        stride = g._align(g.SLOT_HEADER + SLOT_BYTES, 4096)
        self.mem = [np.zeros(total, np.uint8) for _ in range(size)]
        self.ctl = [m[:g._OPENED_AT].view(np.uint64) for m in self.mem]
        self.headers = [[m[first + k * stride:first + k * stride + g.SLOT_HEADER].view(np.uint64)
                         for k in range(NSLOTS)] for m in self.mem]
        self.slots = [[m[first + k * stride + g.SLOT_HEADER:first + k * stride + g.SLOT_HEADER + SLOT_BYTES]
                       for k in range(NSLOTS)] for m in self.mem]
        self.news = np.zeros(1, np.uint64)  # the host's crash-news word (ShmTransport.crash_news)
        bases = [m.ctypes.data for m in self.mem]
        header_addresses = [b + first + k * stride for b in bases for k in range(NSLOTS)]
        self.rounds = [
            C.Rounds(rank=r, size=size, nslots=NSLOTS, slot_bytes=SLOT_BYTES, ctl=bases,
                                  headers=header_addresses, slots=[h + g.SLOT_HEADER for h in header_addresses],
                                  history=[b + g.history_offset(size) for b in bases], history_len=g.HISTORY,
                                  h_deferred=g.H_DEFERRED, due=g.HISTORY - NSLOTS - 2, news=self.news.ctypes.data, posted=g.POSTED,
                                  consumed=g.CONSUMED, reusing=g.REUSING, awaiting=g.AWAITING, deferred=g.DEFERRED, s_round=g.S_ROUND, s_seq=g.S_SEQ,
                                  s_sig=g.S_SIG, s_nbytes=g.S_NBYTES, s_extra=g.S_EXTRA, budget_ns=budget_ns,
                                  yields=False, keepalive=tuple(self.mem) + (self.news,))
            for r in range(size)]

    def post_as_python(self, q: int, k: int, seq: int, sig: int, data: np.ndarray) -> None:
        """What GroupShm.publish writes for member q, with its slot's data."""
        self.slots[q][k % NSLOTS][:data.nbytes] = data.view(np.uint8)
        h = self.headers[q][k % NSLOTS]
        h[g.S_SEQ], h[g.S_SIG], h[g.S_NBYTES], h[g.S_EXTRA], h[g.S_ROUND] = seq, sig, data.nbytes, 0, k
        self.ctl[q][g.POSTED] = k


def kind_of(op_name: str, dtype) -> int:
    from distcomm import ReduceOp

    return native.kind(getattr(ReduceOp, op_name), np.dtype(dtype))


@needs_c
def test_a_round_posts_what_python_posts_and_reduces_in_rank_order():
    m = Members(3)
    xs = [np.array([1.5, -2.0, 3.25], np.float32) * (q + 1) for q in range(3)]
    for q in (0, 2):
        m.post_as_python(q, 1, seq=7, sig=0xABC, data=xs[q])
    mine = xs[1].copy()
    status = m.rounds[1].all_reduce(1, 7, 0xABC, mine, kind_of("SUM", np.float32))
    assert status == C.DONE
    h = m.headers[1][1]
    assert (h[g.S_ROUND], h[g.S_SEQ], h[g.S_SIG], h[g.S_NBYTES], h[g.S_EXTRA]) == (1, 7, 0xABC, 12, 0)
    assert m.ctl[1][g.POSTED] == 1 and m.ctl[1][g.CONSUMED] == 1
    expected = xs[0].copy()
    for q in (1, 2):
        expected += xs[q]
    assert mine.tobytes() == expected.tobytes()
    assert m.slots[1][1][:12].tobytes() == xs[1].tobytes()  # its own copy, for the peers to read


@needs_c
def test_a_round_opens_in_c_only_in_the_common_case():
    """Rounds.open_round numbers rounds as GroupShm.open_round does, and leaves to Python (None,
    nothing changed) a slot a peer has not finished reading, a host's crash news and a deferred
    check that is due."""
    m = Members(2)
    mine = m.rounds[0]
    assert [mine.open_round() for _ in range(NSLOTS)] == list(range(1, NSLOTS + 1))
    assert mine.open_round() is None and mine.round == NSLOTS  # round 1's slot not consumed by the peer
    m.ctl[1][g.CONSUMED] = 2
    assert mine.open_round() == NSLOTS + 1 and mine.consumed_floor == 2
    assert mine.open_round() == NSLOTS + 2  # the floor covers it: no counter read
    m.news[0] = 1
    assert mine.open_round() is None and mine.round == NSLOTS + 2
    m.news[0] = 0
    mine.round = 100  # Python's steps add rounds too (GroupShm.round is this number)
    m.ctl[1][g.CONSUMED] = 100
    m.ctl[0][g.DEFERRED] = 100 - (g.HISTORY - NSLOTS - 2)  # a deferred round's check is due
    assert mine.open_round() is None and mine.round == 100
    m.ctl[0][g.DEFERRED] += 1  # one round later it is not due yet
    assert mine.open_round() == 101


@needs_c
def test_a_peer_that_has_not_posted_hands_the_round_back_unread():
    m = Members(2)
    mine = np.arange(4, dtype=np.int64)
    before = g.rounds_consumed_in_c()
    status = m.rounds[0].all_reduce(1, 1, 5, mine, kind_of("SUM", np.int64))
    assert status == C.PENDING
    assert m.ctl[0][g.POSTED] == 1 and m.ctl[0][g.CONSUMED] == 0  # posted, nothing consumed
    assert mine.tolist() == [0, 1, 2, 3]
    assert g.rounds_consumed_in_c() == before


@needs_c
def test_a_header_that_is_not_ours_is_a_mismatch_and_nothing_is_read():
    m = Members(2)
    m.post_as_python(1, 1, seq=1, sig=5, data=np.ones(3, np.float64))  # 24 bytes against our 16
    mine = np.ones(2, np.float64)
    assert m.rounds[0].all_reduce(1, 1, 5, mine, kind_of("SUM", np.float64)) == C.MISMATCH
    assert m.ctl[0][g.CONSUMED] == 0 and mine.tolist() == [1.0, 1.0]
    m2 = Members(2)
    m2.post_as_python(1, 1, seq=2, sig=5, data=np.ones(2, np.float64))  # another sequence number
    assert m2.rounds[0].all_reduce(1, 1, 5, np.ones(2), kind_of("SUM", np.float64)) == C.MISMATCH


@needs_c
def test_a_sleeping_peer_is_left_to_python_to_ring():
    m = Members(2)
    m.post_as_python(1, 1, seq=1, sig=9, data=np.ones(2, np.float32))
    m.ctl[1][g.AWAITING] = 1  # member 1 sleeps until round 1 is posted
    status = m.rounds[0].all_reduce(1, 1, 9, np.ones(2, np.float32), kind_of("SUM", np.float32))
    assert status == C.PENDING | C.RING_POSTED
    assert m.ctl[0][g.POSTED] == 1 and m.ctl[0][g.CONSUMED] == 0


@needs_c
def test_a_peer_waiting_to_reuse_a_slot_is_reported_after_the_consume():
    m = Members(2)
    m.post_as_python(1, 1, seq=1, sig=9, data=np.zeros(0, np.uint8))
    m.ctl[1][g.REUSING] = 1
    assert m.rounds[0].exchange(1, 1, 9, 0, 0) == C.DONE  # a barrier's round: no data
    assert m.ctl[0][g.CONSUMED] == 0 and m.headers[0][1][g.S_NBYTES] == 0
    assert m.rounds[0].consume(1) == C.RING_CONSUMED
    assert m.ctl[0][g.CONSUMED] == 1


@needs_c
def test_exchange_posts_the_extra_word_and_checks_every_peer():
    m = Members(3)
    m.post_as_python(0, 1, seq=4, sig=6, data=np.zeros(5, np.uint8))
    assert m.rounds[1].exchange(1, 4, 6, 5, 77) == C.PENDING  # member 2 has not posted
    assert m.headers[1][1][g.S_EXTRA] == 77 and m.ctl[1][g.POSTED] == 1
    m.post_as_python(2, 1, seq=4, sig=6, data=np.zeros(5, np.uint8))
    m2 = Members(3)
    m2.post_as_python(0, 1, seq=4, sig=6, data=np.zeros(5, np.uint8))
    m2.post_as_python(2, 1, seq=4, sig=7, data=np.zeros(5, np.uint8))  # member 2 runs something else
    assert m2.rounds[1].exchange(1, 4, 6, 5, 0) == C.MISMATCH


@needs_c
def test_a_message_larger_than_a_slot_or_an_unknown_kind_is_refused_before_posting():
    m = Members(2)
    with pytest.raises(ValueError, match="at most 4096 bytes"):
        m.rounds[0].all_reduce(1, 1, 1, np.zeros(SLOT_BYTES + 8, np.uint8), kind_of("SUM", np.uint8))
    with pytest.raises(ValueError, match="known kind"):
        m.rounds[0].all_reduce(1, 1, 1, np.zeros(2, np.float32), 8 * 0 + 4)  # BAND on float32
    assert m.ctl[0][g.POSTED] == 0


@needs_c
def test_numpy_integers_are_integers_as_they_are_to_the_python_steps():
    m = Members(2)
    m.post_as_python(1, 1, seq=3, sig=4, data=np.zeros(0, np.uint8))
    assert m.rounds[0].exchange(np.int64(1), np.uint64(3), np.int32(4), np.int64(0), np.int64(1)) == C.DONE
    assert m.headers[0][1][g.S_EXTRA] == 1
    with pytest.raises(TypeError):
        m.rounds[0].exchange(1, 3, 4, 0.5, 0)  # as a "Q" memoryview refuses a float


@needs_c
def test_a_rounds_object_without_its_layout_is_refused():
    with pytest.raises(ValueError, match="not initialised"):
        C.Rounds.__new__(C.Rounds).exchange(1, 1, 1, 0, 0)
    m = Members(2)
    with pytest.raises(ValueError, match="counter index"):
        C.Rounds(rank=0, size=2, nslots=NSLOTS, slot_bytes=SLOT_BYTES, ctl=[0, 0], headers=[0] * 4, slots=[0] * 4,
                 history=[0, 0], history_len=g.HISTORY, h_deferred=g.H_DEFERRED, due=0, news=None, posted=24, consumed=g.CONSUMED,
                 reusing=g.REUSING, awaiting=g.AWAITING, deferred=g.DEFERRED, s_round=0, s_seq=1, s_sig=2,
                 s_nbytes=3, s_extra=4, budget_ns=0, yields=False, keepalive=())
    del m


def test_kinds_cover_the_common_dtypes_and_leave_the_rest_to_python():
    from distcomm import ReduceOp

    assert native.kind(ReduceOp.SUM, np.dtype(np.float32)) is not None
    assert native.kind(ReduceOp.AVG, np.dtype(np.float64)) == native.kind(ReduceOp.SUM, np.dtype(np.float64))
    assert native.kind(ReduceOp.BXOR, np.dtype(np.int16)) is not None
    for op, dtype in [(ReduceOp.BAND, np.float32), (ReduceOp.SUM, np.float16), (ReduceOp.SUM, np.bool_),
                      (ReduceOp.SUM, np.complex64), (ReduceOp.SUM, np.uint16), (ReduceOp.PREMUL_SUM, np.float32)]:
        assert native.kind(op, np.dtype(dtype)) is None, (op, dtype)


SPECIAL = {
    "float32": [0.0, -0.0, np.inf, -np.inf, np.nan, 1e38, -1e-45, 3.5],
    "float64": [0.0, -0.0, np.inf, -np.inf, np.nan, 1e308, -5e-324, -2.25],
    "int8": [127, -128, -1, 0, 100, -100, 1, 64],
    "int16": [32767, -32768, -1, 0, 300, -300, 7, 2],
    "int32": [2**31 - 1, -2**31, -1, 0, 65536, -65536, 3, 5],
    "int64": [2**63 - 1, -2**63, -1, 0, 2**40, -2**40, 11, 13],
    "uint8": [255, 0, 1, 128, 200, 3, 77, 254],
}


@needs_c
@pytest.mark.parametrize("dtype", sorted(SPECIAL))
def test_reductions_give_numpys_bits_on_special_values(dtype):
    ufuncs = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
              "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}
    base = np.array(SPECIAL[dtype], dtype=dtype)
    # every pairing of the special values, in both orders, and a third member
    xs = [np.repeat(base, base.size), np.tile(base, base.size), np.roll(np.tile(base, base.size), 3)]
    for op_name, ufunc in ufuncs.items():
        code = kind_of(op_name, dtype)
        if code is None:
            continue
        m = Members(3)
        for q in (0, 2):
            m.post_as_python(q, 1, seq=1, sig=3, data=xs[q])
        mine = xs[1].copy()
        with np.errstate(all="ignore"):
            assert m.rounds[1].all_reduce(1, 1, 3, mine, code) == C.DONE
            expected = xs[0].copy()
            for q in (1, 2):
                ufunc(expected, xs[q], out=expected)
        if expected.dtype.kind == "f":
            assert np.array_equal(mine, expected, equal_nan=True), op_name
            assert np.array_equal(np.signbit(mine), np.signbit(expected)), op_name  # signed zeros
        else:
            assert mine.tobytes() == expected.tobytes(), op_name


# -- in real worlds ---------------------------------------------------------------------------
def mixed_body(rank, world, native_ranks):
    import os

    import numpy as np

    if rank not in native_ranks:
        os.environ["DISTCOMM_SHM_NATIVE"] = "0"
    import distcomm as dist

    dist.init_process_group(None)
    before = g.rounds_consumed_in_c()
    results = []
    for i, n in enumerate((1, 2, 7, 33, 1000)):
        for dtype, op in (("float32", dist.ReduceOp.SUM), ("int64", dist.ReduceOp.MAX), ("float64", dist.ReduceOp.AVG),
                          ("int8", dist.ReduceOp.BXOR)):
            x = (np.arange(n) * (rank + 1) + i).astype(dtype)
            dist.all_reduce(x, op=op)
            results.append((dtype, n, x.tolist()))
        dist.barrier()
    taken = g.rounds_consumed_in_c() - before
    dist.destroy_process_group()
    return results, taken


def _expected(world, dtype, n, i, op_name):
    xs = [(np.arange(n) * (q + 1) + i).astype(dtype) for q in range(world)]
    acc = xs[0].copy()
    for x in xs[1:]:
        {"SUM": np.add, "MAX": np.maximum, "AVG": np.add, "BXOR": np.bitwise_xor}[op_name](acc, x, out=acc)
    if op_name == "AVG":
        acc = acc / world
    return acc.tolist()


@needs_c
@pytest.mark.parametrize("world, native_ranks", [
    pytest.param(2, (0, 1), marks=pytest.mark.slow),
    (2, (1,)),
    pytest.param(3, (0, 2), marks=pytest.mark.slow),
    pytest.param(5, (1, 2, 4), marks=pytest.mark.slow),
])
def test_ranks_with_and_without_the_c_round_meet_in_the_same_rounds(world, native_ranks):
    results = run_world(mixed_body, world, args=(native_ranks,), timeout=120)
    for rank, (got, taken) in enumerate(results):
        ops = [op for _ in range(5) for op in ("SUM", "MAX", "AVG", "BXOR")]
        sizes = [(i, n) for i, n in enumerate((1, 2, 7, 33, 1000)) for _ in range(4)]
        for (dtype, n, value), op_name, (i, _) in zip(got, ops, sizes):
            assert value == _expected(world, dtype, n, i, op_name), (rank, dtype, n, op_name)
        if rank in native_ranks:
            assert taken > 0, f"rank {rank} completed no round in C"  # some may be handed back to Python
        else:
            assert taken == 0


def late_body(rank, world):
    import time

    import numpy as np

    import distcomm as dist
    dist.init_process_group(None)
    sums = []
    for i in range(6):
        if rank == 1:
            time.sleep(0.03)  # past the poll and the yield: rank 0 arms its bell and sleeps
        x = np.full(3, float(rank + i), np.float32)
        dist.all_reduce(x)
        sums.append(x.tolist())
    dist.destroy_process_group()
    return sums


@needs_c
def test_a_late_peer_wakes_the_sleeper_and_the_sums_are_right():
    """The rounds handed back to Python (the sleeper's, past its poll; the late rank's, which finds
    a sleeper to ring) give the right sums. That the ring is left to Python is pinned on bytes
    (test_a_sleeping_peer_is_left_to_python_to_ring); a lost ring would only cost a sleep slice
    here, which a test without timing cannot see."""
    for rank, sums in enumerate(run_world(late_body, 2, timeout=60)):
        assert sums == [[float(2 * i + 1)] * 3 for i in range(6)], rank
