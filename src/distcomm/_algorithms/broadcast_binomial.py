"""Binomial-tree broadcast: in round k every rank that has the data sends it 2^k further.

Ranks are taken relative to the root (v = rank - root mod p). Rank v receives from v minus its
lowest set bit, then sends to v + 2^j for every 2^j below that bit, largest subtree first; the
sends of one rank go out together (isend) and are waited on as a group.

Cost: ceil(log2 p) rounds; n bytes received per non-root, up to ceil(log2 p) · n sent by the root.
Optimal latency, but the root (and every inner node) pushes the whole buffer log2 p times, so for
large messages on p ≥ 3 select.py prefers broadcast_scatter_allgather (≈2n bytes per rank).
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel, wait_all
from ._blocks import post_ready_token, send_ready_token, wants_ready


def broadcast_binomial(ch: Channel, buf: np.ndarray, root: int) -> None:
    """Copy ``buf`` of ``root`` into ``buf`` on every rank."""
    p = ch.size
    if p == 1:
        return
    v = (ch.rank - root) % p
    parent = None
    mask = 1
    while mask < p:
        if v & mask:
            parent = (v - mask + root) % p
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            children.append((v + mask + root) % p)
        mask >>= 1
    # Large messages go to a child only once it says its receive is posted: a child that starts
    # the call late would otherwise get the whole buffer unexpected and copy it twice.
    ready = wants_ready(buf.nbytes)
    tokens = [post_ready_token(ch, child) for child in children] if ready else []
    if parent is not None:
        recv = ch.irecv(parent, buf)
        if ready:
            send_ready_token(ch, parent).wait()
        recv.wait()
    sends = []
    for i, child in enumerate(children):
        if ready:
            tokens[i].wait()
        sends.append(ch.isend(child, buf))
    wait_all(sends)
