"""Ring all_gather: p-1 steps, each rank passing to its right neighbour the block it received last.

Cost: p-1 rounds; (p-1)/p · n bytes sent and received per rank (n = the whole output), which is
optimal. Blocks are received straight into the output, no copies. Used above ~64 KiB of output;
below that allgather_bruck's ceil(log2 p) rounds win.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel
from ._blocks import ring_allgather


def allgather_ring(ch: Channel, out: np.ndarray, count: int) -> None:
    """``out`` has size*count elements, this rank's block already in place; fill in the others."""
    if ch.size == 1:
        return
    ring_allgather(ch, out, [i * count for i in range(ch.size + 1)], ch.rank)
