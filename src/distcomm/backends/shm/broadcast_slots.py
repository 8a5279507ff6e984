"""broadcast through slots: the root writes a chunk of one slot per round, the others copy it out.

Cost: n bytes written by the root, n read by each other rank, one round per slot. The root
writes a chunk while the readers copy the one before (nslots rounds in flight), both at memcpy
speed: at two ranks this beats one single-copy read at every size.

A message of at most one slot is one round (``one_round``), which the latency path runs too."""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from .common import same_channel


def one_round(ctx, seq: int, sig: int, channel, flat: np.ndarray, root: int) -> None:
    """The whole broadcast of ``flat`` (at most one slot): the root posts it, the others copy it
    out; ``channel(seq, sig)`` makes the Channel if a wait must sleep."""
    k = ctx.open_round(seq, sig, channel)
    views = ctx.views(k, flat.dtype, flat.size)
    if ctx.rank == root:
        views[root][...] = flat
        ctx.publish(k, seq, sig, flat.nbytes)
    else:
        ctx.collect(k, seq, sig, flat.nbytes, channel, (root,))
        flat[...] = views[root]
    ctx.consume(k)


def broadcast_slots(ctx, ch: Channel, flat: np.ndarray, root: int) -> None:
    if flat.nbytes <= ctx.slot_bytes:
        return one_round(ctx, ch.key.seq, ch.signature, same_channel(ch), flat, root)
    raw = flat.view(np.uint8)
    n, step = raw.size, ctx.slot_bytes
    lo = 0
    while True:
        hi = min(lo + step, n)
        k = ctx.next_round()
        if ctx.rank == root:
            ctx.acquire(k, ch)[: hi - lo] = raw[lo:hi]
            ctx.post(k, ch, n)
        else:
            ctx.wait_posted(k, ch, n, [root])
            raw[lo:hi] = ctx.data(root, k)[: hi - lo]
        ctx.consume(k)
        lo = hi
        if lo >= n:
            return
