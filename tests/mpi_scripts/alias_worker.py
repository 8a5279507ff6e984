"""Collectives whose input and output are the same memory, on the "mpi" engine under
``mpiexec -n 3`` (tests/test_mpi_fail_fast.py). MPI forbids a send buffer that overlaps the receive
buffer: the engine must still compute what the same call on separate buffers computes.

Each pattern runs at a small size (the latency paths, where the call has one) and a large one
(past MPI's eager limit: a rendezvous transfer, where overlapping buffers went wrong), several
times, and is compared with a reference computed here from the ranks' inputs. Every rank prints
one line per pattern, in one write: ``<rank> <pattern>/<n> ok`` or ``<rank> <pattern>/<n> BAD
<first differences>``, then ``<rank> finished``.
"""

import os
import sys
from datetime import timedelta

import numpy as np

import distcomm as dist

dist.init_process_group(sys.argv[1] if len(sys.argv) > 1 else "mpi", timeout=timedelta(minutes=2))
rank, ws = dist.get_rank(), dist.get_world_size()
SIZES = (2, 100_000)  # elements per block: 16 B, and 800 KB of int64
REPEATS = {2: 3, 100_000: 8}  # a wrong large transfer was wrong most of the time, not every time


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def values(r: int, q: int, n: int) -> np.ndarray:
    """Rank r's block for rank q: distinct for every (r, q, position)."""
    return (np.int64(r * 16 + q) << 32) + np.arange(n, dtype=np.int64)


def split(r: int, q: int) -> int:
    """Uneven splits whose totals are the same on every rank (so one array can be both sides)."""
    return 1 + (r + 2 * q) % ws


def check(name: str, got: np.ndarray, expected: np.ndarray, results: dict) -> None:
    """Record ``name``'s verdict; a pattern's first failure is the one kept."""
    if results.get(name, "ok") != "ok":
        return
    got, expected = np.asarray(got).reshape(-1), np.asarray(expected).reshape(-1)
    if np.array_equal(got, expected):
        results[name] = "ok"
        return
    wrong = np.flatnonzero(got != expected)
    results[name] = (f"BAD {wrong.size} of {expected.size} differ, first at {wrong[:3].tolist()}: got "
                     f"{got[wrong[:3]].tolist()}, expected {expected[wrong[:3]].tolist()}")


def run(n: int, results: dict) -> None:
    def tag(name):
        return f"{name}/{n}"

    mine = np.concatenate([values(rank, q, n) for q in range(ws)])
    exchanged = np.concatenate([values(q, rank, n) for q in range(ws)])

    # all_to_all_single with one array for both, default splits and explicit even ones
    a = mine.copy()
    dist.all_to_all_single(a, a)
    check(tag("a2as_same_array"), a, exchanged, results)
    a = mine.copy()
    dist.all_to_all_single(a, a, [n] * ws, [n] * ws)
    check(tag("a2as_same_array_even_splits"), a, exchanged, results)

    # ... with uneven splits (each rank's totals agree both ways)
    send = [split(rank, q) * n for q in range(ws)]
    recv = [split(q, rank) * n for q in range(ws)]
    a = np.concatenate([values(rank, q, c) for q, c in enumerate(send)])
    dist.all_to_all_single(a, a, recv, send)
    check(tag("a2as_same_array_uneven"), a, np.concatenate([values(q, rank, c) for q, c in enumerate(recv)]), results)

    # ... the output a view of the input's buffer, shifted: the input is read before any output lands
    buf = np.zeros((ws + 1) * n, np.int64)
    buf[:ws * n] = mine
    dist.all_to_all_single(buf[n:], buf[:ws * n])
    check(tag("a2as_output_overlaps_input"), buf[n:], exchanged, results)

    # all_to_all: the same list both ways, and two lists of the same arrays
    lst = [values(rank, q, n) for q in range(ws)]
    dist.all_to_all(lst, lst)
    check(tag("a2a_same_list"), np.concatenate(lst), exchanged, results)
    ins = [values(rank, q, n) for q in range(ws)]
    dist.all_to_all(list(ins), ins)
    check(tag("a2a_same_tensors"), np.concatenate(ins), exchanged, results)

    # all_gather_into_tensor in place (the input is this rank's block of the output)
    out = np.zeros(ws * n, np.int64)
    out[rank * n:(rank + 1) * n] = values(rank, 0, n)
    dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])
    check(tag("agit_in_place"), out, np.concatenate([values(q, 0, n) for q in range(ws)]), results)

    # all_gather: the input is one of the outputs
    outs = [np.zeros(n, np.int64) for _ in range(ws)]
    outs[rank][...] = values(rank, 0, n)
    dist.all_gather(outs, outs[rank])
    check(tag("ag_input_among_outputs"), np.concatenate(outs), np.concatenate([values(q, 0, n) for q in range(ws)]),
          results)

    # reduce_scatter_tensor: the output a view of the input, its own block and another's (SUM of
    # int64 is MPI's own; float32 AVG adds distcomm's arithmetic around it)
    total = sum(np.concatenate([values(r, q, n) for q in range(ws)]) for r in range(ws))
    for other in (0, 1):
        at = (rank + other) % ws
        inp = mine.copy()
        dist.reduce_scatter_tensor(inp[at * n:(at + 1) * n], inp)
        check(tag(f"rst_output_is_block_{'own' if not other else 'next'}"), inp[at * n:(at + 1) * n],
              total[rank * n:(rank + 1) * n], results)
    f = (np.arange(ws * n, dtype=np.float32) % 97) * (rank + 1)
    dist.reduce_scatter_tensor(f[rank * n:(rank + 1) * n], f, op=dist.ReduceOp.AVG)
    base = np.arange(ws * n, dtype=np.float32)[rank * n:(rank + 1) * n] % 97
    check(tag("rst_avg_output_is_own_block"), f[rank * n:(rank + 1) * n],
          (base * sum(range(1, ws + 1)) / ws).astype(np.float32), results)

    # reduce_scatter: the output is this rank's input
    ins = [values(rank, q, n) for q in range(ws)]
    dist.reduce_scatter(ins[rank], ins)
    check(tag("rs_output_is_own_input"), ins[rank], total[rank * n:(rank + 1) * n], results)

    # gather and scatter on the root: its own input / output is one of the list's tensors
    root = 1
    outs = [np.zeros(n, np.int64) for _ in range(ws)] if rank == root else None
    inp = values(rank, 0, n)
    if rank == root:
        outs[root][...] = inp
        inp = outs[root]
    dist.gather(inp, outs, dst=root)
    if rank == root:
        check(tag("gather_input_among_outputs"), np.concatenate(outs),
              np.concatenate([values(q, 0, n) for q in range(ws)]), results)
    ins = [values(root, q, n) for q in range(ws)] if rank == root else None
    out = ins[root] if rank == root else np.zeros(n, np.int64)
    dist.scatter(out, ins, src=root)
    check(tag("scatter_output_among_inputs"), out, values(root, rank, n), results)


results: dict = {}
for n in SIZES:
    for _ in range(REPEATS[n]):
        run(n, results)
for name, verdict in results.items():
    say(f"{rank} {name} {verdict}")
dist.destroy_process_group()
say(f"{rank} finished")
