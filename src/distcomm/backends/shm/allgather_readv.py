"""all_gather "readv" (single copy): every rank copies each peer's input straight from the peer's
memory into its own output for that peer.

The outputs are one array per rank (``outs[q]`` receives rank q's ``send``): views of one flat
tensor (all_gather_into_tensor) or separate tensors (all_gather into a list), each written in
place, with no staging buffer. Cost per rank: (p-1)/p·n bytes read once, this rank's own block
copied locally, one round to publish the inputs' addresses, one wait at the end so that no input
changes before every reader is done."""

from __future__ import annotations

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel


def allgather_readv(ctx, ch: Channel, outs, send: np.ndarray) -> None:
    """``outs[q]`` (contiguous, ``send``'s size and dtype) receives rank q's ``send``; ``outs[r]``
    may be ``send`` itself. No other output may overlap ``send``: peers read it meanwhile."""
    r = ctx.rank
    k = ctx.next_round()
    ctx.acquire(k, ch)
    ctx.post(k, ch, send.nbytes, extra=send.ctypes.data)
    mine = outs[r]
    if mine.size and not np.shares_memory(mine, send):
        mine[...] = send  # while peers are reading
    ctx.wait_posted(k, ch, send.nbytes)
    if send.nbytes:
        for q in range(ctx.size):
            if q != r:
                shm_direct.read(ctx.transport.pid_of(ctx.ranks[q]), ctx.extra(q, k), outs[q])
    ctx.consume(k)
    ctx.wait_consumed(k, ch)
