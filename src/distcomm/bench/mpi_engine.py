"""The MPI engine's overhead over raw mpi4py: ``mpiexec -n 2 python -m distcomm.bench.mpi_engine``.

For each size, rounds alternate between mpi4py's own ``Comm.Allreduce`` (in place, SUM of float32,
on a communicator of its own) and ``distcomm.all_reduce`` on backend "mpi" over the same numpy
array, so both see the same machine load; the median round of each is reported, as time per call
(wall clock), CPU time per call (time.thread_time, which contention on a shared machine inflates
less) and, for large sizes, bus bandwidth (2(n-1)/n x bytes / time, as nccl-tests count it), with
the engine/raw ratios; the best round of each (the least disturbed by other processes); and, for
sizes up to 64 KiB, the 10th percentile of single calls timed one by one (``--each`` calls of each,
alternating), which on a loaded machine is the closest to an idle one's time per call: most calls
there are slowed by a peer descheduled, the fastest tenth are not. No RANK or MASTER_ADDR is
needed: the job learns them from mpiexec.

Options: ``--sizes 8,67108864`` (bytes), ``--rounds 7``, ``--seconds 0.3`` (the target length of
one round; at least ``--min-calls``, default 2), ``--each 2000``.

``--phases``: instead, where the CPU of one 8 B all_reduce goes (time.thread_time per call, the
least of 5 loops of ``--calls`` calls, rank 0's numbers): each phase of the call alone, in a loop
of its own (the local ones communicate nothing), against the whole call, raw and through distcomm,
and the latency path alone (``ProcessGroup.fast_all_reduce``). Under
``mpiexec -n 1`` nothing waits for a peer, so the whole calls are the CPU each costs on its own;
the engine has no latency path for a world of one (nothing to wait for: the general path runs),
so the bench builds the MPI latency path on it itself to time it.
"""

from __future__ import annotations

import argparse
import math
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
    p.add_argument("--min-calls", type=int, default=2, help="calls per round at least")
    p.add_argument("--each", type=int, default=2000, help="single calls timed one by one (sizes <= 64 KiB)")
    p.add_argument("--phases", action="store_true", help="CPU per phase of an 8 B all_reduce (see above)")
    p.add_argument("--calls", type=int, default=20000, help="calls per phase (with --phases)")
    args = p.parse_args(argv)
    if args.phases:
        return phases(args.calls)

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
        calls = comm.bcast(max(args.min_calls, 2, int(args.seconds / max(dt, 1e-7))) if rank == 0 else None, root=0)
        results = {"raw": [], "engine": []}
        for _ in range(args.rounds):
            for name, fn in (("raw", raw), ("engine", engine)):
                comm.Barrier()
                results[name].append(_round(fn, calls))
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in results.items()}
        best = {k: min(w for w, _ in v) for k, v in results.items()}
        p10 = {"raw": math.nan, "engine": math.nan}
        if a.nbytes <= 64 * 1024:
            each = {"raw": [], "engine": []}
            comm.Barrier()
            for _ in range(args.each):
                for name, fn in (("raw", raw), ("engine", engine)):
                    t0 = time.perf_counter_ns()
                    fn()
                    each[name].append(time.perf_counter_ns() - t0)
            p10 = {k: sorted(v)[len(v) // 10] / 1e9 for k, v in each.items()}
        rows.append((a.nbytes, calls, med["raw"], med["engine"], best["raw"], best["engine"], p10["raw"],
                     p10["engine"]))
    comm.Free()
    dist.destroy_process_group()
    if rank == 0:
        print(f"MPI engine vs raw mpi4py Allreduce (float32 SUM, world {size}, median of {args.rounds} rounds)")
        print(f"{'bytes':>10} {'calls':>6} {'raw us':>10} {'engine us':>10} {'ratio':>6} {'raw cpu':>9} "
              f"{'eng cpu':>9} {'ratio':>6} {'raw GB/s':>9} {'eng GB/s':>9} {'bw ratio':>8} {'best raw':>9} "
              f"{'best eng':>9} {'ratio':>6} {'p10 raw':>8} {'p10 eng':>8} {'ratio':>6}")
        for nbytes, calls, (rw, rc), (ew, ec), br, be, pr, pe in rows:
            bus = 2 * (size - 1) / size * nbytes / 1e9
            print(f"{nbytes:>10} {calls:>6} {rw * 1e6:>10.2f} {ew * 1e6:>10.2f} {ew / rw:>6.2f} {rc * 1e6:>9.2f} "
                  f"{ec * 1e6:>9.2f} {ec / max(rc, 1e-12):>6.2f} {bus / rw:>9.2f} {bus / ew:>9.2f} {rw / ew:>8.2f} "
                  f"{br * 1e6:>9.2f} {be * 1e6:>9.2f} {be / br:>6.2f} {pr * 1e6:>8.2f} {pe * 1e6:>8.2f} "
                  f"{pe / pr:>6.2f}")
    return 0


def phases(calls: int) -> int:
    """Print the CPU per call of each phase of an 8 B float32 SUM all_reduce (see the module doc)."""
    import distcomm as dist
    from distcomm import diagnostics
    from distcomm import flight_recorder as fr
    from distcomm._api import args as api_args
    from distcomm.dtypes import from_numpy
    from distcomm.profiling import profiling
    from distcomm.transport.mpi import load_mpi
    from distcomm.types import RedOpType
    from distcomm.work import Work

    MPI = load_mpi()
    dist.init_process_group("mpi")
    rank, size = dist.get_rank(), dist.get_world_size()
    comm = MPI.COMM_WORLD.Dup()
    a = np.ones(2, np.float32)
    pg = api_args.resolve_group(None, "all_reduce")
    dist.all_reduce(a)  # builds the latency path
    if size == 1:
        from distcomm.backends.mpi import latency

        pg.fast_all_reduce = latency.build(pg, pg.collectives).all_reduce
        assert pg.fast_all_reduce(a, RedOpType.SUM)
    SUM, IN_PLACE, FLOAT, MSUM = RedOpType.SUM, MPI.IN_PLACE, MPI.FLOAT, MPI.SUM
    enter, leave = pg.executor.enter_inline, pg.executor.leave_inline
    plans = {SUM: {a.dtype.num: (FLOAT, MSUM, from_numpy(a.dtype))}}

    def cpu(fn, sync: bool) -> float:
        """The least CPU per call of 5 loops of ``calls`` (the least disturbed by other processes)."""
        best = math.inf
        for _ in range(5):
            if sync:
                comm.Barrier()
            c0 = time.thread_time()
            for _ in range(calls):
                fn()
            best = min(best, (time.thread_time() - c0) / calls * 1e6)
        return best

    def p_args():
        api_args.resolve_group(None, "all_reduce")
        diagnostics.check_shapes or pg.fast_all_reduce

    def p_view():
        flags = a.flags
        flags.c_contiguous and flags.writeable
        a if a.ndim == 1 else a.reshape(-1)
        a.__class__ is np.ndarray

    def p_mapping():
        SUM.__class__ is RedOpType and 0 < a.nbytes <= 65536
        by_dtype = plans[SUM]
        num = a.dtype.num
        by_dtype[num] if num in by_dtype else None

    def p_claim():
        profiling()
        enter()
        leave()

    def p_seq():
        pg.next_seq()

    rec = fr.recorder
    fast = pg.fast_all_reduce
    # The calls whose flight recorder records look for the user's frame are made from functions
    # compiled as a user program's, through a function compiled as distcomm's own standing for the
    # API function: the recorder then finds the user's frame where it does in a program (one frame
    # above the API function), not by a walk up through this bench's files.
    inner: dict = {"fast": fast, "rec": rec, "fr": fr, "time": time}
    exec(compile(
        "def api_all_reduce(a, op):\n    return fast(a, op)\n"
        # as the latency path records: started, then the path's own frame, then the API function
        "def api_record():\n    return path_record()\n"
        "def path_record():\n"
        "    e = rec.started('bench', 1, 'all_reduce', 8, 'float32', None, 3)\n"
        "    e[fr.T_COMPLETED], e[fr.STATE] = time.time(), fr.COMPLETED\n",
        fr.__file__, "exec"), inner)
    user: dict = {"dist": dist, "a": a, "SUM": SUM, "rec": rec, "api_all_reduce": inner["api_all_reduce"],
                  "api_record": inner["api_record"]}
    exec(compile(
        "def p_engine():\n    dist.all_reduce(a)\n"
        "def p_path():\n    api_all_reduce(a, SUM)\n"
        "def p_record():\n"
        "    if rec is not None:\n"
        "        api_record()\n",
        "<user program>", "exec"), user)
    p_engine, p_path, p_record = user["p_engine"], user["p_path"], user["p_record"]

    def p_work():
        Work("all_reduce", None)

    def p_raw():
        comm.Allreduce(IN_PLACE, [a, FLOAT], MSUM)

    def p_nonblocking():
        req = comm.Iallreduce(IN_PLACE, [a, FLOAT], MSUM)
        while not req.Test():
            pass


    rows = [
        ("arg checks (resolve_group, check_shapes, fast_all_reduce lookup)", cpu(p_args, False)),
        ("buffer view (type, flags, reshape)", cpu(p_view, False)),
        ("ReduceOp/dtype -> MPI datatype/op (cached plan lookup)", cpu(p_mapping, False)),
        ("executor claim/release (+ profiler check)", cpu(p_claim, False)),
        ("sequence number", cpu(p_seq, False)),
        ("flight recorder record + complete (+2 calls)" + ("" if rec else " (recorder off)"), cpu(p_record, False)),
        ("Work creation (general path only)", cpu(p_work, False)),
        ("MPI: Iallreduce + Test loop", cpu(p_nonblocking, True)),
        ("MPI: blocking Allreduce (= raw mpi4py)", cpu(p_raw, True)),
        ("the latency path alone (pg.fast_all_reduce, +1 call)", cpu(p_path, True)),
        ("whole dist.all_reduce (latency path)", cpu(p_engine, True)),
        ("whole raw comm.Allreduce again", cpu(p_raw, True)),
    ]
    comm.Free()
    dist.destroy_process_group()
    if rank == 0:
        print(f"CPU per call of an 8 B float32 SUM all_reduce, world {size}, {calls} calls per phase (rank 0)")
        for name, us in rows:
            print(f"{us:>9.2f} us  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
