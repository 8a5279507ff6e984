"""The end-to-end worker: what a user writes for torchrun, run under distcomm-run unchanged."""

import os

import numpy as np

import distcomm as dist

dist.init_process_group("gloo")  # env:// from the launcher's environment, nothing else
rank, world = dist.get_rank(), dist.get_world_size()
x = np.full(4, float(rank + 1))
dist.all_reduce(x)
print(f"rank {rank}/{world} restart {os.environ['TORCHELASTIC_RESTART_COUNT']} sum {x.tolist()}", flush=True)
fail_until = int(os.environ.get("TEST_FAIL_UNTIL_RESTART", "0"))
if rank == world - 1 and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < fail_until:
    raise SystemExit(5)  # fail after the collective: the restarted round must rendezvous afresh
dist.destroy_process_group()
