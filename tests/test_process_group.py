"""ProcessGroup as a seam of its own: torch c10d's buffer-level methods on a group built around an
Engine, with no global world (no init_process_group), as a torch backend adapter uses it.

Each rank is a thread with an in-process transport (GenericEngine over InprocTransport); results
are compared with the naive rank-order reference computed here. Also: the public functions accept
such a group, a third-party Engine registered by name runs them, and a Transport that does not
inherit from Transport (duck-typed) is still taken.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import pytest

import distcomm as dist
from distcomm.backends.engine import Engine, FastPath, GroupCollectives, GroupSpec
from distcomm.backends.generic import GenericCollectives, GenericEngine
from distcomm.buffers import as_buffer
from distcomm.process_group import ProcessGroup
from distcomm.transport.base import ANY_SOURCE, Transport
from distcomm.transport.inproc import InprocTransport
from distcomm.types import RedOpType

TIMEOUT = timedelta(seconds=20)


def run_groups(n: int, body, ranks=None):
    """``body(pg)`` on n threads, each with a ProcessGroup over its own end of an in-process world;
    results by rank; the first exception is re-raised."""
    transports = InprocTransport.create_world(n)
    results: list = [None] * n
    errors: list = []

    def play(r: int) -> None:
        pg = ProcessGroup(7, "standalone", range(n), r, GenericEngine(transports[r]), "gloo", TIMEOUT)
        try:
            results[r] = body(pg)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            transports[r].close()
        finally:
            pg.close()

    threads = [threading.Thread(target=play, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def data(rank: int, count: int) -> np.ndarray:
    return (np.arange(count, dtype=np.float64) + 1) * (rank + 1)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_collective_methods_without_a_world(n):
    count = 7

    def body(pg: ProcessGroup):
        r = pg.rank()
        out = {}
        a = data(r, count)
        assert pg.allreduce(as_buffer(a), RedOpType.SUM) is None
        out["allreduce"] = a
        b = data(r, count)
        pg.broadcast(as_buffer(b), n - 1)
        out["broadcast"] = b
        c = data(r, count)
        pg.reduce(as_buffer(c), RedOpType.MAX, 0)
        out["reduce"] = c
        gathered = [np.zeros(count) for _ in range(n)]
        pg.allgather([as_buffer(g) for g in gathered], as_buffer(data(r, count)))
        out["allgather"] = gathered
        flat = np.zeros(count * n)
        pg.allgather_into_tensor(as_buffer(flat), as_buffer(data(r, count)))
        out["allgather_into_tensor"] = flat
        blocks = [np.zeros(count) for _ in range(n)] if r == 0 else None
        pg.gather(None if blocks is None else [as_buffer(g) for g in blocks], as_buffer(data(r, count)), 0)
        out["gather"] = blocks
        piece = np.zeros(count)
        pieces = [as_buffer(data(q, count) + 100 * r) for q in range(n)] if r == 0 else None
        pg.scatter(as_buffer(piece), pieces, 0)
        out["scatter"] = piece
        rs = np.zeros(count)
        pg.reduce_scatter(as_buffer(rs), [as_buffer(data(r, count) + q) for q in range(n)], RedOpType.SUM)
        out["reduce_scatter"] = rs
        rst = np.zeros(count)
        pg.reduce_scatter_tensor(as_buffer(rst), as_buffer(np.concatenate([data(r, count) + q for q in range(n)])),
                                 RedOpType.SUM)
        out["reduce_scatter_tensor"] = rst
        received = [np.zeros(q + 1) for q in range(n)]
        pg.alltoall([as_buffer(x) for x in received], [as_buffer(np.full(r + 1, 10.0 * r + q)) for q in range(n)])
        out["alltoall"] = received
        single = np.zeros(n)
        pg.alltoall_base(as_buffer(single), as_buffer(np.arange(n) + 10.0 * r), [1] * n, [1] * n)
        out["alltoall_base"] = single
        work = pg.allreduce(as_buffer(np.ones(3)), RedOpType.SUM, async_op=True, result="value")
        work.wait()
        out["async_result"] = work.result()
        pg.barrier()
        assert pg.seq == 13  # one sequence number per call
        return out

    results = run_groups(n, body)
    total = sum(data(q, count) for q in range(n))
    for r, out in enumerate(results):
        np.testing.assert_array_equal(out["allreduce"], total)
        np.testing.assert_array_equal(out["broadcast"], data(n - 1, count))
        np.testing.assert_array_equal(out["reduce"], data(n - 1, count) if r == 0 else data(r, count))
        for q in range(n):
            np.testing.assert_array_equal(out["allgather"][q], data(q, count))
        np.testing.assert_array_equal(out["allgather_into_tensor"], np.concatenate([data(q, count) for q in range(n)]))
        if r == 0:
            for q in range(n):
                np.testing.assert_array_equal(out["gather"][q], data(q, count))
        np.testing.assert_array_equal(out["scatter"], data(r, count))
        np.testing.assert_array_equal(out["reduce_scatter"], total + n * r)
        np.testing.assert_array_equal(out["reduce_scatter_tensor"], total + n * r)
        for q in range(n):
            np.testing.assert_array_equal(out["alltoall"][q], np.full(q + 1, 10.0 * q + r))
        np.testing.assert_array_equal(out["alltoall_base"], [10.0 * q + r for q in range(n)])
        assert out["async_result"] == "value"


def test_point_to_point_methods_and_any_source():
    def body(pg: ProcessGroup):
        r = pg.rank()
        if r == 0:
            got = []
            for _ in range(2):
                buf = np.zeros(2)
                work = pg.recv(as_buffer(buf), ANY_SOURCE, tag=3)
                work.wait()
                got.append((work.source_rank(), buf.tolist()))
            return sorted(got)
        pg.send(as_buffer(np.full(2, float(r))), 0, tag=3).wait()
        return None

    assert run_groups(3, body)[0] == [(1, [1.0, 1.0]), (2, [2.0, 2.0])]


def test_public_functions_take_a_standalone_group():
    """dist.all_reduce(t, group=pg) needs no default group when it is given a ProcessGroup."""
    assert not dist.is_initialized()

    def body(pg):
        t = np.full(3, pg.rank() + 1.0)
        dist.all_reduce(t, group=pg)
        dist.barrier(group=pg)
        objs = [None, None]
        dist.all_gather_object(objs, {"rank": pg.rank()}, group=pg)
        return t.tolist(), objs

    for t, objs in run_groups(2, body):
        assert t == [3.0, 3.0, 3.0]
        assert objs == [{"rank": 0}, {"rank": 1}]


def test_engine_interface_is_abstract():
    with pytest.raises(TypeError):
        Engine()  # collectives() must be implemented
    with pytest.raises(TypeError):
        GroupCollectives()


class _Reversed(GenericCollectives):
    """A third-party GroupCollectives: all_reduce through the generic one, counting its calls."""

    calls = 0

    def all_reduce(self, ch, flat, dtype, op):
        type(self).calls += 1
        super().all_reduce(ch, flat, dtype, op)


class _CountingEngine(Engine):
    def __init__(self):
        self.transport = InprocTransport.create_world(1)[0]
        self.released: list[int] = []

    def collectives(self, group: GroupSpec) -> GroupCollectives:
        assert group.ranks == [0] and group.rank == 0
        return _Reversed()

    def release_group(self, group_id: int) -> None:
        self.released.append(group_id)


def test_register_backend_returning_an_engine():
    engine = _CountingEngine()
    dist.Backend.register_backend("counting_engine", lambda store, rank, size, timeout: engine)
    dist.init_process_group("counting_engine", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = np.arange(4.0)
        dist.all_reduce(t)
        np.testing.assert_array_equal(t, np.arange(4.0))
        assert _Reversed.calls == 1
    finally:
        dist.destroy_process_group()


class _LateFastPathEngine(_CountingEngine):
    """An engine whose fast path exists from the group's second call on, counting the askings."""

    def __init__(self):
        super().__init__()
        self.asked = 0
        self.fast_calls = 0

    def fast_path(self, pg):
        self.asked += 1
        if self.asked == 1:
            return None  # not yet: as the shared-memory engine before the group's first collective

        def all_reduce(tensor, op):
            self.fast_calls += 1
            return True
        return FastPath(all_reduce, None)


def test_fast_path_is_asked_for_until_given_then_never_again():
    engine = _LateFastPathEngine()
    dist.Backend.register_backend("late_fast_path", lambda store, rank, size, timeout: engine)
    dist.init_process_group("late_fast_path", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        kept = pg.fast_all_reduce  # bound before the engine had a fast path
        t = np.arange(4.0)
        assert not kept(t, dist.ReduceOp.SUM)  # not yet: the caller's general path runs
        for _ in range(5):
            assert kept(t, dist.ReduceOp.SUM) and pg.fast_all_reduce(t, dist.ReduceOp.SUM)
        assert not pg.fast_barrier()  # the engine's FastPath has no barrier
        assert engine.asked == 2 and engine.fast_calls == 10
    finally:
        dist.destroy_process_group()


def test_register_backend_refuses_what_is_neither():
    dist.Backend.register_backend("returns_nothing", lambda store, rank, size, timeout: object())
    with pytest.raises(TypeError, match="must return a distcomm.backends.engine.Engine or a"):
        dist.init_process_group("returns_nothing", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


def test_duck_typed_transport_counts_as_one():
    class Duck:
        def isend(self, dst, data, key, signature=0): ...
        def irecv(self, src, out, key, signature=0): ...
        def close(self): ...

    class NotADuck:
        def isend(self, dst, data, key, signature=0): ...

    assert isinstance(Duck(), Transport)
    assert not isinstance(NotADuck(), Transport)
