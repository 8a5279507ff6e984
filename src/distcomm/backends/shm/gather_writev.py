"""gather "writev" (single copy by the senders): every peer writes its input straight into the
root's output for it (process_vm_writev), all at once; the root copies its own block meanwhile,
then waits until every peer is done.

Cost: one copy of n bytes per peer, each done by that peer, in parallel (where "readv" has the root
do every copy in turn and slots copy every byte twice); two synchronizations in all, no slots and
no staging: the root posts its outputs' addresses in its slot. The caller has checked the root in
a round before."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel
from .common import address_for, write_addresses


def gather_writev(ctx, ch: Channel, send: np.ndarray, outs: Sequence[np.ndarray] | None, root: int) -> None:
    """Rank q's ``send`` (contiguous) lands in ``outs[q]`` on the root (contiguous arrays of its
    size; None elsewhere)."""
    k = ctx.next_round()
    r = ctx.rank
    nbytes = send.nbytes
    if r == root:
        slot = ctx.acquire(k, ch)
        write_addresses(slot, outs)
        ctx.post(k, ch, nbytes)
        if not np.may_share_memory(outs[r], send):
            outs[r][...] = send
        ctx.consume(k)
        ctx.wait_consumed(k, ch)  # every peer's write has landed
    else:
        ctx.wait_posted(k, ch, nbytes, [root])
        address = address_for(ctx, root, k, r)
        if nbytes:
            shm_direct.write(ctx.transport.pid_of(ctx.ranks[root]), address, send)
        ctx.consume(k)
