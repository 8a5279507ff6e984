"""Hierarchical all_reduce (_algorithms/allreduce_hierarchical.py) against the reference, on the
in-process transport, for host layouts of 2 to 8 ranks; and the default engine's choice of it
(backends/hybrid.py: groups spread evenly over hosts, from the threshold up).

The layouts are given to the algorithm as data (which host each rank is on): across real hosts it
runs in tests/test_multihost_netns.py, against torch.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from distcomm import reduction as R
from distcomm._algorithms import select
from distcomm._algorithms.allreduce_hierarchical import allreduce_hierarchical, layout
from distcomm.backends.generic import GenericCollectives
from distcomm.backends.hierarchical import HierarchicalCollectives
from distcomm.dtypes import from_name
from distcomm.errors import DistTimeoutError
from distcomm.tuning import Tuning
from distcomm.types import RedOpType, _make_nccl_premul_sum
from inproc_threads import run_threads
from test_algorithms import assert_same, channel, check_allreduce_fn, make_input, run, run_threads_exc

LAYOUTS = [
    [0, 1],  # one rank per host: the cross phase only
    [0, 0],  # one host: the local phases only
    [0, 0, 1, 1],
    [0, 1, 0, 1],  # interleaved ranks
    ["b", "a", "a", "b"],  # any host ids, any order
    [0, 0, 0, 1, 1, 1],
    [0, 1, 2, 0, 1, 2],
    [0, 0, 1, 1, 2, 2],
    pytest.param([0, 0, 1, 1, 2, 2, 3, 3], marks=pytest.mark.slow),
    pytest.param([0, 0, 0, 0, 1, 1, 1, 1], marks=pytest.mark.slow),
]


def cross(sub, part, reduce):
    select.choose("allreduce", part.nbytes, sub.size)(sub, part, reduce)


def hierarchical(hosts):
    return functools.partial(allreduce_hierarchical, hosts=hosts, cross=cross)


@pytest.mark.parametrize("hosts", LAYOUTS)
def test_matches_the_reference(hosts):
    p = len(hosts)
    cases = [("float32", RedOpType.SUM), ("int64", RedOpType.MAX), ("bool", RedOpType.BXOR),
             ("bfloat16", RedOpType.SUM), ("complex128", RedOpType.SUM), ("uint8", RedOpType.PRODUCT)]
    for i, count in enumerate(sorted({0, 1, p - 1, 13, 1009, 40_000})):
        dtype_name, op = cases[i % len(cases)]
        check_allreduce_fn(hierarchical(hosts), p, count, dtype_name, op, seed=i)


@pytest.mark.parametrize("hosts", [[0, 0, 1, 1], [0, 1, 2, 0, 1, 2]])
def test_random_floats_bit_identical_on_every_rank(hosts):
    p = len(hosts)
    reduce = R.reducer(RedOpType.SUM, from_name("float64"))
    xs = [np.random.default_rng(r).standard_normal(1009) for r in range(p)]

    def body(rank, mk):
        buf = xs[rank].copy()
        hierarchical(hosts)(mk(), buf, reduce)
        return buf

    results = run(p, body)
    for got in results:
        assert_same(got, results[0])
    np.testing.assert_allclose(results[0], np.sum(xs, axis=0), rtol=1e-12)


def test_uneven_hosts_are_refused():
    assert layout([0, 0, 1]) == ([[0, 1], [2]], False)
    assert layout(["x", "y", "x", "y"]) == ([[0, 2], [1, 3]], True)

    def body(rank, mk):
        hierarchical([0, 0, 1])(mk(), np.ones(4, np.float32), R.reducer(RedOpType.SUM, from_name("float32")))

    results = run_threads_exc(3, body)
    assert all(isinstance(r, ValueError) and "same number of ranks on every host" in str(r) for r in results)


@pytest.mark.slow
def test_errors_name_group_ranks_not_sub_ranks():
    """Rank 3 never comes: rank 2 (its host mate) times out in the local phase naming peer rank 3,
    the group rank, not its index on the host."""
    reduce = R.reducer(RedOpType.SUM, from_name("float32"))

    def body(rank, mk):
        if rank == 3:
            time.sleep(1.0)
            return None
        hierarchical([0, 0, 1, 1])(mk("all_reduce", timeout=0.3), np.ones(64, np.float32), reduce)

    results = run_threads_exc(4, body)
    assert isinstance(results[2], DistTimeoutError), results
    assert "all_reduce #0 on rank 2 (peer rank 3)" in str(results[2]), results[2]


class Recording:
    """A Transport that records where it sends, around the test's in-process one."""

    def __init__(self, transport):
        self.transport, self.rank, self.size = transport, transport.rank, transport.size
        self.sent_to: set[int] = set()

    def isend(self, dst, data, key, signature=0):
        self.sent_to.add(dst)
        return self.transport.isend(dst, data, key, signature)

    def irecv(self, src, out, key, signature=0):
        return self.transport.irecv(src, out, key, signature)

    def close(self):
        self.transport.close()


def test_the_default_engine_chooses_it_by_size():
    """HierarchicalCollectives runs the hierarchical algorithm from the threshold up and the generic
    one below it, told apart by whom each rank sends to: 2 hosts x 3 ranks, where hierarchically a
    rank sends only to its right neighbour on its host and to its counterpart on the other host,
    and the generic ring (non-power-of-two world) only to rank + 1."""
    threshold = select.threshold("allreduce_hierarchical_bytes")
    hosts = [0, 0, 0, 1, 1, 1]
    f32 = from_name("float32")

    def rank_main(rank, transport):
        coll = HierarchicalCollectives(hosts)
        sent = {}
        for seq, count in enumerate((threshold // 4 - 1, threshold // 4)):
            spy = Recording(transport)
            x = make_input("float32", count, rank)
            want = x.copy()
            coll.all_reduce(channel(spy, 6, rank, 2 * seq, "all_reduce"), x, f32, RedOpType.SUM)
            GenericCollectives().all_reduce(channel(transport, 6, rank, 2 * seq + 1, "all_reduce"), want, f32,
                                            RedOpType.SUM)
            assert_same(x, want)
            sent[count] = spy.sent_to
        return sent

    for rank, sent in enumerate(run_threads(6, rank_main, timeout=60, eager_limit=0)):
        host, i = divmod(rank, 3)
        assert sent[threshold // 4] == {host * 3 + (i + 1) % 3, (rank + 3) % 6}, (rank, sent)
        assert sent[threshold // 4 - 1] == {(rank + 1) % 6}, (rank, sent)


def test_a_forced_generic_algorithm_runs_the_whole_all_reduce():
    """DISTCOMM_ALGO_ALLREDUCE=ring: the ring over all 6 ranks even past the threshold (each rank
    sends only to rank + 1), not the hierarchy."""
    tuning = Tuning.from_env({"DISTCOMM_ALGO_ALLREDUCE": "ring"})
    count = select.threshold("allreduce_hierarchical_bytes") // 4 * 2
    f32 = from_name("float32")

    def rank_main(rank, transport):
        spy = Recording(transport)
        x = make_input("float32", count, rank)
        want = x.copy()
        HierarchicalCollectives([0, 0, 0, 1, 1, 1], tuning).all_reduce(channel(spy, 6, rank, 0, "all_reduce"), x,
                                                                       f32, RedOpType.SUM)
        GenericCollectives().all_reduce(channel(transport, 6, rank, 1, "all_reduce"), want, f32, RedOpType.SUM)
        assert_same(x, want)
        return spy.sent_to

    for rank, sent in enumerate(run_threads(6, rank_main, timeout=60, eager_limit=0)):
        assert sent == {(rank + 1) % 6}, (rank, sent)


class CountingHost(GenericCollectives):
    """Collectives among a host's ranks (the generic ones over the host's sub-channel) that count
    what the hierarchy asks of them: stands in for the shared-memory engine's."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def reduce_scatter(self, ch, scratch, out, counts, dtype, op):
        self.calls.append("reduce_scatter")
        super().reduce_scatter(ch, scratch, out, counts, dtype, op)

    def all_gather(self, ch, out, count):
        self.calls.append("all_gather")
        super().all_gather(ch, out, count)


HOST_LAYOUTS = [[0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 1, 1, 1],
                pytest.param([0, 0, 1, 1, 2, 2, 3, 3], marks=pytest.mark.slow)]


@pytest.mark.parametrize("hosts", HOST_LAYOUTS)
@pytest.mark.parametrize("scatter_limit", [None, 0], ids=["host-scatter", "ring-scatter"])
def test_host_collectives_run_the_phases_inside_a_host(hosts, scatter_limit):
    """HierarchicalCollectives given collectives for the host's ranks: the all-gather runs on them,
    and the reduce-scatter too up to allreduce_hierarchical_host_scatter_bytes (above it, the
    point-to-point ring, which must leave the same block on each rank for their all-gather).
    Results match the reference all_reduce bit for bit (AVG and PREMUL_SUM applied once, for the
    whole group); a count that does not split evenly among a host's ranks runs point to point."""
    p = len(hosts)
    per_host = p // len(set(hosts))
    env = {"DISTCOMM_THRESHOLD_ALLREDUCE_HIERARCHICAL_BYTES": "0"}
    if scatter_limit is not None:
        env["DISTCOMM_THRESHOLD_ALLREDUCE_HIERARCHICAL_HOST_SCATTER_BYTES"] = str(scatter_limit)
    tuning = Tuning.from_env(env)
    cases = [("float32", RedOpType.SUM), ("float64", RedOpType.AVG), ("int64", RedOpType.MAX),
             ("bfloat16", RedOpType.SUM), ("uint8", RedOpType.PRODUCT), ("float32", _make_nccl_premul_sum(0.5))]
    counts = [per_host * 7, per_host * 1000 + 1, per_host * 5000]

    def rank_main(rank, transport):
        host = CountingHost()
        coll = HierarchicalCollectives(hosts, tuning, host)
        seq = iter(range(1000))
        calls = []
        for count in counts:
            for dtype_name, op in cases:
                dtype = from_name(dtype_name)
                x = make_input(dtype_name, count, rank)
                want = x.copy()
                host.calls.clear()
                coll.all_reduce(channel(transport, p, rank, next(seq), "all_reduce"), x, dtype, op)
                GenericCollectives().all_reduce(channel(transport, p, rank, next(seq), "all_reduce"), want,
                                                dtype, op)
                assert_same(x, want)
                calls.append((count, list(host.calls)))
        return calls

    for calls in run_threads(p, rank_main, timeout=120, eager_limit=0):
        for count, made in calls:
            if count % per_host:
                assert made == [], (count, made)
            elif scatter_limit == 0:
                assert made == ["all_gather"], (count, made)
            else:
                assert made == ["reduce_scatter", "all_gather"], (count, made)


def test_waiters_sleep_at_once_when_the_world_spans_hosts():
    """backends/hybrid.py connects the shared-memory transport of a world spread over hosts with
    blocking_waits(tuning): no spin or yield phase (a host mate is mostly in a TCP-bound phase), but
    values the user set (DISTCOMM_SHM_SPIN_US, ...) are kept."""
    from distcomm.backends.hybrid import blocking_waits
    from distcomm.transport.shm_wait import WaitPolicy

    default = WaitPolicy(2, Tuning.from_env({}))
    assert (default.spin_s, default.yield_s, default.shared_yield_s) != (0.0, 0.0, 0.0)
    policy = WaitPolicy(2, blocking_waits(Tuning.from_env({"DISTCOMM_THRESHOLD_ALLREDUCE_HIERARCHICAL_BYTES": "7"})))
    assert (policy.spin_s, policy.yield_s, policy.shared_yield_s) == (0.0, 0.0, 0.0)
    tuned = blocking_waits(Tuning.from_env({"DISTCOMM_THRESHOLD_ALLREDUCE_HIERARCHICAL_BYTES": "7"}))
    assert tuned.thresholds == {"allreduce_hierarchical_bytes": 7}  # the rest is left alone
    user = WaitPolicy(2, blocking_waits(Tuning.from_env({"DISTCOMM_SHM_SPIN_US": "5", "DISTCOMM_SHM_YIELD_US": "30"})))
    assert (user.spin_s, user.yield_s, user.shared_yield_s) == pytest.approx((5e-6, 30e-6, 0.0))
    assert user.spin_s > 0 and user.yield_s > 0
