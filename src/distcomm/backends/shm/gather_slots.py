"""gather (and all_gather) through slots: each rank writes its block, a chunk of one slot per
round; the root (every rank, for all_gather) copies every peer's chunk into place.

Cost per round: one slot written per sender, p - 1 slots read per reader; for all_gather every
rank reads (p-1)·n/p bytes of slots.

A block of at most one slot is one round (``one_round``), which the latency path runs too, with a
list of output blocks: separate output tensors are written in place, with no staging buffer. A
gather's one round carries its root check (``root_check.exchange``)."""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from . import root_check
from .common import same_channel


def one_round(ctx, seq: int, sig: int, channel, send: np.ndarray, outs, root: int | None) -> tuple[int, int] | None:
    """The whole gather (all_gather when ``root`` is None) of ``send`` (at most one slot): rank q's
    ``send`` lands in ``outs[q]`` on the root (every rank for all_gather; ``outs`` None elsewhere).
    ``outs[rank]`` may be ``send`` itself or overlap it (all_gather in place): it is then not copied.
    A gather carries its root check (every rank waits for all): returns the first (peer, its root)
    that disagrees (nothing copied then), or None."""
    r = ctx.rank
    k = ctx.open_round(seq, sig, channel)
    views = ctx.views(k, send.dtype, send.size)
    nbytes = send.nbytes
    disagreeing = None
    if root is None:
        views[r][...] = send
        ctx.exchange(k, seq, sig, nbytes, channel)
    else:
        if r != root:
            views[r][...] = send
        disagreeing = root_check.exchange(ctx, k, seq, sig, nbytes, channel, root)
    if outs is not None and disagreeing is None:
        for q in range(ctx.size):
            if q != r:
                outs[q][...] = views[q]
            elif not np.may_share_memory(outs[r], send):
                outs[r][...] = send
    ctx.consume(k)
    return disagreeing


def gather_slots(ctx, ch: Channel, send: np.ndarray, outs, root: int | None) -> tuple[int, int] | None:
    """Rank q's ``send`` into ``outs[q]`` (contiguous arrays of ``send``'s size) on the root (every
    rank if None: all_gather, where ``send`` is this rank's output itself). A gather of one slot is
    ``one_round`` (its root check's result); otherwise the caller has checked the root."""
    if send.nbytes <= ctx.slot_bytes:
        return one_round(ctx, ch.key.seq, ch.signature, same_channel(ch), send, outs, root)
    r = ctx.rank
    src = send.view(np.uint8)
    raw = None if outs is None else [o.view(np.uint8) for o in outs]
    bb, step = src.size, ctx.slot_bytes
    peers = [q for q in range(ctx.size) if q != r]
    reads = root is None or r == root
    lo = 0
    while True:
        hi = min(lo + step, bb)
        k = ctx.next_round()
        if root is None or r != root:
            ctx.acquire(k, ch)[: hi - lo] = src[lo:hi]
            ctx.post(k, ch, bb)
        if reads:
            ctx.wait_posted(k, ch, bb, None if root is None else peers)
            for q in peers:
                raw[q][lo:hi] = ctx.data(q, k)[: hi - lo]
            if root is not None:
                raw[r][lo:hi] = src[lo:hi]
        ctx.consume(k)
        lo = hi
        if lo >= bb:
            return
