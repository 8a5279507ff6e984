"""The latency paths for small synchronous all_reduces and barriers (backends/shm/latency.py).

* It takes the calls it should (counted through the engine's observer, backends/shm/observe.py) and gives the same
  bits as the general path (the same inputs through ``async_op=True``, which never takes it) and
  as the rank-order reference computed locally, for every dtype and op at sizes 1, 2, prime and
  its limit, at world sizes 2, 3, 4 and 8.
* It leaves everything else to the general path (it returns False and does nothing): messages
  over its limit, non-contiguous and bfloat16 buffers, PREMUL_SUM, a group with async
  work queued; and the results of those calls are right too.
* Errors through it name the operation, its sequence number and the peer, and mark the group's
  shared memory broken: a size mismatch, a timeout. (A killed peer is test_shm_failures.py's
  test_dead_peer_fails_fast_naming_it, whose all_reduce takes this path.)
* A barrier through it holds every rank until the last arrives, shares rounds with all_reduces and
  with the general path's barrier, and a barrier met by another collective names both sides.

Tiers: the fast tier (``pytest -m "not slow"``) keeps the mixed rounds here (both paths in one
round), and test_differential's fast world compares what this path gives with torch: its small
synchronous all_reduces take it (test_shm_variants_ran checks that they did). The rest is slow: the
result tables (every dtype and op, torch tensors: each rank imports torch), the declines (torch
again), the errors (the timeout makes a rank sleep it out) and the barriers.
"""

from __future__ import annotations

import pytest

from harness import run_world

SIZES = (1, 2, 7)


def _cases(np):
    from distcomm import ReduceOp

    floats = ("float32", "float64", "float16", "complex64")
    ints = ("int32", "int64", "uint8")
    for dtype in floats + ints + ("bool",):
        ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PRODUCT]
        if dtype in floats:
            ops.append(ReduceOp.AVG)
        if dtype.startswith("complex"):
            ops = [ReduceOp.SUM, ReduceOp.AVG]
        if dtype in ints or dtype == "bool":
            ops += [ReduceOp.MIN, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
        for op in ops:
            for count in SIZES:
                yield dtype, op, count


def _input(np, dtype: str, count: int, rank: int, salt: int):
    rng = np.random.default_rng(1000 * salt + rank)
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    if dtype.startswith("complex"):
        return (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dtype)
    if dtype.startswith(("int", "uint")):
        return rng.integers(0, 100, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def _reference(np, dtype: str, op, count: int, world: int, salt: int):
    """((x0 ⊕ x1) ⊕ x2) ... with the library's kernels, every rank's input made here."""
    from distcomm.dtypes import from_numpy
    from distcomm.reduction import finish, reducer

    dt = from_numpy(np.dtype(dtype))
    xs = [_input(np, dtype, count, q, salt) for q in range(world)]
    acc = xs[0].copy()
    for x in xs[1:]:
        reducer(op, dt)(acc, x)
    finish(op, acc, world, dt)
    return acc


_GENERAL_ALL_REDUCE = ("allreduce_direct", "allreduce_slices", "allreduce_readv", "reduce_direct")


def _count_taken(pg, latency="latency_all_reduce", general=_GENERAL_ALL_REDUCE):
    """Observe which path runs each all_reduce (or, with the barrier's names, each barrier) from
    now on, through the shared-memory engine's observer (backends/shm/observe.py): a list with one
    entry per call, True where the latency path took it, False where the general path ran it."""
    from distcomm.backends.shm import observe

    taken = []

    def observer(name):
        if name == latency:
            taken.append(True)
        elif name in general:
            taken.append(False)

    observe.set_observer(observer)
    return taken


def results_body(rank, world):
    import numpy as np

    import distcomm as dist
    from distcomm import world as dist_world

    dist.init_process_group(None)
    dist.all_reduce(np.ones(1))  # the first call sets up the group's shared memory
    pg = dist_world.default_pg
    dist.all_reduce(np.ones(1))  # ... and the second finds the latency path
    taken = _count_taken(pg)
    limit = min(pg.collectives.direct_limit(world), pg.collectives.transport.group_shm(pg.group_id).slot_bytes)
    failures = []
    cases = list(_cases(np)) + [("float32", dist.ReduceOp.SUM, limit // 4), ("uint8", dist.ReduceOp.MAX, limit)]
    for salt, (dtype, op, count) in enumerate(cases):
        fast = _input(np, dtype, count, rank, salt)
        general = fast.copy()
        dist.all_reduce(fast, op=op)
        dist.all_reduce(general, op=op, async_op=True).wait()
        expected = _reference(np, dtype, op, count, world, salt)
        for name, got in (("latency path", fast), ("general path", general)):
            if got.tobytes() != expected.tobytes():
                failures.append(f"{name} {dtype} {op!r} count {count}: {got[:4]} != {expected[:4]}")
    assert failures == [], failures[:5]
    # each synchronous call through the latency path, each async one through the general path
    assert taken == [True, False] * len(cases), f"the latency path declined {taken[::2].count(False)} calls"

    # torch tensors take it too, requires_grad or not (the result lands in the tensor's memory)
    import torch

    t = torch.arange(5, dtype=torch.float32) * (rank + 1)
    g = torch.ones(3, requires_grad=True)
    dist.all_reduce(t)
    dist.all_reduce(g)
    assert t.tolist() == [float(i * world * (world + 1) // 2) for i in range(5)]
    assert g.tolist() == [float(world)] * 3
    assert taken[-2:] == [True, True]
    # the same tensor call after call (its numpy view is reused), then changed in place
    same = torch.zeros(4)
    for i in range(3):
        same.fill_(rank + i)
        dist.all_reduce(same)
        assert same.tolist() == [float(sum(range(world)) + i * world)] * 4
    same.resize_(2)  # fewer elements at the same address
    same.fill_(1.0)
    dist.all_reduce(same)
    assert same.tolist() == [float(world)] * 2
    other = torch.full((3,), float(rank))
    same.set_(other)  # other memory
    dist.all_reduce(same)
    assert same.tolist() == other.tolist() == [float(sum(range(world)))] * 3
    assert taken[-5:] == [True] * 5
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_latency_path_results_match_reference_and_general_path(world):
    run_world(results_body, world, timeout=150)


def declines_body(rank, world):
    import numpy as np
    import torch

    import distcomm as dist
    from distcomm import world as dist_world

    dist.init_process_group(None)
    dist.barrier()
    pg = dist_world.default_pg
    dist.all_reduce(np.ones(1))
    taken = _count_taken(pg)
    limit = min(pg.collectives.direct_limit(world), pg.collectives.transport.group_shm(pg.group_id).slot_bytes)
    big = np.full(limit // 8 + 1, float(rank))  # one element over the limit
    strided = (np.arange(10.0) * (rank + 1))[::2]
    bf16 = torch.ones(4, dtype=torch.bfloat16)
    premul = np.ones(2)
    empty = np.ones(0)
    dist.all_reduce(big)
    dist.all_reduce(strided)
    dist.all_reduce(bf16)
    dist.all_reduce(premul, op=dist._make_nccl_premul_sum(2.0))
    dist.all_reduce(empty)
    assert taken == [False] * 5, taken
    # a busy group (here: this thread holds it, as a running async op would) is declined at once
    assert pg.executor.enter_inline()
    try:
        assert pg.fast_all_reduce(np.ones(2), dist.ReduceOp.SUM) is False
    finally:
        pg.executor.leave_inline()
    # async work queued: a synchronous call after it runs after it (on the general path, unless the
    # work has finished by then)
    queued = np.ones(1000)
    work = dist.all_reduce(queued, async_op=True)
    after = np.ones(2)
    dist.all_reduce(after)
    work.wait()
    assert (big == sum(range(world))).all()
    assert strided.tolist() == [2.0 * i * world * (world + 1) // 2 for i in range(5)]
    assert bf16.tolist() == [float(world)] * 4
    assert premul.tolist() == [2.0 * world] * 2
    assert (queued == world).all() and (after == world).all()
    dist.destroy_process_group()


@pytest.mark.slow
def test_latency_path_declines_what_it_does_not_handle():
    run_world(declines_body, 3, timeout=90)


def mismatch_body(rank, world):
    import numpy as np

    import distcomm as dist

    dist.init_process_group(None)
    dist.barrier()
    dist.all_reduce(np.ones(2))
    try:
        dist.all_reduce(np.ones(2 if rank == 0 else 3))
    except RuntimeError as exc:
        message = str(exc)
    else:
        return "no error"
    try:
        dist.all_reduce(np.ones(2))
    except RuntimeError as exc:
        return message, str(exc)
    return message, "no error after"


@pytest.mark.slow
def test_latency_path_mismatch_names_the_peer_and_breaks_the_group():
    results = run_world(mismatch_body, 2, timeout=60)
    for rank, (message, after) in enumerate(results):
        assert "all_reduce #3" in message, message
        mine, theirs = (16, 24) if rank == 0 else (24, 16)  # 2 or 3 float64
        assert (f"in all_reduce #3 this rank passed {mine} bytes but rank {1 - rank} passed {theirs} bytes; "
                "every rank of the group must pass the same size") in message, message
        assert "unusable after an earlier failure" in after, after


def timeout_body(rank, world):
    import time
    from datetime import timedelta

    import numpy as np

    import distcomm as dist

    dist.init_process_group(None, timeout=timedelta(seconds=2))
    dist.barrier()
    dist.all_reduce(np.ones(2))
    if rank == 1:
        time.sleep(6)  # alive (not a lost peer), just absent from the call
        return "stayed away"
    try:
        dist.all_reduce(np.ones(2))
    except dist.DistTimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_latency_path_timeout_names_the_missing_rank():
    results = run_world(timeout_body, 2, timeout=60)
    assert results[1] == "stayed away"
    assert "rank 1" in results[0] and "all_reduce #3" in results[0], results[0]


def mixed_paths_body(rank, world):
    import numpy as np

    import distcomm as dist
    from distcomm import world as dist_world

    dist.init_process_group(None)
    dist.all_reduce(np.ones(1))
    dist.all_reduce(np.ones(1))
    taken = _count_taken(dist_world.default_pg)
    for i in range(12):
        values = np.arange(5.0) * (rank + 1) + i
        # some ranks in each call take the latency path (contiguous), the others the general path
        # (a strided view): both sides of one round must speak the same protocol
        if (i + rank) % 2:
            backing = np.zeros(10)
            data = backing[::2]
            data[...] = values
        else:
            data = values
        dist.all_reduce(data)
        expected = np.arange(5.0) * sum(range(1, world + 1)) + i * world
        assert data.tolist() == expected.tolist(), (i, data, expected)
    assert taken == [(i + rank) % 2 == 0 for i in range(12)], taken


def test_latency_and_general_paths_meet_in_one_round():
    run_world(mixed_paths_body, 3, timeout=60)


def barrier_body(rank, world):
    import time

    import numpy as np

    import distcomm as dist
    from distcomm import world as dist_world

    dist.init_process_group(None)
    dist.barrier()  # sets up the group's shared memory
    pg = dist_world.default_pg
    inner = pg.fast_barrier  # installs the latency paths on first use
    dist.barrier()
    assert pg.fast_barrier is not inner
    taken = _count_taken(pg, "latency_barrier", ("barrier_slots",))
    # a barrier holds everyone until the last arrives (here: rank 0, late, so the others sleep)
    if rank == 0:
        time.sleep(0.3)
    entered = np.array([time.time()])
    dist.barrier()
    left = np.array([time.time()])
    # barriers between all_reduces, on both paths
    for i in range(5):
        x = np.full(3, float(rank + i))
        dist.all_reduce(x)
        dist.barrier()
        assert x.tolist() == [float(sum(range(world)) + i * world)] * 3
    dist.barrier(async_op=True).wait()  # the general path, same rounds
    dist.barrier()
    assert taken == [True] * 6 + [False, True], taken
    # nobody left the late barrier before rank 0 entered it (one host: one clock)
    entries, exits = [np.zeros(1) for _ in range(world)], [np.zeros(1) for _ in range(world)]
    dist.all_gather(entries, entered)
    dist.all_gather(exits, left)
    assert min(e[0] for e in exits) >= entries[0][0], (entries, exits)
    dist.destroy_process_group()


@pytest.mark.slow
def test_barrier_latency_path_holds_everyone_and_shares_rounds():
    run_world(barrier_body, 3, timeout=60)


def barrier_mismatch_body(rank, world):
    import numpy as np

    import distcomm as dist

    dist.init_process_group(None)
    dist.barrier()
    dist.barrier()
    try:
        if rank == 0:
            dist.barrier()
        else:
            dist.all_reduce(np.ones(2))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_barrier_latency_path_mismatch_names_the_peer():
    results = run_world(barrier_mismatch_body, 2, timeout=60)
    assert "barrier #3" in results[0] and "rank 1" in results[0], results[0]
    assert "all_reduce #3" in results[1] and "rank 0" in results[1], results[1]
