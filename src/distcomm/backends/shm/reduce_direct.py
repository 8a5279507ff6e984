"""reduce "direct" (and all_reduce "direct" past one slot): every rank posts its chunk, the root
(every rank, for all_reduce) reduces all p copies in rank order into its buffer; one round per
chunk of one slot.

Cost per chunk of m bytes: one round; each reading rank reads p·m and reduces (p - 1)·m; the
others only write m. Simple and in lockstep; the root does all the reduction work, which is why
large reductions take ``reduce_readv`` where single-copy reads are allowed.

A reduce of at most one slot is one round (``one_round``), which the latency path runs too; it
carries the root check (``root_check.exchange``: every rank waits for all).
"""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from . import root_check
from .common import same_channel, view


def one_round(ctx, seq: int, sig: int, channel, flat: np.ndarray, red, root: int) -> tuple[int, int] | None:
    """The whole reduce of ``flat`` (at most one slot) to ``root``, with its root check: every rank
    posts it and waits for every post, the root reduces the p copies in rank order into ``flat``.
    Returns the first (peer, its root) that disagrees (nothing reduced then), or None."""
    k = ctx.open_round(seq, sig, channel)
    views = ctx.views(k, flat.dtype, flat.size)
    views[ctx.rank][...] = flat
    disagreeing = root_check.exchange(ctx, k, seq, sig, flat.nbytes, channel, root)
    if disagreeing is None and ctx.rank == root:
        if root != 0:
            flat[...] = views[0]
        for q in range(1, ctx.size):
            red(flat, views[q])
    ctx.consume(k)
    return disagreeing


def reduce_direct(ctx, ch: Channel, flat: np.ndarray, red, root: int | None) -> tuple[int, int] | None:
    """Every rank posts its chunk; the root (every rank if None) reduces all of them in rank order.
    A reduce of one slot is ``one_round`` (its root check's result); otherwise the caller has
    checked the root."""
    if root is not None and flat.nbytes <= ctx.slot_bytes:
        return one_round(ctx, ch.key.seq, ch.signature, same_channel(ch), flat, red, root)
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
