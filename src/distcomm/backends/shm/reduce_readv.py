"""reduce "readv" (single copy): every rank reduces a share of each chunk straight from all
members' buffers into its slot; the root copies the shares into its buffer.

Cost: the reduction is spread over the group (each rank reads p·n/p and reduces (p-1)·n/p per
chunk; the root also copies n out of the slots), plus one round to publish the buffers'
addresses and a last wait so that no buffer changes before every reader is done. The root alone
reading and reducing every buffer ran at half gloo's speed with 4 ranks on 2 cores. Memory stays
bounded by the slots; non-root buffers are never written.
"""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from .common import reduce_from_peers, view


def reduce_readv(ctx, ch: Channel, flat: np.ndarray, red, root: int) -> None:
    p, r = ctx.size, ctx.rank
    dt, nbytes = flat.dtype, flat.nbytes
    share = max(1, ctx.slot_bytes // dt.itemsize)  # elements one rank reduces per chunk
    k = ctx.next_round()
    ctx.acquire(k, ch)
    ctx.post(k, ch, nbytes, extra=flat.ctypes.data)
    ctx.wait_posted(k, ch, nbytes)
    base = [ctx.extra(q, k) for q in range(p)]
    ctx.consume(k)
    tmp = np.empty(min(share, flat.size), dt)
    for lo in range(0, flat.size, share * p):
        hi = min(lo + share * p, flat.size)
        k = ctx.next_round()
        slot = ctx.acquire(k, ch)
        a, b = min(lo + r * share, hi), min(lo + (r + 1) * share, hi)
        if b > a:
            reduce_from_peers(ctx, view(slot, dt, b - a), a, flat[a:b], base, red, tmp)
        ctx.post(k, ch, nbytes)
        if r == root:
            # Every member has posted this chunk, so nobody reads our part of it any more.
            ctx.wait_posted(k, ch, nbytes)
            for q in range(p):
                qa, qb = min(lo + q * share, hi), min(lo + (q + 1) * share, hi)
                if qb > qa:
                    flat[qa:qb] = view(ctx.data(q, k), dt, qb - qa)
        ctx.consume(k)
    ctx.wait_consumed(k, ch)  # every member has read every buffer: they may change now
