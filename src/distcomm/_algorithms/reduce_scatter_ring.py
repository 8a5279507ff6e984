"""Ring reduce_scatter: the first half of the ring all_reduce, with blocks of any sizes.

In p-1 steps each rank sends one block to its right neighbour and reduces the block arriving from
its left into its copy, scheduled so that rank r finishes with the fully reduced block r, which is
then copied to ``out``.

Cost: p-1 rounds; (n - n_r) bytes sent and reduced per rank, ≈ (p-1)/p · n for even blocks (n =
the whole input): bandwidth-optimal. Used at every size (a recursive-halving variant would save
rounds for small messages; not implemented).

``buf`` is clobbered (it holds partial sums afterwards): the caller passes a scratch copy when the
input must survive. Each block is reduced on one rank only, so the result is deterministic.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..transport.base import Channel
from ._blocks import Reducer, offsets, ring_reduce_scatter, scratch, uses_scratch


@uses_scratch
def reduce_scatter_ring(
    ch: Channel, buf: np.ndarray, out: np.ndarray, counts: Sequence[int], reduce: Reducer
) -> None:
    """Reduce block r of every rank's ``buf`` (blocks of ``counts`` elements) into ``out`` on rank r."""
    p, r = ch.size, ch.rank
    bounds = offsets(counts)
    if p > 1:
        tmp = scratch(2 * max(counts), buf.dtype)
        ring_reduce_scatter(ch, buf, bounds, (r - 1) % p, reduce, tmp)
    out[...] = buf[bounds[r] : bounds[r + 1]]
