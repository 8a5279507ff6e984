"""A rank dies in the middle of an MPI job (tests/test_mpi_engine.py): rank 1 kills itself with
SIGKILL while rank 0 waits in an all_reduce with a 10-minute timeout. MPICH's launcher must end
the whole job; rank 0 must never print "survived"."""

import os
import signal
import sys
from datetime import timedelta

import numpy as np

import distcomm as dist

dist.init_process_group(sys.argv[1], timeout=timedelta(minutes=10))
rank = dist.get_rank()
dist.all_reduce(np.ones(4))
os.write(1, f"{rank} initialised\n".encode())
dist.barrier()  # both have said so: MPICH ends the job at once when rank 1 dies, before rank 0's write
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(np.ones(4))
os.write(1, f"{rank} survived\n".encode())
