"""Errors on the MPI engine, under mpiexec -n 2 (tests/test_mpi_engine.py): each line printed is
``<rank> <check> <error class>: <message>`` for the test to check.

1. rank 1 joins an all_reduce 3 s late, past rank 0's 1.5 s timeout: rank 0's DistTimeoutError;
2. a receive nobody sends to times out (and its receive is cancelled);
3. a receive of 16 bytes given 8, and of 8 bytes given 16: mismatches naming the peer;
4. a send/recv with a tag past the exact range, and send_object_list, still work;
5. an all_to_all_single whose splits are even on one rank only.
"""

import os
import time
from datetime import timedelta

import numpy as np

import distcomm as dist


def say(line: str) -> None:
    """One write per line: mpiexec forwards the ranks' output in chunks, and a line printed in
    two writes could be split by another rank's."""
    os.write(1, (line + "\n").encode())


dist.init_process_group("mpi", timeout=timedelta(seconds=60))
SHORT = timedelta(seconds=1.5)  # the groups whose calls are meant to time out
rank = dist.get_rank()


def report(check, fn):
    try:
        fn()
        say(f"{rank} {check} ok")
    except Exception as exc:  # noqa: BLE001 - printed for the test
        say(f"{rank} {check} {type(exc).__name__}: {exc}".replace("\n", " "))


# 1. a collective that times out inside MPI; the late rank completes it, so MPI finishes cleanly
g = dist.new_group([0, 1], timeout=SHORT)
if rank == 1:
    time.sleep(3)
report("timeout_all_reduce", lambda: dist.all_reduce(np.ones(4, np.float32), group=g))
report("after_timeout", lambda: dist.all_reduce(np.ones(4, np.float32), group=g) if rank == 0 else None)
dist.barrier()

# 2. a receive that times out
h = dist.new_group([0, 1], timeout=SHORT)
if rank == 0:
    report("timeout_recv", lambda: dist.recv(np.zeros(2, np.float32), src=1, tag=5, group=h))
dist.barrier()

# 3. size mismatches in both directions
if rank == 0:
    dist.send(np.ones(2, np.float32), dst=1, tag=7)
    dist.send(np.ones(4, np.float32), dst=1, tag=8)
else:
    report("recv_longer_than_sent", lambda: dist.recv(np.zeros(4, np.float32), src=0, tag=7))
    report("recv_shorter_than_sent", lambda: dist.recv(np.zeros(2, np.float32), src=0, tag=8))
dist.barrier()

# 4. tags outside the exact range, and object lists (which use a tag of -2**62)
big = (1 << 40) + 3
if rank == 0:
    dist.send(np.full(3, 9.0), dst=1, tag=big)
    dist.send_object_list([{"a": 1}, "two"], dst=1)
else:
    buf = np.zeros(3)
    report("big_tag", lambda: dist.recv(buf, src=0, tag=big) and None)
    objs = [None, None]
    dist.recv_object_list(objs, src=0)
    say(f"{rank} values {buf.tolist()} {objs}")
# 5. all_to_all_single whose splits are even on rank 0 ([1, 1] both ways) and uneven on rank 1
send_splits, recv_splits = ([1, 1], [1, 1]) if rank == 0 else ([1, 2], [1, 2])
inp = np.arange(sum(send_splits), dtype=np.float64) + 10 * rank
out = np.zeros(sum(recv_splits))
dist.all_to_all_single(out, inp, recv_splits, send_splits)
say(f"{rank} a2a_mixed {out.tolist()}")
dist.destroy_process_group()
say(f"{rank} finished")
