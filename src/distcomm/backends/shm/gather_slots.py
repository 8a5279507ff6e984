"""gather (and all_gather) through slots: each rank writes its block, a chunk of one slot per
round; the root (every rank, for all_gather) copies every peer's chunk into place.

Cost per round: one slot written per sender, p - 1 slots read per reader; for all_gather every
rank reads (p-1)·n/p bytes of slots."""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel


def gather_slots(ctx, ch: Channel, send: np.ndarray, out: np.ndarray | None, root: int | None) -> None:
    """Rank q's ``send`` into block q of ``out`` on the root (every rank if None: all_gather, where
    ``send`` is this rank's block of ``out`` itself)."""
    r = ctx.rank
    src = send.view(np.uint8)
    raw = None if out is None else out.view(np.uint8)
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
                raw[q * bb + lo : q * bb + hi] = ctx.data(q, k)[: hi - lo]
            if root is not None:
                raw[r * bb + lo : r * bb + hi] = src[lo:hi]
        ctx.consume(k)
        lo = hi
        if lo >= bb:
            return
