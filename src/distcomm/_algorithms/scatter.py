"""Direct scatter: the root sends each rank its block, all sends posted at once.

Cost: 1 round; (p-1)/p · n bytes sent by the root, n/p received per rank (n = the root's whole
input). As for gather, the root's link carries everything anyway, so direct is used at every size.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel, wait_all


def scatter_direct(ch: Channel, chunks: np.ndarray | None, out: np.ndarray, root: int) -> None:
    """Give rank r block r of ``chunks`` (size*count elements on root; None elsewhere) in ``out``."""
    if ch.rank != root:
        ch.recv(root, out)
        return
    count = out.size
    sends = [ch.isend(r, chunks[r * count : (r + 1) * count]) for r in range(ch.size) if r != root]
    out[...] = chunks[root * count : (root + 1) * count]
    wait_all(sends)
