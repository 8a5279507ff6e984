"""Large all_gather / all_to_all in their list and single-tensor forms: wall time and CPU per call.

    PYTHONPATH=<a distcomm tree>/src python docs/scripts/large_lists.py [--bytes 64M] [--world 2]
    mpiexec -n 2 python docs/scripts/large_lists.py --mpi [--bytes 64M]

distcomm: torch tensors through ``import distcomm as dist`` (default engine), ``all_gather`` into a
list, ``all_gather_into_tensor``, ``all_to_all`` of lists and ``all_to_all_single``; ``--mpi``:
mpi4py's ``Allgather``/``Alltoall`` on numpy buffers (MPI has no list forms). Each form: 2 warmup
calls, then 8 calls each after a barrier; per rank the median wall time and the mean
``time.process_time`` per call (system time included: process_vm_readv copies in the kernel). Rows
report the slowest rank. busbw = size/time·(p-1)/p (nccl-tests). Only public calls, so any commit
of distcomm can be measured against another. Results are checked.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time

import numpy as np


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _measure(barrier, fn):
    for _ in range(2):
        fn()
    walls = []
    cpu = time.process_time()
    for _ in range(8):
        barrier()
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    return sorted(walls)[len(walls) // 2], (time.process_time() - cpu) / 8


def _distcomm_rank(rank: int, world: int, nbytes: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    import distcomm as dist

    dist.init_process_group("gloo", init_method="env://")
    n = nbytes // 4 // world
    inp = torch.full((n,), float(rank + 1))
    outs = [torch.empty(n) for _ in range(world)]
    flat = torch.empty(n * world)
    sends = [torch.full((n,), float(rank * world + q)) for q in range(world)]
    recvs = [torch.empty(n) for _ in range(world)]
    send1, recv1 = torch.cat(sends), torch.empty(n * world)
    rows = {
        "all_gather (list)": lambda: dist.all_gather(outs, inp),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(flat, inp),
        "all_to_all (list)": lambda: dist.all_to_all(recvs, sends),
        "all_to_all_single": lambda: dist.all_to_all_single(recv1, send1),
    }
    out = {name: _measure(dist.barrier, fn) for name, fn in rows.items()}
    assert all(bool((outs[q] == q + 1).all()) for q in range(world))
    assert bool((flat.view(world, n)[:, 0] == torch.arange(1, world + 1)).all())
    assert all(bool((recvs[q] == q * world + rank).all()) for q in range(world))
    dist.destroy_process_group()
    queue.put(out)


def _mpi(nbytes: int) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    world, rank = comm.size, comm.rank
    n = nbytes // 4 // world
    inp, flat = np.full(n, rank + 1, np.float32), np.empty(n * world, np.float32)
    send, recv = np.ones(n * world, np.float32), np.empty(n * world, np.float32)
    out = {"Allgather": _measure(comm.Barrier, lambda: comm.Allgather(inp, flat)),
           "Alltoall": _measure(comm.Barrier, lambda: comm.Alltoall(send, recv))}
    return comm.gather(out, root=0)


def _print(results, nbytes: int, world: int) -> None:
    print(f"# {nbytes} B, world {world}: slowest rank's median wall time, mean CPU per call")
    print(f"{'form':<26}{'time (ms)':>10}{'busbw (GB/s)':>14}{'CPU (ms)':>10}")
    for name in results[0]:
        wall = max(r[name][0] for r in results)
        cpu = max(r[name][1] for r in results)
        print(f"{name:<26}{wall * 1e3:>10.1f}{nbytes / wall * (world - 1) / world / 1e9:>14.2f}{cpu * 1e3:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", default="64M")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mpi", action="store_true", help="run under mpiexec: mpi4py's buffer calls")
    args = parser.parse_args()
    nbytes = _size(args.bytes)
    if args.mpi:
        results = _mpi(nbytes)
        if results is not None:
            _print(results, nbytes, len(results))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_distcomm_rank, args=(r, args.world, nbytes, port, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    _print(results, nbytes, args.world)


if __name__ == "__main__":
    main()
