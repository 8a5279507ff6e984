"""Ring all_reduce: a ring reduce-scatter followed by a ring all-gather (Gloo's allreduce_ring_chunked,
Patarasuk & Yuan's bandwidth-optimal all-reduce).

The buffer is cut into p blocks (as even as possible). In p-1 steps each rank sends one block to its
right neighbour and reduces the block arriving from its left into its own copy; afterwards rank r
holds the fully reduced block r+1. In p-1 more steps the reduced blocks travel once more around the
ring, received straight into place.

Cost: 2(p-1) rounds; 2(p-1)/p · n bytes sent and received per rank, (p-1)/p · n bytes reduced.
That bandwidth term is optimal and independent of p, but the 2(p-1) latency term grows linearly, so
select.py uses it for large messages (above ~64 KiB) on non-power-of-two groups, where
halving-doubling would have to fold ranks in and out with full-size messages.

Each block is reduced on exactly one rank per step and then copied, so all ranks end bit-identical.
count < p (some blocks empty) and count 0 work: empty blocks are sent as zero-byte messages, which
keeps ranks that disagree about the count failing with a mismatch instead of waiting.
"""

from __future__ import annotations

import numpy as np

from ..transport.base import Channel
from ._blocks import Reducer, even_counts, offsets, ring_allgather, ring_reduce_scatter, scratch, uses_scratch


@uses_scratch
def allreduce_ring(ch: Channel, buf: np.ndarray, reduce: Reducer) -> None:
    """Reduce ``buf`` across the group in place; every rank ends with the same result."""
    p = ch.size
    if p == 1:
        return
    counts = even_counts(buf.size, p)
    bounds = offsets(counts)
    tmp = scratch(2 * max(counts), buf.dtype)
    done = ring_reduce_scatter(ch, buf, bounds, ch.rank, reduce, tmp)
    ring_allgather(ch, buf, bounds, done)
