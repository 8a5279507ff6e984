"""A rank catches the DistError of a failed collective and ends its program itself
(tests/test_mpi_caught_fault.py), under ``mpiexec -n 3``.

    caught_fault_worker.py <backend> <scenario> <late> <token>

Every rank initialises (a 2 s timeout), makes one all_reduce and a barrier; then rank ``late`` (1,
or 0: the store's host) does not join the next all_reduce, which times out on the other two. They
catch the DistTimeoutError, print one JSON line and end their program. Rank ``late``:

* ``stuck``: sleeps for 10 minutes (a data loader that never returns); the others then call
  ``sys.exit(1)``, the common pattern: the job must still end (MPI_Abort once
  DISTCOMM_MPI_EXIT_GRACE has passed), not wait in MPI_Finalize for it;
* ``late``: sleeps 3 s, then ends its program normally, as the others do (they return, exit status
  0): every rank has left within the grace, so nothing may be aborted;
* ``late_destroy``: the same, but it calls destroy_process_group before it ends: it has left too.
"""

import json
import os
import sys
import time
from datetime import timedelta

import numpy as np

import distcomm as dist

backend, scenario, late = sys.argv[1], sys.argv[2], int(sys.argv[3])


def say(**fields) -> None:
    os.write(1, (json.dumps(fields) + "\n").encode())


dist.init_process_group(**({} if backend == "default" else {"backend": backend}), timeout=timedelta(seconds=2))
rank = dist.get_rank()
x = np.ones(4, dtype=np.float32)
dist.all_reduce(x)
dist.barrier()
if rank == late:
    time.sleep(600 if scenario == "stuck" else 3.0)
    say(rank=rank, event="woke")  # never in "stuck": the job is aborted first
    if scenario == "late_destroy":
        dist.destroy_process_group()
else:
    try:
        dist.all_reduce(x)
        say(rank=rank, event="completed")
    except dist.DistError as exc:
        say(rank=rank, event="caught", type=type(exc).__name__)
        if scenario == "stuck":
            sys.exit(1)
