"""all_gather "readv" (single copy): every rank copies each peer's block straight from the peer's
output buffer.

Cost per rank: (p-1)/p·n bytes read once (no staging copy), one round to publish the buffers'
addresses, one wait at the end so that no buffer changes before every reader is done."""

from __future__ import annotations

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel


def allgather_readv(ctx, ch: Channel, out: np.ndarray, count: int) -> None:
    r = ctx.rank
    raw = out.view(np.uint8)
    bb = raw.size // ctx.size
    k = ctx.next_round()
    ctx.acquire(k, ch)
    ctx.post(k, ch, raw.size, extra=out.ctypes.data)
    ctx.wait_posted(k, ch, raw.size)
    for q in range(ctx.size):
        if q != r and bb:
            shm_direct.read(ctx.transport.pid_of(ctx.ranks[q]), ctx.extra(q, k) + q * bb, raw[q * bb : (q + 1) * bb])
    ctx.consume(k)
    ctx.wait_consumed(k, ch)
