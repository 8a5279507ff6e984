"""One-round collectives as plans of copies (backends/shm/round_plan.py), run in one C call
(``Rounds.move`` in transport/_shm_round.c), beside the algorithms' own Python rounds.

* On bytes, with no process (members' memory laid out as GroupShm lays it out): a plan's writes land
  in this member's slot and its header carries the byte count and extra word; its reads copy from
  the peers' slots and from local buffers, or fold them in rank order as numpy does; a peer whose
  extra word differs (a root check) hands the round back unread and unconsumed (DIFFERS), as
  does a peer that has not posted (PENDING); a plan that reaches outside a slot or a buffer, or
  writes into a read-only one, is refused before anything is posted.
* In real worlds: ranks running the plans in C and ranks running the algorithms' rounds in Python
  (DISTCOMM_SHM_NATIVE=0) meet in the same rounds for broadcast, reduce, gather, scatter,
  all_gather (list), all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, all_reduce
  and barrier at world sizes 2, 3 and 5,
  against numpy; a late peer makes the C call hand its round back, and Python finishes it (reads
  and folds); an all_to_all_single whose peer sends another split hands its round back to the
  algorithm, which names the peer.

test_shm_latency_ops.py runs every latency path against the general path and the naive reference
at world sizes 1-8, with numpy arrays and torch tensors; where C is built those are these plans.
"""

from __future__ import annotations

import numpy as np
import pytest

from distcomm.transport import shm_group as g
from harness import run_world
from test_shm_native import C, NSLOTS, SLOT_BYTES, Members, kind_of, needs_c


def post(m: Members, q: int, k: int, seq: int, sig: int, data: np.ndarray, extra: int = 0) -> None:
    """What GroupShm.publish writes for member q (its slot's data, then the header and counter)."""
    m.slots[q][k % NSLOTS][:data.nbytes] = data.view(np.uint8)
    h = m.headers[q][k % NSLOTS]
    h[g.S_SEQ], h[g.S_SIG], h[g.S_NBYTES], h[g.S_EXTRA], h[g.S_ROUND] = seq, sig, data.nbytes, extra, k
    m.ctl[q][g.POSTED] = k


@needs_c
def test_writes_land_in_the_slot_and_reads_copy_from_peers_and_buffers():
    m = Members(3)
    send = np.array([1.0, 2.0, 3.0], np.float32)
    blocks = [np.array([10.0, 20.0, 30.0], np.float32) * (q + 1) for q in range(3)]
    for q in (0, 2):
        post(m, q, 1, seq=5, sig=8, data=blocks[q], extra=2)
    out = np.zeros(9, np.float32)
    n = send.nbytes
    status = m.rounds[1].move(1, 5, 8, n, 2, True, ((send, 0, 64, n),),
                              ((0, 0, out, 0, n), (send, 0, out, n, n), (2, 4, out, 2 * n + 4, n - 4)), -1, ())
    assert status == C.DONE
    h = m.headers[1][1]
    assert (h[g.S_ROUND], h[g.S_SEQ], h[g.S_SIG], h[g.S_NBYTES], h[g.S_EXTRA]) == (1, 5, 8, n, 2)
    assert m.ctl[1][g.POSTED] == 1 and m.ctl[1][g.CONSUMED] == 1
    assert m.slots[1][1][64:64 + n].tobytes() == send.tobytes()
    assert out[:3].tolist() == blocks[0].tolist() and out[3:6].tolist() == send.tolist()
    assert out[6] == 0 and out[7:].tolist() == blocks[2][1:].tolist()


@needs_c
@pytest.mark.parametrize("op_name, ufunc", [("SUM", np.add), ("MAX", np.maximum), ("BXOR", np.bitwise_xor)])
def test_a_fold_reduces_in_the_order_given_as_numpy_does(op_name, ufunc):
    dtype = np.int32 if op_name == "BXOR" else np.float64
    m = Members(3)
    xs = [(np.arange(5) * (q + 2) - 3 * q).astype(dtype) for q in range(3)]
    for q in (0, 2):
        post(m, q, 1, seq=1, sig=2, data=xs[q])
    out = np.full(5, 99, dtype)
    n = xs[0].nbytes
    reads = ((0, 0, out, 0, n), (xs[1], 0, out, 0, n), (2, 0, out, 0, n))
    assert m.rounds[1].move(1, 1, 2, n, 0, False, (), reads, kind_of(op_name, dtype), ()) == C.DONE
    expected = xs[0].copy()
    for x in xs[1:]:
        ufunc(expected, x, out=expected)
    assert out.tobytes() == expected.tobytes()


@needs_c
def test_a_peer_with_another_extra_word_hands_the_round_back_unread():
    m = Members(3)
    post(m, 0, 1, seq=3, sig=4, data=np.ones(2, np.float32), extra=0)
    post(m, 2, 1, seq=3, sig=4, data=np.ones(2, np.float32), extra=2)  # member 2 believes it is the root
    out = np.zeros(2, np.float32)
    status = m.rounds[1].move(1, 3, 4, 8, 0, True, (), ((0, 0, out, 0, 8),), -1, ())
    assert status == C.DIFFERS
    assert out.tolist() == [0.0, 0.0] and m.ctl[1][g.POSTED] == 1 and m.ctl[1][g.CONSUMED] == 0
    # without the check the extra word is not compared
    m2 = Members(2)
    post(m2, 0, 1, seq=3, sig=4, data=np.ones(2, np.float32), extra=7)
    assert m2.rounds[1].move(1, 3, 4, 8, 0, False, (), ((0, 0, out, 0, 8),), -1, ()) == C.DONE
    assert out.tolist() == [1.0, 1.0]


@needs_c
def test_a_peer_that_has_not_posted_leaves_the_reads_and_the_consume_to_python():
    m = Members(2)
    out = np.zeros(2, np.float32)
    assert m.rounds[0].move(1, 1, 1, 8, 0, False, (), ((1, 0, out, 0, 8),), -1, ()) == C.PENDING
    assert m.ctl[0][g.POSTED] == 1 and m.ctl[0][g.CONSUMED] == 0 and out.tolist() == [0.0, 0.0]


@needs_c
def test_copies_from_own_memory_are_made_while_the_peers_posts_come_unless_a_check_may_fail():
    # an all_to_all's or all_gather's own block needs no peer: copied between the post and the
    # poll; a rooted call's check that fails must find nothing read, so there every read waits
    own, theirs = np.arange(2, dtype=np.float32) + 5, np.zeros(2, np.float32)
    m = Members(2)
    out = np.zeros(4, np.float32)
    reads = ((own, 0, out, 0, 8), (1, 0, out, 8, 8))
    assert m.rounds[0].move(1, 1, 1, 8, 0, False, (), reads, -1, ()) == C.PENDING
    assert out.tolist() == [5.0, 6.0, 0.0, 0.0]  # the own block, not the peer's
    checked = Members(2)
    out[:] = 0
    assert checked.rounds[0].move(1, 1, 1, 8, 0, True, (), reads, -1, ()) == C.PENDING
    assert out.tolist() == [0.0] * 4
    done = Members(2)
    post(done, 1, 1, seq=1, sig=1, data=theirs + 9)
    out[:] = 0
    assert done.rounds[0].move(1, 1, 1, 8, 0, False, (), reads, -1, ()) == C.DONE
    assert out.tolist() == [5.0, 6.0, 9.0, 9.0]


@needs_c
@pytest.mark.parametrize("writes, reads", [
    (((np.zeros(8, np.uint8), 0, SLOT_BYTES - 4, 8),), ()),  # past the end of the slot
    (((np.zeros(8, np.uint8), 4, 0, 8),), ()),  # past the end of the source
    ((), ((1, SLOT_BYTES - 4, np.zeros(8, np.uint8), 0, 8),)),  # past the end of a peer's slot
    ((), ((1, 0, np.zeros(4, np.uint8), 0, 8),)),  # past the end of the destination
    ((), ((5, 0, np.zeros(8, np.uint8), 0, 8),)),  # no such member
    ((), ((1, -8, np.zeros(8, np.uint8), 0, 8),)),  # a negative offset
    ((), ((1, 0, np.zeros(8, np.uint8), 0),)),  # a malformed read
])
def test_a_plan_outside_its_memory_is_refused_before_posting(writes, reads):
    m = Members(2)
    with pytest.raises(ValueError, match="out of bounds or malformed"):
        m.rounds[0].move(1, 1, 1, 8, 0, False, writes, reads, -1, ())
    assert m.ctl[0][g.POSTED] == 0


@needs_c
def test_a_read_only_destination_or_an_unknown_kind_is_refused_before_posting():
    m = Members(2)
    frozen = np.zeros(8, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        m.rounds[0].move(1, 1, 1, 8, 0, False, (), ((1, 0, frozen, 0, 8),), -1, ())
    with pytest.raises(ValueError, match="kind"):
        m.rounds[0].move(1, 1, 1, 8, 0, False, (), (), 4, ())  # BAND on float32
    assert m.ctl[0][g.POSTED] == 0


# -- in real worlds ---------------------------------------------------------------------------
OPS = ("broadcast", "reduce", "gather", "scatter", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
       "all_to_all_single", "all_reduce", "barrier")


def _inputs(op: str, rank: int, world: int, n: int, i: int, dtype: str):
    """The call's input for ``rank`` (each rank's differs; block q of a reduce_scatter for rank q)."""
    count = n * world if op in ("reduce_scatter_tensor", "all_to_all_single") else n
    return ((np.arange(count) % 11) * (rank + 1) + 3 * i - rank).astype(dtype)


def _expected(op: str, rank: int, world: int, n: int, i: int, dtype: str, root: int):
    xs = [_inputs(op, q, world, n, i, dtype) for q in range(world)]
    if op == "broadcast":
        return xs[root]
    if op == "all_reduce":  # rank order, as every member folds
        return np.sum(xs, axis=0, dtype=dtype)
    if op == "barrier":
        return None
    if op == "reduce":
        return np.sum(xs, axis=0, dtype=dtype) if rank == root else xs[rank]
    if op == "gather":
        return np.concatenate(xs) if rank == root else None
    if op == "scatter":
        return xs[root] + rank
    if op in ("all_gather", "all_gather_into_tensor"):
        return np.concatenate(xs)
    if op == "all_to_all_single":  # block q of rank q's input, from every rank in rank order
        return np.concatenate([x[rank * n:(rank + 1) * n] for x in xs])
    return np.sum([x[rank * n:(rank + 1) * n] for x in xs], axis=0, dtype=dtype)


def _call(dist, op: str, rank: int, world: int, n: int, i: int, dtype: str, root: int):
    x = _inputs(op, rank, world, n, i, dtype)
    if op == "all_reduce":
        dist.all_reduce(x)
        return x
    if op == "barrier":
        dist.barrier()
        return None
    if op in ("broadcast", "reduce"):
        getattr(dist, op)(x, root)
        return x
    if op == "gather":
        outs = [np.zeros(n, dtype) for _ in range(world)] if rank == root else None
        dist.gather(x, outs, dst=root)
        return None if outs is None else np.concatenate(outs)
    if op == "scatter":
        out = np.zeros(n, dtype)
        dist.scatter(out, [x + q for q in range(world)] if rank == root else None, src=root)
        return out
    if op == "all_gather":
        outs = [np.zeros(n, dtype) for _ in range(world)]
        dist.all_gather(outs, x)
        return np.concatenate(outs)
    if op == "all_gather_into_tensor":
        out = np.zeros(n * world, dtype)
        dist.all_gather_into_tensor(out, x)
        return out
    if op == "all_to_all_single":
        out = np.zeros(n * world, dtype)
        dist.all_to_all_single(out, x)
        return out
    out = np.zeros(n, dtype)
    dist.reduce_scatter_tensor(out, x)
    return out


def plans_body(rank, world, native_ranks, late_rank):
    import os
    import time

    if rank not in native_ranks:
        os.environ["DISTCOMM_SHM_NATIVE"] = "0"
    import distcomm as dist

    dist.init_process_group(None)
    dist.barrier()
    before = g.rounds_consumed_in_c()
    wrong = []
    for i, n in enumerate((1, 7, 61)):
        for dtype in ("float32", "int64"):
            for op in OPS:
                root = (i + OPS.index(op)) % world
                if rank == late_rank:
                    time.sleep(0.02)  # past every poll: the others' C calls hand their rounds back
                got = _call(dist, op, rank, world, n, i, dtype, root)
                want = _expected(op, rank, world, n, i, dtype, root)
                if (got is None) != (want is None) or (got is not None and got.tobytes() != want.tobytes()):
                    wrong.append((op, dtype, n, root))
    taken = g.rounds_consumed_in_c() - before
    dist.destroy_process_group()
    return wrong, taken


@needs_c
@pytest.mark.parametrize("world, native_ranks", [
    (2, (1,)),
    pytest.param(3, (0, 2), marks=pytest.mark.slow),
    pytest.param(5, (1, 2, 4), marks=pytest.mark.slow),
    pytest.param(3, (0, 1, 2), marks=pytest.mark.slow),
])
def test_plans_in_c_and_rounds_in_python_meet_in_the_same_rounds(world, native_ranks):
    for rank, (wrong, taken) in enumerate(run_world(plans_body, world, args=(native_ranks, None), timeout=120)):
        assert wrong == [], (rank, wrong[:5])
        if rank in native_ranks:
            assert taken >= len(OPS) * 6, f"rank {rank} completed {taken} rounds in C"
        else:
            assert taken == 0


@needs_c
@pytest.mark.slow
def test_a_late_peer_makes_c_hand_back_and_python_finishes_the_plans():
    for rank, (wrong, _) in enumerate(run_world(plans_body, 3, args=((0, 1, 2), 2), timeout=120)):
        assert wrong == [], (rank, wrong[:5])


def split_body(rank, world):
    import distcomm as dist

    dist.init_process_group(None)
    dist.barrier()
    try:
        if rank == 0:  # even splits: the plan, expecting two elements from rank 1
            dist.all_to_all_single(np.zeros(4, np.float32), np.arange(4, dtype=np.float32))
        else:  # the general path, sending rank 0 one element
            dist.all_to_all_single(np.zeros(5, np.float32), np.arange(4, dtype=np.float32), [2, 3], [1, 3])
        error = None
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    return error


@needs_c
def test_an_all_to_all_whose_peer_sends_another_split_hands_back_and_names_the_peer():
    errors = run_world(split_body, 2, timeout=60)
    assert errors[0] is not None and "rank 1" in errors[0], errors
    assert errors[1] is None, errors


def in_place_body(rank, world, native):
    import os

    if not native:
        os.environ["DISTCOMM_SHM_NATIVE"] = "0"
    import torch

    import distcomm as dist

    dist.init_process_group(None)
    dist.barrier()
    wrong = []
    for make in (np.asarray, torch.from_numpy):
        for n in (1, 3):
            inp = make(np.arange(n * world, dtype=np.float32) + 10 * rank)
            out = inp[rank * n:(rank + 1) * n]  # the output is this rank's block of the input (FSDP's way)
            dist.reduce_scatter_tensor(out, inp)
            want = sum(np.arange(n * world, dtype=np.float32) + 10 * q for q in range(world))[rank * n:(rank + 1) * n]
            if np.asarray(out).tolist() != want.tolist():
                wrong.append(("reduce_scatter_tensor", make.__name__, n, np.asarray(out).tolist(), want.tolist()))
            ins = [make(np.full(n, float(rank + q), np.float32)) for q in range(world)]
            dist.reduce_scatter(ins[rank], ins)  # the output is one of the inputs
            want = [float(sum(q + rank for q in range(world)))] * n
            if np.asarray(ins[rank]).tolist() != want:
                wrong.append(("reduce_scatter", make.__name__, n, np.asarray(ins[rank]).tolist(), want))
    dist.destroy_process_group()
    return wrong


@pytest.mark.parametrize("world, native", [(3, True), pytest.param(2, True, marks=pytest.mark.slow),
                                           pytest.param(3, False, marks=pytest.mark.slow)])
def test_a_reduce_scatter_whose_output_is_in_its_input_is_right(world, native):
    """The fold would overwrite this rank's own block before reading it: the latency paths leave an
    output inside its input to the general path, which reduces a copy."""
    for rank, wrong in enumerate(run_world(in_place_body, world, args=(native,), timeout=120)):
        assert wrong == [], (rank, wrong)
