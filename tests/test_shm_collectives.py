"""Every collective on the "shm" engine and the default engine, against numpy, at world sizes 2-8.

Each rank computes every rank's input (deterministic per rank), runs the collectives, and checks
its own result against the reference semantics computed with numpy: reductions in rank order,
((x0 ⊕ x1) ⊕ x2) ..., which is what the shared-memory algorithms compute, so results are compared
bit for bit. ``DISTCOMM_SHM_SLOT_BYTES=4096`` makes small messages take many rounds (chunking,
slot reuse, uneven pieces) while staying fast; ``DISTCOMM_SHM_THRESHOLD_ALLREDUCE_DIRECT_BYTES=256`` sends
all but the smallest all_reduce through a bandwidth algorithm: through slots when single-copy
reads are off (``DISTCOMM_SHM_DIRECT=0``), with process_vm_readv from 2 KiB on
(``DISTCOMM_SHM_THRESHOLD_READV_BYTES=2048``). Also: async work, two groups on the
same ranks used at once, subgroups, object collectives, torch tensors with bfloat16, the default
slot size with messages of a few MiB, and the generic algorithms over the shared-memory rings
(``DISTCOMM_SHM_COLLECTIVES=0``).

Worlds are oversubscribed on this 2-core machine (up to 8 ranks): sizes stay small.

Tiers: the fast tier (``pytest -m "not slow"``) runs every collective on "shm" at world sizes 2
(slots only) and 3 (single-copy reads); the other worlds and engines, the all_to_all straddling the
single-copy threshold, the multi-MiB messages and the torch tensors (each rank imports torch) are
slow. The default engine meets torch in test_differential's fast world.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from harness import run_world

CHUNKY = {"DISTCOMM_SHM_SLOT_BYTES": "4096", "DISTCOMM_SHM_THRESHOLD_ALLREDUCE_DIRECT_BYTES": "256"}
# the same through the slot algorithms only (no single-copy reads), and with single-copy reads from 2 KiB
SLOTS = {**CHUNKY, "DISTCOMM_SHM_DIRECT": "0"}
READV = {**CHUNKY, "DISTCOMM_SHM_THRESHOLD_READV_BYTES": "2048", "DISTCOMM_SHM_THRESHOLD_ALLREDUCE_READV_BYTES": "2048"}


def _data(rank: int, n: int, dtype, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * salt + rank)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(-50 if dtype.kind == "i" else 0, 50, n).astype(dtype)
    return (rng.standard_normal(n) * 10).astype(dtype)


def _fold(parts, fn):
    acc = parts[0].copy()
    for x in parts[1:]:
        acc = fn(acc, x).astype(acc.dtype)
    return acc


def _check(name, got, want):
    if os.environ.get("DISTCOMM_SHM_COLLECTIVES") == "0" and got.dtype.kind == "f":
        # the generic algorithms reduce in another order than the reference: compare values
        if np.allclose(got, want, rtol=1e-5, atol=1e-4, equal_nan=True):
            return
    if not np.array_equal(got, want, equal_nan=got.dtype.kind == "f"):
        bad = np.flatnonzero(got != want)[:5]
        raise AssertionError(f"{name}: {bad.size and len(np.flatnonzero(got != want))} wrong elements, first at "
                             f"{bad.tolist()}: got {got[bad].tolist()}, want {want[bad].tolist()}")


def _reductions(dist, rank, world, group, members, salt):
    """all_reduce and reduce over a few dtypes, ops and sizes; ``members``: global ranks of group."""
    grank = members.index(rank)
    ReduceOp = dist.ReduceOp
    cases = [
        (np.float32, ReduceOp.SUM, np.add), (np.float32, ReduceOp.MAX, np.maximum),
        (np.int64, ReduceOp.SUM, np.add), (np.int32, ReduceOp.BXOR, np.bitwise_xor),
        (np.bool_, ReduceOp.SUM, np.logical_or), (np.float64, ReduceOp.PRODUCT, np.multiply),
    ]
    for i, (dtype, op, fn) in enumerate(cases):
        for n in (0, 1, 7, 300, 2500):
            parts = [_data(g, n, dtype, salt + i) for g in members]
            x = parts[grank].copy()
            dist.all_reduce(x, op=op, group=group)
            _check(f"all_reduce {np.dtype(dtype)} {op} n={n}", x, _fold(parts, fn))
            root = members[-1]
            y = parts[grank].copy()
            dist.reduce(y, dst=root, op=op, group=group)
            _check(f"reduce {np.dtype(dtype)} {op} n={n}", y, _fold(parts, fn) if rank == root else parts[grank])
    n = 1500
    parts = [_data(g, n, np.float32, salt + 9) for g in members]
    x = parts[grank].copy()
    dist.all_reduce(x, op=ReduceOp.AVG, group=group)
    _check("all_reduce AVG", x, (_fold(parts, np.add) / np.float32(len(members))).astype(np.float32))
    # AVG on integers truncates toward zero; the bandwidth algorithms divide each part as they publish it
    ints = [_data(g, n, np.int64, salt + 10) for g in members]
    x = ints[grank].copy()
    dist.all_reduce(x, op=ReduceOp.AVG, group=group)
    total = _fold(ints, np.add)
    _check("all_reduce AVG int64", x, np.sign(total) * (np.abs(total) // len(members)))
    x = parts[grank].copy()
    dist.all_reduce(x, op=ReduceOp.PREMUL_SUM(2.0), group=group)
    _check("all_reduce PREMUL_SUM", x, _fold([p * np.float32(2.0) for p in parts], np.add))
    _coalesced(dist, rank, group, members, salt)
    y = parts[grank].copy()
    dist.reduce(y, dst=members[0], op=ReduceOp.PREMUL_SUM(2.0), group=group)
    _check("reduce PREMUL_SUM", y, _fold([p * np.float32(2.0) for p in parts], np.add) if rank == members[0] else parts[grank])


def _coalesced(dist, rank, group, members, salt):
    """all_reduce_coalesced in place over pieces of uneven sizes (an empty one, chunks spanning
    pieces): the result is the all_reduce of the concatenation. Returns the ops that ran."""
    import warnings

    grank = members.index(rank)
    ReduceOp = dist.ReduceOp
    sizes = [300, 0, 1, 1500, 37, 2999, 5]
    for dtype, op, want_of in ((np.float32, ReduceOp.SUM, lambda t: t), (np.int64, ReduceOp.MAX, None),
                               (np.float32, ReduceOp.AVG, lambda t: (t / np.float32(len(members))).astype(np.float32)),
                               (np.float64, ReduceOp.PREMUL_SUM(0.5), None)):
        parts = [_data(g, sum(sizes), dtype, salt + 20) for g in members]
        if want_of is None:
            fn = np.maximum if op == ReduceOp.MAX else None
            want = _fold(parts, fn) if fn else _fold([x * 0.5 for x in parts], np.add)
        else:
            want = want_of(_fold(parts, np.add))
        mine = parts[grank]
        pieces = np.split(mine.copy(), np.cumsum(sizes)[:-1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_reduce_coalesced(pieces, op=op, group=group)
        _check(f"all_reduce_coalesced {np.dtype(dtype)} {op}", np.concatenate(pieces), want)


def _data_movement(dist, rank, world, group, members, salt):
    p = len(members)
    grank = members.index(rank)
    for n in (0, 5, 1100):
        root = members[1 % p]
        x = _data(root, n, np.int16, salt) if rank == root else np.zeros(n, np.int16)
        dist.broadcast(x, src=root, group=group)
        _check(f"broadcast n={n}", x, _data(root, n, np.int16, salt))

        out = np.zeros(n * p, np.float64)
        dist.all_gather_into_tensor(out, _data(rank, n, np.float64, salt), group=group)
        _check(f"all_gather_into_tensor n={n}", out, np.concatenate([_data(g, n, np.float64, salt) for g in members]))
        outs = [np.zeros(n, np.uint8) for _ in members]
        dist.all_gather(outs, _data(rank, n, np.uint8, salt), group=group)
        for g, o in zip(members, outs):
            _check(f"all_gather n={n} from {g}", o, _data(g, n, np.uint8, salt))

        root = members[-1]
        gl = [np.zeros(n, np.int64) for _ in members] if rank == root else None
        dist.gather(_data(rank, n, np.int64, salt), gl, dst=root, group=group)
        if rank == root:
            for g, o in zip(members, gl):
                _check(f"gather n={n} from {g}", o, _data(g, n, np.int64, salt))

        root = members[0]
        out = np.zeros(n, np.float32)
        sl = [_data(g, n, np.float32, salt + 1) for g in members] if rank == root else None
        dist.scatter(out, sl, src=root, group=group)
        _check(f"scatter n={n}", out, _data(rank, n, np.float32, salt + 1))

    # reduce_scatter with uneven blocks, and the tensor form
    counts = [300 + 37 * q for q in range(p)]
    inputs = {g: [_data(g, c, np.float32, salt + 2 + q) for q, c in enumerate(counts)] for g in members}
    out = np.zeros(counts[grank], np.float32)
    dist.reduce_scatter(out, [a.copy() for a in inputs[rank]], group=group)
    _check("reduce_scatter", out, _fold([inputs[g][grank] for g in members], np.add))
    whole = {g: _data(g, 700 * p, np.int64, salt + 3) for g in members}
    out = np.zeros(700, np.int64)
    dist.reduce_scatter_tensor(out, whole[rank].copy(), op=dist.ReduceOp.MAX, group=group)
    _check("reduce_scatter_tensor", out, _fold([whole[g][grank * 700:(grank + 1) * 700] for g in members], np.maximum))

    # all_to_all with uneven splits (sender g sends 150 + 10 q + g elements to group rank q)
    def split(g, q):
        return 150 + 10 * q + g

    send = np.concatenate([np.full(split(rank, q), 1000 * rank + q, np.int32) for q in range(p)])
    recv = np.zeros(sum(split(g, grank) for g in members), np.int32)
    dist.all_to_all_single(recv, send, output_split_sizes=[split(g, grank) for g in members],
                           input_split_sizes=[split(rank, q) for q in range(p)], group=group)
    _check("all_to_all_single", recv, np.concatenate([np.full(split(g, grank), 1000 * g + grank, np.int32)
                                                      for g in members]))
    outs = [np.zeros(3, np.int32) for _ in members]
    dist.all_to_all(outs, [np.full(3, 10 * rank + q, np.int32) for q in range(p)], group=group)
    for g, o in zip(members, outs):
        _check("all_to_all", o, np.full(3, 10 * g + grank, np.int32))
    dist.barrier(group=group)


def _objects_and_async(dist, rank, world):
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "pad": "x" * (rank * 1000)})
    assert [o["rank"] for o in objs] == list(range(world))
    lst = [{"from": 0}] if rank == 0 else [None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [{"from": 0}]
    # async work on two groups over the same ranks, interleaved, plus the world
    g1, g2 = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    works, expect = [], []
    for i in range(6):
        for j, g in enumerate((g1, g2, None)):
            x = _data(rank, 900 + 100 * j, np.float32, 50 + 3 * i + j)
            works.append((dist.all_reduce(x, group=g, async_op=True), x))
            expect.append(_fold([_data(q, 900 + 100 * j, np.float32, 50 + 3 * i + j) for q in range(world)], np.add))
    for (w, x), want in zip(works, expect):
        w.wait()
        _check("async all_reduce", x, want)
    b = np.arange(4000, dtype=np.float32) if rank == 0 else np.zeros(4000, np.float32)
    w1 = dist.broadcast(b, src=0, group=g1, async_op=True)
    c = np.full(10, rank, np.int64)
    w2 = dist.all_reduce(c, group=g2, async_op=True)
    w1.wait()
    w2.wait()
    _check("async broadcast", b, np.arange(4000, dtype=np.float32))
    _check("async all_reduce g2", c, np.full(10, sum(range(world)), np.int64))


def world_body(rank, world, backend, salt):
    import distcomm as dist

    dist.init_process_group(backend)
    try:
        members = list(range(world))
        _reductions(dist, rank, world, None, members, salt)
        _data_movement(dist, rank, world, None, members, salt)
        if world >= 3:  # a subgroup of every other rank, reversed order of creation irrelevant
            sub_ranks = members[::2]
            sub = dist.new_group(sub_ranks)
            if rank in sub_ranks:
                _reductions(dist, rank, world, sub, sub_ranks, salt + 7)
                _data_movement(dist, rank, world, sub, sub_ranks, salt + 7)
        _objects_and_async(dist, rank, world)
        assert dist.get_backend() == (backend or "undefined")  # torch's answer when init was given none
    finally:
        dist.destroy_process_group()
    return "ok"


@pytest.mark.parametrize(
    "backend, world, env",
    [
        ("shm", 2, SLOTS),
        ("shm", 3, READV),
        pytest.param("shm", 8, SLOTS, marks=pytest.mark.slow),
        pytest.param("gloo", 4, READV, marks=pytest.mark.slow),
        pytest.param(None, 3, {}, marks=pytest.mark.slow),
        pytest.param("shm", 4, {"DISTCOMM_SHM_COLLECTIVES": "0", "DISTCOMM_SHM_RING_BYTES": "4096"},
                     marks=pytest.mark.slow),
    ],
    ids=["shm-2", "shm-3", "shm-8", "gloo-4", "default-slots-3", "shm-rings-only-4"],
)
def test_every_collective(backend, world, env):
    assert run_world(world_body, world, args=(backend, world), env=env, timeout=150) == ["ok"] * world


def large_body(rank, world):
    """The default slot size with messages of a few MiB, every all_reduce algorithm forced."""
    import os

    import distcomm as dist
    from distcomm.backends.shm import observe

    ran: list[str] = []
    observe.set_observer(ran.append)
    dist.init_process_group("tcp")
    n = 3 * (1 << 20) // 4 + 13  # ~3 MiB of float32: several 1 MiB rounds and a ragged end
    parts = [_data(q, n, np.float32, 77) for q in range(world)]
    for algo in ("slices", "direct", "readv"):
        # Forced through the Tuning, read when an engine is connected: each new_group with another
        # backend than the world's connects one.
        os.environ["DISTCOMM_SHM_ALGO_ALLREDUCE"] = algo
        group = dist.new_group(backend="shm")
        x = parts[rank].copy()
        del ran[:]
        dist.all_reduce(x, group=group)
        _check(f"all_reduce {algo}", x, _fold(parts, np.add))
        # direct past one slot runs as reduce_direct; readv needs process_vm_readv allowed here
        expected = {"slices": ["allreduce_slices"], "direct": ["reduce_direct"],
                    "readv": ["allreduce_readv"] if group.engine.transport.direct_reads_ok(range(world))
                    else ["allreduce_slices"]}[algo]
        assert ran == expected, (algo, ran)
    del os.environ["DISTCOMM_SHM_ALGO_ALLREDUCE"]
    x = parts[0].copy() if rank == 0 else np.zeros(n, np.float32)
    dist.broadcast(x, src=0, group=group)
    _check("broadcast", x, parts[0])
    out = np.zeros(n * world, np.float32)
    dist.all_gather_into_tensor(out, parts[rank], group=group)
    _check("all_gather", out, np.concatenate(parts))
    dist.destroy_process_group()
    return "ok"


@pytest.mark.slow
def test_large_messages_default_slots():
    assert run_world(large_body, 2, timeout=120) == ["ok"] * 2


def coalesced_body(rank, world):
    """all_reduce_coalesced takes the in-place single-copy algorithm where reads are allowed."""
    import distcomm as dist
    from distcomm.backends.shm import observe

    ran: list[str] = []
    dist.init_process_group("shm")
    observe.set_observer(ran.append)
    _coalesced(dist, rank, None, list(range(world)), 5)
    direct = dist.group.WORLD.engine.transport.direct_reads_ok(range(world))
    dist.destroy_process_group()
    return ran.count("allreduce_pieces_readv"), direct


def test_all_reduce_coalesced_in_place():
    results = run_world(coalesced_body, 2, env=READV, timeout=60)
    for ran, direct in results:
        assert ran == (3 if direct else 0), results  # not PREMUL_SUM: it premultiplies a copy


def two_rank_readv_body(rank, world):
    """At two ranks the single-copy all_reduce (and all_reduce_coalesced) lets rank 1 fold rank
    0's copy into its own, and reduce_scatter rank 0, where the op commutes (reduction.commutes):
    the results must still be rank order's, bit for bit, for every op, with -0.0 against 0.0 in the
    same places (where float MIN/MAX do not commute)."""
    import distcomm as dist
    from distcomm.backends.shm import observe
    from distcomm.types import ReduceOp, RedOpType

    ran: list[str] = []
    dist.init_process_group("shm")
    observe.set_observer(ran.append)
    n = 3002  # many chunks of a 4 KiB slot
    cases = [(np.float32, op) for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM")] + [
        (np.float64, "SUM"), (np.complex64, "SUM"), (np.int32, "SUM"), (np.int8, "MAX"), (np.uint8, "BXOR"),
        (np.bool_, "SUM"), (np.bool_, "MIN")]
    fold = {"SUM": np.add, "AVG": np.add, "PREMUL_SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum,
            "MAX": np.maximum, "BXOR": np.bitwise_xor}
    for dtype, name in cases:
        inputs = [_data(q, n, dtype, 31) for q in range(world)]
        if np.dtype(dtype).kind == "f":  # at both ends: in each rank's slice
            for ends in (slice(0, 4), slice(-4, None)):
                inputs[0][ends], inputs[1][ends] = [-0.0, 0.0, np.inf, -1.5], [0.0, -0.0, 2.0, -np.inf]
        if np.dtype(dtype).kind == "i":
            inputs[0][:2] = inputs[1][:2] = np.iinfo(dtype).max  # a SUM that wraps
        op = ReduceOp.PREMUL_SUM(0.5) if name == "PREMUL_SUM" else getattr(RedOpType, name)
        # the reference folds what the collective folds: PREMUL_SUM's inputs premultiplied
        parts = [x * np.float32(0.5) for x in inputs] if name == "PREMUL_SUM" else inputs
        want = _fold(parts, {"SUM": np.logical_or, "MIN": np.logical_and}[name] if dtype is np.bool_ else fold[name])
        if name == "AVG":
            want = want / np.float32(world)
        x = inputs[rank].copy()
        del ran[:]
        with np.errstate(all="ignore"):
            dist.all_reduce(x, op=op, async_op=True).wait()  # async: no latency path
        _check(f"all_reduce {name} {np.dtype(dtype).name}", x, want)
        if np.dtype(dtype).kind == "f":
            assert (np.signbit(x) == np.signbit(want)).all(), (name, "the signs of zeros")
        direct = dist.group.WORLD.engine.transport.direct_reads_ok(range(world))
        assert ran == (["allreduce_readv"] if direct else ["allreduce_slices"]), (name, ran)
        # all_reduce_coalesced on two pieces: chunks within one piece (folded in place) and one
        # across both (gathered); not PREMUL_SUM, which premultiplies a copy
        if name != "PREMUL_SUM":
            pieces = [inputs[rank][:1201].copy(), inputs[rank][1201:].copy()]
            del ran[:]
            with np.errstate(all="ignore"):
                dist.all_reduce_coalesced(pieces, op=op, async_op=True).wait()
            got = np.concatenate(pieces)
            _check(f"all_reduce_coalesced {name} {np.dtype(dtype).name}", got, want)
            if np.dtype(dtype).kind == "f":
                assert (np.signbit(got) == np.signbit(want)).all(), (name, "the signs of zeros")
            assert ran == (["allreduce_pieces_readv"] if direct else ["allreduce_slices"]), (name, ran)
        # reduce_scatter_tensor: rank 0 folds its own block into the peer's; block r of the
        # all_reduce's result is what rank r gets
        out = np.empty(n // world, dtype)
        del ran[:]
        with np.errstate(all="ignore"):
            dist.reduce_scatter_tensor(out, inputs[rank].copy(), op=op, async_op=True).wait()
        mine = want[rank * out.size : (rank + 1) * out.size]
        _check(f"reduce_scatter_tensor {name} {np.dtype(dtype).name}", out, mine)
        if np.dtype(dtype).kind == "f":
            assert (np.signbit(out) == np.signbit(mine)).all(), (name, "the signs of zeros")
        # (PREMUL_SUM stages a premultiplied copy first, then reduces it)
        assert ran[-1:] == (["reduce_scatter_readv"] if direct else ["reduce_scatter_slots"]), (name, ran)
    dist.destroy_process_group()
    return "ok"


def test_two_rank_single_copy_reductions_are_rank_order_bit_for_bit():
    assert run_world(two_rank_readv_body, 2, env=READV, timeout=60) == ["ok"] * 2


def torch_body(rank, world):
    import torch

    import distcomm as dist

    dist.init_process_group("shm")
    for dtype in (torch.bfloat16, torch.float16, torch.complex64):
        parts = [torch.arange(3000, dtype=torch.float32).to(dtype) * (q + 1) / 7 for q in range(world)]
        t = parts[rank].clone()
        dist.all_reduce(t)
        want = parts[0].clone()
        for p in parts[1:]:
            want += p
        assert torch.equal(t, want), dtype
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous: written back
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * world)
    dist.destroy_process_group()
    return "ok"


@pytest.mark.slow
def test_torch_tensors_bfloat16_and_non_contiguous():
    assert run_world(torch_body, 2, env=CHUNKY, timeout=120) == ["ok"] * 2


def a2a_straddle_body(rank, world):
    """all_to_all_single with uneven splits where only some ranks send enough for single-copy
    reads (DISTCOMM_SHM_THRESHOLD_READV_BYTES=2048): the ranks must still agree on one algorithm."""
    import distcomm as dist

    dist.init_process_group("shm")

    def split(src, dst):  # rank 0 sends 600 floats to each peer (2400 B), the others 1 + src + dst
        return 600 if src == 0 else 1 + src + dst

    for salt in range(3):  # several calls in a row: the slot rounds stay in step afterwards
        send_counts = [split(rank, q) for q in range(world)]
        recv_counts = [split(q, rank) for q in range(world)]
        inp = _data(rank, sum(send_counts), np.float64, 90 + salt)
        out = np.full(sum(recv_counts), -1.0)
        dist.all_to_all_single(out, inp, recv_counts, send_counts)
        want = []
        for q in range(world):
            theirs = _data(q, sum(split(q, d) for d in range(world)), np.float64, 90 + salt)
            start = sum(split(q, d) for d in range(rank))
            want.append(theirs[start : start + split(q, rank)])
        _check("all_to_all_single straddling the single-copy threshold", out, np.concatenate(want))
    dist.destroy_process_group()
    return "ok"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_ranks_disagreeing_on_single_copy(world):
    env = {"DISTCOMM_SHM_THRESHOLD_READV_BYTES": "2048", "DISTCOMM_SHM_SLOT_BYTES": "4096"}
    assert run_world(a2a_straddle_body, world, env=env, timeout=120) == ["ok"] * world
