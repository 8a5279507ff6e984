"""broadcast through slots: the root writes a chunk of one slot per round, the others copy it out.

Cost: n bytes written by the root, n read by each other rank, one round per slot. The root
writes a chunk while the readers copy the one before (nslots rounds in flight), both at memcpy
speed. At two ranks a message of more than one slot goes to broadcast_split instead (single copy:
measured faster from just past one slot; see choose).

A message of at most one slot is one round (``one_round``), which the latency path runs too; it
carries the root check (``root_check.exchange``: every rank posts, the root included, and waits for
all), so a broadcast of one slot costs one round in all."""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from . import root_check
from .common import same_channel


def one_round(ctx, seq: int, sig: int, channel, flat: np.ndarray, root: int) -> tuple[int, int] | None:
    """The whole broadcast of ``flat`` (at most one slot), with its root check: the root posts it,
    the others copy it out; ``channel(seq, sig)`` makes the Channel if a wait must sleep. Returns the
    first (peer, its root) that disagrees (nothing copied then), or None."""
    k = ctx.open_round(seq, sig, channel)
    views = ctx.views(k, flat.dtype, flat.size)
    if ctx.rank == root:
        views[root][...] = flat
    disagreeing = root_check.exchange(ctx, k, seq, sig, flat.nbytes, channel, root)
    if disagreeing is None and ctx.rank != root:
        flat[...] = views[root]
    ctx.consume(k)
    return disagreeing


def broadcast_slots(ctx, ch: Channel, flat: np.ndarray, root: int) -> tuple[int, int] | None:
    """One round with the root check (its result) for a message of one slot, else a round per
    slot (the caller has checked the root)."""
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
