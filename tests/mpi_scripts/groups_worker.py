"""Groups on the MPI engine, under mpiexec -n 3 (tests/test_mpi_engine.py). Prints
``<rank> <check> <value>`` lines.

1. a world on the default engine with an "mpi" group of ranks [2, 0] (an engine connected among its
   members only: their communicator is made from MPI_COMM_WORLD by Create_group);
2. a world on "mpi" with new_group([1, 2]), subgroups [[0, 2], [1]] and split_group [[2, 1]], a group
   destroyed and its communicator freed, then every rank's own mpi4py calls on MPI_COMM_WORLD still working.
"""

import os

import numpy as np
from mpi4py import MPI

import distcomm as dist


def say(line: str) -> None:
    """One write per line: mpiexec forwards the ranks' output in chunks, and a line printed in
    two writes could be split by another rank's."""
    os.write(1, (line + "\n").encode())


dist.init_process_group()
rank = dist.get_rank()
say(f"{rank} local_rank {dist.get_node_local_rank()}")  # MPI_LOCALRANKID: no LOCAL_RANK under mpiexec
g = dist.new_group([2, 0], backend="mpi")
if rank in (0, 2):
    t = np.full(2, float(rank + 1))
    dist.all_reduce(t, group=g)
    b = np.full(3, float(rank))
    dist.broadcast(b, src=2, group=g)
    say(f"{rank} default+mpi_group {dist.get_backend(g)} {t.tolist()} {b.tolist()}")
dist.destroy_process_group()

dist.init_process_group("mpi")
h = dist.new_group([1, 2])
if rank in (1, 2):
    t = np.full(1, rank, np.int64)
    dist.all_reduce(t, group=h, op=dist.ReduceOp.MAX)
    x = np.zeros(2, np.float16)
    if rank == 1:
        dist.send(np.ones(2, np.float16), dst=2, group=h)
    else:
        src = dist.recv(x, group=h)
        say(f"{rank} recv_any {src} {x.tolist()}")
    say(f"{rank} group12 {t.tolist()}")
    dist.destroy_process_group(h)
sub, _ = dist.new_subgroups_by_enumeration([[0, 2], [1]])
t = np.full(2, float(rank + 1), np.float32)
dist.all_reduce(t, group=sub, op=dist.ReduceOp.AVG)
say(f"{rank} subgroup {dist.get_world_size(sub)} {t.tolist()}")
half = dist.split_group(split_ranks=[[2, 1]])  # every rank makes the split (MPI: Create_group); rank 0 gets None
if half is not None:
    t = np.full(1, float(rank), np.float32)
    dist.all_reduce(t, group=half)
    say(f"{rank} split {dist.get_process_group_ranks(half)} {t.tolist()}")
else:
    say(f"{rank} split None")
dist.barrier()  # rank 0 hosts the store, which ranks 1 and 2 use to agree on their split's members
dist.destroy_process_group()
total = MPI.COMM_WORLD.allreduce(rank)
say(f"{rank} own_mpi {total}")
