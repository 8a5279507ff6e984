"""reduce "direct" (and all_reduce "direct" past one slot): every rank posts its chunk, the root
(every rank, for all_reduce) reduces all p copies in rank order into its buffer; one round per
chunk of one slot.

Cost per chunk of m bytes: one round; each reading rank reads p·m and reduces (p - 1)·m; the
others only write m. Simple and in lockstep; the root does all the reduction work, which is why
large reductions take ``reduce_readv`` where single-copy reads are allowed.
"""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from .common import view


def reduce_direct(ctx, ch: Channel, flat: np.ndarray, red, root: int | None) -> None:
    """Every rank posts its chunk; the root (every rank if None) reduces all of them in rank order."""
    p, r = ctx.size, ctx.rank
    dt = flat.dtype
    per = max(1, ctx.slot_bytes // dt.itemsize)
    count, nbytes = flat.size, flat.nbytes
    reads = root is None or r == root
    lo = 0
    while True:
        hi = min(lo + per, count)
        m = hi - lo
        k = ctx.next_round()
        mine = flat[lo:hi]
        view(ctx.acquire(k, ch), dt, m)[...] = mine
        ctx.post(k, ch, nbytes)
        if reads:
            ctx.wait_posted(k, ch, nbytes)
            if m:
                if r != 0:
                    mine[...] = view(ctx.data(0, k), dt, m)
                for q in range(1, p):
                    red(mine, view(ctx.data(q, k), dt, m))
        ctx.consume(k)
        lo = hi
        if lo >= count:
            return
