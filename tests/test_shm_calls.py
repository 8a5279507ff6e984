"""Whole small collectives on numpy arrays and torch tensors in C (``Calls``, transport/_shm_calls.c).

* A small synchronous call on plain numpy arrays runs in C from the API function on: neither the
  Python latency paths nor the general path run (sys.setprofile watches every Python call). So
  does one on plain CPU torch tensors (one or two of them: lists of tensors take the Python path),
  whose memory C keeps with the tensor: a tensor whose memory changed in place since (another
  dtype over the same bytes, a transpose, a resize) is seen again, with right results, and more
  tensors than it keeps, in rounds handed back to Python, give right results too.
* What C does not take it hands to the Python latency path with the same arguments, which takes
  it or leaves it to the general path: arrays that are not C-contiguous, read-only, 0-d, in the
  other byte order (the general path's error); dtypes with no C fold (float16, bool, complex) in
  reductions and any dtype in copies; AVG; lists holding something else than arrays; an
  in-place reduce_scatter_tensor; a list of the wrong length (the general path's error). Every
  result is compared with numpy's.
* A C call records what the Python path records (op, sequence number, bytes, dtype, root, the
  user's line, completed).

Hand-backs (a late peer, a root that differs, a mismatch) are in test_round_plan.py and
test_shm_latency_ops.py, whose numpy calls are these where C is built; test_differential.py
compares them with torch's gloo.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from distcomm.transport import shm_group
from harness import run_world

needs_calls = pytest.mark.skipif(shm_group.Calls is None, reason="the whole calls in C are not built here "
                                 "(no compiler, or numpy's headers, at install)")

def _declined(frame: str) -> bool:
    """Whether a Python frame ("file:function") is where a call C declined goes: a Python latency
    path (latency.py's tensor_<op>, small_all_reduce and small_barrier, which are its fallbacks),
    or the general path, which makes Buffers (buffers.py). A call C took enters only the API
    function's helpers, the group's claim and the round's opening, or, when a peer is late (the
    watch itself slows a rank down), the hand-back's wait and finish: never these."""
    file, function = frame.split(":")
    return file == "buffers.py" or (file == "latency.py" and (
        function.startswith("tensor_") or function in ("small_all_reduce", "small_barrier")))


OPS_IN_C = ("all_reduce", "barrier", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
            "scatter", "reduce_scatter_tensor", "all_to_all_single")


def _calls(dist, rank: int, world: int):
    """(name, call) for every op with a whole call in C, on small float32 arrays."""
    x = np.arange(3, dtype=np.float32) + rank
    outs = [np.zeros(3, np.float32) for _ in range(world)]
    big = np.zeros(3 * world, np.float32)
    src = np.arange(3 * world, dtype=np.float32)
    received = np.zeros(3 * world, np.float32)
    return [
        ("all_reduce", lambda: dist.all_reduce(x)),
        ("barrier", lambda: dist.barrier()),
        ("broadcast", lambda: dist.broadcast(x, src=world - 1)),
        ("reduce", lambda: dist.reduce(x, dst=0)),
        ("all_gather", lambda: dist.all_gather(outs, x)),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(big, x)),
        ("gather", lambda: dist.gather(x, outs if rank == 0 else None, dst=0)),
        ("scatter", lambda: dist.scatter(x, outs if rank == 1 else None, src=1)),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(x, src)),
        ("all_to_all_single", lambda: dist.all_to_all_single(received, src)),
    ]


def _tensor_calls(dist, rank: int, world: int):
    """(name, call) for every op C takes on torch tensors."""
    import torch

    x = torch.arange(3, dtype=torch.float32) + rank
    big = torch.zeros(3 * world)
    src = torch.arange(3 * world, dtype=torch.float32)
    return [
        ("all_reduce", lambda: dist.all_reduce(x)),
        ("broadcast", lambda: dist.broadcast(x, src=world - 1)),
        ("reduce", lambda: dist.reduce(x, dst=0)),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(big, x)),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(x, src)),
    ]


def frames_body(rank, world, kind):
    import os
    import sys

    import distcomm as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    entered: dict[str, set] = {}
    for name, call in (_calls if kind == "numpy" else _tensor_calls)(dist, rank, world):
        for _ in range(3):  # the group's memory, its paths and the recorder's files: set up on first use
            call()
        seen: set = set()

        def watch(frame, event, arg):
            if event == "call":
                seen.add((os.path.basename(frame.f_code.co_filename), frame.f_code.co_name))

        sys.setprofile(watch)
        try:
            for _ in range(5):
                call()
        finally:
            sys.setprofile(None)
        entered[name] = {f"{file}:{fn}" for file, fn in seen if file not in ("test_shm_calls.py",)}
    dist.destroy_process_group()
    return entered


@needs_calls
@pytest.mark.parametrize("world, kind", [(2, "numpy"), (2, "torch"), pytest.param(3, "numpy", marks=pytest.mark.slow),
                                         pytest.param(3, "torch", marks=pytest.mark.slow)])
def test_small_calls_run_in_c_from_the_api_function_on(world, kind):
    for rank, entered in enumerate(run_world(frames_body, world, args=(kind,), timeout=60)):
        for name, frames in entered.items():
            declined = {f for f in frames if _declined(f)}
            assert not declined, (rank, name, sorted(frames))
            # the API function of the op itself ran (the watch saw Python calls at all)
            assert any(f.startswith("collectives.py:") for f in frames), (rank, name, sorted(frames))


def declined_body(rank, world):
    import distcomm as dist
    from distcomm import ReduceOp

    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    wrong = []

    def check(what, got, want):
        if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
            wrong.append((what, got.tolist(), want.tolist()))

    def value(q, dtype, n=4):
        return (np.arange(n) % 3 + q + 1).astype(dtype)

    # arrays C declines: strided, read-only (as a broadcast source), the other byte order, 0-d
    base = np.zeros(8, np.float32)
    strided = base[::2]
    strided[:] = value(rank, np.float32)
    dist.all_reduce(strided)
    check("strided all_reduce", strided, sum(value(q, np.float32) for q in range(world)))
    frozen = value(rank, np.float32)
    frozen.flags.writeable = False
    dist.all_gather_into_tensor(np.zeros(4 * world, np.float32), frozen)
    try:  # the other byte order: the general path's error, on every rank
        dist.broadcast(value(rank, ">f4"), src=0)
        wrong.append(("a big-endian array was taken", None, None))
    except TypeError as exc:
        if "not supported" not in str(exc):
            wrong.append(("big-endian", str(exc), None))
    scalar = np.array(rank + 1.0)
    dist.all_reduce(scalar)
    check("0-d all_reduce", scalar, np.array(float(sum(range(1, world + 1)))))
    # dtypes: copies of any number dtype in C, reductions without a C fold in Python
    for dtype in (np.float16, np.bool_, np.complex64, np.uint16, np.int64, np.longlong):
        x = value(rank, dtype)
        dist.broadcast(x, src=world - 1)
        check(f"broadcast {np.dtype(dtype)}", x, value(world - 1, dtype))
        outs = [np.zeros(4, dtype) for _ in range(world)]
        dist.all_gather(outs, value(rank, dtype))
        for q in range(world):
            check(f"all_gather {np.dtype(dtype)} from {q}", outs[q], value(q, dtype))
    for dtype in (np.float16, np.complex64, np.int32, np.float64):
        x = value(rank, dtype)
        dist.all_reduce(x)
        check(f"all_reduce {np.dtype(dtype)}", x, sum(value(q, dtype) for q in range(world)).astype(dtype))
    # AVG, and MAX, on a reduce and a reduce_scatter_tensor
    x = value(rank, np.float32)
    dist.reduce(x, dst=0, op=ReduceOp.AVG)
    if rank == 0:
        check("reduce AVG", x, (sum(value(q, np.float32) for q in range(world)) / world).astype(np.float32))
    y = np.zeros(2, np.int64)
    dist.reduce_scatter_tensor(y, value(rank, np.int64, 2 * world), op=ReduceOp.MAX)
    check("reduce_scatter_tensor MAX", y, value(world - 1, np.int64, 2 * world)[2 * rank:2 * rank + 2])
    # in place: the output is the input's own block
    inp = value(rank, np.float32, 2 * world)
    dist.reduce_scatter_tensor(inp[2 * rank:2 * rank + 2], inp)
    check("reduce_scatter_tensor in place", inp[2 * rank:2 * rank + 2],
          sum(value(q, np.float32, 2 * world) for q in range(world))[2 * rank:2 * rank + 2])
    # lists holding something else: a list of lists is not a tensor list (the general path's error)
    try:
        dist.all_gather([[0.0] * 4 for _ in range(world)], value(rank, np.float32))
        wrong.append(("a list of lists was taken", None, None))
    except (TypeError, ValueError, RuntimeError):
        pass
    # the wrong length of a gather list on the root, last: the general path's error on the root (the
    # others' gather then fails when the root leaves)
    try:
        dist.gather(value(rank, np.float32), [np.zeros(4, np.float32)] * (world + 1) if rank == 0 else None, dst=0)
        raised = None
    except (TypeError, ValueError, RuntimeError) as exc:
        raised = str(exc)
    if rank == 0 and (raised is None or "gather_list" not in raised):
        wrong.append(("gather list of the wrong length", raised, rank))
    dist.destroy_process_group()
    return wrong


@needs_calls
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_what_c_declines_python_takes_with_the_same_results(world):
    for rank, wrong in enumerate(run_world(declined_body, world, timeout=90)):
        assert wrong == [], (rank, wrong)


def changed_body(rank, world):
    import torch

    import distcomm as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    wrong = []

    def check(what, got, want):
        if not torch.equal(got, want):
            wrong.append((what, got.tolist(), want.tolist()))

    t = torch.full((2, 2), float(rank + 1))
    for _ in range(3):
        dist.all_reduce(t)  # kept with its memory from the second call on
    check("float", t, torch.full((2, 2), float(world ** 2 * sum(range(1, world + 1)))))
    t.fill_(rank + 1)
    t.data = t.data.view(torch.int32)  # the same bytes, another dtype
    t.fill_((rank + 1) * 10 ** 8)  # (small integers' bit patterns would add alike as float32 denormals)
    dist.all_reduce(t)
    check("another dtype", t, torch.full((2, 2), sum(range(1, world + 1)) * 10 ** 8, dtype=torch.int32))
    u = torch.arange(4, dtype=torch.float32).reshape(2, 2)
    dist.broadcast(u, src=0)
    if rank == 0:
        u.t_()  # the same memory and element count, no longer contiguous: C must not take it
    u.copy_(torch.arange(4, dtype=torch.float32).reshape(2, 2) + 10 * rank)
    dist.broadcast(u, src=world - 1)  # into rank 0's transposed tensor: by element, not by byte
    check("transposed", u, torch.arange(4, dtype=torch.float32).reshape(2, 2) + 10 * (world - 1))
    v = torch.full((4,), float(rank + 1))
    dist.all_reduce(v)
    v.resize_(2)  # fewer elements over the same memory
    v.fill_(rank + 1)
    dist.all_reduce(v)
    check("resized", v, torch.full((2,), float(sum(range(1, world + 1)))))
    dist.destroy_process_group()
    return wrong


def many_tensors_body(rank, world):
    import time

    import torch

    import distcomm as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    wrong = []
    # more tensors than C keeps (two a call), each call with a late peer now and then: a round
    # handed back reads the tensors' views, which the call holds whatever the cache does meanwhile
    ins = [torch.full((3,), float(10 * i + rank)) for i in range(7)]
    outs = [torch.zeros(3 * world) for _ in range(7)]
    for rep in range(4):
        for i in range(7):
            if rank == 1 and (rep + i) % 3 == 0:
                time.sleep(0.01)  # past the poll: the other's C call hands its round back
            dist.all_gather_into_tensor(outs[i], ins[i])
            want = torch.cat([torch.full((3,), float(10 * i + q)) for q in range(world)])
            if not torch.equal(outs[i], want):
                wrong.append((rep, i, outs[i].tolist()))
            outs[i].zero_()
    dist.destroy_process_group()
    return wrong


@needs_calls
def test_more_tensors_than_kept_with_rounds_handed_back():
    for rank, wrong in enumerate(run_world(many_tensors_body, 2, timeout=60)):
        assert wrong == [], (rank, wrong[:3])


@needs_calls
def test_a_tensor_whose_memory_changed_in_place_is_seen_again():
    for rank, wrong in enumerate(run_world(changed_body, 2, timeout=60)):
        assert wrong == [], (rank, wrong)


def records_body(rank, world):
    import distcomm as dist
    from distcomm import flight_recorder as fr

    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    calls = _calls(dist, rank, world)
    for _, call in calls:
        call()
    before = fr.recorder.recorded()
    for _, call in calls:
        call()
    records = [fr.to_dict(e) for e in fr.recorder.entries()][before - fr.recorder.recorded():]
    dist.destroy_process_group()
    return [(r["op"], r["seq"], r["nbytes"], r["dtype"], r["peer"], r["site"]["line"], r["state"]) for r in records
            if r["site"]["file"] == __file__]


@needs_calls
def test_calls_in_c_record_what_the_python_paths_record():
    with open(__file__) as f:  # the user's frame: each op's lambda in _calls
        lines: dict = {}
        for i, text in enumerate(f, 1):
            for op in OPS_IN_C:
                if f'("{op}", lambda' in text:
                    lines.setdefault(op, i)  # _calls's, the first
    want_bytes = {"all_reduce": 12, "barrier": 0, "broadcast": 12, "reduce": 12, "all_gather": 12,
                  "all_gather_into_tensor": 12, "gather": 12, "scatter": 12, "reduce_scatter_tensor": 12,
                  "all_to_all_single": 24}
    peers = {"broadcast": 1, "reduce": 0, "gather": 0, "scatter": 1}
    for records in run_world(records_body, 2, timeout=60):
        assert [r[0] for r in records] == list(OPS_IN_C)
        seqs = [r[1] for r in records]
        assert seqs == list(range(seqs[0], seqs[0] + len(records)))
        for op, seq, nbytes, dtype, peer, at, state in records:
            assert nbytes == want_bytes[op] and peer == peers.get(op) and at == lines[op] and state == "completed"
            assert dtype == (None if op == "barrier" else "float32")
