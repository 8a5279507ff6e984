"""Dissemination barrier (Hensgen, Finkel & Manber 1988): in round k each rank notifies rank + 2^k
and waits for rank - 2^k.

Cost: ceil(log2 p) rounds of zero-byte messages, for any p: after round k every rank has heard,
directly or not, from the 2^(k+1) - 1 ranks before it, so after the last round from all of them.
Fewer rounds than a gather-to-root-and-release barrier (2 log2 p) and no root hot spot.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel


def barrier_dissemination(ch: Channel) -> None:
    """Return on each rank only after every rank of the group has entered."""
    p, r = ch.size, ch.rank
    token, sink = np.empty(0, np.uint8), np.empty(0, np.uint8)
    d = 1
    while d < p:
        ch.sendrecv((r + d) % p, token, (r - d) % p, sink)
        d <<= 1
