"""CPU time per call of small shared-memory collectives, split into phases by peeling layers off.

    PYTHONPATH=<a distcomm tree>/src python docs/scripts/cpu_phases.py --world 2 --calls 5000

Each rank runs the same loops in lockstep (a barrier between them) and measures
``time.thread_time()`` around each (waiting included: spinning and yielding cost CPU too). For every
op, size and kind of tensor (torch, numpy) it times, per call:

* ``public``: the ``distcomm`` function (``dist.broadcast(t, src=0)``);
* ``pg``: the ProcessGroup method on Buffers made once (``pg.broadcast(buf, 0)``): public - pg is
  the wrapper, its argument checks and the Buffers;
* ``fast``: the engine's FastPath callable for the op, asked of the engine once: pg - fast is
  ProcessGroup's dispatch (``_fast``);
* ``round``: the algorithm's round(s) alone on the group's GroupShm (open, write, post, wait,
  copy/reduce, consume), with the root check's round for a rooted op: fast - round is the latency
  path's own code (claim, sequence number, flight recorder, observer, views, commit);
* ``rootcheck``: the root check's round alone (rooted ops).

and in-process, without communication: ``buffers`` (making the op's Buffers, as the wrapper does),
``record`` (one flight recorder record, as the latency paths make it: ``FlightRecorder.started``). Rows report the slowest rank. Reaches the GroupShm through
public attributes only (``pg.collectives.transport.group_shm``); a measurement tool, not an API.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import time
from functools import partial

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier")
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def _case(dist, pg, fp, ctx, kind, op, nbytes, rank, world):
    """{layer: zero-argument call} for one op, size and kind (torch or numpy)."""
    import numpy as np

    from distcomm.backends.shm import (allreduce_direct, alltoall_slots, broadcast_slots, gather_slots,
                                       reduce_direct, reduce_scatter_slots, root_check, scatter_slots)
    from distcomm.buffers import as_buffer
    from distcomm.dtypes import from_numpy
    from distcomm.reduction import reducer, sequence_reducer
    from distcomm.signatures import signature, without_root
    from distcomm.types import RedOpType

    if kind == "torch":
        import torch

        def make(n, fill=0.0):
            return torch.full((n,), fill, dtype=torch.float32)
    else:
        def make(n, fill=0.0):
            return np.full(n, fill, dtype=np.float32)

    SUM = RedOpType.SUM
    dt = from_numpy(np.dtype(np.float32))
    count = max(world, nbytes // 4)
    count -= count % world
    chunk = count // world
    ch = partial(pg.channel, op)
    nxt = pg.next_seq
    L = {}

    def rooted(one, sig, *args):
        if hasattr(root_check, "exchange"):  # the op's one round carries the root check itself
            return lambda: one(ctx, nxt(), sig, ch, *args)

        def call():  # (before that: a round of its own first)
            seq = nxt()
            root_check.one_round(ctx, seq, without_root(sig), ch, 0)
            one(ctx, seq, sig, ch, *args)
        return call

    if op == "all_reduce":
        t = make(count, 1.0)
        flat = as_buffer(t).flat
        sig, red = signature("all_reduce", dt.code, int(SUM)), sequence_reducer(SUM, dt)
        L["public"] = lambda: dist.all_reduce(t)
        L["fast"] = lambda: pg.fast_all_reduce(t, SUM)
        L["round"] = lambda: allreduce_direct.one_round(ctx, nxt(), sig, ch, flat, red)
        L["buffers"] = lambda: as_buffer(t)
    elif op == "barrier":
        sig = signature("barrier")

        def rnd():
            seq = nxt()
            k = ctx.open_round(seq, sig, ch)
            ctx.exchange(k, seq, sig, 0, ch)
            ctx.consume(k)
        L["public"] = dist.barrier
        L["fast"] = pg.fast_barrier
        L["round"] = rnd
    elif op == "broadcast":
        t = make(count)
        buf = as_buffer(t)
        sig = signature("broadcast", dt.code, root=0)
        L["public"] = lambda: dist.broadcast(t, src=0)
        L["pg"] = lambda: pg.broadcast(buf, 0)
        L["fast"] = lambda: fp.broadcast(buf, 0)
        L["round"] = rooted(broadcast_slots.one_round, sig, buf.flat, 0)
        L["buffers"] = lambda: as_buffer(t)
    elif op == "reduce":
        t = make(count, 1.0)
        buf = as_buffer(t)
        sig, red = signature("reduce", dt.code, int(SUM), 0), reducer(SUM, dt)
        L["public"] = lambda: dist.reduce(t, dst=0)
        L["pg"] = lambda: pg.reduce(buf, SUM, 0)
        L["fast"] = lambda: fp.reduce(buf, SUM, 0)
        L["round"] = rooted(reduce_direct.one_round, sig, buf.flat, red, 0)
        L["buffers"] = lambda: as_buffer(t)
    elif op in ("all_gather", "gather"):
        root = None if op == "all_gather" else 0
        inp = make(chunk, 1.0)
        outs = [make(chunk) for _ in range(world)] if root is None or rank == root else None
        ib = as_buffer(inp)
        obs = None if outs is None else [as_buffer(o) for o in outs]
        flats = None if obs is None else [b.flat for b in obs]
        if root is None:
            sig = signature("all_gather", dt.code)
            L["public"] = lambda: dist.all_gather(outs, inp)
            L["pg"] = lambda: pg.allgather(obs, ib)
            L["fast"] = lambda: fp.allgather(obs, ib)
            L["round"] = lambda: gather_slots.one_round(ctx, nxt(), sig, ch, ib.flat, flats, None)
        else:
            sig = signature("gather", dt.code, root=0)
            L["public"] = lambda: dist.gather(inp, outs, dst=0)
            L["pg"] = lambda: pg.gather(obs, ib, 0)
            L["fast"] = lambda: fp.gather(obs, ib, 0)
            L["round"] = rooted(gather_slots.one_round, sig, ib.flat, flats, 0)
        L["buffers"] = lambda: (as_buffer(inp), outs and [as_buffer(o) for o in outs])
    elif op == "all_gather_into_tensor":
        inp, out = make(chunk, 1.0), make(count)
        ib, ob = as_buffer(inp), as_buffer(out)
        sig = signature("all_gather_into_tensor", dt.code)
        L["public"] = lambda: dist.all_gather_into_tensor(out, inp)
        L["pg"] = lambda: pg.allgather_into_tensor(ob, ib)
        L["fast"] = lambda: fp.allgather_into_tensor(ob, ib)
        L["round"] = lambda: gather_slots.one_round(ctx, nxt(), sig, ch, ib.flat,
                                                    [ob.flat[q * chunk:(q + 1) * chunk] for q in range(world)], None)
        L["buffers"] = lambda: (as_buffer(out), as_buffer(inp))
    elif op == "scatter":
        out = make(chunk)
        ins = [make(chunk, q) for q in range(world)] if rank == 0 else None
        ob = as_buffer(out)
        ibs = None if ins is None else [as_buffer(i) for i in ins]
        sig = signature("scatter", dt.code, root=0)
        L["public"] = lambda: dist.scatter(out, ins, src=0)
        L["pg"] = lambda: pg.scatter(ob, ibs, 0)
        L["fast"] = lambda: fp.scatter(ob, ibs, 0)
        L["round"] = rooted(scatter_slots.one_round, sig, None if ibs is None else [b.flat for b in ibs], ob.flat, 0)
        L["buffers"] = lambda: (as_buffer(out), ins and [as_buffer(i) for i in ins])
    elif op in ("reduce_scatter", "reduce_scatter_tensor"):
        out = make(chunk)
        ob = as_buffer(out)
        red = reducer(SUM, dt)
        sig = signature(op, dt.code, int(SUM))
        if op == "reduce_scatter":
            ins = [make(chunk, 1.0) for _ in range(world)]
            ibs = [as_buffer(i) for i in ins]
            blocks = [b.flat for b in ibs]
            L["public"] = lambda: dist.reduce_scatter(out, ins)
            L["pg"] = lambda: pg.reduce_scatter(ob, ibs, SUM)
            L["fast"] = lambda: fp.reduce_scatter(ob, ibs, SUM)
            L["buffers"] = lambda: (as_buffer(out), [as_buffer(i) for i in ins])
        else:
            inp = make(count, 1.0)
            ib = as_buffer(inp)
            blocks = [ib.flat[q * chunk:(q + 1) * chunk] for q in range(world)]
            L["public"] = lambda: dist.reduce_scatter_tensor(out, inp)
            L["pg"] = lambda: pg.reduce_scatter_tensor(ob, ib, SUM)
            L["fast"] = lambda: fp.reduce_scatter_tensor(ob, ib, SUM)
            L["buffers"] = lambda: (as_buffer(out), as_buffer(inp))
        total = sum(b.nbytes for b in blocks)
        L["round"] = lambda: reduce_scatter_slots.one_round(ctx, nxt(), sig, ch, blocks, ob.flat, total, red)
    elif op in ("all_to_all", "all_to_all_single"):
        sig = signature(op, dt.code)
        if op == "all_to_all":
            ins, outs = [make(chunk, 1.0) for _ in range(world)], [make(chunk) for _ in range(world)]
            ibs, obs = [as_buffer(i) for i in ins], [as_buffer(o) for o in outs]
            sends, recvs = [b.flat for b in ibs], [b.flat for b in obs]
            L["public"] = lambda: dist.all_to_all(outs, ins)
            L["pg"] = lambda: pg.alltoall(obs, ibs)
            L["fast"] = lambda: fp.alltoall(obs, ibs)
            L["buffers"] = lambda: ([as_buffer(o) for o in outs], [as_buffer(i) for i in ins])
        else:
            inp, out = make(count, 1.0), make(count)
            ib, ob = as_buffer(inp), as_buffer(out)
            counts = [chunk] * world
            sends = [ib.flat[q * chunk:(q + 1) * chunk] for q in range(world)]
            recvs = [ob.flat[q * chunk:(q + 1) * chunk] for q in range(world)]
            L["public"] = lambda: dist.all_to_all_single(out, inp)
            L["pg"] = lambda: pg.alltoall_base(ob, ib, counts, counts)
            L["fast"] = lambda: fp.alltoall_base(ob, ib, counts, counts)
            L["buffers"] = lambda: (as_buffer(out), as_buffer(inp))
        # base 0: nobody reads single copies at these sizes (the slots algorithm is chosen)
        L["round"] = lambda: alltoall_slots.alltoall_rounds(ctx, nxt(), sig, ch, sends, recvs, 0, [0] * world)
    if op in ROOTED:
        rsig = without_root(signature(op, dt.code, int(SUM) if op == "reduce" else 0, 0))
        L["rootcheck"] = lambda: root_check.one_round(ctx, nxt(), rsig, ch, 0)
    return L


LOCAL = ("buffers", "record")  # measured without communication


def _rank(rank, world, port, ops, sizes, kinds, calls, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch  # noqa: F401

    import distcomm as dist
    from distcomm import flight_recorder as fr
    from distcomm import world as dworld

    dist.init_process_group("shm")
    dist.barrier()
    dist.all_reduce(torch.zeros(1))
    pg = dworld.default_pg
    fp = pg.engine.fast_path(pg)
    ctx = pg.collectives.transport.group_shm(pg.spec.group_id)
    results = {}
    for kind in kinds:
        for op in ops:
            for nbytes in sizes:
                if op == "barrier" and nbytes != sizes[0]:
                    continue
                layers = _case(dist, pg, fp, ctx, kind, op, nbytes, rank, world)
                if fr.recorder is not None:
                    # as the latency paths record (skip 1: the lambda stands for the path, the user
                    # is its caller)
                    layers["record"] = lambda: fr.recorder.started("0", 1, op, 8, "float32", None, 1)
                for layer, call in layers.items():
                    if layer == "fast":
                        assert call() is True, (op, nbytes, kind, "the latency path declined the call")
                    n = calls * (5 if layer in LOCAL else 1)
                    for _ in range(min(500, calls)):
                        call()
                    if layer not in LOCAL:
                        dist.barrier()
                    start = time.thread_time()
                    for _ in range(n):
                        call()
                    results[f"{kind}/{op}/{nbytes}/{layer}"] = (time.thread_time() - start) / n * 1e6
                    if layer not in LOCAL:
                        dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--sizes", default="8,65536")
    parser.add_argument("--kinds", default="torch,numpy")
    parser.add_argument("--json")
    args = parser.parse_args()
    ops, sizes, kinds = args.ops.split(","), [int(s) for s in args.sizes.split(",")], args.kinds.split(",")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, ops, sizes, kinds, args.calls, queue))
             for r in range(args.world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(60)
    worst = {key: max(per_rank[r][key] for r in per_rank) for key in per_rank[0]}
    cols = ("public", "pg", "fast", "round", "rootcheck", "buffers", "record")
    print(f"# world {args.world}, {args.calls} calls per rank, CPU µs per call (slowest rank)")
    print("| kind | op | bytes | " + " | ".join(cols) + " |")
    rows = sorted({k.rsplit("/", 1)[0] for k in worst}, key=lambda r: (r.split("/")[0], ops.index(r.split("/")[1]),
                                                                     int(r.split("/")[2])))
    for row in rows:
        kind, op, nbytes = row.split("/")
        vals = [worst.get(f"{row}/{c}") for c in cols]
        print(f"| {kind} | {op} | {nbytes} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in vals) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "calls": args.calls, "us": worst}, f, indent=1)


if __name__ == "__main__":
    main()
