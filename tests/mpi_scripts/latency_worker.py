"""The MPI engine's latency paths (backends/mpi/latency.py), under mpiexec -n 2 or 3
(tests/test_mpi_engine.py). Prints ``<rank> <check> <value>`` lines.

Each path is called through the engine's FastPath (``engine.fast_path(group)``, the seam
ProcessGroup calls), so a line says both that the path took the call (it returned True) and what
the call computed. The calls are made:

1. on every rank through the path: all_reduce of numpy and torch (SUM, AVG, MAX of int64),
   all_gather_into_tensor, reduce_scatter_tensor (SUM, AVG), barrier, broadcast;
2. through the path on rank 0 and the general path (async_op=True) on the others: the two must
   make the same MPI call, or this hangs until the harness's deadline;
3. calls the path must decline (PREMUL_SUM, an output overlapping the input, too large);
4. the flight recorder's records of the calls of 1: op, sequence number, completed;
5. a path's call that times out (rank 1 joins 3 s late, past a 1.5 s timeout): the error names the
   op, sequence number and rank, the record says failed, the group is broken;
6. (made before 5) the records of calls through the public API name the caller's line and function;
7. (made before 6) all_reduces of more sizes than the group keeps persistent requests for, mixing
   the latency and general paths;
8. (made after 6) where it is built, a numpy all_reduce runs in C (the Python path never runs).
"""

import os
import time
from datetime import timedelta

import numpy as np
import torch

import distcomm as dist
from distcomm import flight_recorder as fr
from distcomm.buffers import as_buffer


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


dist.init_process_group("mpi", timeout=timedelta(seconds=60))
rank, size = dist.get_rank(), dist.get_world_size()
g = dist.new_group(list(range(size)))
paths = g.engine.fast_path(g)
SUM, AVG, MAX = dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX

# 1. every rank through the latency paths
a = np.full(3, float(rank + 1), np.float32)
took = paths.all_reduce(a, SUM)
say(f"{rank} all_reduce_numpy {took} {a.tolist()}")
t = torch.full((2, 2), float(rank + 1), dtype=torch.float64)
took = paths.all_reduce(t, AVG)
took2 = paths.all_reduce(t, SUM)  # the same tensor again: its cached view
say(f"{rank} all_reduce_torch {took} {took2} {t.flatten().tolist()}")
m = np.array([rank, -rank], np.int64)
took = paths.all_reduce(m, MAX)
say(f"{rank} all_reduce_max {took} {m.tolist()}")
out = torch.zeros(2 * size, dtype=torch.int32)
took = paths.allgather_into_tensor(as_buffer(out), as_buffer(torch.tensor([rank, 10 * rank], dtype=torch.int32)))
say(f"{rank} all_gather_into_tensor {took} {out.tolist()}")
inp = np.arange(2 * size, dtype=np.float32) + rank
rs = np.zeros(2, np.float32)
took = paths.reduce_scatter_tensor(as_buffer(rs), as_buffer(inp), SUM)
say(f"{rank} reduce_scatter_tensor {took} {rs.tolist()}")
rt = torch.zeros(2, dtype=torch.float32)
took = paths.reduce_scatter_tensor(as_buffer(rt), as_buffer(torch.from_numpy(inp)), AVG)
say(f"{rank} reduce_scatter_tensor_avg {took} {rt.tolist()}")
say(f"{rank} barrier {paths.barrier()}")
root = size - 1
c = np.full(3, 7.0 if rank == root else 0.0)
took = paths.broadcast(as_buffer(c), root)
say(f"{rank} broadcast {took} {c.tolist()}")
records = [(e[fr.OP], e[fr.SEQ], e[fr.STATE], e[fr.NBYTES]) for e in fr.recorder.entries()
           if e[fr.GROUP] == g.group_name]
say(f"{rank} records {records}")

# 2. rank 0 on the latency path, the others on the general path, for each collective
b = np.full(2, float(rank), np.float32)
if rank == 0:
    took = paths.all_reduce(b, SUM)
else:
    took = dist.all_reduce(b, group=g, async_op=True).wait()
say(f"{rank} mixed_all_reduce {took} {b.tolist()}")
o = np.zeros(size, np.int64)
i = np.array([rank + 5], np.int64)
if rank == 0:
    took = paths.allgather_into_tensor(as_buffer(o), as_buffer(i))
else:
    took = dist.all_gather_into_tensor(o, i, group=g, async_op=True).wait()
say(f"{rank} mixed_all_gather {took} {o.tolist()}")
r = np.zeros(1, np.float64)
x = np.arange(size, dtype=np.float64) * (rank + 1)
if rank == 0:
    took = paths.reduce_scatter_tensor(as_buffer(r), as_buffer(x), SUM)
else:
    took = dist.reduce_scatter_tensor(r, x, group=g, async_op=True).wait()
say(f"{rank} mixed_reduce_scatter {took} {r.tolist()}")
if rank == 0:
    took = paths.barrier()
else:
    took = dist.barrier(group=g, async_op=True).wait()
say(f"{rank} mixed_barrier {took}")
d = torch.full((2,), float(rank))
if rank == 0:
    took = paths.broadcast(as_buffer(d), 1)
else:
    took = dist.broadcast(d, src=1, group=g, async_op=True).wait()
say(f"{rank} mixed_broadcast {took} {d.tolist()}")

# 3. what the paths decline (having done nothing): the general path then runs it
whole = np.arange(2 * size, dtype=np.float32)
declined = [
    paths.all_reduce(np.ones(2, np.float32), dist._make_nccl_premul_sum(2.0)),
    paths.reduce_scatter_tensor(as_buffer(whole[:2]), as_buffer(whole), SUM),  # the output is in the input
    paths.all_reduce(np.ones(64 * 1024 // 4 + 1, np.float32), SUM),  # past LIMIT
    paths.all_reduce(np.ones(4, np.float16), SUM),  # MPI has no float16: distcomm's algorithms run it
    paths.broadcast(as_buffer(np.zeros(0)), 0),  # nothing to send
]
dist.all_reduce(np.ones(2, np.float32), group=g)  # the group still works in step on every rank
# DETAIL's shape check: the general path exchanges fingerprints first, so the paths on Buffers decline
dist.set_debug_level(dist.DebugLevel.DETAIL)
declined.append(paths.broadcast(as_buffer(np.zeros(2)), 0))
dist.set_debug_level(dist.DebugLevel.OFF)
say(f"{rank} declined {declined}")

# 7. more all_reduce sizes than a group keeps persistent requests for (backends/mpi/persistent.py),
# each taken by the latency path on some ranks and the general path on the others, alternating:
# every rank must make and free its requests at the same calls, or this hangs or sums wrongly
from distcomm.backends.mpi import persistent  # noqa: E402

sizes_ok = True
for rep in range(2):
    for count in range(1, persistent.CAPACITY + 5):
        v = np.full(count, float(rank + 1), np.float32)
        if (rank + count + rep) % 2 == 0:
            took = paths.all_reduce(v, SUM)
        else:
            took = dist.all_reduce(v, group=g, async_op=True).wait()
        sizes_ok = sizes_ok and took and v.tolist() == [float(size * (size + 1) // 2)] * count
say(f"{rank} persistent_sizes {sizes_ok}")

# 6. calls through the public API: each record names the caller's line and function, found by the
# latency path's one lookup (the groups are idle: every call takes its path; a barrier's record
# says 0 bytes there, None on the general path)
def public_calls():
    with open(__file__) as f:
        lines = f.read().splitlines()
    line = {m: next(i for i, text in enumerate(lines, 1) if text.endswith(f"# SITE-{m}")) for m in ("AR", "BC", "BA")}
    before = fr.recorder.recorded()
    dist.all_reduce(np.ones(2, np.float32), group=g)  # SITE-AR
    dist.broadcast(np.ones(2), src=0, group=g)  # SITE-BC
    dist.barrier(group=g)  # SITE-BA
    got = [(e["op"], e["nbytes"], e["site"]) for e in map(fr.to_dict, fr.recorder.entries()[before:])]
    want = [(op, nbytes, {"file": __file__, "line": line[m], "function": "public_calls"})
            for op, nbytes, m in (("all_reduce", 8, "AR"), ("broadcast", 16, "BC"), ("barrier", 0, "BA"))]
    return "ok" if got == want else f"{got} != {want}"


say(f"{rank} public_sites {public_calls()}")


# 8. where the all_reduce in C is built (backends/mpi/_mpi_calls.c), a numpy all_reduce never
# reaches the Python path (small_all_reduce, which stays its fallback); where the MPI library's
# MPI_Start and MPI_Test are found (library.py), the calls in C use them
def all_reduce_in_c():
    import sys

    from distcomm.backends.mpi import latency, library

    if not latency.ALL_REDUCE_IN_C:
        return "not built"
    calls = paths.all_reduce.__self__
    found = library.entry_points() is not None
    seen = set()

    def watch(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_name)

    v = np.ones(2, np.float32)
    dist.all_reduce(v, group=g)
    sys.setprofile(watch)
    try:
        for _ in range(5):
            dist.all_reduce(v, group=g)
    finally:
        sys.setprofile(None)
    return "python path" if "small_all_reduce" in seen else f"yes direct={calls.direct} found={found}"


say(f"{rank} all_reduce_in_c {all_reduce_in_c()}")

# 5. a latency-path call that times out inside MPI
s = dist.new_group(list(range(size)), timeout=timedelta(seconds=1.5))
spaths = s.engine.fast_path(s)
if rank == 1:
    time.sleep(3)
try:
    took = spaths.allgather_into_tensor(as_buffer(np.zeros(size, np.int64)), as_buffer(np.array([rank])))
    say(f"{rank} timeout ok {took}")
except Exception as exc:  # noqa: BLE001 - printed for the test
    say(f"{rank} timeout {type(exc).__name__}: {str(exc).splitlines()[0]}")
last = [e for e in fr.recorder.entries() if e[fr.GROUP] == s.group_name][-1]
say(f"{rank} timeout_record {last[fr.OP]} {last[fr.SEQ]} {last[fr.STATE]}")
if rank == 0:
    try:
        dist.barrier(group=s)  # the general path: the latency path declines a broken group
        say(f"{rank} after_timeout ok")
    except Exception as exc:  # noqa: BLE001
        say(f"{rank} after_timeout {type(exc).__name__}: {str(exc).splitlines()[0]}")
dist.barrier()
dist.destroy_process_group()
say(f"{rank} finished")
