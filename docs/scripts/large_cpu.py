"""Large collectives: wall time and CPU (user + system) per call, distcomm or MPICH, numpy buffers.

    PYTHONPATH=<a distcomm tree>/src python docs/scripts/large_cpu.py --world 2 --ops all_gather,... --sizes 4M,64M
    DISTCOMM_SHM_ALGO_ALLGATHER=slots PYTHONPATH=... python docs/scripts/large_cpu.py ...   (a forced algorithm)
    mpiexec -n 2 python docs/scripts/large_cpu.py --mpi --ops ... --sizes ...

Sizes are the bench's (all_gather: the output; reduce_scatter, all_to_all: the input). Each (op,
size): 2 warmup calls, then ``--calls`` calls each after a barrier; per rank the median wall time
and the mean ``time.process_time`` per call (system time included: process_vm_readv copies in the
kernel). Rows report the slowest rank. CPU per call is what a loaded machine cannot blur: with the
other helpers' load, wall times mostly measure the scheduler (docs/performance-notes.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time

import numpy as np

OPS = ("broadcast", "all_gather", "all_gather_list", "reduce_scatter", "reduce_scatter_list", "all_to_all",
       "all_to_all_list", "all_reduce", "gather", "scatter", "reduce")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _distcomm_call(d, op, count, rank, n):
    c = count // n
    if op == "broadcast":
        b = np.ones(count, np.float32)
        return lambda: d.broadcast(b, src=0)
    if op == "reduce":
        b = np.ones(count, np.float32)
        return lambda: d.reduce(b, dst=0)
    if op == "all_reduce":
        b = np.ones(count, np.float32)
        return lambda: d.all_reduce(b)
    if op == "all_gather":
        out, inp = np.zeros(count, np.float32), np.ones(c, np.float32)
        return lambda: d.all_gather_into_tensor(out, inp)
    if op == "all_gather_list":
        outs, inp = [np.zeros(c, np.float32) for _ in range(n)], np.ones(c, np.float32)
        return lambda: d.all_gather(outs, inp)
    if op == "reduce_scatter":
        out, inp = np.zeros(c, np.float32), np.ones(count, np.float32)
        return lambda: d.reduce_scatter_tensor(out, inp)
    if op == "reduce_scatter_list":
        out, ins = np.zeros(c, np.float32), [np.ones(c, np.float32) for _ in range(n)]
        return lambda: d.reduce_scatter(out, ins)
    if op == "all_to_all":
        out, inp = np.zeros(count, np.float32), np.ones(count, np.float32)
        return lambda: d.all_to_all_single(out, inp)
    if op == "all_to_all_list":
        outs, ins = [np.zeros(c, np.float32) for _ in range(n)], [np.ones(c, np.float32) for _ in range(n)]
        return lambda: d.all_to_all(outs, ins)
    if op == "gather":
        inp = np.ones(c, np.float32)
        outs = [np.zeros(c, np.float32) for _ in range(n)] if rank == 0 else None
        return lambda: d.gather(inp, outs, dst=0)
    if op == "scatter":
        out = np.zeros(c, np.float32)
        ins = [np.ones(c, np.float32) for _ in range(n)] if rank == 0 else None
        return lambda: d.scatter(out, ins, src=0)
    raise ValueError(op)


def _mpi_call(comm, MPI, op, count, rank, n):
    c = count // n
    if op == "broadcast":
        b = np.ones(count, np.float32)
        return lambda: comm.Bcast(b, 0)
    if op == "reduce":
        b = np.ones(count, np.float32)
        if rank == 0:
            return lambda: comm.Reduce(MPI.IN_PLACE, b, MPI.SUM, 0)
        return lambda: comm.Reduce(b, None, MPI.SUM, 0)
    if op == "all_reduce":
        b = np.ones(count, np.float32)
        return lambda: comm.Allreduce(MPI.IN_PLACE, b)
    if op.startswith("all_gather"):
        out, inp = np.zeros(count, np.float32), np.ones(c, np.float32)
        return lambda: comm.Allgather(inp, out)
    if op.startswith("reduce_scatter"):
        out, inp = np.zeros(c, np.float32), np.ones(count, np.float32)
        return lambda: comm.Reduce_scatter_block(inp, out)
    if op.startswith("all_to_all"):
        out, inp = np.zeros(count, np.float32), np.ones(count, np.float32)
        return lambda: comm.Alltoall(inp, out)
    if op == "gather":
        inp, out = np.ones(c, np.float32), np.zeros(count, np.float32) if rank == 0 else None
        return lambda: comm.Gather(inp, out, 0)
    if op == "scatter":
        out, inp = np.zeros(c, np.float32), np.ones(count, np.float32) if rank == 0 else None
        return lambda: comm.Scatter(inp, out, 0)
    raise ValueError(op)


def _measure(barrier, fn, calls):
    for _ in range(2):
        fn()
    walls = []
    cpu = time.process_time()
    for _ in range(calls):
        barrier()
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu) / calls
    return sorted(walls)[len(walls) // 2], cpu


def _plan(args):
    return [(op, _size(s)) for op in args.ops.split(",") for s in args.sizes.split(",")]


def _rank(rank, n, port, args, queue):
    os.setsid()  # a session of its own, as mpiexec gives each MPI rank (autogroup scheduling: docs/performance-notes.md)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n),
                      LOCAL_WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
    import distcomm as d

    d.init_process_group("gloo")
    out = {}
    for op, size in _plan(args):
        out[(op, size)] = _measure(d.barrier, _distcomm_call(d, op, size // 4, rank, n), args.calls)
    d.destroy_process_group()
    queue.put((rank, out))


def _report(per_rank, label):
    keys = per_rank[0].keys()
    for op, size in keys:
        wall = max(r[(op, size)][0] for r in per_rank.values())
        cpu = max(r[(op, size)][1] for r in per_rank.values())
        print(f"{label:>10} {op:>20} {size >> 20:>4} MiB  wall {wall * 1e3:8.2f} ms  cpu {cpu * 1e3:8.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ops", default="all_gather,reduce_scatter,all_to_all")
    p.add_argument("--sizes", default="4M,16M,64M")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--label", default="distcomm")
    p.add_argument("--mpi", action="store_true")
    args = p.parse_args()
    if args.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, n = comm.Get_rank(), comm.Get_size()
        out = {}
        for op, size in _plan(args):
            out[(op, size)] = _measure(comm.Barrier, _mpi_call(comm, MPI, op, size // 4, rank, n), args.calls)
        everything = comm.gather(out, 0)
        if rank == 0:
            _report(dict(enumerate(everything)), "mpich")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    per_rank = dict(queue.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join(60)
    _report(per_rank, args.label)


if __name__ == "__main__":
    main()
