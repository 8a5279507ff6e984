"""The root check of a rooted collective (broadcast, reduce, gather, scatter) on shared memory.

One round in which every rank posts its root (the header's extra word) and reads every peer's: a
barrier's cost, and every rank sees any disagreement (``GroupCollectives.check_root``). It runs
before the collective's own rounds on both the general path (ShmCollectives.check_root) and the
latency paths (latency.py), so a rank on one meets a rank on the other in the same rounds.
"""

from __future__ import annotations


def one_round(ctx, seq: int, sig: int, channel, root: int) -> list[tuple[int, int]]:
    """Post ``root`` in a round of ``seq`` and signature ``sig`` (without its root bits: a different
    root is compared by the caller, in words); [(peer, its root)] for every other rank."""
    k = ctx.open_round(seq, sig, channel)
    ctx.exchange(k, seq, sig, 0, channel, extra=root)
    theirs = [(q, ctx.extra(q, k)) for q in range(ctx.size) if q != ctx.rank]
    ctx.consume(k)
    return theirs
