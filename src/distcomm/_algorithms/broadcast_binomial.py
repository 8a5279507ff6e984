"""Binomial-tree broadcast: in round k every rank that has the data sends it 2^k further.

Ranks are taken relative to the root (v = rank - root mod p). Rank v receives from v minus its
lowest set bit, then sends to v + 2^j for every 2^j below that bit, largest subtree first; the
sends of one rank go out together (isend) and are waited on as a group.

Cost: ceil(log2 p) rounds; n bytes received per non-root, up to ceil(log2 p) · n sent by the root.
Optimal latency, but the root (and every inner node) pushes the whole buffer log2 p times, so for
large messages on p ≥ 3 select.py prefers broadcast_scatter_allgather (≈2n bytes per rank).

No "receives posted" token here (unlike the ring reduce-scatter and all-gather): a receiver that
starts late gets the buffer unexpected, copied twice, but waiting for a token cost the root more
(measured, tcp engine, 2 ranks, 16 MiB: root CPU 5-6 ms per call without, 9-12 ms with).
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel, wait_all


def broadcast_binomial(ch: Channel, buf: np.ndarray, root: int) -> None:
    """Copy ``buf`` of ``root`` into ``buf`` on every rank."""
    p = ch.size
    if p == 1:
        return
    v = (ch.rank - root) % p
    mask = 1
    while mask < p:
        if v & mask:
            ch.recv((v - mask + root) % p, buf)
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            sends.append(ch.isend((v + mask + root) % p, buf))
        mask >>= 1
    wait_all(sends)
