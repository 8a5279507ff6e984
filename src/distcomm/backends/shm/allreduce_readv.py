"""all_reduce "readv" (single copy, where process_vm_readv is allowed): each rank reduces its
slice reading the peers' copies of it straight from their buffers, then copies every other
slice's result straight from its owner's buffer.

Cost per rank: about 2.5 n bytes through memory (its slice and the peers' copies of it read, its
slice written, the other results read and written; rank 0 reduces into its own slice in place,
the others into an accumulator that starts as rank 0's chunk, read straight into it, and copy
the result back) against ~4.5 n through slots, plus a system call and page pinning per chunk
(``common.chunked_slices``). At two ranks, with an op that ``commutes`` (reduction.commutes: the
caller says), rank 1 too folds the peer's copy into its own slice in place: no accumulator and no
copy back, so neither rank is the other's straggler. And no lockstep: after the first round (which
publishes each buffer's address) a rank reduces its whole slice without waiting for anyone, picking
up the peers' finished chunks as they come (the ``posted`` counter of round k0 + 1 + j says "chunk j of
my slice is final"; by then its owner has read all it needed from the others' buffers). A last
wait keeps every buffer unchanged until the peers have read it. Only round k0 uses a slot.

``finish_part`` (AVG's division, or None) is applied to each reduced chunk of the slice before it
is published, while the chunk is still in cache: no pass over the whole result afterwards.
"""

from __future__ import annotations

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel
from .common import chunked_slices, fetch_finished, fetch_rest


def allreduce_readv(ctx, ch: Channel, flat: np.ndarray, red, finish_part=None, commutes: bool = False) -> None:
    p, r = ctx.size, ctx.rank
    dt = flat.dtype
    item = dt.itemsize
    count, nbytes = flat.size, flat.nbytes
    k0, edges, per, chunks = chunked_slices(ctx, count, item)
    pids = [ctx.transport.pid_of(g) for g in ctx.ranks]
    read = shm_direct.read
    ctx.acquire(k0, ch)
    ctx.post(k0, ch, nbytes, extra=flat.ctypes.data)
    ctx.wait_posted(k0, ch, nbytes)
    base = [ctx.extra(q, k0) for q in range(p)]
    swap = commutes and p == 2 and r == 1
    tmp = np.empty(min(per, edges[r + 1] - edges[r]), dt)
    acc = None if swap or r == 0 else np.empty_like(tmp)
    copied = [chunks if q == r else 0 for q in range(p)]  # peers' final chunks copied so far

    def fetch(q: int) -> None:
        j = copied[q]
        lo = edges[q] + j * per
        hi = min(lo + per, edges[q + 1])
        if hi > lo:
            read(pids[q], base[q] + lo * item, flat[lo:hi])
        copied[q] = j + 1

    for j in range(chunks):
        lo = edges[r] + j * per
        hi = min(lo + per, edges[r + 1])
        if hi > lo:  # my slice's chunk j, reduced in rank order
            mine, t = flat[lo:hi], tmp[: hi - lo]
            if swap:  # mine ⊕= the peer's: the same bits as the peer's ⊕ mine
                read(pids[1 - r], base[1 - r] + lo * item, t)
                red(mine, t)
                a = mine
            else:
                # rank 0 folds the peers into its own copy; the others start from rank 0's, read
                # straight into the accumulator: no copy of either into place
                a = mine if r == 0 else acc[: hi - lo]
                for q in range(p):
                    if q == 0:
                        if r != 0:
                            read(pids[0], base[0] + lo * item, a)
                    elif q == r:
                        red(a, mine)
                    else:
                        read(pids[q], base[q] + lo * item, t)
                        red(a, t)
            if finish_part is not None:
                finish_part(a)
            if a is not mine:
                mine[...] = a
        ctx.advance(k0 + 1 + j, wake=j == chunks - 1)
        fetch_finished(ctx, k0, copied, chunks, fetch)  # whatever the peers have finished meanwhile
    fetch_rest(ctx, ch, k0, copied, chunks, fetch)
