"""reduce_scatter "readv" (single copy): each rank reduces its own block straight from every
member's input for it, into its output.

The inputs are one array per destination (``ins[q]`` is this rank's block for rank q): views of
one input tensor (reduce_scatter_tensor) or separate tensors (reduce_scatter of a list), read in
place and left as they were, with no staging buffer. Each rank posts the addresses of its p blocks
in its slot.

Cost per rank: reads p - 1 blocks of its own size (one system call per chunk of a slot, so the
chunk being reduced stays in cache) and reduces p - 1 of them; one round to publish the inputs'
addresses and one wait at the end so that no input changes before every reader is done. At two
ranks, with an op that ``commutes`` (reduction.commutes: the caller says), rank 0 too reads the
peer's block straight into its output and folds its own into it, as rank 1 does in rank order:
no copy of its own block into the output first.
"""

from __future__ import annotations

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel
from .common import address_for, reduce_from_peers, write_addresses


def reduce_scatter_readv(ctx, ch: Channel, ins, out: np.ndarray, red, commutes: bool = False) -> None:
    """``out`` = the rank-order reduction of every rank's ``ins[ch.rank]``; ``out`` must not
    overlap any of ``ins`` (peers read them meanwhile)."""
    p, r = ctx.size, ctx.rank
    nbytes = sum(x.nbytes for x in ins)  # every rank's header carries it: a disagreement is a mismatch
    k = ctx.next_round()
    slot = ctx.acquire(k, ch)
    write_addresses(slot, ins)
    ctx.post(k, ch, nbytes)
    ctx.wait_posted(k, ch, nbytes)
    base = [address_for(ctx, q, k, r) for q in range(p)]
    mine, count = ins[r], out.size
    per = max(1, ctx.slot_bytes // out.itemsize)
    if commutes and p == 2 and r == 0:  # out = the peer's ⊕ mine: the bits of mine ⊕ the peer's
        pid = ctx.transport.pid_of(ctx.ranks[1])
        for lo in range(0, count, per):
            part = out[lo : lo + per]
            shm_direct.read(pid, base[1] + lo * out.itemsize, part)
            red(part, mine[lo : lo + per])
    else:
        tmp = np.empty(min(per, count), out.dtype)
        for lo in range(0, count, per):
            n = min(per, count - lo)
            reduce_from_peers(ctx, out[lo : lo + n], lo, mine[lo : lo + n], base, red, tmp)
    ctx.consume(k)
    ctx.wait_consumed(k, ch)
