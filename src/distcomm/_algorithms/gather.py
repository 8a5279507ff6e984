"""Direct gather: every rank sends its block straight to the root, which posts all receives at once.

Cost: 1 round; n/p bytes sent per non-root, (p-1)/p · n received by the root (n = the whole
output). The root's link carries everything whatever the schedule, so a tree would only add rounds
(and copies through intermediate ranks); direct is used at every size.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel, wait_all


def gather_direct(ch: Channel, send: np.ndarray, out: np.ndarray | None, root: int) -> None:
    """Collect every rank's ``send`` into ``out`` on ``root`` (size*count elements, in rank order).

    ``out`` is ignored (may be None) on other ranks; the root's own block is copied locally.
    """
    if ch.rank != root:
        ch.send(root, send)
        return
    count = send.size
    recvs = [ch.irecv(r, out[r * count : (r + 1) * count]) for r in range(ch.size) if r != root]
    out[root * count : (root + 1) * count] = send
    wait_all(recvs)
