"""Binomial-tree reduce: the mirror image of the binomial broadcast.

Ranks are relative to the root (v = rank - root mod p). Rank v receives from v + 1, v + 2, v + 4, ...
(while that bit of v is clear and the child exists), reducing each into its accumulator in that
order, then sends the accumulator to v minus its lowest set bit. Leaves send their input as it is.

Cost: ceil(log2 p) rounds; n bytes sent per non-root, up to ceil(log2 p) · n received and reduced
by the root. Latency-optimal; used at every size (a reduce-scatter + gather variant would halve the
root's bandwidth for very large messages — not implemented).

Only the root's ``buf`` changes: an inner rank accumulates into a copy, a leaf sends ``buf`` itself.
The combination order is fixed by (p, root), so the result is deterministic.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel
from ._blocks import Reducer, scratch, uses_scratch


@uses_scratch
def reduce_binomial(ch: Channel, buf: np.ndarray, root: int, reduce: Reducer) -> None:
    """Reduce every rank's ``buf`` into ``buf`` on ``root``; other ranks' ``buf`` is unchanged."""
    p = ch.size
    if p == 1:
        return
    v = (ch.rank - root) % p
    children = []
    mask = 1
    while mask < p and not v & mask:
        if v + mask < p:
            children.append((v + mask + root) % p)
        mask <<= 1
    acc = buf
    if children:
        if v != 0:
            acc = buf.copy()
        tmp = scratch(buf.size, buf.dtype)
        for child in children:
            ch.recv(child, tmp)
            reduce(acc, tmp)
    if v != 0:
        ch.send((v - mask + root) % p, acc)
