"""CPU time per call of small collectives through ``import distcomm as dist``, with torch tensors.

    PYTHONPATH=<a distcomm tree>/src python docs/scripts/cpu_per_call.py --world 2 --calls 20000

Each rank runs every (op, size) ``--calls`` times back to back after a warmup and a barrier, and
measures ``time.thread_time()`` around the loop: the CPU its own thread spent per call (waiting
included, as spinning or yielding costs CPU too). Rows report the slowest rank. CPU time rather
than wall time because the machine is shared (docs/performance-notes.md). Only public API calls
are used, so the same script measures any commit of distcomm (e.g. 1f5f367, before the engine
redesign) against another.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import time

OPS = ("broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "reduce")


def _calls(dist, torch, op: str, nbytes: int, rank: int, world: int):
    count = max(world, nbytes // 4)
    count -= count % world
    chunk = count // world
    if op == "broadcast":
        buf = torch.zeros(count)
        return lambda: dist.broadcast(buf, src=0)
    if op == "reduce":
        buf = torch.ones(count)
        return lambda: dist.reduce(buf, dst=0)
    if op == "all_gather":
        out, inp = torch.zeros(count), torch.ones(chunk)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if op == "reduce_scatter":
        out, inp = torch.zeros(chunk), torch.ones(count)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    if op == "all_to_all":
        out, inp = torch.zeros(count), torch.ones(count)
        return lambda: dist.all_to_all_single(out, inp)
    if op == "gather":
        inp = torch.ones(chunk)
        outs = [torch.zeros(chunk) for _ in range(world)] if rank == 0 else None
        return lambda: dist.gather(inp, outs, dst=0)
    if op == "scatter":
        out = torch.zeros(chunk)
        ins = [torch.ones(chunk) for _ in range(world)] if rank == 0 else None
        return lambda: dist.scatter(out, ins, src=0)
    raise ValueError(op)


def _rank(rank: int, world: int, port: int, ops, sizes, calls: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch

    import distcomm as dist

    dist.init_process_group("gloo")
    results = {}
    for op in ops:
        for nbytes in sizes:
            call = _calls(dist, torch, op, nbytes, rank, world)
            for _ in range(min(1000, calls)):
                call()
            dist.barrier()
            start = time.thread_time()
            for _ in range(calls):
                call()
            results[f"{op}/{nbytes}"] = (time.thread_time() - start) / calls * 1e6
            dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--sizes", default="8,65536")
    parser.add_argument("--json")
    args = parser.parse_args()
    ops, sizes = args.ops.split(","), [int(s) for s in args.sizes.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, ops, sizes, args.calls, queue))
             for r in range(args.world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(60)
    worst = {key: max(per_rank[r][key] for r in per_rank) for key in per_rank[0]}
    print(f"# world {args.world}, {args.calls} calls per rank, CPU µs per call (slowest rank)")
    for key, value in worst.items():
        print(f"{key:>24} {value:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "calls": args.calls, "us": worst}, f, indent=1)


if __name__ == "__main__":
    main()
