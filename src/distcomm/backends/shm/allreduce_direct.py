"""all_reduce "direct": the whole message in one slot; every rank copies its data into its slot,
posts, waits for every post and reduces all p copies into its own buffer in rank order.

Cost per rank: one round (one write of n bytes, one post, one wait), p reads of n bytes and p - 1
reductions of n. The fewest synchronizations of any all_reduce: the latency path runs this very
round (``one_round``; or, for common dtypes and ops where it is built, the same round in C:
``native.py``) and so does every small all_reduce of the general path. Larger messages
use ``reduce_direct`` (the same round per chunk) or slices (choose.py).
"""

from __future__ import annotations

import numpy as np

from ...transport.base import Channel
from .common import same_channel


def one_round(ctx, seq: int, sig: int, channel, flat: np.ndarray, reduce_all) -> None:
    """The round itself, for ``flat.nbytes <= ctx.slot_bytes``: ``reduce_all(acc, xs)`` folds the
    peers' copies into ``acc`` in order; ``channel(seq, sig)`` makes the Channel if a wait must sleep."""
    k = ctx.open_round(seq, sig, channel)
    ctx.views(k, flat.dtype, flat.size)[ctx.rank][...] = flat  # cached typed views: no slicing per call
    ctx.exchange(k, seq, sig, flat.nbytes, channel)
    finish(ctx, k, flat, reduce_all)


def finish(ctx, k: int, flat: np.ndarray, reduce_all) -> None:
    """The round's end, once every post of round k is in and checked: the reduction of every
    member's copy, in rank order, into ``flat``, and the consume (also native.py's, for a round
    its C call handed back)."""
    views = ctx.views(k, flat.dtype, flat.size)
    if ctx.rank:
        flat[...] = views[0]
    reduce_all(flat, views[1:])
    ctx.consume(k)


def allreduce_direct(ctx, ch: Channel, flat: np.ndarray, reduce_all) -> None:
    one_round(ctx, ch.key.seq, ch.signature, same_channel(ch), flat, reduce_all)
