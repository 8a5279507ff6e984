"""The MPI engine's overhead over raw mpi4py: ``mpiexec -n 2 python -m distcomm.bench.mpi_engine``.

For each size, rounds alternate between mpi4py's own ``Comm.Allreduce`` (in place, SUM of float32,
on a communicator of its own) and ``distcomm.all_reduce`` on backend "mpi" over the same numpy
array, so both see the same machine load; the median round of each is reported, as time per call
(wall clock), CPU time per call (time.thread_time, which contention on a shared machine inflates
less) and, for large sizes, bus bandwidth (2(n-1)/n x bytes / time, as nccl-tests count it), with
the engine/raw ratios; and the best round of each (the least disturbed by other processes). No RANK or MASTER_ADDR is needed: the job learns them from mpiexec.

Options: ``--sizes 8,67108864`` (bytes), ``--rounds 7``, ``--seconds 0.3`` (the target length of
one round; at least 2 calls).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def _round(fn, calls: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls, (time.thread_time() - c0) / calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m distcomm.bench.mpi_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,67108864", help="message sizes in bytes, comma-separated")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=0.3, help="target length of one round")
    args = p.parse_args(argv)

    import distcomm as dist
    from distcomm.transport.mpi import load_mpi

    MPI = load_mpi()
    dist.init_process_group("mpi")
    rank, size = dist.get_rank(), dist.get_world_size()
    comm = MPI.COMM_WORLD.Dup()
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        a = np.ones(max(1, nbytes // 4), np.float32)

        def raw():
            comm.Allreduce(MPI.IN_PLACE, [a, MPI.FLOAT], MPI.SUM)

        def engine():
            dist.all_reduce(a)

        # calls per round from a first timing of raw MPI, agreed by all ranks
        dt, _ = _round(raw, 3)
        calls = comm.bcast(max(2, int(args.seconds / max(dt, 1e-7))) if rank == 0 else None, root=0)
        results = {"raw": [], "engine": []}
        for _ in range(args.rounds):
            for name, fn in (("raw", raw), ("engine", engine)):
                comm.Barrier()
                results[name].append(_round(fn, calls))
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in results.items()}
        best = {k: min(w for w, _ in v) for k, v in results.items()}
        rows.append((a.nbytes, calls, med["raw"], med["engine"], best["raw"], best["engine"]))
    comm.Free()
    dist.destroy_process_group()
    if rank == 0:
        print(f"MPI engine vs raw mpi4py Allreduce (float32 SUM, world {size}, median of {args.rounds} rounds)")
        print(f"{'bytes':>10} {'calls':>6} {'raw us':>10} {'engine us':>10} {'ratio':>6} {'raw cpu':>9} "
              f"{'eng cpu':>9} {'ratio':>6} {'raw GB/s':>9} {'eng GB/s':>9} {'bw ratio':>8} {'best raw':>9} "
              f"{'best eng':>9} {'ratio':>6}")
        for nbytes, calls, (rw, rc), (ew, ec), br, be in rows:
            bus = 2 * (size - 1) / size * nbytes / 1e9
            print(f"{nbytes:>10} {calls:>6} {rw * 1e6:>10.2f} {ew * 1e6:>10.2f} {ew / rw:>6.2f} {rc * 1e6:>9.2f} "
                  f"{ec * 1e6:>9.2f} {ec / max(rc, 1e-12):>6.2f} {bus / rw:>9.2f} {bus / ew:>9.2f} {rw / ew:>8.2f} "
                  f"{br * 1e6:>9.2f} {be * 1e6:>9.2f} {be / br:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
