"""reduce_scatter through slots: each rank posts the pieces of the blocks others own, and reduces
its own block from every member's slot in rank order; one round per chunk (a slot holds one
1/p-slot piece per destination).

Cost per rank: writes (p-1)/p of the input, reads p pieces of its own block and reduces p - 1."""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from .common import offsets, view


def reduce_scatter_slots(ctx, ch: Channel, scratch: np.ndarray, out: np.ndarray, counts, red) -> None:
    p, r = ctx.size, ctx.rank
    dt = scratch.dtype
    item = dt.itemsize
    per = max(1, ctx.slot_bytes // p // item)
    offs = offsets(counts)
    longest = max(counts) if counts else 0
    lo = 0
    while True:
        k = ctx.next_round()
        slot = ctx.acquire(k, ch)
        for q in range(p):
            n = min(per, max(0, counts[q] - lo))
            if q != r and n:
                view(slot, dt, n, q * per * item)[...] = scratch[offs[q] + lo : offs[q] + lo + n]
        ctx.post(k, ch, scratch.nbytes)
        ctx.wait_posted(k, ch, scratch.nbytes)
        n = min(per, max(0, counts[r] - lo))
        if n:
            mine = scratch[offs[r] + lo : offs[r] + lo + n]
            acc = out[lo : lo + n]
            acc[...] = mine if r == 0 else view(ctx.data(0, k), dt, n, r * per * item)
            for q in range(1, p):
                red(acc, mine if q == r else view(ctx.data(q, k), dt, n, r * per * item))
        ctx.consume(k)
        lo += per
        if lo >= longest:
            return
