"""Bruck all_gather: ceil(log2 p) rounds for any p (Bruck et al. 1997).

Working in a scratch buffer ordered relative to this rank (slot i holds rank (rank + i)'s block), in
round k with distance d = 2^k each rank sends its first min(d, p - d) blocks to rank - d and receives
as many from rank + d into slots d, d+1, ...; after the last round the scratch is rotated into
``out``.

Cost: ceil(log2 p) rounds; (p-1)/p · n bytes sent per rank (n = the whole output) plus one local
copy of n. Fewest rounds for any p, which is what counts for small messages: select.py uses it up
to ~64 KiB of output, and the ring (no extra copy, neighbour traffic only) above.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel


def allgather_bruck(ch: Channel, out: np.ndarray, count: int) -> None:
    """``out`` has size*count elements, this rank's block already in place; fill in the others."""
    p, r = ch.size, ch.rank
    if p == 1:
        return
    tmp = np.empty_like(out)
    tmp[:count] = out[r * count : (r + 1) * count]
    d = 1
    while d < p:
        n = min(d, p - d) * count
        ch.sendrecv((r - d) % p, tmp[:n], (r + d) % p, tmp[d * count : d * count + n])
        d <<= 1
    split = (p - r) * count  # slot i is rank (r + i) % p
    out[r * count :] = tmp[:split]
    out[: r * count] = tmp[split:]
