"""reduce_scatter through slots: each rank posts the pieces of the blocks others own, and reduces
its own block from every member's slot in rank order; one round per chunk (a slot holds one
1/p-slot piece per destination).

Cost per rank: writes (p-1)/p of the input, reads p pieces of its own block and reduces p - 1.

The blocks are read from a list (views of one input tensor, or separate tensors), in place: no
staging buffer, and the inputs are left as they were. When every block fits one piece
(``piece_count``) it is one round (``one_round``), which the latency path runs too."""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from .common import same_channel, view


def piece_count(slot_bytes: int, p: int, item: int) -> int:
    """The elements of each destination's piece in one round's slot."""
    return max(1, slot_bytes // p // item)


def one_round(ctx, seq: int, sig: int, channel, ins, out: np.ndarray, nbytes: int, red) -> None:
    """The whole reduce_scatter when every block fits one piece: ``ins[q]`` is this rank's block for
    rank q, ``nbytes`` the bytes of all of them (every rank's header carries it); ``out`` gets the
    rank-order reduction of every rank's block for this rank."""
    p, r = ctx.size, ctx.rank
    dt = out.dtype
    stride = piece_count(ctx.slot_bytes, p, dt.itemsize) * dt.itemsize
    k = ctx.open_round(seq, sig, channel)
    slot = ctx.data(r, k)
    for q in range(p):
        if q != r and ins[q].size:
            slot[q * stride : q * stride + ins[q].nbytes].view(dt)[...] = ins[q]
    ctx.exchange(k, seq, sig, nbytes, channel)
    mine = ins[r]
    n = mine.nbytes
    if n:
        at = r * stride
        out[...] = mine if r == 0 else ctx.data(0, k)[at : at + n].view(dt)
        for q in range(1, p):
            red(out, mine if q == r else ctx.data(q, k)[at : at + n].view(dt))
    ctx.consume(k)


def reduce_scatter_slots(ctx, ch: Channel, ins, out: np.ndarray, red) -> None:
    """``ins[q]``: this rank's block for rank q (read in place, left as it was); ``out`` must not
    overlap any of ``ins``."""
    p, r = ctx.size, ctx.rank
    dt = out.dtype
    item = dt.itemsize
    per = piece_count(ctx.slot_bytes, p, item)
    counts = [x.size for x in ins]
    nbytes = sum(x.nbytes for x in ins)
    longest = max(counts) if counts else 0
    if longest <= per:
        return one_round(ctx, ch.key.seq, ch.signature, same_channel(ch), ins, out, nbytes, red)
    lo = 0
    while True:
        k = ctx.next_round()
        slot = ctx.acquire(k, ch)
        for q in range(p):
            n = min(per, max(0, counts[q] - lo))
            if q != r and n:
                view(slot, dt, n, q * per * item)[...] = ins[q][lo : lo + n]
        ctx.post(k, ch, nbytes)
        ctx.wait_posted(k, ch, nbytes)
        n = min(per, max(0, counts[r] - lo))
        if n:
            mine = ins[r][lo : lo + n]
            acc = out[lo : lo + n]
            acc[...] = mine if r == 0 else view(ctx.data(0, k), dt, n, r * per * item)
            for q in range(1, p):
                red(acc, mine if q == r else view(ctx.data(q, k), dt, n, r * per * item))
        ctx.consume(k)
        lo += per
        if lo >= longest:
            return
