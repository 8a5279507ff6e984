"""broadcast "split" (single copy, both ends copying): each reader reads the head of the root's
buffer straight from the root's memory while the root writes the tail straight into each reader's
buffer (process_vm_writev), so at two ranks both CPUs copy at once.

Cost: n bytes land in each reader in one copy, of which the root copies ``tail_bytes`` (1/p of the
message, page-aligned) and the reader the rest: at two ranks each end copies half, where
"readv" has the reader copy it all while the root waits and "slots" copies it twice. One round to
publish every member's buffer address, and one wait at the end: a reader's buffer is complete, and
the root's free to change, only when every copy of the round is done. The caller has checked the
root in a round before.
"""

from __future__ import annotations

import numpy as np

from ...transport import shm_direct
from ...transport.base import Channel

_PAGE = 4096


def tail_bytes(nbytes: int, size: int) -> int:
    """The bytes at the end of the message the root writes into each reader: 1/size of it, rounded
    down to whole pages (copies of whole pages pin fewer of them)."""
    return nbytes // size // _PAGE * _PAGE


def broadcast_split(ctx, ch: Channel, flat: np.ndarray, root: int) -> None:
    k = ctx.next_round()
    n = flat.nbytes
    head = n - tail_bytes(n, ctx.size)
    raw = flat.view(np.uint8)
    ctx.acquire(k, ch)
    ctx.post(k, ch, n, extra=flat.ctypes.data)
    if ctx.rank == root:
        ctx.wait_posted(k, ch, n)
        if head < n:
            for q in range(ctx.size):
                if q != root:
                    shm_direct.write(ctx.transport.pid_of(ctx.ranks[q]), ctx.extra(q, k) + head, raw[head:])
    else:
        ctx.wait_posted(k, ch, n, [root])
        shm_direct.read(ctx.transport.pid_of(ctx.ranks[root]), ctx.extra(root, k), raw[:head])
    ctx.consume(k)
    ctx.wait_consumed(k, ch)
