"""A rank's program ends in the middle of an MPI job (tests/test_mpi_fail_fast.py), under
``mpiexec -n 3``: its exit waits in MPI_Finalize, so its peers cannot see its process end; they
must still fail at once, naming it and its cause.

    fail_fast_worker.py <backend> <scenario> <culprit>

Every rank initialises (a 10-minute timeout: nobody may wait it out), makes one all_reduce and a
barrier, then the culprit, 0.3 s later (the others are in their next all_reduce by then):

* ``raise``: raises ValueError from load_batch (an uncaught exception);
* ``exit``: calls sys.exit(3);
* ``busy``: raises, while rank 2 sleeps for 10 minutes instead of calling a collective: the
  job must end anyway (MPI_Abort once DISTCOMM_MPI_EXIT_GRACE has passed);
* ``finally``: raises inside ``try: ... finally: destroy_process_group()``, as many programs do;
* ``clean``: nobody fails; every rank ends without destroy_process_group (rank 0 a second late).

The others print one JSON line each (one write: mpiexec forwards output in chunks): their error,
its type and how long their all_reduce took to fail; then they re-raise it, as a program that does
not catch it would.
"""

import json
import os
import sys
import time
from datetime import timedelta

import numpy as np

import distcomm as dist

backend, scenario, culprit = sys.argv[1], sys.argv[2], int(sys.argv[3])


def say(**fields) -> None:
    os.write(1, (json.dumps(fields) + "\n").encode())


def load_batch(i):
    raise ValueError(f"bad batch {i}")  # RAISE


def main() -> None:
    rank = dist.get_rank()
    x = np.ones(4, dtype=np.float32)
    dist.all_reduce(x)
    dist.barrier()
    if scenario == "clean":
        dist.all_reduce(x)
        if rank == 0:
            time.sleep(1.0)
        say(rank=rank, event="done", value=float(x[0]))
        return
    if rank == culprit:
        time.sleep(0.3)
        if scenario == "exit":
            sys.exit(3)
        load_batch(57)
    if scenario == "busy" and rank == 2:
        time.sleep(600)
        say(rank=rank, event="woke")  # never: the job is aborted first
    t0 = time.monotonic()
    try:
        for _ in range(3):
            dist.all_reduce(x)
        say(rank=rank, event="completed")
    except dist.DistError as exc:
        say(rank=rank, event="error", type=type(exc).__name__, error=str(exc)[:2500],
            elapsed=round(time.monotonic() - t0, 3))
        raise


dist.init_process_group(**({} if backend == "default" else {"backend": backend}), timeout=timedelta(minutes=10))
if scenario == "finally":
    try:
        main()
    finally:
        dist.destroy_process_group()
else:
    main()
