"""The end-to-end worker: a torchrun-style script run under distcomm-run.

``init_process_group("gloo")`` with no other argument (env://), or, with ``--explicit-store``, the
store built by hand from the launcher's environment contract: a client of the launcher's store
(TORCHELASTIC_USE_AGENT_STORE) under this round's prefix (DISTCOMM_STORE_PREFIX). Then an
all_reduce. With TEST_FAIL_UNTIL_RESTART=k the last rank exits 5 after the collective in rounds
before k, so the restarted round must rendezvous afresh on the same store.
"""

import os
import sys
from datetime import timedelta

import numpy as np

import distcomm as dist

if "--explicit-store" in sys.argv:
    from distcomm.store import PrefixStore, TCPStore

    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    client = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timedelta(seconds=30))
    dist.init_process_group(
        "gloo",
        store=PrefixStore(os.environ["DISTCOMM_STORE_PREFIX"], client),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
else:
    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x = np.full(4, float(rank + 1))
dist.all_reduce(x)
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"rank {rank}/{world} restart {restart} sum {x.tolist()}", flush=True)
if rank == world - 1 and restart < int(os.environ.get("TEST_FAIL_UNTIL_RESTART", "0")):
    raise SystemExit(5)
dist.destroy_process_group()
