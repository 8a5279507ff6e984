"""reduce_scatter "readv" (single copy): each rank reduces its own block straight from every
member's input, into its output.

Cost per rank: reads p blocks of its own size (one through a system call per chunk of a slot) and
reduces p - 1 of them; one round to publish the inputs' addresses and one wait at the end so that
no input changes before every reader is done.
"""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from .common import offsets, reduce_from_peers


def reduce_scatter_readv(ctx, ch: Channel, scratch: np.ndarray, out: np.ndarray, counts, red) -> None:
    r = ctx.rank
    offs = offsets(counts)
    k = ctx.next_round()
    ctx.acquire(k, ch)
    ctx.post(k, ch, scratch.nbytes, extra=scratch.ctypes.data)
    ctx.wait_posted(k, ch, scratch.nbytes)
    base = [ctx.extra(q, k) for q in range(ctx.size)]
    per = max(1, ctx.slot_bytes // scratch.itemsize)
    tmp = np.empty(min(per, counts[r]), scratch.dtype)
    for lo in range(0, counts[r], per):
        n = min(per, counts[r] - lo)
        reduce_from_peers(ctx, out[lo : lo + n], offs[r] + lo, scratch[offs[r] + lo : offs[r] + lo + n], base, red, tmp)
    ctx.consume(k)
    ctx.wait_consumed(k, ch)
