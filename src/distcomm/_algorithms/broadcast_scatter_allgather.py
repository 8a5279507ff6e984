"""Scatter-allgather broadcast (van de Geijn): a binomial-tree scatter of p blocks from the root,
then a ring all-gather of the blocks.

Ranks are relative to the root (v = rank - root mod p) and block v belongs to rank v. In the
scatter, rank v receives blocks [v, v + lowbit(v)) from its parent and passes each child its
subtree's blocks; the ring then circulates the blocks among ranks v, v+1, ... (which are actual
neighbours rank, rank+1).

Cost: ceil(log2 p) + p - 1 rounds; about 2(p-1)/p · n bytes sent per rank (the root sends
(p-1)/p · n in the scatter, everybody (p-1)/p · n in the ring). Against the binomial tree's
log2(p) · n this wins for large n once p ≥ 3 (at p = 2 both move n and the tree has fewer rounds):
select.py uses it above ~512 KiB for p ≥ 3.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel, wait_all
from ._blocks import even_counts, offsets, ring_allgather


def broadcast_scatter_allgather(ch: Channel, buf: np.ndarray, root: int) -> None:
    """Copy ``buf`` of ``root`` into ``buf`` on every rank."""
    p = ch.size
    if p == 1:
        return
    bounds = offsets(even_counts(buf.size, p))
    v = (ch.rank - root) % p

    def blocks(first: int, stop: int) -> np.ndarray:
        return buf[bounds[first] : bounds[min(stop, p)]]

    mask = 1
    while mask < p:
        if v & mask:
            ch.recv((v - mask + root) % p, blocks(v, v + mask))
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask > 0:
        child = v + mask
        if child < p:
            sends.append(ch.isend((child + root) % p, blocks(child, child + mask)))
        mask >>= 1
    wait_all(sends)
    ring_allgather(ch, buf, bounds, v)
