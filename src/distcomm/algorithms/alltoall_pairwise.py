"""Pairwise-exchange all_to_all(v): in step s = 1 .. p-1 rank r sends its block for rank r+s and
receives rank r-s's block for it; its own block is copied locally.

Cost: p-1 rounds; n - n_self bytes sent and received per rank (n = this rank's whole send buffer):
every byte crosses once, which is optimal, and each step has one partner per rank, so no link is
oversubscribed. Used at every size (a Bruck all_to_all would trade bandwidth for log2 p rounds on
tiny messages; not implemented).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..transport.base import Channel
from ._blocks import offsets


def alltoallv_pairwise(
    ch: Channel, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray, recv_counts: Sequence[int]
) -> None:
    """Send block j of ``send`` (``send_counts[j]`` elements) to rank j, receive rank j's into block j
    of ``recv`` (``recv_counts[j]`` elements); blocks are consecutive in rank order."""
    p, r = ch.size, ch.rank
    so, ro = offsets(send_counts), offsets(recv_counts)
    recv[ro[r] : ro[r + 1]] = send[so[r] : so[r + 1]]
    for s in range(1, p):
        dst, src = (r + s) % p, (r - s) % p
        ch.sendrecv(dst, send[so[dst] : so[dst + 1]], src, recv[ro[src] : ro[src + 1]])
