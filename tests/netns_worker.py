"""The worker tests/test_multihost_netns.py runs with distcomm-run on each namespaced host.

    python netns_worker.py describe <out_dir>
    python netns_worker.py diff <out_dir> <oracle_port> <case,case,...>
    python netns_worker.py loop <out_dir>
    python netns_worker.py bench <out_dir> <nbytes,nbytes,...> <iterations,iterations,...>

describe: init the default engine and write what it is made of (``describe<rank>.json``: hostname,
engine and transport classes, the ranks it reaches over shared memory, its TCP connections), after
one all_reduce whose result is checked.
diff: describe, then the differential cases (tests/diff_cases.py) on torch's gloo (with its own
TCPStore at MASTER_ADDR:<oracle_port>, since torch cannot talk to distcomm-run's store) and on
distcomm's default engine; both results go to ``diff<rank>.pkl`` for the test to compare.
loop: all_reduce until something fails (a host is killed); ``ready<rank>`` marks the first one done.
bench: all_reduce (float32 SUM) per size on the default engine (the world group) and on a
``backend="tcp"`` group of the same ranks, alternating: the slowest rank's median wall seconds and
median process CPU seconds (all threads) per call; rank 0 writes ``bench.json``.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import sys
import time
from datetime import timedelta

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TIMEOUT = timedelta(seconds=60)


def describe(dist, out: str) -> dict:
    pg = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    t = np.full(4, rank + 1, dtype=np.float32)
    dist.all_reduce(t)
    assert t.tolist() == [size * (size + 1) / 2] * 4, t
    transport = pg.transport
    info = {
        "rank": rank,
        "hostname": socket.gethostname(),
        "engine": type(pg.engine).__name__,
        "collectives": type(pg.collectives).__name__,
        "host_collectives": type(getattr(pg.collectives, "host", None)).__name__,
        "transport": type(transport).__name__,
        "local_ranks": getattr(transport, "local_ranks", None),
        "shm": type(getattr(transport, "shm", None)).__name__,
        "tcp": type(getattr(transport, "tcp", None)).__name__,
        "connections": {str(q): list(map(list, c)) for q, c in transport.tcp.connections().items()}
        if hasattr(transport, "tcp") else {},
    }
    with open(os.path.join(out, f"describe{rank}.json"), "w") as f:
        json.dump(info, f)
    dist.barrier()  # nobody closes its connections (destroy) before everyone has listed theirs
    return info


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "diff":
        import diff_cases as dc

        from distcomm.store import TCPStore

        port, only = sys.argv[3], sys.argv[4].split(",")
        # the cases are kept apart by a barrier on distcomm-run's store, outside both frameworks
        launcher_store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, TIMEOUT)
        saved = {k: os.environ.get(k) for k in ("MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")}
        os.environ["MASTER_PORT"] = port
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE")  # torch's rank 0 hosts its own store
        expected = dc.run_cases(rank, size, "torch", "gloo", only, numpy=False,
                                between=dc.store_barrier(launcher_store, size, "diff/torch"))
        for k, v in saved.items():
            os.environ[k] = v
    import distcomm as dist

    dist.init_process_group(timeout=TIMEOUT)
    if mode == "describe":
        describe(dist, out)
    elif mode == "diff":
        describe(dist, out)
        dist.destroy_process_group()
        got = dc.run_cases(rank, size, "distcomm", "gloo", only, numpy=False,
                           between=dc.store_barrier(launcher_store, size, "diff/distcomm"))
        with open(os.path.join(out, f"diff{rank}.pkl"), "wb") as f:
            pickle.dump({"torch": expected, "distcomm": got}, f)
        return
    elif mode == "loop":
        t = np.ones(1 << 16, dtype=np.float32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        open(os.path.join(out, f"ready{rank}"), "w").close()
        while True:  # until a peer is lost: the error propagates, the worker exits non-zero
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    elif mode == "bench":
        sizes, iters = [int(s) for s in sys.argv[3].split(",")], [int(s) for s in sys.argv[4].split(",")]
        groups = {"default": None, "tcp": dist.new_group(backend="tcp")}
        result: dict[str, dict[int, list[float]]] = {name: {} for name in groups}
        for nbytes, n in zip(sizes, iters):
            t = np.ones(nbytes // 4, dtype=np.float32)
            wall = {name: [] for name in groups}
            cpu = {name: [] for name in groups}
            # the hierarchical collectives time their phases when given a list (phase_log)
            hier = getattr(dist.group.WORLD, "collectives", None)
            phases = [] if hasattr(hier, "phase_log") else None
            for i in range(n + 2):  # two warm-ups; the engines alternate, so a noisy moment hits both
                for name, group in groups.items():
                    dist.barrier(group=group)
                    if name == "default" and phases is not None:
                        hier.phase_log = phases
                    t0, c0 = time.perf_counter(), time.process_time()
                    dist.all_reduce(t, group=group)
                    wall[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
                    if phases is not None:
                        hier.phase_log = None
            for name, group in groups.items():
                # a collective takes as long as its slowest rank: the largest median; CPU: the mean
                m = np.array([np.median(wall[name][2:]), np.median(cpu[name][2:])])
                dist.all_reduce(m, op=dist.ReduceOp.MAX)
                result[name][nbytes] = m.tolist()
            timed = [p for p in (phases or [])[2:] if p]  # empty below the hierarchy's threshold
            if timed:
                # per phase: the largest over ranks of each rank's median wall and thread CPU
                names = list(timed[0])
                m = np.array([[np.median([p[k][j] for p in timed]) for j in (0, 1)] for k in names])
                dist.all_reduce(m, op=dist.ReduceOp.MAX)
                result.setdefault("phases", {})[nbytes] = dict(zip(names, m.tolist()))
        if rank == 0:
            with open(os.path.join(out, "bench.json"), "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
