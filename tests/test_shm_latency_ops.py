"""The latency paths of every collective but all_reduce and barrier (backends/shm/latency.py):
broadcast, reduce, all_gather (list and tensor), gather, scatter, reduce_scatter (list and
tensor), all_to_all (list) and all_to_all_single.

* Each small synchronous call takes its path (counted through the engine's observer), and gives
  the same bytes as the general path (the same call with ``async_op=True``, which never takes it)
  and as the naive reference of ``_algorithms/reference.py`` run in the same world on the same
  inputs (through ``ProcessGroup.run``, over the group's point-to-point channel): at world sizes
  1 (no latency path: a group of one), 2, 3, 4, 5 and 8, sizes 0, 1 and 7 elements (and uneven
  all_to_all splits), the first and the last rank as root, numpy arrays and torch tensors, list
  outputs written straight into each output.
* The latency path of one rank and the general path of another meet in one round (some ranks
  call synchronously, the others asynchronously), for every op: both speak the same rounds.
* Larger messages (past the one-round limits) and non-plain reduce ops are left to the general
  path, with right results; a mismatch through a latency path names the peer.

Tiers: all slow (worlds of up to 8 ranks; the mixed world of 3 takes seconds). In the fast tier
only test_differential's world (its small synchronous calls, compared with torch) can reach them.
"""

from __future__ import annotations

import pytest

from harness import run_world

COUNTS = (0, 1, 7)


def _observe():
    """Names of the latency paths taken from now on (one entry per call they take)."""
    from distcomm.backends.shm import observe

    taken: list[str] = []
    observe.set_observer(lambda name: taken.append(name) if name.startswith("latency_") else None)
    return taken


def _data(np, dtype: str, count: int, rank: int, salt: int):
    rng = np.random.default_rng(7919 * salt + rank)
    if dtype.startswith(("int", "uint")):
        return rng.integers(-50 if dtype.startswith("int") else 0, 100, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def _reference(pg, op: str, fn, *args):
    """Run reference ``fn(ch, *args)`` as this group's next collective (the general machinery,
    point-to-point: nothing of the latency paths or the shared-memory algorithms)."""
    from distcomm.signatures import signature

    pg.run(op, signature(op), lambda ch: fn(ch, *args))


def _cases(world: int, counts=COUNTS):
    """(op, dtype, count, root, reduce op name) for every call the body makes."""
    for count in counts:
        for dtype in ("float32", "int64"):
            for root in sorted({0, world - 1}):
                yield "broadcast", dtype, count, root, None
                yield "gather", dtype, count, root, None
                yield "scatter", dtype, count, root, None
                for red in ("SUM", "MAX"):
                    yield "reduce", dtype, count, root, red
            yield "all_gather", dtype, count, None, None
            yield "all_gather_into_tensor", dtype, count, None, None
            yield "all_to_all", dtype, count, None, None
            yield "all_to_all_single", dtype, count, None, None
            for red in ("SUM", "MIN"):
                yield "reduce_scatter", dtype, count, None, red
                yield "reduce_scatter_tensor", dtype, count, None, red
        yield "reduce", "float64", count, world - 1, "AVG"
        yield "reduce_scatter_tensor", "float64", count, None, "AVG"


def _run_case(dist, np, pg, make, case, salt: int, rank: int, world: int, mode: str):
    """One call of ``case`` with arrays from ``make`` (numpy or torch), in ``mode`` "sync" or
    "async" (the general path), and the reference on the same inputs: (result, reference) as bytes."""
    from distcomm._algorithms import reference
    from distcomm.dtypes import from_numpy
    from distcomm.reduction import finish, reducer

    op, dtype, count, root, red = case
    async_op = mode == "async"
    x = _data(np, dtype, count, rank, salt)
    every = [_data(np, dtype, count, q, salt) for q in range(world)]
    rop = getattr(dist.ReduceOp, red) if red else None
    dt = from_numpy(np.dtype(dtype))
    to_np = (lambda t: t.numpy()) if make is not np.asarray else (lambda a: a)

    def done(work):
        if work is not None:
            work.wait()

    def reducer_of():
        red_fn = reducer(rop, dt)
        return red_fn

    if op == "broadcast":
        buf = make(x.copy())
        done(dist.broadcast(buf, src=root, async_op=async_op))
        ref = x.copy()
        _reference(pg, "broadcast", reference.broadcast, ref, root)
        return to_np(buf).tobytes(), ref.tobytes()
    if op == "reduce":
        buf = make(x.copy())
        done(dist.reduce(buf, dst=root, op=rop, async_op=async_op))
        ref = x.copy()
        _reference(pg, "reduce", reference.reduce, ref, root, reducer_of())
        if rank == root:
            finish(rop, ref, world, dt)
        return to_np(buf).tobytes(), ref.tobytes()
    if op in ("all_gather", "gather"):
        outs = [make(np.zeros(count, dtype)) for _ in range(world)] if op == "all_gather" or rank == root else None
        if op == "all_gather":
            done(dist.all_gather(outs, make(x.copy()), async_op=async_op))
        else:
            done(dist.gather(make(x.copy()), outs, dst=root, async_op=async_op))
        flat = np.zeros(count * world, dtype)
        if op == "all_gather":
            flat[rank * count:(rank + 1) * count] = x
            _reference(pg, "all_gather", reference.allgather, flat, count)
        else:
            _reference(pg, "gather", reference.gather, x.copy(), flat if rank == root else None, root)
        got = b"" if outs is None else b"".join(to_np(o).tobytes() for o in outs)
        return got, b"" if outs is None else flat.tobytes()
    if op == "all_gather_into_tensor":
        out = make(np.zeros(count * world, dtype))
        done(dist.all_gather_into_tensor(out, make(x.copy()), async_op=async_op))
        flat = np.zeros(count * world, dtype)
        flat[rank * count:(rank + 1) * count] = x
        _reference(pg, "all_gather", reference.allgather, flat, count)
        return to_np(out).tobytes(), flat.tobytes()
    if op == "scatter":
        ins = [make(every[q] + q) for q in range(world)] if rank == root else None
        out = make(np.zeros(count, dtype))
        done(dist.scatter(out, ins, src=root, async_op=async_op))
        ref = np.zeros(count, dtype)
        chunks = np.concatenate([every[q] + q for q in range(world)]) if rank == root else None
        _reference(pg, "scatter", reference.scatter, chunks, ref, root)
        return to_np(out).tobytes(), ref.tobytes()
    if op in ("reduce_scatter", "reduce_scatter_tensor"):
        blocks = [_data(np, dtype, count, rank, salt * 31 + q) for q in range(world)]
        out = make(np.zeros(count, dtype))
        if op == "reduce_scatter":
            ins = [make(b.copy()) for b in blocks]
            done(dist.reduce_scatter(out, ins, op=rop, async_op=async_op))
            untouched = all(to_np(i).tobytes() == b.tobytes() for i, b in zip(ins, blocks))
        else:
            inp = make(np.concatenate(blocks))
            done(dist.reduce_scatter_tensor(out, inp, op=rop, async_op=async_op))
            untouched = to_np(inp).tobytes() == np.concatenate(blocks).tobytes()
        assert untouched, f"{op} changed its input"
        ref = np.zeros(count, dtype)
        _reference(pg, "reduce_scatter", reference.reduce_scatter, np.concatenate(blocks), ref, [count] * world,
                   reducer_of())
        finish(rop, ref, world, dt)
        return to_np(out).tobytes(), ref.tobytes()
    if op in ("all_to_all", "all_to_all_single"):
        # uneven: rank r sends rank q (count + r + q) % 3 + count elements
        send_counts = [(count + rank + q) % 3 + count for q in range(world)]
        recv_counts = [(count + q + rank) % 3 + count for q in range(world)]
        send = _data(np, dtype, sum(send_counts), rank, salt)
        if op == "all_to_all":
            pieces = np.split(send, np.cumsum(send_counts)[:-1])
            outs = [make(np.zeros(c, dtype)) for c in recv_counts]
            done(dist.all_to_all(outs, [make(p.copy()) for p in pieces], async_op=async_op))
            got = b"".join(to_np(o).tobytes() for o in outs)
        else:
            out = make(np.zeros(sum(recv_counts), dtype))
            done(dist.all_to_all_single(out, make(send.copy()), recv_counts, send_counts, async_op=async_op))
            got = to_np(out).tobytes()
        ref = np.zeros(sum(recv_counts), dtype)
        _reference(pg, "all_to_all", reference.alltoallv, send, send_counts, ref, recv_counts)
        return got, ref.tobytes()
    raise AssertionError(op)


def _path_name(op: str) -> str:
    return "latency_" + op


def results_body(rank, world, use_torch, counts=COUNTS):
    import numpy as np

    import distcomm as dist
    from distcomm import world as dist_world

    dist.init_process_group(None)
    dist.all_reduce(np.ones(1))  # the first call sets up the group's shared memory
    pg = dist_world.default_pg
    make = np.asarray
    if use_torch:
        import torch

        make = torch.from_numpy
    taken = _observe()
    failures = []
    expected_taken = []
    for salt, case in enumerate(_cases(world, counts)):
        for mode in ("sync", "async"):
            got, ref = _run_case(dist, np, pg, make, case, salt, rank, world, mode)
            if got != ref:
                failures.append(f"{mode} {case}: {np.frombuffer(got, case[1])[:6]} != {np.frombuffer(ref, case[1])[:6]}")
        if world > 1:
            expected_taken.append(_path_name(case[0]))
    assert failures == [], failures[:6]
    # every synchronous call through its latency path, every async one through the general path
    assert taken == expected_taken, [c for c in expected_taken if c not in taken][:5] or taken[:10]
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_latency_paths_match_reference_and_general_path(world):
    run_world(results_body, world, args=(False,), timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_latency_paths_with_torch_tensors(world):
    run_world(results_body, world, args=(True,), timeout=300)


# around the size from which the C round writes a slot with streaming stores (_shm_round.c's
# STREAM_FROM, 32 KiB): just under it, at it, and past it by a piece of a line (float32; int64's
# twice as large), where writes end in a tail (and a world-3 float32 reduce_scatter's start off a
# cache line)
STREAMED = (8191, 8192, 8193, 12289)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_latency_paths_with_writes_past_the_streaming_size(world):
    run_world(results_body, world, args=(False, STREAMED), timeout=400)


def streamed_body(rank, world):
    """Which ranks stream their writes into the slot (shm_group.rounds_streamed_in_c), call by call,
    and the results: the senders of broadcast, scatter and gather, every rank of all_gather and of an
    even all_to_all_single, a reduce's non-roots but not its root (it reads its own slot back), and
    of the direct all_reduce the first rank only (the others read their own slot back)."""
    import numpy as np

    import distcomm as dist
    from distcomm.transport.shm_group import rounds_streamed_in_c

    dist.init_process_group(None)
    dist.all_reduce(np.ones(1))
    n = 12289  # float32: 48 KiB per rank

    def data(salt, q=rank):
        return np.random.default_rng(1000 * salt + q).standard_normal(n).astype(np.float32)

    def total(salt):
        acc = data(salt, 0)
        for q in range(1, world):
            acc = acc + data(salt, q)
        return acc

    deltas, failures = [], []

    def streamed(call):
        before = rounds_streamed_in_c()
        call()
        deltas.append(rounds_streamed_in_c() - before)

    def expect(what, got, want):
        if not np.array_equal(got, want):
            failures.append(what)

    buf = data(1)
    streamed(lambda: dist.broadcast(buf, 0))
    expect("broadcast", buf, data(1, 0))
    buf = data(2)
    streamed(lambda: dist.reduce(buf, 0))
    if rank == 0:
        expect("reduce", buf, total(2))
    outs = [np.zeros(n, np.float32) for _ in range(world)]
    streamed(lambda: dist.all_gather(outs, data(3)))
    for q in range(world):
        expect(f"all_gather {q}", outs[q], data(3, q))
    inp = np.concatenate([data(4) + 10 * q for q in range(world)])
    out = np.zeros(world * n, np.float32)
    streamed(lambda: dist.all_to_all_single(out, inp))
    expect("all_to_all_single", out, np.concatenate([data(4, q) + 10 * rank for q in range(world)]))
    gathered = [np.zeros(n, np.float32) for _ in range(world)] if rank == 0 else None
    streamed(lambda: dist.gather(data(5), gathered, 0))
    if rank == 0:
        for q in range(world):
            expect(f"gather {q}", gathered[q], data(5, q))
    got = np.zeros(n, np.float32)
    streamed(lambda: dist.scatter(got, [data(6, 0) + q for q in range(world)] if rank == 0 else None, 0))
    expect("scatter", got, data(6, 0) + rank)
    buf = data(7)
    streamed(lambda: dist.all_reduce(buf))
    expect("all_reduce", buf, total(7))

    everyone = np.zeros((world, len(deltas)), np.int64)
    dist.all_gather_into_tensor(everyone.reshape(-1), np.array(deltas, np.int64))
    dist.destroy_process_group()
    assert failures == [], failures
    senders_but_root = [0] + [1] * (world - 1)
    root_only = [1] + [0] * (world - 1)
    expected = [root_only, senders_but_root, [1] * world, [1] * world, senders_but_root, root_only, root_only]
    assert everyone.T.tolist() == expected, everyone.T.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_rounds_that_stream_their_writes_and_their_results(world):
    from distcomm.transport import shm_group

    if shm_group.C_UNAVAILABLE is not None:
        pytest.skip(shm_group.C_UNAVAILABLE)
    run_world(streamed_body, world, timeout=300)


def kept_plans_body(rank, world):
    """The same arrays call after call (the latency paths keep their rounds' plans for them), with
    new contents each time, two inputs and two outputs in every pairing, fresh arrays every few calls
    (more than the paths keep), and torch tensors whose storage is resized between calls (new
    memory, same object)."""
    import numpy as np
    import torch

    import distcomm as dist

    dist.init_process_group(None)
    dist.all_reduce(np.ones(1))
    taken = _observe()
    count = 3
    bigs = [np.zeros(count * world, np.float32) for _ in range(2)]
    smalls = [np.zeros(count, np.float32) for _ in range(2)]
    tensors = (torch.zeros(count * world), torch.zeros(count))
    calls = 0
    for step in range(40):
        if step % 5 == 4:
            bigs[step % 2] = np.zeros(count * world, np.float32)
            smalls[step % 2] = np.zeros(count, np.float32)
        # every pairing of the two inputs with the two outputs comes back
        big, small = bigs[step % 2], smalls[(step // 2) % 2]
        if step % 7 == 6:  # the same tensors, their memory reallocated
            for t in tensors:
                nbytes = t.untyped_storage().nbytes()
                t.untyped_storage().resize_(0)
                t.untyped_storage().resize_(nbytes)
        tbig, tsmall = tensors
        every = [np.arange(count * world, dtype=np.float32) + 100 * q + step for q in range(world)]

        big[...] = every[rank]
        dist.reduce_scatter_tensor(small, big)
        assert small.tolist() == sum(every)[rank * count:(rank + 1) * count].tolist(), (step, small)
        small[...] = every[rank][:count]
        dist.all_gather_into_tensor(big, small)
        assert big.tolist() == np.concatenate([e[:count] for e in every]).tolist(), (step, big)
        big[...] = every[rank]
        out = np.zeros_like(big) if step % 3 == 0 else small.repeat(world)
        dist.all_to_all_single(out, big)
        assert out.tolist() == np.concatenate([e[rank * count:(rank + 1) * count] for e in every]).tolist(), step
        tbig.copy_(torch.from_numpy(every[rank]))
        dist.reduce_scatter_tensor(tsmall, tbig)
        assert tsmall.tolist() == sum(every)[rank * count:(rank + 1) * count].tolist(), (step, tsmall)
        calls += 4
    assert len(taken) == calls and all(name.startswith("latency_") for name in taken), taken[:8]
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_latency_paths_keep_plans_only_for_the_same_arrays(world):
    run_world(kept_plans_body, world, timeout=120)


def mixed_body(rank, world):
    """In each call some ranks take the latency path (synchronous) and the others the general
    path (async_op=True): both sides of every round speak the same protocol."""
    import numpy as np

    import distcomm as dist
    from distcomm import world as dist_world

    dist.init_process_group(None)
    dist.all_reduce(np.ones(1))
    pg = dist_world.default_pg
    taken = _observe()
    failures, expected = [], []
    cases = [c for c in _cases(world) if c[2] == 7 and c[1] == "float32"]
    for salt, case in enumerate(cases):
        for flip in (0, 1):
            mode = "sync" if (rank + flip) % 2 == 0 else "async"
            got, ref = _run_case(dist, np, pg, np.asarray, case, salt, rank, world, mode)
            if got != ref:
                failures.append(f"{mode} {case}")
            if mode == "sync":
                expected.append(_path_name(case[0]))
    assert failures == [], failures[:6]
    assert taken == expected, taken[:10]
    dist.destroy_process_group()


@pytest.mark.slow
def test_latency_and_general_paths_meet_in_one_round_for_every_op():
    run_world(mixed_body, 3, timeout=120)


def declines_body(rank, world):
    """What the latency paths leave to the general path: past their one-round limits, PREMUL_SUM;
    the results are right either way."""
    import numpy as np

    import distcomm as dist
    from distcomm import world as dist_world

    dist.init_process_group(None)
    dist.all_reduce(np.ones(1))
    pg = dist_world.default_pg
    slot = pg.transport.group_shm(pg.group_id).slot_bytes
    taken = _observe()
    big = np.full(slot // 8 + 1, float(rank))  # one element over a slot
    dist.broadcast(big, src=1)
    assert (big == 1.0).all()
    outs = [np.zeros_like(big) for _ in range(world)]
    dist.all_gather(outs, big)
    assert all((o == 1.0).all() for o in outs)
    premul = np.ones(3)
    dist.reduce(premul, dst=0, op=dist._make_nccl_premul_sum(2.0))
    if rank == 0:
        assert premul.tolist() == [2.0 * world] * 3
    out = np.zeros(slot // 8)  # each block over reduce_scatter's piece of a slot
    dist.reduce_scatter_tensor(out, np.ones(world * out.size))
    assert (out == world).all()
    assert taken == [], taken
    small = np.ones(2)
    dist.broadcast(small, src=0)
    assert taken == ["latency_broadcast"]
    dist.destroy_process_group()


@pytest.mark.slow
def test_latency_paths_decline_what_does_not_fit_one_round():
    run_world(declines_body, 2, timeout=120)


def mismatch_body(rank, world):
    import numpy as np

    import distcomm as dist

    dist.init_process_group(None)
    dist.all_reduce(np.ones(1))
    dist.broadcast(np.ones(2), src=0)
    taken = _observe()
    try:
        dist.all_gather_into_tensor(np.zeros(2 * (2 if rank == 0 else 3)), np.ones(2 if rank == 0 else 3))
    except RuntimeError as exc:
        message = str(exc)
    else:
        return "no error", taken
    try:
        dist.broadcast(np.ones(2), src=0)
    except RuntimeError as exc:
        return message, str(exc), taken
    return message, "no error after", taken


@pytest.mark.slow
def test_latency_path_mismatch_names_the_peer():
    results = run_world(mismatch_body, 2, timeout=60)
    for rank, (message, after, taken) in enumerate(results):
        assert taken == ["latency_all_gather_into_tensor"], taken
        assert "all_gather_into_tensor #3" in message, message
        mine, theirs = (16, 24) if rank == 0 else (24, 16)  # 2 or 3 float64
        assert (f"in all_gather_into_tensor #3 this rank passed {mine} bytes but rank {1 - rank} passed {theirs} "
                "bytes; every rank of the group must pass the same size") in message, message
        assert "unusable after an earlier failure" in after, after


def root_disagreement_body(rank, world, modes, big):
    """Every rooted op with ranks passing different roots: rank r believes rank ``r % 2`` is the
    root. Each rank calls synchronously (its latency path, when the message fits one round) or
    asynchronously (the general path), as ``modes`` says; ``big``: a message past one slot (the
    root check then has a round of its own). After each op a broadcast that agrees: the group still
    works, and each call completes even when it raises. A rank whose small rooted call in C returned
    before every peer's root was in (it defers those checks) gets the op's error from a later call
    on the group, once that one has completed; two barriers at the end make sure the checks are
    made (the first has every earlier round posted, the second checks them). Returns each op's
    errors on this rank, attributed by the op and sequence number they name."""
    import numpy as np

    import distcomm as dist
    from distcomm import world as dist_world

    dist.init_process_group(None)
    dist.all_reduce(np.ones(1))
    pg = dist_world.default_pg
    slot = pg.transport.group_shm(pg.group_id).slot_bytes
    count = slot // 4 + 1 if big else 7
    root = rank % 2
    mine = root == rank
    async_op = modes[rank] == "async"
    taken = _observe()
    ops = ("broadcast", "reduce", "gather", "scatter")
    errors: dict = {}

    def attempt(call) -> None:
        try:
            work = call()
            if work is not None:
                work.wait()
        except RuntimeError as exc:
            named = [op for op in ops if str(exc).startswith(f"{op} #")]
            errors.setdefault(named[0] if named else "other", []).append((type(exc).__name__, str(exc)))

    for op in ops:
        x = np.full(count, float(rank), dtype=np.float32)
        if op == "broadcast":
            attempt(lambda: dist.broadcast(x, src=root, async_op=async_op))
        elif op == "reduce":
            attempt(lambda: dist.reduce(x, dst=root, async_op=async_op))
        elif op == "gather":
            attempt(lambda: dist.gather(x, [np.zeros_like(x) for _ in range(world)] if mine else None, dst=root,
                                        async_op=async_op))
        else:
            attempt(lambda: dist.scatter(x, [np.full_like(x, q) for q in range(world)] if mine else None, src=root,
                                         async_op=async_op))
        after = np.full(2, float(rank))
        attempt(lambda: dist.broadcast(after, src=0))  # the group's memory is still usable
        assert after.tolist() == [0.0, 0.0], after  # completed, even when it raised an earlier op's error
    attempt(dist.barrier)
    attempt(dist.barrier)
    dist.destroy_process_group()
    return errors, taken


@pytest.mark.slow
@pytest.mark.parametrize("modes,big", [
    (("sync", "sync"), False),  # both on the latency path: the check rides in the op's one round
    (("sync", "async", "sync"), False),  # latency and general paths meet in that round
    (("sync", "async"), True),  # past one slot: the general path's root check round of its own
])
def test_root_disagreement_raises_on_every_rank(modes, big):
    world = len(modes)
    results = run_world(root_disagreement_body, world, args=(modes, big), timeout=120)
    seq = {"broadcast": 2, "reduce": 4, "gather": 6, "scatter": 8}  # each op, then a broadcast
    for rank, (errors, taken) in enumerate(results):
        assert set(errors) == set(seq), errors  # every op's, and none that names no op
        for op, raised in errors.items():
            assert len(raised) == 1, (rank, op, raised)  # from the op, or from a later call: once
            (kind, msg), = raised
            what = "src" if op in ("broadcast", "scatter") else "dst"
            assert kind == "CollectiveMismatchError", (rank, op, kind, msg)
            assert f"{op} #{seq[op]} on rank {rank}" in msg, msg
            assert f"called {op} with {what}={rank % 2} but rank" in msg, msg
            assert f"with {what}={1 - rank % 2}" in msg, msg
        on_latency_path = not big and modes[rank] == "sync"
        # each op's latency path (when taken), and every check broadcast's (small, synchronous)
        assert taken.count("latency_broadcast") == 4 + on_latency_path, taken
        others = ["latency_reduce", "latency_gather", "latency_scatter"] if on_latency_path else []
        assert [n for n in taken if n not in ("latency_broadcast", "latency_barrier")] == others, taken
