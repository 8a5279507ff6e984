"""Ranks that disagree on a collective's sizes, dtypes or roots, on the MPI engine, under
``mpiexec -n 2`` or ``-n 3`` (tests/test_mpi_mismatch.py). Prints one line per rank and case:
``<rank> <case>/<n> ok <what it computed>`` or ``<rank> <case>/<n> <error class>: <message>``.

Every case runs on a fresh group (new_group, with a timeout of TIMEOUT seconds: a call that
hangs ends as DistTimeoutError, which the test tells from a mismatch by its class), at a small and
a large size (``n`` elements: 4, under the latency paths' 64 KiB, and 100,000, over it). The last
rank ("odd") is the one that passes something else. Cases named ``kept_*`` first make legitimate
calls of both sizes, so each rank has a persistent request for each (backends/mpi/persistent.py),
then disagree: the ranks start different requests, which MPI never matches.
"""

import os
import sys
from datetime import timedelta

import numpy as np
import torch

import distcomm as dist

TIMEOUT = float(os.environ.get("MISMATCH_TIMEOUT", "20"))


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


dist.init_process_group("mpi", timeout=timedelta(seconds=60))
rank, size = dist.get_rank(), dist.get_world_size()
odd = size - 1
mine = rank == odd
SMALL, LARGE = 4, 100_000
only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 and sys.argv[1] else None


def summary(x) -> str:
    """A short account of a result (the garbage an unchecked mismatch returns shows here)."""
    if isinstance(x, torch.Tensor):
        x = x.numpy()
    if isinstance(x, np.ndarray):
        return f"{x.size} values {np.unique(x)[:4].tolist()}"
    if isinstance(x, (list, tuple)):
        return "; ".join(summary(v) for v in x)
    return str(x)


def ones(n: int, dtype=torch.float32):
    return torch.ones(n, dtype=dtype)


# -- the cases: fn(group, n) -> a result to print ----------------------------------------------------
def all_reduce_numpy(g, n):
    a = np.ones(2 * n if mine else n, np.float32)
    dist.all_reduce(a, group=g)
    return a


def all_reduce_torch(g, n):
    t = ones(2 * n if mine else n)
    dist.all_reduce(t, group=g)
    return t


def all_reduce_async(g, n):
    t = ones(2 * n if mine else n)
    dist.all_reduce(t, group=g, async_op=True).wait()
    return t


def all_reduce_dtype(g, n):
    t = ones(n, torch.float64 if mine else torch.float32)
    dist.all_reduce(t, group=g)
    return t


def all_reduce_same_bytes(g, n):  # int32 and float32: the same bytes, another dtype
    t = ones(n, torch.int32 if mine else torch.float32)
    dist.all_reduce(t, group=g)
    return t


def all_reduce_generic(g, n):  # float16: distcomm's algorithms over MPI point-to-point
    t = ones(2 * n if mine else n, torch.float16)
    dist.all_reduce(t, group=g)
    return t


def all_reduce_empty(g, n):
    t = ones(0 if rank == 0 else n)
    dist.all_reduce(t, group=g)
    return t


def _kept(g, n, make):
    for count in (n, 2 * n):  # every rank makes and keeps a request for each size
        dist.all_reduce(make(count), group=g)
    t = make(2 * n if mine else n)
    dist.all_reduce(t, group=g)
    return t


def kept_numpy(g, n):  # the all_reduce in C (_mpi_calls.c), where it is built
    return _kept(g, n, lambda c: np.ones(c, np.float32))


def kept_torch(g, n):  # the latency path in Python
    return _kept(g, n, lambda c: ones(c))


def kept_async(g, n):  # the general path
    def call(t):
        dist.all_reduce(t, group=g, async_op=True).wait()

    for count in (n, 2 * n):
        call(ones(count))
    t = ones(2 * n if mine else n)
    call(t)
    return t


def kept_dtype(g, n):  # a request for each dtype kept, then each rank starts another
    for dtype in (torch.float32, torch.float64):
        dist.all_reduce(ones(n, dtype), group=g)
    t = ones(n, torch.float64 if mine else torch.float32)
    dist.all_reduce(t, group=g)
    return t


def kept_vs_large(g, n):  # a kept request on the others, the large general path on the odd rank
    dist.all_reduce(ones(n), group=g)
    t = ones(LARGE if mine else n)
    dist.all_reduce(t, group=g)
    return t


def barrier_vs_all_reduce(g, n):  # another op: a kept all_reduce against the group's barrier
    dist.all_reduce(ones(n), group=g)
    dist.barrier(group=g)
    t = ones(n)
    if mine:
        dist.all_reduce(t, group=g)
    else:
        dist.barrier(group=g)
    return t


def broadcast(g, n):
    t = ones(2 * n if mine else n)
    dist.broadcast(t, src=0, group=g)
    return t


def broadcast_root_longer(g, n):
    t = ones(2 * n if rank == 0 else n)
    dist.broadcast(t, src=0, group=g)
    return t


def broadcast_dtype(g, n):
    t = ones(n, torch.int32 if mine else torch.float32)
    dist.broadcast(t, src=0, group=g)
    return t


def broadcast_roots(g, n):  # the odd rank believes it is the root
    t = ones(n)
    dist.broadcast(t, src=odd if mine else 0, group=g)
    return t


def reduce(g, n):
    t = ones(2 * n if mine else n)
    dist.reduce(t, dst=0, group=g)
    return t


def all_gather(g, n):
    m = 2 * n if mine else n
    outs = [torch.zeros(m) for _ in range(size)]
    dist.all_gather(outs, ones(m), group=g)
    return outs


def all_gather_into_tensor(g, n):
    m = 2 * n if mine else n
    out = torch.zeros(m * size)
    dist.all_gather_into_tensor(out, ones(m), group=g)
    return out


def gather(g, n):
    m = 2 * n if mine else n
    outs = [torch.zeros(m) for _ in range(size)] if rank == 0 else None
    dist.gather(ones(m), outs, dst=0, group=g)
    return outs if outs is not None else "-"


def scatter(g, n):
    m = 2 * n if mine else n
    out = torch.zeros(m)
    dist.scatter(out, [ones(m) for _ in range(size)] if rank == 0 else None, src=0, group=g)
    return out


def reduce_scatter_tensor(g, n):
    m = 2 * n if mine else n
    out = torch.zeros(m)
    dist.reduce_scatter_tensor(out, ones(m * size), group=g)
    return out


def reduce_scatter_splits(g, n):  # the same total, split otherwise on the odd rank
    counts = [n] * size
    if mine:
        counts[0], counts[odd] = n // 2, n + n // 2
    out = torch.zeros(counts[rank])
    dist.reduce_scatter(out, [ones(c) for c in counts], group=g)
    return out


def _splits(n):
    """all_to_all_single's splits: the odd rank sends 2n to rank 0, which expects n from it."""
    send, recv = [n] * size, [n] * size
    if mine:
        send[0] = 2 * n
    return send, recv


def all_to_all_longer(g, n):
    send, recv = _splits(n)
    out = torch.zeros(sum(recv))
    dist.all_to_all_single(out, ones(sum(send)), recv, send, group=g)
    return out


def all_to_all_shorter(g, n):  # the odd rank sends n/2 to rank 0, which expects n
    send, recv = [n] * size, [n] * size
    if mine:
        send[0] = n // 2
    out = torch.zeros(sum(recv))
    dist.all_to_all_single(out, ones(sum(send)), recv, send, group=g)
    return out


def all_to_all_list(g, n):
    send, recv = _splits(n)
    outs = [torch.zeros(c) for c in recv]
    dist.all_to_all(outs, [ones(c) for c in send], group=g)
    return outs


CASES = [all_reduce_numpy, all_reduce_torch, all_reduce_async, all_reduce_dtype, all_reduce_same_bytes,
         all_reduce_generic, all_reduce_empty, kept_numpy, kept_torch, kept_async, kept_dtype, kept_vs_large,
         barrier_vs_all_reduce, broadcast, broadcast_root_longer, broadcast_dtype, broadcast_roots, reduce,
         all_gather, all_gather_into_tensor, gather, scatter, reduce_scatter_tensor, reduce_scatter_splits,
         all_to_all_longer, all_to_all_shorter, all_to_all_list]
SMALL_ONLY = {"kept_numpy", "kept_torch", "kept_async", "kept_dtype", "kept_vs_large", "barrier_vs_all_reduce"}

for fn in CASES:
    for n in (SMALL, LARGE):
        name = f"{fn.__name__}/{n}"
        if (n == LARGE and fn.__name__ in SMALL_ONLY) or (only and fn.__name__ not in only):
            continue
        g = dist.new_group(list(range(size)), timeout=timedelta(seconds=TIMEOUT))
        try:
            say(f"{rank} {name} ok {summary(fn(g, n))}")
        except Exception as exc:  # noqa: BLE001 - printed for the test
            say(f"{rank} {name} {type(exc).__name__}: {exc}".replace("\n", " "))

# the ranks still agree on everything else: a fresh group and the world work, in step
g = dist.new_group(list(range(size)), timeout=timedelta(seconds=TIMEOUT))
checks = []
for n in (SMALL, LARGE):
    t = ones(n)
    dist.all_reduce(t, group=g)
    checks.append(bool((t == size).all()))
    b = torch.full((n,), float(rank))
    dist.broadcast(b, src=odd, group=g)
    checks.append(bool((b == odd).all()))
    send = torch.arange(n * size, dtype=torch.float32) + 1000 * rank
    out = torch.zeros(n * size)
    dist.all_to_all_single(out, send, group=g)
    checks.append(all(bool((out[q * n:(q + 1) * n] == send[rank * n:(rank + 1) * n] - 1000 * rank + 1000 * q).all())
                      for q in range(size)))
dist.barrier()
say(f"{rank} sane {checks}")
dist.destroy_process_group()
say(f"{rank} finished")
