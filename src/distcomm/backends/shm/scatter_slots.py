"""scatter through slots: each round the root writes every destination's next piece (1/p of a
slot each), and each rank copies its own out.

Cost: the root writes (p-1)/p·(p·n) bytes, each rank reads its n; one round per 1/p slot of a
rank's block."""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel


def scatter_slots(ctx, ch: Channel, chunks: np.ndarray | None, out: np.ndarray, root: int) -> None:
    p, r = ctx.size, ctx.rank
    raw = out.view(np.uint8)
    src = None if chunks is None else chunks.view(np.uint8)
    bb = raw.size
    step = max(64, ctx.slot_bytes // p // 64 * 64)
    lo = 0
    while True:
        hi = min(lo + step, bb)
        k = ctx.next_round()
        if r == root:
            slot = ctx.acquire(k, ch)
            for q in range(p):
                if q != r:
                    slot[q * step : q * step + hi - lo] = src[q * bb + lo : q * bb + hi]
            ctx.post(k, ch, bb)
            raw[lo:hi] = src[r * bb + lo : r * bb + hi]
        else:
            ctx.wait_posted(k, ch, bb, [root])
            raw[lo:hi] = ctx.data(root, k)[r * step : r * step + hi - lo]
        ctx.consume(k)
        lo = hi
        if lo >= bb:
            return
