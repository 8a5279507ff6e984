"""scatter "readv" (single copy): every rank copies its own block straight from the root's input
for it; the root copies its own block meanwhile, then waits until all have read.

Cost: one process_vm_readv copy of n bytes per reader, the readers in parallel, two
synchronizations in all, no slots and no staging (through slots the root writes every block into
its slot and each reader copies its block out again, a round per piece of a slot). The root's
inputs may be separate arrays: it posts their addresses in its slot. The caller has checked the
root in a round before."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel
from .common import address_for, write_addresses


def scatter_readv(ctx, ch: Channel, ins: Sequence[np.ndarray] | None, out: np.ndarray, root: int) -> None:
    """``ins[q]`` on the root (contiguous, ``out``'s size; None elsewhere) lands in rank q's ``out``
    (contiguous)."""
    k = ctx.next_round()
    r = ctx.rank
    nbytes = out.nbytes
    if r == root:
        slot = ctx.acquire(k, ch)
        write_addresses(slot, ins)
        ctx.post(k, ch, nbytes)
        out[...] = ins[r]
        ctx.consume(k)
        ctx.wait_consumed(k, ch)
    else:
        ctx.wait_posted(k, ch, nbytes, [root])
        address = address_for(ctx, root, k, r)
        shm_direct.read(ctx.transport.pid_of(ctx.ranks[root]), address, out)
        ctx.consume(k)
