"""gather "readv" (single copy): the root copies every peer's input straight from the peer's
memory into the output for it; each peer waits until the root has read.

Cost: one process_vm_readv copy of n bytes per peer, all by the root, two synchronizations in all,
no slots and no staging (through slots every peer writes its block into its slot and the root
copies it out again, a round per slot). The caller has checked the root in a round before."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel


def gather_readv(ctx, ch: Channel, send: np.ndarray, outs: Sequence[np.ndarray] | None, root: int) -> None:
    """Rank q's ``send`` (contiguous) lands in ``outs[q]`` on the root (contiguous arrays of its
    size; None elsewhere)."""
    k = ctx.next_round()
    r = ctx.rank
    nbytes = send.nbytes
    if r == root:
        outs[r][...] = send
        peers = [q for q in range(ctx.size) if q != r]
        ctx.wait_posted(k, ch, nbytes, peers)
        for q in peers:
            shm_direct.read(ctx.transport.pid_of(ctx.ranks[q]), ctx.extra(q, k), outs[q])
        ctx.consume(k)
    else:
        ctx.acquire(k, ch)
        ctx.post(k, ch, nbytes, extra=send.ctypes.data)
        ctx.consume(k)
        ctx.wait_consumed(k, ch)
