"""Every collective algorithm against the naive reference (algorithms/reference.py), on the in-process
transport, at world sizes 1 to 8 and sizes 0, 1, smaller than the world, prime and large.

Each rank runs on a thread with its own Channel; the transport is synchronous (eager_limit=0: a
send completes only when received), so an algorithm that relies on buffered sends deadlocks here
instead of passing by luck. Inputs are chosen so that every reduction is exact whatever the order
(small integers; powers of two for bfloat16 products), so results must equal the reference exactly;
a separate test uses random floats and checks every rank ends bit-identical.

World sizes 1 to 3 (one rank, a power of two, a non-power of two) run in the fast tier (``pytest -m
"not slow"``); 4 to 8 are marked slow, as their threads take most of this module's time on 2 cores.
So is the missing rank, which waits out its deadline.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distcomm import reduction as R
from distcomm._algorithms import reference, select
from distcomm.tuning import Tuning
from distcomm.dtypes import from_name
from distcomm.errors import CollectiveMismatchError, DistTimeoutError, PeerLostError
from distcomm.transport.base import Channel, MessageKey
from distcomm.types import RedOpType
from inproc_threads import run_threads

ALLREDUCE = ["ring", "ring_pipelined", "recursive_doubling", "halving_doubling"]
BROADCAST = ["binomial", "scatter_allgather"]
ALLGATHER = ["ring", "bruck"]
FAST_WORLDS = 3  # the largest world size in the fast tier


def worlds(*sizes: int, fast: int = FAST_WORLDS) -> list:
    """World sizes as parameters, those above ``fast`` marked slow."""
    return [p if p <= fast else pytest.param(p, marks=pytest.mark.slow) for p in sizes]


WORLDS = worlds(*range(1, 9))

VALID_OPS = {
    "bool": [RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX, RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR],
    "int": [RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX, RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR],
    "uint": [RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX, RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR],
    "float": [RedOpType.SUM, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX],
    "complex": [RedOpType.SUM],
}
DTYPES = ["float32", "float64", "int32", "int64", "uint8", "bool", "bfloat16", "float16", "complex128"]


def counts_for(p: int) -> list[int]:
    """0, 1, smaller than the world, prime sizes."""
    return sorted({0, 1, max(p - 1, 0), 13, 1009})


def make_input(dtype_name: str, count: int, rank: int, seed: int = 0) -> np.ndarray:
    """Values whose sums and products are exact in the dtype for up to 8 ranks."""
    rng = np.random.default_rng([seed, rank, count])
    dtype = from_name(dtype_name)
    if dtype.kind == "bool":
        return rng.random(count) < 0.5
    if dtype_name == "bfloat16":
        return R.to_bfloat16_bits(rng.choice([-2.0, -1.0, 0.5, 1.0, 2.0], count))
    if dtype.kind == "complex":
        return (rng.integers(-8, 9, count) + 1j * rng.integers(-8, 9, count)).astype(dtype.storage)
    if dtype_name == "float16":
        return rng.choice([-2.0, -1.0, 0.5, 1.0, 2.0], count).astype(np.float16)
    if dtype.kind == "uint":
        return rng.integers(0, 256, count).astype(dtype.storage)
    return rng.integers(-8, 9, count).astype(dtype.storage)


def channel(transport, n: int, rank: int, seq: int, op: str = "test", timeout: float = 20.0) -> Channel:
    return Channel(
        transport,
        ranks=list(range(n)),
        rank=rank,
        key=MessageKey(group=0, kind=0, seq=seq),
        op=op,
        deadline=time.monotonic() + timeout,
    )


def run(n: int, body, timeout: float = 60.0):
    """``body(rank, make_channel)`` on n threads; ``make_channel()`` gives a fresh-seq Channel each call."""

    def rank_main(rank, transport):
        seq = iter(range(1_000_000))
        return body(rank, lambda op="test", timeout=20.0: channel(transport, n, rank, next(seq), op, timeout))

    return run_threads(n, rank_main, timeout=timeout, eager_limit=0)


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    """Bit-identical (NaN-safe)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def assert_all_pairs_same(results) -> None:
    """Every rank's list of (algorithm's result, reference's result) pairs agree bit for bit."""
    for per_rank in results:
        for got, want in per_rank:
            assert_same(got, want)


def check_allreduce(algo: str, p: int, count: int, dtype_name: str, op, seed: int = 0) -> None:
    check_allreduce_fn(select.choose("allreduce", 0, p, algo=algo), p, count, dtype_name, op, seed)


def check_allreduce_fn(fn, p: int, count: int, dtype_name: str, op, seed: int = 0) -> None:
    """check_allreduce for a function (e.g. an algorithm with non-default parameters)."""
    dtype = from_name(dtype_name)
    reduce = R.reducer(op, dtype)

    def body(rank, mk):
        x = make_input(dtype_name, count, rank, seed)
        got, want = x.copy(), x.copy()
        fn(mk("all_reduce"), got, reduce)
        reference.allreduce(mk("all_reduce"), want, reduce)
        return got, want

    results = run(p, body)
    for got, want in results:
        assert_same(got, want)
        assert_same(got, results[0][0])


# -- the reference itself, against numpy -----------------------------------------------------------
@pytest.mark.parametrize("p", worlds(1, 3, 4))
def test_reference_allreduce_is_rank_ordered_fold(p):
    xs = [np.random.default_rng(r).standard_normal(37).astype(np.float32) for r in range(p)]
    expected = xs[0].copy()
    for x in xs[1:]:
        expected += x

    def body(rank, mk):
        buf = xs[rank].copy()
        reference.allreduce(mk(), buf, R.reducer(RedOpType.SUM, from_name("float32")))
        return buf

    for got in run(p, body):
        assert_same(got, expected)


@pytest.mark.parametrize("p", worlds(1, 2, 5))
def test_reference_data_movement(p):
    count = 3

    def body(rank, mk):
        mine = np.arange(count, dtype=np.int64) + 100 * rank
        out = np.zeros(p * count, np.int64)
        out[rank * count : (rank + 1) * count] = mine
        reference.allgather(mk(), out, count)
        g = np.zeros(p * count, np.int64) if rank == p - 1 else None
        reference.gather(mk(), mine, g, p - 1)
        s = np.zeros(count, np.int64)
        reference.scatter(mk(), np.arange(p * count, dtype=np.int64) * 2 if rank == p - 1 else None, s, p - 1)
        b = mine.copy()
        reference.broadcast(mk(), b, p - 1)
        send_counts = [(rank + j) % 3 for j in range(p)]
        recv_counts = [(j + rank) % 3 for j in range(p)]
        send = np.concatenate([np.full(c, 10 * rank + j, np.int64) for j, c in enumerate(send_counts)] + [np.zeros(0, np.int64)])
        recv = np.zeros(sum(recv_counts), np.int64)
        reference.alltoallv(mk(), send, send_counts, recv, recv_counts)
        reference.barrier(mk())
        return out, g, s, b, recv, recv_counts

    for rank, (out, g, s, b, recv, recv_counts) in enumerate(run(p, body)):
        full = np.concatenate([np.arange(count) + 100 * r for r in range(p)])
        assert_same(out, full)
        if rank == p - 1:
            assert_same(g, full)
        assert_same(s, np.arange(rank * count, (rank + 1) * count, dtype=np.int64) * 2)
        assert_same(b, np.arange(count, dtype=np.int64) + 100 * (p - 1))
        want = np.concatenate([np.full(c, 10 * j + rank, np.int64) for j, c in enumerate(recv_counts)] + [np.zeros(0, np.int64)])
        assert_same(recv, want)


# -- all_reduce ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p", WORLDS)
@pytest.mark.parametrize("algo", ALLREDUCE)
def test_allreduce_sizes(algo, p):
    for i, count in enumerate(counts_for(p)):
        dtype_name, op = [("float32", RedOpType.SUM), ("int64", RedOpType.MAX), ("bool", RedOpType.BXOR),
                          ("bfloat16", RedOpType.SUM), ("complex128", RedOpType.SUM)][i % 5]
        check_allreduce(algo, p, count, dtype_name, op, seed=i)


@pytest.mark.parametrize("p", worlds(3, 4))
@pytest.mark.parametrize("algo", ALLREDUCE)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_allreduce_every_op_and_dtype(algo, p, dtype_name):
    for op in VALID_OPS[from_name(dtype_name).kind]:
        check_allreduce(algo, p, 13, dtype_name, op)


@pytest.mark.parametrize("p", worlds(2, 3, 4))
@pytest.mark.parametrize("algo", ALLREDUCE)
def test_allreduce_large(algo, p):
    count = 1 << 20
    reduce = R.reducer(RedOpType.SUM, from_name("float32"))
    fn = select.choose("allreduce", 0, p, algo=algo)

    def body(rank, mk):
        buf = np.full(count, rank + 1, np.float32)
        buf[rank::7] = -3
        fn(mk(), buf, reduce)
        return buf

    expected = np.zeros(count, np.float32)
    for r in range(p):
        x = np.full(count, r + 1, np.float32)
        x[r::7] = -3
        expected += x
    for got in run(p, body):
        assert_same(got, expected)


@pytest.mark.parametrize("p", worlds(3, 5, 6, 8))
@pytest.mark.parametrize("algo", ALLREDUCE)
def test_allreduce_random_floats_bit_identical_on_every_rank(algo, p):
    fn = select.choose("allreduce", 0, p, algo=algo)
    for dtype in (np.float32, np.float64):
        reduce = R.reducer(RedOpType.SUM, from_name(np.dtype(dtype).name))
        xs = [np.random.default_rng(r).standard_normal(1009).astype(dtype) for r in range(p)]
        # Two NaNs with different payloads: x86 keeps the first operand's, so ranks that combined
        # them in different orders would differ in the bits.
        for r, payload in ((0, 1), (p - 1, 2)):
            bits = xs[r][5:6].view(np.uint32 if dtype == np.float32 else np.uint64)
            bits[0] = (0x7FC00000 if dtype == np.float32 else 0x7FF8000000000000) + payload

        def body(rank, mk):
            buf = xs[rank].copy()
            fn(mk(), buf, reduce)
            return buf

        results = run(p, body)
        for got in results:
            assert_same(got, results[0])
        np.testing.assert_allclose(results[0], np.sum(xs, axis=0), rtol=1e-5, atol=1e-5)


# -- broadcast, reduce ---------------------------------------------------------------------------
@pytest.mark.parametrize("p", WORLDS)
@pytest.mark.parametrize("algo", BROADCAST)
def test_broadcast(algo, p):
    fn = select.choose("broadcast", 0, p, algo=algo)
    roots = sorted({0, p - 1, p // 2})

    def body(rank, mk):
        out = []
        for count in counts_for(p):
            for root in roots:
                buf = make_input("float64", count, rank, seed=root)
                fn(mk("broadcast"), buf, root)
                out.append(buf)
        return out

    results = run(p, body)
    i = 0
    for count in counts_for(p):
        for root in roots:
            for rank in range(p):
                assert_same(results[rank][i], make_input("float64", count, root, seed=root))
            i += 1


@pytest.mark.parametrize("p", WORLDS)
def test_reduce_binomial(p):
    roots = sorted({0, p - 1, (p + 1) // 2 % p})
    cases = [("float32", RedOpType.SUM), ("int32", RedOpType.PRODUCT), ("bool", RedOpType.MIN), ("bfloat16", RedOpType.MAX)]

    def body(rank, mk):
        out = []
        for i, count in enumerate(counts_for(p)):
            dtype_name, op = cases[i % len(cases)]
            reduce = R.reducer(op, from_name(dtype_name))
            for root in roots:
                x = make_input(dtype_name, count, rank, seed=i)
                got, want = x.copy(), x.copy()
                select.choose("reduce", 0, p)(mk("reduce"), got, root, reduce)
                reference.reduce(mk("reduce"), want, root, reduce)
                out.append((root, x, got, want))
        return out

    for rank, cases_out in enumerate(run(p, body)):
        for root, x, got, want in cases_out:
            if rank == root:
                assert_same(got, want)
            else:
                assert_same(got, x)  # non-root buffers are never modified


# -- all_gather, gather, scatter -------------------------------------------------------------------
@pytest.mark.parametrize("p", WORLDS)
@pytest.mark.parametrize("algo", ALLGATHER)
def test_allgather(algo, p):
    fn = select.choose("allgather", 0, p, algo=algo)

    def body(rank, mk):
        out = []
        for count in counts_for(p):
            buf = np.zeros(p * count, np.int32)
            buf[rank * count : (rank + 1) * count] = make_input("int32", count, rank)
            fn(mk("all_gather"), buf, count)
            out.append(buf)
        return out

    for per_rank in run(p, body):
        for buf, count in zip(per_rank, counts_for(p)):
            assert_same(buf, np.concatenate([make_input("int32", count, r) for r in range(p)]))


@pytest.mark.parametrize("p", WORLDS)
def test_gather_and_scatter(p):
    roots = sorted({0, p - 1})

    def body(rank, mk):
        out = []
        for count in counts_for(p):
            for root in roots:
                send = make_input("complex128", count, rank)
                g = np.zeros(p * count, np.complex128) if rank == root else None
                select.choose("gather", 0, p)(mk("gather"), send, g, root)
                whole = make_input("complex128", p * count, 99) if rank == root else None
                s = np.zeros(count, np.complex128)
                select.choose("scatter", 0, p)(mk("scatter"), whole, s, root)
                out.append((count, root, g, s))
        return out

    for rank, per_rank in enumerate(run(p, body)):
        for count, root, g, s in per_rank:
            if rank == root:
                assert_same(g, np.concatenate([make_input("complex128", count, r) for r in range(p)]))
            assert_same(s, make_input("complex128", p * count, 99)[rank * count : (rank + 1) * count])


# -- reduce_scatter, all_to_all, barrier --------------------------------------------------------------
def uneven_counts(p: int, total: int, seed: int) -> list[int]:
    """``p`` block sizes summing to ``total``, some of them zero."""
    rng = np.random.default_rng([seed, p, total])
    cuts = np.sort(rng.integers(0, total + 1, p - 1))
    return list(np.diff(np.concatenate([[0], cuts, [total]])).astype(int))


@pytest.mark.parametrize("p", WORLDS)
def test_reduce_scatter_ring(p):
    cases = [("float64", RedOpType.SUM), ("int64", RedOpType.BOR), ("bfloat16", RedOpType.PRODUCT), ("bool", RedOpType.MAX)]

    def body(rank, mk):
        out = []
        for i, total in enumerate(counts_for(p)):
            for counts in (uneven_counts(p, total, i), [total // p] * p):
                dtype_name, op = cases[i % len(cases)]
                reduce = R.reducer(op, from_name(dtype_name))
                x = make_input(dtype_name, sum(counts), rank, seed=i)
                got, want = np.zeros(counts[rank], x.dtype), np.zeros(counts[rank], x.dtype)
                select.choose("reduce_scatter", 0, p)(mk("reduce_scatter"), x.copy(), got, counts, reduce)
                reference.reduce_scatter(mk("reduce_scatter"), x.copy(), want, counts, reduce)
                out.append((got, want))
        return out

    assert_all_pairs_same(run(p, body))


@pytest.mark.parametrize("p", WORLDS)
def test_alltoallv_pairwise(p):
    def body(rank, mk):
        out = []
        for i, total in enumerate(counts_for(p)):
            # send_counts[rank][j] for every rank, so recv_counts can be derived consistently
            matrix = [uneven_counts(p, total, 10 * i + r) for r in range(p)]
            send_counts = matrix[rank]
            recv_counts = [matrix[j][rank] for j in range(p)]
            send = make_input("int64", sum(send_counts), rank, seed=i)
            got, want = np.zeros(sum(recv_counts), np.int64), np.zeros(sum(recv_counts), np.int64)
            select.choose("all_to_all", 0, p)(mk("all_to_all"), send, send_counts, got, recv_counts)
            reference.alltoallv(mk("all_to_all"), send, send_counts, want, recv_counts)
            out.append((got, want))
        return out

    assert_all_pairs_same(run(p, body))


@pytest.mark.parametrize("p", WORLDS)
def test_barrier_waits_for_everyone(p):
    import threading

    arrived = []
    lock = threading.Lock()

    def body(rank, mk):
        for round_ in range(3):
            if rank == round_ % p:
                time.sleep(0.02)  # the late rank differs each round
            with lock:
                arrived.append((round_, rank))
            select.choose("barrier", 0, p)(mk("barrier"))
            with lock:
                # everybody has arrived for this round before anyone leaves it
                assert sum(1 for r, _ in arrived if r == round_) == p

    run(p, body)


# -- the pipelined ring with small segments: many segments per block, blocks that are not multiples
# of the segment, windows smaller and larger than the number of segments ------------------------------
@pytest.mark.parametrize("p", WORLDS)
@pytest.mark.parametrize("segment_bytes,window", [(4, 1), (8, 2), (12, 3), (4, 8), (1 << 20, 4)])
def test_allreduce_ring_pipelined_segments(p, segment_bytes, window):
    from distcomm._algorithms.allreduce_ring_pipelined import allreduce_ring_pipelined

    fn = functools.partial(allreduce_ring_pipelined, segment_bytes=segment_bytes, window=window)
    for count in sorted({0, 1, max(p - 1, 0), 2 * p + 1, 13, 101, 1009}):
        check_allreduce_fn(fn, p, count, "int32", RedOpType.SUM)
    check_allreduce_fn(fn, p, 257, "bfloat16", RedOpType.SUM, seed=1)
    check_allreduce_fn(fn, p, 50, "uint8", RedOpType.PRODUCT, seed=2)


@pytest.mark.parametrize("p", worlds(2, 3, 5))
def test_allreduce_ring_pipelined_random_floats_bit_identical(p):
    """Segments change nothing about the order of reduction: the same bits as the plain ring."""
    from distcomm._algorithms.allreduce_ring_pipelined import allreduce_ring_pipelined

    reduce = R.reducer(RedOpType.SUM, from_name("float32"))
    count = 4099

    def body(rank, mk):
        x = np.random.default_rng([7, rank]).standard_normal(count).astype(np.float32)
        a, b = x.copy(), x.copy()
        allreduce_ring_pipelined(mk("all_reduce"), a, reduce, segment_bytes=256, window=3)
        select.choose("allreduce", 0, p, algo="ring")(mk("all_reduce"), b, reduce)
        return a, b

    results = run(p, body)
    for a, b in results:
        assert_same(a, b)
        assert_same(a, results[0][0])


@pytest.mark.parametrize("p", [2, 3])
def test_allreduce_ring_pipelined_count_mismatch_with_equal_segments(p):
    """Counts 4·seg and 6·seg per block give segments of equal size: the count message catches it."""
    from distcomm._algorithms.allreduce_ring_pipelined import allreduce_ring_pipelined

    reduce = R.reducer(RedOpType.SUM, from_name("float32"))

    def body(rank, mk):
        count = p * (6 if rank == p - 1 else 4)
        allreduce_ring_pipelined(mk("all_reduce", timeout=5.0), np.ones(count, np.float32), reduce,
                                 segment_bytes=4, window=2)

    mismatch = _fails_with_a_mismatch(p, body)
    assert "all_reduce" in str(mismatch) and "peer rank" in str(mismatch)


def _fails_with_a_mismatch(p, body) -> CollectiveMismatchError:
    """Run ``body`` on p threads: they end promptly, each rank either finished or failed with the
    mismatch or because a failed peer went away, and at least one with the mismatch (returned)."""
    start = time.monotonic()
    results = run_threads_exc(p, body)
    assert time.monotonic() - start < 4.0, "ranks waited out their deadline instead of failing"
    assert any(isinstance(e, CollectiveMismatchError) for e in results), results
    for e in results:
        assert e is None or isinstance(e, (CollectiveMismatchError, PeerLostError)), repr(e)
    return next(e for e in results if isinstance(e, CollectiveMismatchError))


# -- disagreement between ranks: an error, never a hang or silent corruption ------------------------
MISMATCH_CASES = [
    ("allreduce", "ring"),
    ("allreduce", "recursive_doubling"),
    ("allreduce", "halving_doubling"),
    ("allreduce", "ring_pipelined"),
    ("broadcast", "binomial"),
    ("broadcast", "scatter_allgather"),
    ("reduce", "binomial"),
    ("allgather", "ring"),
    ("allgather", "bruck"),
]


@pytest.mark.parametrize("op_name,algo", MISMATCH_CASES)
@pytest.mark.parametrize("p", worlds(2, 3, 5))
def test_count_mismatch_raises(op_name, algo, p):
    fn = select.choose(op_name, 0, p, algo=algo)
    reduce = R.reducer(RedOpType.SUM, from_name("float32"))

    def body(rank, mk):
        count = 11 if rank == p - 1 else 12
        ch = mk(op_name, timeout=5.0)
        if op_name == "allreduce":
            fn(ch, np.ones(count, np.float32), reduce)
        elif op_name == "broadcast":
            fn(ch, np.ones(count, np.float32), 0)
        elif op_name == "reduce":
            fn(ch, np.ones(count, np.float32), 0, reduce)
        else:
            fn(ch, np.ones(p * count, np.float32), count)

    mismatch = _fails_with_a_mismatch(p, body)
    assert op_name in str(mismatch) and "#0" in str(mismatch) and "peer rank" in str(mismatch)


def run_threads_exc(n, body):
    def rank_main(rank, transport):
        seq = iter(range(1000))
        return body(rank, lambda op="test", timeout=20.0: channel(transport, n, rank, next(seq), op, timeout))

    return run_threads(n, rank_main, timeout=30.0, eager_limit=0, return_exceptions=True)


@pytest.mark.slow
def test_missing_rank_times_out_naming_it():
    """A rank that never joins: the others fail at the deadline, naming op, seq, rank and peer."""
    fn = select.choose("allreduce", 0, 3, algo="ring")
    reduce = R.reducer(RedOpType.SUM, from_name("float32"))

    def body(rank, mk):
        if rank == 2:
            time.sleep(1.0)  # never calls the collective (leaves after the others' deadline)
            return None
        fn(mk("all_reduce", timeout=0.3), np.ones(6, np.float32), reduce)

    results = run_threads_exc(3, body)
    for rank in (0, 1):
        assert isinstance(results[rank], DistTimeoutError), results
        assert f"all_reduce #0 on rank {rank}" in str(results[rank])
    assert "peer rank" in str(results[0])


# -- selection -------------------------------------------------------------------------------------
def test_select_defaults_and_overrides(monkeypatch):
    from distcomm._algorithms.allreduce_halving_doubling import allreduce_halving_doubling
    from distcomm._algorithms.allreduce_recursive_doubling import allreduce_recursive_doubling
    from distcomm._algorithms.allreduce_ring import allreduce_ring
    from distcomm._algorithms.allreduce_ring_pipelined import allreduce_ring_pipelined

    assert select.choose("all_reduce", 8, 4) is allreduce_recursive_doubling
    assert select.choose("allreduce", 1 << 20, 4) is allreduce_halving_doubling
    assert select.choose("allreduce", 1 << 20, 6) is allreduce_ring
    assert select.choose("allreduce", 1 << 20, 2) is allreduce_halving_doubling
    assert select.choose("allreduce", 64 << 20, 2) is allreduce_ring_pipelined
    assert select.choose("allreduce", 64 << 20, 4) is allreduce_halving_doubling
    assert select.choose("allreduce", 8, 4, algo="ring") is allreduce_ring
    monkeypatch.setenv("DISTCOMM_ALGO_ALLREDUCE", "ring")
    forced = Tuning.from_env()
    assert select.choose("all_reduce", 8, 4) is allreduce_recursive_doubling  # the environment is read once, into a Tuning
    assert select.choose("all_reduce", 8, 4, forced) is allreduce_ring
    assert select.choose("allreduce", 8, 4, forced, algo="halving_doubling") is allreduce_halving_doubling
    monkeypatch.delenv("DISTCOMM_ALGO_ALLREDUCE")
    monkeypatch.setenv("DISTCOMM_THRESHOLD_ALLREDUCE_SMALL_BYTES", str(4 << 20))
    assert select.choose("allreduce", 1 << 20, 4, Tuning.from_env()) is allreduce_recursive_doubling
    monkeypatch.setenv("DISTCOMM_THRESHOLD_ALLREDUCE_SEGMENT_BYTES", str(1 << 20))
    segmented = select.choose("allreduce", 64 << 20, 2, Tuning.from_env())
    assert segmented.func is allreduce_ring_pipelined and segmented.keywords == {"segment_bytes": 1 << 20, "window": 4}
    assert select.choose("broadcast", 1 << 20, 2).__name__ == "broadcast_binomial"
    assert select.choose("broadcast", 1 << 20, 3).__name__ == "broadcast_scatter_allgather"
    assert select.choose("all_gather", 64, 3).__name__ == "allgather_bruck"
    assert select.choose("all_gather", 1 << 20, 3).__name__ == "allgather_ring"
    for op in ("reduce", "gather", "scatter", "reduce_scatter", "all_to_all", "barrier"):
        assert callable(select.choose(op, 100, 3))
    assert select.choose("barrier", 0, 3, algo="reference") is reference.barrier


def test_select_unknown_names(monkeypatch):
    with pytest.raises(ValueError, match="valid: ring, recursive_doubling, halving_doubling"):
        select.choose("allreduce", 8, 2, algo="tree")
    monkeypatch.setenv("DISTCOMM_ALGO_BROADCAST", "pipeline")
    with pytest.raises(ValueError, match="DISTCOMM_ALGO_BROADCAST.*binomial, scatter_allgather"):
        select.choose("broadcast", 8, 2, Tuning.from_env())
    monkeypatch.setenv("DISTCOMM_THRESHOLD_ALLREDUCE_SMALL_BYTES", "lots")
    with pytest.raises(ValueError, match="DISTCOMM_THRESHOLD_ALLREDUCE_SMALL_BYTES='lots' is not a number of bytes"):
        Tuning.from_env()
    with pytest.raises(ValueError, match="no algorithms for collective"):
        select.choose("allscatter", 8, 2)


@pytest.mark.parametrize("p", worlds(3, 4))
def test_large_data_movement(p):
    """1<<20 float32 elements through every non-all_reduce algorithm that is chosen for large sizes."""
    count = (1 << 20) // p
    total = count * p
    sum32 = R.reducer(RedOpType.SUM, from_name("float32"))

    def data(rank):
        return (np.arange(total, dtype=np.float32) % 1000) + rank

    def body(rank, mk):
        b = data(rank)
        select.choose("broadcast", b.nbytes, p, algo="scatter_allgather")(mk(), b, 1)
        g = np.zeros(total, np.float32)
        g[rank * count : (rank + 1) * count] = rank
        select.choose("allgather", g.nbytes, p, algo="ring")(mk(), g, count)
        rs = np.empty(count, np.float32)
        select.choose("reduce_scatter", total * 4, p)(mk(), data(rank), rs, [count] * p, sum32)
        red = data(rank)
        select.choose("reduce", red.nbytes, p)(mk(), red, 0, sum32)
        a2a = np.empty(total, np.float32)
        select.choose("all_to_all", total * 4, p)(mk(), data(rank), [count] * p, a2a, [count] * p)
        return b, g, rs, red, a2a

    full_sum = sum(data(r) for r in range(p))
    for rank, (b, g, rs, red, a2a) in enumerate(run(p, body)):
        assert_same(b, data(1))
        assert_same(g, np.repeat(np.arange(p, dtype=np.float32), count))
        assert_same(rs, full_sum[rank * count : (rank + 1) * count])
        assert_same(red, full_sum if rank == 0 else data(rank))
        assert_same(a2a, np.concatenate([data(src)[rank * count : (rank + 1) * count] for src in range(p)]))


# -- random shapes (hypothesis) ----------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=st.integers(1, 8),
    count=st.integers(0, 300),
    algo=st.sampled_from(ALLREDUCE),
    case=st.sampled_from([("int32", RedOpType.SUM), ("uint8", RedOpType.PRODUCT), ("bool", RedOpType.BOR),
                          ("float64", RedOpType.MIN), ("bfloat16", RedOpType.SUM)]),
    seed=st.integers(0, 2**16),
)
def test_allreduce_random_shapes(p, count, algo, case, seed):
    check_allreduce(algo, p, count, case[0], case[1], seed=seed)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(1, 8), data=st.data())
def test_reduce_scatter_and_broadcast_random_shapes(p, data):
    counts = data.draw(st.lists(st.integers(0, 40), min_size=p, max_size=p))
    root = data.draw(st.integers(0, p - 1))
    algo = data.draw(st.sampled_from(BROADCAST))
    reduce = R.reducer(RedOpType.SUM, from_name("int64"))

    def body(rank, mk):
        x = make_input("int64", sum(counts), rank)
        got, want = np.zeros(counts[rank], np.int64), np.zeros(counts[rank], np.int64)
        select.choose("reduce_scatter", 0, p)(mk(), x.copy(), got, counts, reduce)
        reference.reduce_scatter(mk(), x.copy(), want, counts, reduce)
        b = make_input("int64", sum(counts), rank, seed=1)
        select.choose("broadcast", 0, p, algo=algo)(mk(), b, root)
        return [(got, want), (b, make_input("int64", sum(counts), root, seed=1))]

    assert_all_pairs_same(run(p, body))
